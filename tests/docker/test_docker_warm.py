"""Warm pools on the docker backend: real containers started ahead, claimed at once, all removed at the end."""

from __future__ import annotations

import asyncio

import pytest
from docker_support import BUSYBOX, containers

import orchard
from support import cancel_twice

pytestmark = pytest.mark.docker


async def test_claims_take_pooled_containers_and_close_removes_every_one(docker_ready: str) -> None:
    async with orchard.Client("docker", warm={BUSYBOX: 2}) as client:
        mine = f"orchard.dev/session={client.session_id}"
        await client.wait_warm(timeout=120)
        pooled = {c["Id"] for c in containers(mine)}
        assert len(pooled) == 2
        async with client.sandbox(BUSYBOX) as a, client.sandbox(BUSYBOX) as b:
            assert "claim" in a.timings
            assert "claim" in b.timings
            assert (await a.exec("echo warm")).stdout == "warm\n"
            hosts = {(await sb.exec("cat /etc/hostname")).stdout.strip() for sb in (a, b)}
            # A container's hostname is its id's first 12 characters: the two are those started ahead.
            assert len(hosts) == 2
            assert all(any(i.startswith(h) for i in pooled) for h in hosts)
        await client.wait_warm(timeout=120)  # refilled with new containers, the claimed ones removed
        now = {c["Id"] for c in containers(mine)}
        assert len(now) == 2
        assert not now & pooled
    assert containers(mine) == []


async def test_a_start_cancelled_twice_has_removed_its_container_when_it_returns(docker_ready: str) -> None:
    """A second cancel, landing while the first one's cleanup runs, does not cut that cleanup short."""
    async with orchard.Client("docker") as client:
        mine = f"orchard.dev/session={client.session_id}"
        for i in range(8):
            # The first cancel at a different step of the start each time, the second 10 ms later.
            await cancel_twice(asyncio.create_task(client.create(BUSYBOX)), i / 20, 0.01)
            assert containers(mine) == [], f"cancelled after {i * 50} ms"
