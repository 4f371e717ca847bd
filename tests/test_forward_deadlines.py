"""forward() with a frozen executor: its tunnels are reset within the liveness deadline, and the block exits."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

import orchard
from support import WAIT, eventually
from test_forward import drained, received, start_servers

pytestmark = pytest.mark.executor


@pytest.fixture
async def quick_client(local_root: Path) -> AsyncIterator[orchard.Client]:
    """A local Client with short deadlines: 2 s to answer, a probe after 1 s of silence."""
    config = orchard.LocalConfig(root=str(local_root), isolation="none")
    async with orchard.Client(config, read_timeout=2.0, liveness_timeout=1.0) as client:
        yield client


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


async def test_a_frozen_executor_resets_forwarded_connections(quick_client: orchard.Client) -> None:
    async with quick_client.sandbox() as sb:
        _, raw = await start_servers(sb)
        pid = (await sb.info()).pid
        forwarding = sb.forward(raw)
        url = await forwarding.__aenter__()
        reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
        writer.write(b"abc")
        await writer.drain()
        await eventually(lambda: received(sb, b"3"), what="the bytes to arrive")
        with stopped(pid):
            # The liveness watchdog finds the executor frozen and fails the tunnel: the local side is reset.
            assert await asyncio.wait_for(drained(reader), WAIT) == b""
            writer.close()
            await asyncio.wait_for(forwarding.__aexit__(None, None, None), WAIT)
