"""forward() with a frozen executor: its tunnels are reset within the liveness deadline, and the block exits."""

from __future__ import annotations

import asyncio

import pytest

import orchard
from support import WAIT, eventually, stopped
from test_forward import drained, received, start_servers

pytestmark = pytest.mark.executor


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
