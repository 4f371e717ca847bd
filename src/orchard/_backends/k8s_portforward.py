"""Port-forward transport: reach a pod's executor through the API server.

For clients outside the cluster network (a laptop), where pod IPs are not
routable. A listener on 127.0.0.1 accepts the executor client's ordinary
HTTP connections and tunnels each one over its own port-forward websocket
(``v4.channel.k8s.io``: one byte of channel, then data; the first frame on
each channel carries the port), so the executor client needs no changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from typing import Any

import aiohttp

log = logging.getLogger("orchard.kubernetes")

_DATA, _ERROR = 0, 1


class PortForward:
    """A loopback listener tunnelling to one pod port."""

    def __init__(self, ws_core: Any, namespace: str, pod: str, port: int) -> None:
        self._core = ws_core
        self._namespace = namespace
        self._pod = pod
        self._port = port
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        #: Where the executor client should connect.
        self.base_url = ""
        #: Set once a tunnel has carried the executor's bytes: until then a refused
        #: connection is the expected answer to a readiness probe, not worth a warning.
        self.ready = False

    async def start(self) -> str:
        """Listen on a free loopback port; returns the base URL."""
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        host, port = self._server.sockets[0].getsockname()[:2]
        self.base_url = f"http://{host}:{port}"
        return self.base_url

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.create_task(self._tunnel(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _tunnel(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            connect = await self._core.connect_get_namespaced_pod_portforward(
                self._pod, self._namespace, ports=self._port, _preload_content=False
            )
            async with connect as ws:
                pump = asyncio.create_task(self._upstream(reader, ws))
                try:
                    await self._downstream(ws, writer)
                finally:
                    pump.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await pump
        except Exception as exc:  # the client sees a closed connection and maps it
            log.debug("port-forward to %s:%s ended: %r", self._pod, self._port, exc)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _upstream(self, reader: asyncio.StreamReader, ws: aiohttp.ClientWebSocketResponse) -> None:
        while data := await reader.read(256 * 1024):
            await ws.send_bytes(bytes([_DATA]) + data)
        await ws.close()

    async def _downstream(self, ws: aiohttp.ClientWebSocketResponse, writer: asyncio.StreamWriter) -> None:
        seen_port = {_DATA: False, _ERROR: False}
        async for msg in ws:
            if msg.type != aiohttp.WSMsgType.BINARY or not msg.data:
                continue
            channel, payload = msg.data[0], msg.data[1:]
            if channel in seen_port and not seen_port[channel]:
                # The first frame of each channel starts with the port number.
                seen_port[channel] = True
                if len(payload) >= 2 and struct.unpack("<H", payload[:2])[0] == self._port:
                    payload = payload[2:]
            if not payload:
                continue
            if channel == _ERROR:
                report = log.warning if self.ready else log.debug
                report("port-forward to %s:%s: %s", self._pod, self._port, payload.decode("utf-8", "replace"))
                return
            self.ready = True
            writer.write(payload)
            await writer.drain()

    async def close(self) -> None:
        """Stop listening and cut every tunnel."""
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
