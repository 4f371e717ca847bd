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

The reverse direction (``Sandbox.reverse_forward``: a process in the sandbox
reaches the client's side) takes two routes:

``GET /v1/ports/{port}/listen`` (a websocket upgrade; ``port`` 0 picks a
free one) binds ``127.0.0.1:{port}`` in the sandbox and makes this websocket
the listener's control channel. Its first text message is a JSON
``Listening`` (``{"type": "listening", "port": N}``, the port bound) or a
``Refused`` (``{"type": "refused", "code": ..., "message": ...}``, then the
close): ``bad_request`` for a port in use, ``permission_denied`` for one the
executor may not bind (below 1024 without the privilege). Then one
``Accepted`` (``{"type": "accepted", "id": ...}``) per connection made to the
port. The client claims each with ``GET /v1/ports/{port}/accept/{id}`` (a
websocket upgrade), which then carries the connection's bytes exactly as a
``connect`` tunnel does; one not claimed within ``CLAIM_TIMEOUT`` is closed.
A connection the client cannot carry on (its target refused) is closed with
``CLOSE_FAILED``, and the sandbox side is reset at once.

Bounds: ``MAX_LISTENERS`` per executor (``too_many_tunnels``, HTTP 429, like
a bad port's 400, before the upgrade); per listener ``MAX_REVERSE``
connections at once and ``MAX_UNCLAIMED`` waiting for their claim: beyond
either, new connections wait in the kernel's backlog, unaccepted. When the
control websocket ends (the block exited, the client closed or died, found
by TCP keepalive and the websocket heartbeat), or the executor stops, the
port is closed and every connection through it is reset.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import secrets
import socket
import struct
from typing import Any, Protocol

import aiohttp
import msgspec
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
#: Listeners (``reverse_forward`` ports) open at once per executor.
MAX_LISTENERS = 4
#: Connections through one listener at once; more wait in the kernel's backlog.
MAX_REVERSE = 128
#: Accepted connections of one listener waiting for the client's claim; more wait in the backlog.
MAX_UNCLAIMED = 32
#: Seconds the client has to claim an accepted connection before it is closed.
CLAIM_TIMEOUT = 10.0
#: The kernel's backlog of connections a listener has not accepted yet.
BACKLOG = 128
#: Seconds between the executor's pings on a listener's control websocket (a vanished client is found in two).
HEARTBEAT = 30.0


class Listening(msgspec.Struct, tag_field="type", tag="listening"):
    """The control websocket's first message: the port is bound (``port``: the one chosen for 0)."""

    port: int


class Refused(msgspec.Struct, tag_field="type", tag="refused"):
    """The control websocket's first message: the port could not be bound (an ``ErrorCode``)."""

    code: str
    message: str


class Accepted(msgspec.Struct, tag_field="type", tag="accepted"):
    """A connection was made to the port: claim it at ``/v1/ports/{port}/accept/{id}``."""

    id: str


ControlMessage = Listening | Refused | Accepted


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
        elif msg.type == aiohttp.WSMsgType.CLOSE and msg.data == CLOSE_FAILED:
            raise ConnectionResetError("the other end of the tunnel failed")
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


def parse_port(raw: str, lowest: int = 1) -> int:
    """A port number, ``lowest``..65535, as the route gives it."""
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 5) or not lowest <= int(raw) <= 65535:
        raise ExecutorError("bad_request", f"port {raw[:16]!r} is not a number within {lowest}..65535")
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


def _reset(sock: socket.socket) -> None:
    """Close with a reset, not an EOF: the peer sees at once that the connection failed."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def reset(writer: asyncio.StreamWriter) -> None:
    """Close a stream's connection with a reset (an abort alone sends an EOF when nothing is left unread)."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def _bind(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        # Not a second listener on the port (Linux refuses that still), but no wait for the last one's TIME_WAIT.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _refusal(port: int, exc: OSError) -> Refused:
    if exc.errno == errno.EADDRINUSE:
        return Refused(
            code="bad_request",
            message=f"127.0.0.1:{port} in the sandbox is in use; choose another remote_port, or 0 for a free one",
        )
    if exc.errno in (errno.EACCES, errno.EPERM):
        return Refused(
            code="permission_denied",
            message=f"the executor may not bind 127.0.0.1:{port} in the sandbox (a port below 1024 needs a "
            "privilege it lacks); choose a remote_port from 1024 up, or 0 for a free one",
        )
    return Refused(code="internal", message=f"cannot bind 127.0.0.1:{port} in the sandbox: {exc.strerror or exc}")


class _Listener:
    """One ``listen`` port: its socket, and the connections accepted on it until they end."""

    def __init__(self, sock: socket.socket, control: web.WebSocketResponse) -> None:
        self.sock = sock
        self.port: int = sock.getsockname()[1]
        self._control = control
        #: Set when the listener closes: every connection through it is reset.
        self.closed = asyncio.Event()
        self._slots = asyncio.Semaphore(MAX_REVERSE)
        self._room = asyncio.Semaphore(MAX_UNCLAIMED)
        #: Accepted connections the client has not claimed yet, and their deadlines.
        self.unclaimed: dict[str, tuple[socket.socket, asyncio.TimerHandle]] = {}

    async def accept(self) -> None:
        """Accept connections while there is room, announcing each on the control websocket."""
        loop = asyncio.get_running_loop()
        while True:
            # Beyond the bounds, connections wait in the kernel's backlog instead of being accepted.
            await self._slots.acquire()
            await self._room.acquire()
            try:
                conn, _ = await loop.sock_accept(self.sock)
            except OSError as exc:
                self._room.release()
                self._slots.release()
                if exc.errno in _OUT_OF_FDS:
                    await asyncio.sleep(0.1)  # the fd limit: the connection waits in the backlog
                continue
            except BaseException:
                self._room.release()
                self._slots.release()
                raise
            # asyncio sets no TCP_NODELAY on a socket made with proto 0: without it a reply in two writes
            # waits for the delayed ACK (40 ms a request).
            with contextlib.suppress(OSError):
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn_id = secrets.token_hex(16)
            self.unclaimed[conn_id] = (conn, loop.call_later(CLAIM_TIMEOUT, self._expire, conn_id))
            await self._control.send_str(_ENCODE(Accepted(id=conn_id)).decode())

    def claim(self, conn_id: str) -> socket.socket:
        """The connection ``conn_id``, now the caller's; ``release`` it when it ends."""
        conn, timer = self.unclaimed.pop(conn_id)
        timer.cancel()
        self._room.release()
        return conn

    def release(self) -> None:
        """A claimed connection ended: room for another."""
        self._slots.release()

    def _expire(self, conn_id: str) -> None:
        if conn_id in self.unclaimed:
            _reset(self.claim(conn_id))
            self.release()

    def close(self) -> None:
        """Stop listening and reset every connection, claimed or not."""
        self.closed.set()
        self.sock.close()
        for conn, timer in self.unclaimed.values():
            timer.cancel()
            _reset(conn)
        self.unclaimed.clear()


async def _until_closed(ws: web.WebSocketResponse) -> None:
    """Read the control websocket until it ends (the client sends nothing on it)."""
    while True:
        msg = await ws.receive()
        if msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.CLOSED):
            return
        if msg.type == aiohttp.WSMsgType.ERROR:
            return


