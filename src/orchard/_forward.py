"""``Sandbox.forward``: a local URL for a TCP port inside the sandbox, through its executor.

A listener on 127.0.0.1 (a free port) lives for the ``async with`` block;
each connection made to it becomes one tunnel: a websocket to the
executor's ``/v1/ports/{port}/connect`` (see ``orchard_executor.ports``),
which connects to 127.0.0.1:port inside the sandbox. The tunnel goes over
the sandbox's own executor connection, so it works wherever the executor is
reachable (a unix socket, TLS to a container or a pod, a port-forward
through the Kubernetes API) and is authenticated with the sandbox's token.
It carries raw bytes both ways, so HTTP, streaming replies and websockets
all pass through.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import aiohttp

from orchard_executor import ports

from ._rpc import ExecutorClient
from .errors import ConfigError, OrchardError, PortClosed

log = logging.getLogger("orchard.forward")
#: Seconds between reachability checks while ``wait`` lasts.
_RETRY = 0.1


async def _open(rpc: ExecutorClient, port: int) -> aiohttp.ClientWebSocketResponse:
    return await rpc.websocket(f"/v1/ports/{port}/connect", max_msg_size=4 * ports.CHUNK)


async def _check(rpc: ExecutorClient, sandbox_id: str, port: int, wait: float) -> None:
    """Open and close one tunnel, until one opens or ``wait`` seconds pass."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    while True:
        try:
            ws = await _open(rpc, port)
        except PortClosed as exc:
            if loop.time() + _RETRY > deadline:
                raise PortClosed(
                    f"sandbox {sandbox_id}: nothing listens on port {port} inside the sandbox (127.0.0.1:{port})"
                    + (f" after waiting {wait:g}s" if wait else "")
                    + "; start the server first, or give it time with forward(wait=...)",
                    code=exc.code,
                    sandbox_id=sandbox_id,
                ) from None
            await asyncio.sleep(_RETRY)
        else:
            await ws.close()
            return


@contextlib.asynccontextmanager
async def forward(
    rpc: ExecutorClient, sandbox_id: str, port: int, *, wait: float = 0.0, check: bool = True
) -> AsyncIterator[str]:
    """The body of ``Sandbox.forward`` (see there)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ConfigError(f"forward(port={port!r}): a port is a number within 1..65535", sandbox_id=sandbox_id)
    if wait < 0:
        raise ConfigError(f"forward(wait={wait!r}) must be 0 or more seconds", sandbox_id=sandbox_id)
    if check:
        await _check(rpc, sandbox_id, port, wait)
    tunnels: set[asyncio.Task[None]] = set()
    reported: set[str] = set()
    closing = False

    def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Our own task, not asyncio's: it is cancelled at the block's end, which asyncio would log as an error.
        task = asyncio.ensure_future(serve(reader, writer))
        tunnels.add(task)
        task.add_done_callback(tunnels.discard)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ws = None
        clean = False
        try:
            if closing:  # accepted as the block ended
                return
            # Under the executor client's watch: the sandbox's close or death ends the tunnel.
            with rpc._watch():
                ws = await _open(rpc, port)
                clean = await ports.splice(ws, reader, writer)
        except OrchardError as exc:
            if str(exc) not in reported:  # once per cause, however often a client retries
                reported.add(str(exc))
                log.warning("forward(%d): a connection was reset: %s", port, exc)
        except (OSError, EOFError):
            pass  # one end failed: the other is reset below
        finally:
            if clean:
                writer.close()
            else:
                # A reset, not an EOF: the local client sees at once that the connection failed.
                writer.transport.abort()
            if ws is not None:
                with contextlib.suppress(Exception):
                    await ws.close(code=aiohttp.WSCloseCode.OK if clean else ports.CLOSE_FAILED)

    server = await asyncio.start_server(accepted, "127.0.0.1", 0, limit=ports.CHUNK)
    local = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{local}"
    finally:
        closing = True
        server.close()
        for task in list(tunnels):
            task.cancel()
        await asyncio.gather(*tunnels, return_exceptions=True)
        await server.wait_closed()
