"""Accepting connections: a cap, idle ones evicted for new ones, no log flood at the fd limit.

asyncio's own accept loop logs an error for every failed ``accept()`` at the
fd limit and retries every second, 128 times a tick: idle connections held
by a peer at 1024 fds made it write hundreds of MiB of log and stall the
executor. Here the executor accepts itself: it keeps the connections under
a cap set below the fd limit (room stays for commands' pipes and files),
and when the cap or the fd limit is reached it closes the connection idle
the longest (none of its requests running, quiet for ``MIN_IDLE``) to make
room, or leaves new connections waiting in the kernel's backlog for a
moment. An authenticated client thus gets in while a peer holds idle
connections; the peer's are the ones that go.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import time
from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    import ssl

#: Connections kept at most (the fd limit may lower it).
MAX_CONNECTIONS = 1024
#: Seconds without a request before a connection may be closed to make room.
MIN_IDLE = 0.5
#: Seconds to leave new connections in the backlog when there is no room.
PAUSE = 0.1
#: Connections accepted per wakeup, so that serving requests goes on during a flood.
BATCH = 16
#: Seconds a new TLS connection may take to finish its handshake.
TLS_HANDSHAKE_TIMEOUT = 10.0
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)

log = logging.getLogger("orchard_executor.listener")


def connection_cap(fd_limit: int) -> int:
    """Connections to allow under a soft fd limit, keeping an eighth (at least 32) for everything else."""
    return max(4, min(MAX_CONNECTIONS, fd_limit - max(32, fd_limit // 8)))


class Listener:
    """Accepts connections on ``sock`` for an aiohttp ``web.Server``, over TLS if ``tls`` is given."""

    def __init__(
        self, sock: socket.socket, server: web.Server, max_connections: int, tls: ssl.SSLContext | None = None
    ) -> None:
        self._sock = sock
        self._tls = tls
        self._server = server
        self._max = max_connections
        self._loop = asyncio.get_running_loop()
        self._pending = 0
        self._paused: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._warned = 0.0
        #: Connections closed to make room (said in the warning when accepts pause).
        self.evicted = 0

    def start(self) -> None:
        """Start accepting."""
        self._sock.setblocking(False)
        self._loop.add_reader(self._sock.fileno(), self._accept)

    def close(self) -> None:
        """Stop accepting and close the listening socket."""
        if self._paused is not None:
            self._paused.cancel()
        with contextlib.suppress(ValueError, OSError):
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()

    def _pause(self, why: str) -> None:
        self._loop.remove_reader(self._sock.fileno())
        self._paused = self._loop.call_later(PAUSE, self._resume)
        now = time.monotonic()
        if now - self._warned > 60:  # one line a minute, however long it lasts
            self._warned = now
            log.warning("%s: new connections wait (%d evicted so far)", why, self.evicted)

    def _resume(self) -> None:
        self._paused = None
        self._loop.add_reader(self._sock.fileno(), self._accept)

    def _evict(self) -> bool:
        """Close the connection idle the longest, if one has been idle long enough."""
        idle = [
            h
            for h in self._server.connections
            if not getattr(h, "_request_in_progress", False) and getattr(h, "transport", None) is not None
        ]
        if not idle:
            return False
        # aiohttp moves a connection's keep-alive deadline at its start and after each reply.
        oldest = min(idle, key=lambda h: getattr(h, "_next_keepalive_close_time", 0.0))
        quiet_since = getattr(oldest, "_next_keepalive_close_time", 0.0) - oldest.keepalive_timeout
        if self._loop.time() - quiet_since < MIN_IDLE:
            return False
        oldest.force_close()
        self.evicted += 1
        return True

    def _accept(self) -> None:
        for _ in range(BATCH):
            if len(self._server.connections) + self._pending >= self._max and not self._evict():
                self._pause(f"at the connection cap ({self._max})")
                return
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                if exc.errno not in _OUT_OF_FDS:
                    raise
                self._evict()  # its fd is free by the next try
                self._pause(f"out of file descriptors ({exc.strerror})")
                return
            self._pending += 1
            task = self._loop.create_task(self._serve(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, conn: socket.socket) -> None:
        try:
            conn.setblocking(False)
            if self._tls is None:
                await self._loop.connect_accepted_socket(self._server, conn)
            else:
                # A handshake is a pending connection: it counts against the cap until done or timed out.
                await self._loop.connect_accepted_socket(
                    self._server, conn, ssl=self._tls, ssl_handshake_timeout=TLS_HANDSHAKE_TIMEOUT
                )
        except (OSError, TimeoutError):
            conn.close()
        finally:
            self._pending -= 1
