"""The executor as PID 1: orphans are reaped, and the exit statuses it waits for are never stolen."""

from __future__ import annotations

import asyncio

import pytest
from docker_support import BUSYBOX, SWE, SandboxFactory, live_processes

import orchard
from support import eventually

pytestmark = pytest.mark.docker


async def processes(sb: orchard.Sandbox) -> list[tuple[int, str, str, int]]:
    return live_processes((await sb.exec("cat /proc/[0-9]*/stat")).stdout)


async def zombies(sb: orchard.Sandbox) -> list[tuple[int, str, str, int]]:
    return [p for p in await processes(sb) if p[2] == "Z"]


@pytest.mark.parametrize("image", [BUSYBOX, SWE])
async def test_orphans_are_reaped(sandbox: SandboxFactory, image: str) -> None:
    sb = await sandbox(image)
    # Each command leaves a grandchild behind that outlives it: it is reparented to PID 1.
    for _ in range(3):
        r = await sb.exec("for i in 1 2 3 4 5 6 7 8 9 10; do sleep 3 & done; exit 0")
        assert r.ok
    orphans = [p for p in await processes(sb) if p[1] == "sleep"]
    assert len(orphans) == 30
    assert {p[3] for p in orphans} == {1}, "the grandchildren are PID 1's now"

    async def all_reaped() -> bool:
        procs = await processes(sb)
        return not [p for p in procs if p[1] == "sleep" or p[2] == "Z"]

    await eventually(all_reaped, timeout=30, what="every orphan exited and was reaped")


async def test_a_daemonized_background_process_is_reaped(sandbox: SandboxFactory) -> None:
    sb = await sandbox(BUSYBOX)
    r = await sb.exec("setsid sh -c 'sleep 0.5' </dev/null >/dev/null 2>&1 &")
    assert r.ok
    await eventually(lambda: _no_zombies_or_sleepers(sb), timeout=30, what="the daemon reaped")


async def _no_zombies_or_sleepers(sb: orchard.Sandbox) -> bool:
    return not [p for p in await processes(sb) if p[1] == "sleep" or p[2] == "Z"]


async def test_exit_statuses_survive_a_storm_of_orphans(sandbox: SandboxFactory) -> None:
    sb = await sandbox(BUSYBOX)
    # A background process that keeps orphaning short-lived grandchildren while the execs run.
    storm = await sb.start_process("for i in $(seq 4000); do (sleep 0.01 &); sleep 0.005; done")

    async def one(i: int) -> None:
        r = await sb.exec(["sh", "-c", f"exit {i % 256}"])
        assert r.exit_code == i % 256, (i, r)
        p = await sb.start_process(["sh", "-c", f"sleep 0.05; exit {(i * 7) % 256}"])
        status = await p.wait(60)
        assert status.exit_code == (i * 7) % 256, (i, status)

    await asyncio.gather(*(one(i) for i in range(120)))
    await storm.kill()
    await eventually(lambda: _no_zombies_or_sleepers(sb), timeout=30, what="the storm's orphans reaped")
