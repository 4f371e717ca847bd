"""``Sandbox.reverse_forward``: a port inside the sandbox that leads to an address on the client's side.

The mirror of ``Sandbox.forward``. For the ``async with`` block, a control
websocket to the executor's ``/v1/ports/{port}/listen`` keeps 127.0.0.1:port
bound inside the sandbox (see ``orchard_executor.ports``); the executor
announces each connection made to it, and the client claims it with a
websocket of its own (``/v1/ports/{port}/accept/{id}``) and connects that to
the target here. Everything goes over the sandbox's own executor connection
(a unix socket, TLS to a container or a pod, a port-forward through the
Kubernetes API), authenticated with its token, so the sandbox needs no
network of its own; the bytes are raw TCP, so streaming replies and
websockets pass through.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import aiohttp
import msgspec
import yarl

from orchard_executor import ports

from ._rpc import ExecutorClient
from .errors import EXECUTOR_ERRORS, ConfigError, ExecutorError, OrchardError, ProtocolError

log = logging.getLogger("orchard.reverse_forward")
#: Seconds to connect to the target on the client's side.
CONNECT_TIMEOUT = 10.0
_DEFAULT_PORTS = {"http": 80, "ws": 80, "https": 443, "wss": 443}
_DECODE = msgspec.json.Decoder(ports.ControlMessage).decode


def target(local_url: str, sandbox_id: str) -> tuple[str, int]:
    """The host and port that ``local_url`` (``http://host:port``, ``host:port``) names."""
    option = f"reverse_forward(local_url={local_url!r})"
    if not isinstance(local_url, str):
        raise ConfigError(f"{option}: give a URL or host:port as a string", sandbox_id=sandbox_id)
    try:
        url = yarl.URL(local_url if "://" in local_url else f"tcp://{local_url}")
        port = url.port or _DEFAULT_PORTS.get(url.scheme)
    except ValueError as exc:
        raise ConfigError(f"{option}: not a URL or host:port ({exc})", sandbox_id=sandbox_id) from None
    if not url.host or port is None or not 1 <= port <= 65535:
        raise ConfigError(f"{option}: name a host and a port, as http://127.0.0.1:8000", sandbox_id=sandbox_id)
    if url.path not in ("", "/") or url.query_string or url.fragment or url.user is not None:
        raise ConfigError(
            f"{option}: the tunnel carries raw TCP to a host and port; leave out the path, query and user",
            sandbox_id=sandbox_id,
        )
    return url.host, port


def _refused(message: ports.Refused, sandbox_id: str) -> ExecutorError:
    cls = EXECUTOR_ERRORS.get(message.code, ExecutorError)
    return cls(f"sandbox {sandbox_id}: {message.message}", code=message.code, sandbox_id=sandbox_id)


async def _receive(ws: aiohttp.ClientWebSocketResponse, sandbox_id: str) -> ports.ControlMessage | None:
    """The next control message, or None once the control websocket has ended."""
    msg = await ws.receive()
    if msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.CLOSED):
        return None
    if msg.type == aiohttp.WSMsgType.ERROR:
        raise ConnectionResetError(f"the control websocket failed: {msg.data!r}")
    try:
        if msg.type != aiohttp.WSMsgType.TEXT:
            raise msgspec.DecodeError(f"a {msg.type.name} message")
        return _DECODE(msg.data)
    except msgspec.DecodeError as exc:
        raise ProtocolError(
            f"sandbox {sandbox_id}: the executor sent a control message outside the protocol ({exc})",
            sandbox_id=sandbox_id,
        ) from None


@contextlib.asynccontextmanager
async def reverse_forward(rpc: ExecutorClient, sandbox_id: str, remote_port: int, local_url: str) -> AsyncIterator[int]:
    """The body of ``Sandbox.reverse_forward`` (see there)."""
    if isinstance(remote_port, bool) or not isinstance(remote_port, int) or not 0 <= remote_port <= 65535:
        raise ConfigError(
            f"reverse_forward(remote_port={remote_port!r}): a port is a number within 1..65535, or 0 for a free one",
            sandbox_id=sandbox_id,
        )
    host, local_port = target(local_url, sandbox_id)
    control = await rpc.websocket(f"/v1/ports/{remote_port}/listen", max_msg_size=ports.CHUNK)
    tunnels: set[asyncio.Task[None]] = set()
    reported: set[str] = set()
    watcher: asyncio.Task[None] | None = None
    closing = False
    try:
        with rpc._watch():
            first = await _receive(control, sandbox_id)
        if isinstance(first, ports.Refused):
            raise _refused(first, sandbox_id)
        if not isinstance(first, ports.Listening):
            raise ProtocolError(
                f"sandbox {sandbox_id}: the executor answered a listen with {first!r}", sandbox_id=sandbox_id
            )
        port = first.port

        def report(exc: BaseException) -> None:
            if str(exc) not in reported:  # once per cause, however many connections it ends
                reported.add(str(exc))
                log.warning("reverse_forward(%d, %r): a connection was reset: %s", port, local_url, exc)

        async def serve(conn_id: str) -> None:
            ws = None
            clean = False
            writer = None
            try:
                # Under the executor client's watch: the sandbox's close or death ends the tunnel.
                with rpc._watch():
                    ws = await rpc.websocket(f"/v1/ports/{port}/accept/{conn_id}", max_msg_size=4 * ports.CHUNK)
                    try:
                        reader, writer = await asyncio.wait_for(
                            asyncio.open_connection(host, local_port, limit=ports.CHUNK), CONNECT_TIMEOUT
                        )
                    except (OSError, TimeoutError) as exc:
                        report(OSError(f"cannot connect to {host}:{local_port}: {exc}"))
                        return  # the executor resets the sandbox's side (CLOSE_FAILED, below)
                    clean = await ports.splice(ws, reader, writer)
            except OrchardError as exc:
                report(exc)
            except (OSError, EOFError):
                pass  # one end failed: the other is reset below
            finally:
                if writer is not None:
                    if clean:
                        writer.close()
                    else:
                        ports.reset(writer)
                if ws is not None:
                    with contextlib.suppress(Exception):
                        await ws.close(code=aiohttp.WSCloseCode.OK if clean else ports.CLOSE_FAILED)

        async def watch() -> None:
            """Claim each connection the executor announces, until the control websocket ends."""
            try:
                with rpc._watch():
                    while (msg := await _receive(control, sandbox_id)) is not None:
                        if isinstance(msg, ports.Accepted):
                            task = asyncio.ensure_future(serve(msg.id))
                            tunnels.add(task)
                            task.add_done_callback(tunnels.discard)
                        else:
                            raise ProtocolError(
                                f"sandbox {sandbox_id}: the executor sent {msg!r} on a listening port",
                                sandbox_id=sandbox_id,
                            )
                if not closing:
                    log.warning("reverse_forward(%d): the executor closed the port in the sandbox", port)
            except (OrchardError, OSError) as exc:
                log.warning("reverse_forward(%d): the port in the sandbox is closed: %s", port, exc)

        watcher = asyncio.ensure_future(watch())
        yield port
    finally:
        closing = True
        # Closing the control websocket closes the port and resets its connections in the sandbox; the
        # executor answers the close once the port is closed. The watcher is not cancelled but ends with
        # the close: a receive cancelled would make aiohttp close without waiting for that answer.
        with contextlib.suppress(Exception):
            await control.close()
        if watcher is not None:
            with contextlib.suppress(Exception):
                await watcher
        for task in list(tunnels):
            task.cancel()
        await asyncio.gather(*tunnels, return_exceptions=True)
