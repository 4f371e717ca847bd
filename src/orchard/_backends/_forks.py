"""The local backend's fork server, from the client's side.

A local sandbox's start used to be a fresh interpreter importing the
executor, aiohttp above all: most of its time. ``LocalConfig(fork=True)``
(the default) starts one interpreter that imported the executor (the
zygote, ``orchard_executor.zygote``) per backend instead, and asks it for
an executor per sandbox. Under bubblewrap, bwrap still builds the sandbox
(its root, namespaces and uid) around a placeholder first process; the
zygote's fork joins those namespaces, pinned and checked here, drops every
privilege and becomes the sandbox's executor.

The zygote's replies and its executors' exit statuses come back on one
SOCK_SEQPACKET socket. If the zygote dies, the next start starts another;
executors it forked keep running, and their exits are seen on their pidfds
(with an unknown status, -1).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import signal
import socket
import sys
from typing import Any

from ..errors import SandboxStartError

#: The launch of the zygote; ``paths`` are where this process found the executor and its dependencies.
LAUNCH = "import sys; sys.path[:0] = {paths!r}; from orchard_executor.zygote import main; main()"
#: How much of a process's stderr (an executor's, the zygote's) the client keeps, for error messages.
_TAIL_BYTES = 4000
#: Bytes of command line each forked executor may show (its directories, not its token's hash).
_TITLE_ROOM = 2048
#: The status of an executor whose exit its zygote did not live to report.
UNKNOWN_STATUS = -1


def forks_work() -> bool:
    """Whether the fork server can run here: Linux with pidfds (5.3+); elsewhere a fresh interpreter per sandbox."""
    if sys.platform != "linux" or not hasattr(os, "pidfd_open"):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:
        return False
    return True


async def tail_into(stream: asyncio.StreamReader | None, tail: bytearray) -> None:
    """Keep the last bytes of a process's output (a pipe into this process: no file the sandbox could swap)."""
    assert stream is not None
    while chunk := await stream.read(65536):
        tail += chunk
        del tail[:-_TAIL_BYTES]


async def written(stream: asyncio.StreamReader) -> str:
    """What a process that failed to start wrote to ``stream`` (waiting briefly: another may hold it open)."""
    tail = b""
    with contextlib.suppress(TimeoutError):
        tail = await asyncio.wait_for(stream.read(_TAIL_BYTES), 0.5)
    return tail.decode("utf-8", "replace").strip()


class _Pipe:
    """The client's end of a pipe, closed once (the executor's stdin: its closing is the cue to exit)."""

    def __init__(self, fd: int) -> None:
        self.fd: int | None = fd

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class ForkedExecutor:
    """An executor forked by the zygote, shaped like the ``asyncio.subprocess.Process`` a spawn gives."""

    def __init__(self, pid: int, pidfd: int, stdin: int, stderr: asyncio.StreamReader, exited: asyncio.Future[int]):
        self.pid = pid
        self.pidfd: int | None = pidfd
        self.stdin = _Pipe(stdin)
        self.stderr = stderr
        self._exited = exited
        exited.add_done_callback(lambda _: self._close_pidfd())

    @property
    def returncode(self) -> int | None:
        return self._exited.result() if self._exited.done() else None

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def kill(self) -> None:
        if self.pidfd is None:
            raise ProcessLookupError(self.pid)
        signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)

    def _close_pidfd(self) -> None:
        if self.pidfd is not None:
            with contextlib.suppress(RuntimeError):
                asyncio.get_running_loop().remove_reader(self.pidfd)
            os.close(self.pidfd)
            self.pidfd = None


