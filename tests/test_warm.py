"""Warm pools (``Client(warm=...)``) on the local backend: real executor processes.

A claim hands out a started, never-used sandbox once and the pool refills; a
spec that differs, an empty pool or a pooled executor that died means a cold
start, never an error; a pool that cannot start backs off and its claims fail
with the cold start's typed error; closing the Client ends pooled sandboxes.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

import orchard
import orchard.sync
from orchard import _warm
from orchard.errors import ConfigError, SandboxTimeout
from support import eventually, host_pid_alive, unisolated_ok, workdir_executors


@pytest.fixture
def warm_client(local_root: Path) -> Callable[..., Any]:
    @asynccontextmanager
    async def make(warm: dict[str, Any]) -> AsyncIterator[orchard.Client]:
        client = orchard.Client(orchard.LocalConfig(root=str(local_root), isolation="none"), warm=warm)
        with unisolated_ok():
            await client.__aenter__()
        async with client:
            yield client

    return make


async def test_a_claim_takes_a_ready_sandbox_once_and_the_pool_refills(
    warm_client: Callable[..., Any], local_root: Path
) -> None:
    async with warm_client({"local": 2}) as client:
        await client.wait_warm(timeout=60)
        assert client.warm_status()["local"]["ready"] == 2
        pooled = set(workdir_executors(local_root))
        assert len(pooled) == 2

        a, b = await asyncio.gather(client.create(), client.create())
        assert "claim" in a.timings
        assert "claim" in b.timings
        assert a.id != b.id
        assert {(await a.info()).pid, (await b.info()).pid} == pooled  # the two started ahead, one each
        await a.write_file("used", b"by a")
        c = await client.create()  # the pool is refilling: whether claimed or cold, it is not a or b
        assert c.id not in (a.id, b.id)
        assert not await c.exists("used")
        for sb in (a, b, c):
            await sb.aclose()

        await client.wait_warm(timeout=60)
        assert client.warm_status()["local"]["ready"] == 2
        assert not set(workdir_executors(local_root)) & pooled  # the claimed ones are gone, new ones wait
    assert workdir_executors(local_root) == []  # closing the Client ends the pooled sandboxes too


async def test_another_spec_or_an_empty_pool_is_a_cold_start(warm_client: Callable[..., Any]) -> None:
    async with warm_client({"local": {"size": 1, "env": {"POOL": "yes"}}}) as client:
        await client.wait_warm(timeout=60)
        async with client.sandbox(env={"POOL": "no"}) as other:
            assert "claim" not in other.timings
            assert (await other.exec("echo $POOL")).stdout == "no\n"
        assert client.warm_status()["local"]["ready"] == 1  # untouched by a claim of another spec
        async with client.sandbox(env={"POOL": "yes"}) as first, client.sandbox(env={"POOL": "yes"}) as second:
            assert "claim" in first.timings
            assert "claim" not in second.timings  # the pool was empty: started cold, no error
            for sb in (first, second):
                assert (await sb.exec("echo $POOL")).stdout == "yes\n"


async def test_a_pooled_sandbox_that_died_is_skipped(warm_client: Callable[..., Any], local_root: Path) -> None:
    async with warm_client({"local": 1}) as client:
        await client.wait_warm(timeout=60)
        [dead] = workdir_executors(local_root)
        os.kill(dead, signal.SIGKILL)
        async with client.sandbox() as sb:
            assert (await sb.info()).pid != dead
            assert (await sb.exec("echo alive")).stdout == "alive\n"
        await client.wait_warm(timeout=60)  # and the pool refilled


async def test_a_pool_that_cannot_start_backs_off_and_claims_fail_typed(warm_client: Callable[..., Any]) -> None:
    # A working directory that cannot be made: every start fails at once with ConfigError.
    async with warm_client({"local": {"size": 2, "workdir": "/dev/null/x"}}) as client:
        with pytest.raises(SandboxTimeout, match="warm pools not full.*0 of 2 ready.*last start failed"):
            await client.wait_warm(timeout=3)
        status = client.warm_status()["local"]
        assert status["ready"] == 0
        assert status["last_error"].startswith("ConfigError: workdir='/dev/null/x' cannot be created")
        # Backing off 0.5 s, 1 s, 2 s between batches of 2: at most 4 batches in 3 s (without it, hundreds).
        assert 2 <= status["starts"] <= 8
        with pytest.raises(ConfigError, match="cannot be created"):
            await client.create(workdir="/dev/null/x")


def test_the_back_off_doubles_from_half_a_second_and_stops_at_thirty() -> None:
    delays, delay = [], 0.0  # no failure yet
    for _ in range(9):
        delay = _warm.next_delay(delay)
        delays.append(delay)
    assert delays == [0.5, 1, 2, 4, 8, 16, 30, 30, 30]


@pytest.mark.parametrize(
    ("warm", "message"),
    [
        ({"local": -1}, "whole number >= 0, not -1"),
        ({"local": 1.5}, "whole number >= 0, not 1.5"),
        ({"local": {"cpu": "1"}}, "whole number >= 0, not None"),
        ({"local": {"size": 1, "colour": "red"}}, "colour"),
    ],
)
def test_a_bad_warm_option_is_a_config_error(warm: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        orchard.Client(warm=warm)


def test_the_sync_client_takes_warm_pools_too(local_root: Path) -> None:
    config = orchard.LocalConfig(root=str(local_root), isolation="none")
    with unisolated_ok(), orchard.sync.Client(config, warm={"local": 1}) as client:
        client.wait_warm(timeout=60)
        assert client.warm_status()["local"]["ready"] == 1
        with client.sandbox() as sb:
            assert "claim" in sb.timings
            assert sb.exec("echo sync").stdout == "sync\n"
    assert workdir_executors(local_root) == []


@pytest.mark.filterwarnings("ignore::orchard.errors.UnisolatedWarning")
@pytest.mark.parametrize("isolation", ["none", "bwrap"])
async def test_closing_the_client_while_its_pool_refills_leaves_nothing(
    isolation: str, local_root: Path, request: pytest.FixtureRequest, unretrieved: list[str]
) -> None:
    """The close cancels the refills' starts twice (as the Client's starts, then as the pool's): each still cleans up."""
    if isolation == "bwrap":
        request.getfixturevalue("bwrap_ready")
    for i in range(6):
        async with orchard.Client(
            orchard.LocalConfig(root=str(local_root), isolation=isolation), warm={"local": 8}
        ) as client:
            async with client.sandbox() as sb:  # the first claim starts the pool, which refills at once
                await sb.exec("true")
            await asyncio.sleep(i / 100)  # the close lands at a different step of the refills each time
        assert os.listdir(local_root) == [], f"closed {i * 10} ms after the first sandbox"
        await eventually(lambda: workdir_executors(local_root) == [], what="no executors left")
    gc.collect()
    assert unretrieved == []