class Listeners:
    """The ``listen`` and ``accept`` routes' handlers: ports in the sandbox that lead to the client's side."""

    def __init__(self, stopped: asyncio.Event) -> None:
        self._stopped = stopped
        self._listeners: set[_Listener] = set()
        self.open = 0

    async def listen(self, request: web.Request) -> web.StreamResponse:
        """Listen on a port in the sandbox for as long as this websocket lasts (see the module docstring)."""
        port = parse_port(request.match_info["port"], lowest=0)
        # Not autoclose: the client's close is answered once the port is closed, so a block's exit waits for it.
        ws = web.WebSocketResponse(max_msg_size=CHUNK, autoping=True, autoclose=False, heartbeat=HEARTBEAT)
        if not ws.can_prepare(request).ok:
            raise ExecutorError("bad_request", "a listener needs a websocket upgrade (Upgrade: websocket)")
        if self.open >= MAX_LISTENERS:
            raise ExecutorError("too_many_tunnels", f"{MAX_LISTENERS} ports are listening; close one first")
        self.open += 1
        counted = True
        try:
            try:
                sock = _bind(port)
            except OSError as exc:
                self.open -= 1
                counted = False
                _keepalive(request)
                await ws.prepare(request)
                await ws.send_str(_ENCODE(_refusal(port, exc)).decode())
                await ws.close()
                return ws
            listener = _Listener(sock, ws)
            self._listeners.add(listener)
            tasks: list[asyncio.Future[Any]] = []
            try:
                _keepalive(request)
                await ws.prepare(request)
                await ws.send_str(_ENCODE(Listening(port=listener.port)).decode())
                tasks = [
                    asyncio.ensure_future(listener.accept()),
                    asyncio.ensure_future(_until_closed(ws)),
                    asyncio.ensure_future(self._stopped.wait()),
                ]
                # The accept loop ends only by failing to announce a connection: the client is gone too.
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            finally:
                self._listeners.discard(listener)
                listener.close()
                self.open -= 1
                counted = False
                for task in tasks:
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        await task
                await ws.close(code=CLOSE_GOING_AWAY if self._stopped.is_set() else aiohttp.WSCloseCode.OK)
            return ws
        finally:
            if counted:
                self.open -= 1

    async def accept(self, request: web.Request) -> web.StreamResponse:
        """Carry one accepted connection over this websocket (see the module docstring)."""
        port = parse_port(request.match_info["port"])
        conn_id = request.match_info["id"]
        ws = web.WebSocketResponse(max_msg_size=4 * CHUNK, autoping=True)
        if not ws.can_prepare(request).ok:
            raise ExecutorError("bad_request", "a tunnel needs a websocket upgrade (Upgrade: websocket)")
        listener = next((x for x in self._listeners if x.port == port and conn_id in x.unclaimed), None)
        if listener is None:
            raise ExecutorError(
                "port_closed",
                f"no connection {conn_id[:40]!r} waits on port {port}: it was claimed, waited more than "
                f"{CLAIM_TIMEOUT:g}s, or its port closed",
            )
        conn = listener.claim(conn_id)
        clean = False
        try:
            reader, writer = await asyncio.open_connection(sock=conn, limit=CHUNK)
            try:
                _keepalive(request)
                await ws.prepare(request)
                try:
                    clean = await splice(ws, reader, writer, listener.closed)
                except (OSError, EOFError):
                    await ws.close(code=CLOSE_FAILED)
                else:
                    await ws.close(code=aiohttp.WSCloseCode.OK if clean else CLOSE_GOING_AWAY)
            finally:
                if clean:
                    writer.close()
                else:
                    # Its listener closed, or the client's end failed or refused: a reset, seen at once.
                    reset(writer)
        except BaseException:
            _reset(conn)
            raise
        finally:
            listener.release()
        return ws


_ENCODE = msgspec.json.Encoder().encode
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)

TUNNELS = web.AppKey("tunnels", Tunnels)
LISTENERS = web.AppKey("listeners", Listeners)


def setup(app: web.Application, stopped: asyncio.Event) -> None:
    """Add the ``connect``, ``listen`` and ``accept`` routes to the executor's application."""
    app[TUNNELS] = tunnels = Tunnels(stopped)
    app.router.add_get("/v1/ports/{port}/connect", tunnels.connect)
    app[LISTENERS] = listeners = Listeners(stopped)
    app.router.add_get("/v1/ports/{port}/listen", listeners.listen)
    app.router.add_get("/v1/ports/{port}/accept/{id}", listeners.accept)
