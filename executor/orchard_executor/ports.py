"""Port forwarding: a websocket tunnel from the client to a TCP port inside the sandbox.

``GET /v1/ports/{port}/connect`` with a websocket upgrade connects to
``127.0.0.1:{port}`` in the sandbox (its network namespace; never another
host) and, once connected, answers ``101`` and carries raw bytes both ways:
binary messages are data, the text message ``EOF`` half-closes the
direction it travels (the receiver shuts down writing), and the websocket
closes when both directions are done or either end fails. The connection is
made before the upgrade, so its failure is an ordinary error reply: ``502
port_closed`` when nothing listens, ``400 bad_request`` for a port outside
1..65535 or a request without the upgrade, ``429 too_many_tunnels`` beyond
``MAX_TUNNELS``.

An open tunnel is a request in progress: it keeps the executor from idling
out and is never evicted by the listener's connection cap. A client that
vanishes without closing is found by TCP keepalive (``KEEPALIVE``); a
stopping executor closes every tunnel.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any, Protocol

import aiohttp
from aiohttp import web

from .errors import ExecutorError

#: Tunnels open at once per executor: each holds two fds and a connection slot.
MAX_TUNNELS = 256
#: Bytes read from a socket at a time, and so the largest data message.
CHUNK = 64 * 1024
#: The text message that half-closes a direction.
EOF = "EOF"
#: Seconds to connect to the port in the sandbox.
CONNECT_TIMEOUT = 10.0
#: TCP keepalive on a tunnel's connection: idle seconds, interval, probes.
KEEPALIVE = (30, 10, 3)
#: Close code for a tunnel whose other end failed (reset, broken pipe).
CLOSE_FAILED = 1011
#: Close code for a tunnel ended by a stopping executor.
CLOSE_GOING_AWAY = 1001


class WebSocket(Protocol):
    """What ``splice`` needs of a websocket: aiohttp's client and server ones alike."""

    async def send_bytes(self, data: bytes) -> None: ...  # noqa: D102

    async def send_str(self, data: str) -> None: ...  # noqa: D102

    async def receive(self) -> aiohttp.WSMessage: ...  # noqa: D102


async def _up(ws: WebSocket, reader: asyncio.StreamReader) -> None:
    """TCP to websocket, then the half-close."""
    while data := await reader.read(CHUNK):
        await ws.send_bytes(data)
    await ws.send_str(EOF)


async def _down(ws: WebSocket, writer: asyncio.StreamWriter) -> bool:
    """Websocket to TCP; True if the peer half-closed (more may go the other way), False if it closed."""
    while True:
        msg = await ws.receive()
        if msg.type == aiohttp.WSMsgType.BINARY:
            writer.write(msg.data)
            await writer.drain()
        elif msg.type == aiohttp.WSMsgType.TEXT and msg.data == EOF:
            if writer.can_write_eof():
                writer.write_eof()
            return True
        elif msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.CLOSED):
            return False
        elif msg.type == aiohttp.WSMsgType.ERROR:
            raise ConnectionResetError(f"the tunnel failed: {msg.data!r}")
        else:
            raise ConnectionResetError(f"unexpected tunnel message {msg.type.name}")


async def splice(
    ws: WebSocket, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, stop: asyncio.Event | None = None
) -> bool:
    """Carry bytes both ways until both directions end, either end closes, or ``stop`` is set.

    Returns True if the tunnel ended cleanly (both ways at EOF, or closed by
    the peer), False if ``stop`` ended it; raises if an end failed. The
    caller closes ``ws`` and ``writer``.
    """
    up = asyncio.ensure_future(_up(ws, reader))
    down = asyncio.ensure_future(_down(ws, writer))
    tasks: set[asyncio.Future[Any]] = {up, down}
    stopping = None if stop is None else asyncio.ensure_future(stop.wait())
    try:
        while tasks:
            done, _ = await asyncio.wait(
                tasks if stopping is None else tasks | {stopping}, return_when=asyncio.FIRST_COMPLETED
            )
            if stopping in done:
                return False
            for ended in done:
                tasks.discard(ended)
                ended.result()  # an end failed: raise it
                if ended is down and not ended.result():
                    return True  # the peer closed: nothing more goes either way
        return True
    finally:
        for left in (up, down, stopping):
            if left is not None and not left.done():
                left.cancel()
                with contextlib.suppress(BaseException):
                    await left


def parse_port(raw: str) -> int:
    """A port number, 1..65535, as the route gives it."""
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 5) or not 1 <= int(raw) <= 65535:
        raise ExecutorError("bad_request", f"port {raw[:16]!r} is not a number within 1..65535")
    return int(raw)


def _keepalive(request: web.Request) -> None:
    sock = request.transport.get_extra_info("socket") if request.transport is not None else None
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return  # a unix socket ends when its peer does
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE[0])
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE[1])
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE[2])


class Tunnels:
    """The ``connect`` route's handler and its count of open tunnels."""

    def __init__(self, stopped: asyncio.Event) -> None:
        self._stopped = stopped
        self.open = 0

    async def connect(self, request: web.Request) -> web.StreamResponse:
        """Open a tunnel to a port in the sandbox (see the module docstring)."""
        port = parse_port(request.match_info["port"])
        ws = web.WebSocketResponse(max_msg_size=4 * CHUNK, autoping=True)
        if not ws.can_prepare(request).ok:
            raise ExecutorError("bad_request", "a tunnel needs a websocket upgrade (Upgrade: websocket)")
        if self.open >= MAX_TUNNELS:
            raise ExecutorError("too_many_tunnels", f"{MAX_TUNNELS} tunnels are open; close one first")
        self.open += 1
        try:
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection("127.0.0.1", port, limit=CHUNK), CONNECT_TIMEOUT
                )
            except TimeoutError:
                raise ExecutorError(
                    "port_closed", f"127.0.0.1:{port} in the sandbox did not accept within {CONNECT_TIMEOUT:g}s"
                ) from None
            except OSError as exc:
                raise ExecutorError(
                    "port_closed", f"nothing listens on 127.0.0.1:{port} in the sandbox ({exc.strerror or exc})"
                ) from None
            try:
                _keepalive(request)
                await ws.prepare(request)
                try:
                    clean = await splice(ws, reader, writer, self._stopped)
                except (OSError, EOFError):
                    await ws.close(code=CLOSE_FAILED)
                    writer.transport.abort()
                else:
                    await ws.close(code=aiohttp.WSCloseCode.OK if clean else CLOSE_GOING_AWAY)
            finally:
                writer.close()
            return ws
        finally:
            self.open -= 1


TUNNELS = web.AppKey("tunnels", Tunnels)


def setup(app: web.Application, stopped: asyncio.Event) -> None:
    """Add the ``connect`` route to the executor's application."""
    app[TUNNELS] = tunnels = Tunnels(stopped)
    app.router.add_get("/v1/ports/{port}/connect", tunnels.connect)