class Zygote:
    """One zygote process: requests sent, replies matched in order, exits reported per pid."""

    def __init__(self, python: str, paths: list[str]) -> None:
        # The blank argument is room for each fork's command line (set_title writes over its zygote's).
        self._argv = [python, "-I", "-c", LAUNCH.format(paths=paths), "orchard-zygote" + " " * _TITLE_ROOM]
        self._proc: asyncio.subprocess.Process | None = None
        self._sock: socket.socket | None = None
        self._replies: collections.deque[asyncio.Future[tuple[dict[str, Any], list[int]]]] = collections.deque()
        self._exits: dict[int, asyncio.Future[int]] = {}
        #: Executors whose pidfd said they exited, their status not yet reported.
        self._ended: set[int] = set()
        self._tail = bytearray()
        self._drain: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._starting: asyncio.Lock = asyncio.Lock()

    async def _ensure(self, sandbox_id: str) -> socket.socket:
        async with self._starting:
            if self._sock is not None:
                return self._sock
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                self._proc = await asyncio.create_subprocess_exec(
                    *self._argv,
                    stdin=theirs.fileno(),
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.PIPE,
                    cwd="/",
                    env={"PATH": os.defpath, "LANG": "C.UTF-8"},
                    # Not the client's Ctrl-C: its executors end when their stdin closes, not before.
                    start_new_session=True,
                )
            except OSError as exc:
                ours.close()
                raise SandboxStartError(
                    f"cannot run the executor with {self._argv[0]!r}: {exc}; set LocalConfig(python=...)",
                    sandbox_id=sandbox_id,
                    reason="spawn",
                ) from exc
            finally:
                theirs.close()
            self._tail.clear()
            self._drain = asyncio.create_task(tail_into(self._proc.stderr, self._tail))
            ours.setblocking(False)
            asyncio.get_running_loop().add_reader(ours, self._receive)
            self._sock = ours
            return ours

    def _receive(self) -> None:
        assert self._sock is not None
        while True:
            try:
                message, fds, _, _ = socket.recv_fds(self._sock, 65536, 4)
            except BlockingIOError:
                return
            except OSError:
                message, fds = b"", []
            if not message:
                self._lost()
                return
            reply = json.loads(message)
            if "exit" in reply:
                self._ended.discard(reply["exit"])
                exited = self._exits.pop(reply["exit"], None)
                if exited is not None and not exited.done():
                    exited.set_result(reply["status"])
                for fd in fds:
                    os.close(fd)
            elif self._replies and not (waiter := self._replies.popleft()).done():
                waiter.set_result((reply, fds))
            else:
                # Its start was cancelled: the executor (if forked) exits as its stdin is closed.
                for fd in fds:
                    os.close(fd)

    def _lost(self) -> None:
        """The zygote is gone: pending requests fail; live executors are left to their pidfds."""
        sock, self._sock = self._sock, None
        if sock is not None:
            asyncio.get_running_loop().remove_reader(sock)
            sock.close()
        while self._replies:
            reply = self._replies.popleft()
            if not reply.done():  # not cancelled meanwhile
                reply.set_exception(ConnectionResetError("the zygote exited"))
        exits, self._exits = self._exits, {}
        for pid, exited in exits.items():
            # Exited, but its status was never reported: it never will be now.
            if pid in self._ended and not exited.done():
                exited.set_result(UNKNOWN_STATUS)
        self._ended.clear()

    async def fork(
        self, sandbox_id: str, request: dict[str, Any], fds: list[int], stdin: int, stderr: asyncio.StreamReader
    ) -> ForkedExecutor:
        """A new executor, given ``fds`` [stdin, stderr, ready, (hold), *namespaces] (closed by the caller).

        ``stdin`` (the write end of its stdin) and ``stderr`` (the reader of its stderr) become the
        returned executor's, which then owns them.
        """
        sock = await self._ensure(sandbox_id)
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[tuple[dict[str, Any], list[int]]] = loop.create_future()
        async with self._lock:
            self._replies.append(reply)
            try:
                await self._send(sock, json.dumps(request).encode(), fds)
            except OSError:
                self._lost()
        try:
            answer, got = await reply
        except ConnectionResetError:
            await self._dead()
            raise SandboxStartError(
                f"sandbox {sandbox_id}: the executor's fork server exited ({self._status()}): {self.tail()}",
                sandbox_id=sandbox_id,
                reason="exited",
            ) from None
        if "error" in answer:
            # What the fork wrote before it failed (a traceback) is in its stderr.
            raise SandboxStartError(
                f"sandbox {sandbox_id}: the executor could not be forked: {answer['error']}: " + await written(stderr),
                sandbox_id=sandbox_id,
                reason="spawn",
            )
        pid: int = answer["pid"]
        (pidfd,) = got
        exited: asyncio.Future[int] = loop.create_future()
        if self._sock is sock:
            self._exits[pid] = exited
        # If the zygote dies first, the pidfd still says when the executor exits.
        loop.add_reader(pidfd, self._pidfd_ready, pid, pidfd, exited)
        return ForkedExecutor(pid, pidfd, stdin, stderr, exited)

    def _pidfd_ready(self, pid: int, pidfd: int, exited: asyncio.Future[int]) -> None:
        asyncio.get_running_loop().remove_reader(pidfd)
        if exited.done():
            return
        if pid in self._exits:
            self._ended.add(pid)  # the zygote's report, with the status, is on its way
        else:
            exited.set_result(UNKNOWN_STATUS)

    @staticmethod
    async def _send(sock: socket.socket, message: bytes, fds: list[int]) -> None:
        while True:
            try:
                socket.send_fds(sock, [message], fds)
                return
            except BlockingIOError:
                await asyncio.sleep(0.001)

    async def _dead(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._proc.wait(), 2)
        if self._drain is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._drain), 0.5)

    def _status(self) -> str:
        code = self._proc.returncode if self._proc is not None else None
        return "running" if code is None else f"exit status {code}"

    def tail(self) -> str:
        return bytes(self._tail[-2000:]).decode("utf-8", "replace").strip()

    async def aclose(self) -> None:
        """Close the socket: the zygote exits (its executors end with their stdin, not with it)."""
        self._lost()
        if self._proc is not None and self._proc.returncode is None:
            try:
                # At once, for one that is not stuck (it exits when it reads the end of the socket).
                await asyncio.wait_for(self._proc.wait(), 2)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self._proc.kill()
                await self._proc.wait()
        if self._drain is not None:
            self._drain.cancel()