async def test_a_claim_cancelled_while_it_checks_the_sandbox_puts_it_back(warm_client: Callable[..., Any]) -> None:
    async with warm_client({"local": 1}) as client:
        await client.wait_warm(timeout=60)
        pool = client._pools["local"]
        pooled = pool._ready[0][1]
        checked = asyncio.Event()
        info = pooled.info

        async def slow_info() -> Any:
            checked.set()
            await asyncio.sleep(60)
            return await info()

        pooled.info = slow_info  # type: ignore[method-assign]
        claim = asyncio.create_task(client.create())
        await checked.wait()
        claim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await claim
        del pooled.info
        assert client.warm_status()["local"]["ready"] == 1
        async with client.sandbox() as sb:
            assert sb is pooled  # claimed by the next create, never started twice
            assert (await sb.exec("echo still fresh")).stdout == "still fresh\n"


async def test_a_pooled_sandbox_that_does_not_answer_its_first_request_is_a_failed_start(
    local_root: Path,
) -> None:
    """Each pooled sandbox is sent its first request as it starts; one whose executor hangs is closed, not pooled."""
    hung: list[int] = []
    with unisolated_ok():
        client = await orchard.Client(orchard.LocalConfig(root=str(local_root), isolation="none")).__aenter__()
    async with client:

        async def start() -> orchard.Sandbox:
            sb = await client.create()
            pid = (await sb.info()).pid
            os.kill(pid, signal.SIGSTOP)  # started, then answers nothing more
            hung.append(pid)
            return sb

        [(size, spec)] = _warm.parse({"local": 1}).values()
        pool = _warm.Pool(spec, size, start)
        pool.open()
        try:
            await eventually(lambda: pool.last_error is not None, what="the unanswered first request fails the start")
            assert isinstance(pool.last_error, TimeoutError)
            assert pool.ready == 0
            # Closed, not left stopped: the executor is gone and its directory removed.
            await eventually(lambda: not host_pid_alive(hung[0]), what="the hung executor ended")
        finally:
            await pool.aclose()
        await eventually(lambda: workdir_executors(local_root) == [], what="no executor left under the root")


async def test_a_pooled_sandbox_that_died_while_it_waited_is_replaced_before_any_claim(
    warm_client: Callable[..., Any], local_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool sends its ready sandboxes a request every PING_INTERVAL (10 s; 0.5 s here), claims or not."""
    monkeypatch.setattr(_warm, "PING_INTERVAL", 0.5)
    async with warm_client({"local": 1}) as client:
        await client.wait_warm(timeout=60)
        [dead] = workdir_executors(local_root)
        os.kill(dead, signal.SIGKILL)
        await eventually(
            lambda: client.warm_status()["local"]["starts"] == 2 and client.warm_status()["local"]["ready"] == 1,
            what="the pool replaced the dead sandbox without a claim",
        )
        [alive] = workdir_executors(local_root)
        assert alive != dead
        async with client.sandbox() as sb:
            assert "claim" in sb.timings
            assert (await sb.info()).pid == alive
