"""Running one command: process groups, timeouts, bounded output capture."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable
from typing import Literal

from .errors import ExecutorError
from .protocol import ExecRequest, ExecResult

StreamName = Literal["stdout", "stderr"]
OutputSink = Callable[[StreamName, bytes], None]

#: After the command exits, how long to wait for processes it left behind to
#: close the output pipes before returning what was read.
PIPE_GRACE = 0.5


class OutputBuffer:
    """Captures a stream, keeping its first and last ``cap // 2`` bytes."""

    def __init__(self, cap: int) -> None:
        self._head_cap = cap - cap // 2
        self._tail_cap = cap // 2
        self._head = bytearray()
        self._tail = bytearray()
        self.total = 0

    def feed(self, data: bytes) -> None:
        """Add a chunk; memory stays within about twice the cap."""
        self.total += len(data)
        room = self._head_cap - len(self._head)
        if room > 0:
            self._head += data[:room]
            data = data[room:]
        if data and self._tail_cap:
            self._tail += data
            if len(self._tail) > 2 * self._tail_cap:
                del self._tail[: len(self._tail) - self._tail_cap]

    @property
    def truncated(self) -> bool:
        """Whether bytes were dropped."""
        return self.total > self._head_cap + self._tail_cap

    def getvalue(self) -> bytes:
        """The kept bytes: the head, then the tail."""
        if len(self._tail) > self._tail_cap:
            del self._tail[: len(self._tail) - self._tail_cap]
        return bytes(self._head + self._tail)


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``, found through /proc."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name may hold spaces and parentheses: split after the last ')'.
        fields = stat[stat.rfind(b")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(entry))
    found: list[int] = []
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal a command's process group and every descendant, even ones that left it."""
    strays = descendants(pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
    for child in strays:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(child, sig)


def build_argv(cmd: list[str] | str, shell: str) -> list[str]:
    """The argv to execute: a list as is, a string through ``shell -c``."""
    if isinstance(cmd, str):
        return [shell, "-c", cmd]
    if not cmd:
        raise ExecutorError("bad_request", "cmd is an empty list")
    return list(cmd)


def spawn_error(exc: OSError, argv: list[str], cwd: str) -> ExecutorError:
    """Turn an exec failure into the error the client should see."""
    if not os.path.isdir(cwd):
        return ExecutorError("file_not_found", f"working directory {cwd!r} does not exist", cwd)
    if isinstance(exc, FileNotFoundError):
        return ExecutorError(
            "command_not_found",
            f"{argv[0]!r} was not found in the sandbox"
            + (" (a string cmd needs a shell; pass an argv list instead)" if argv[1:2] == ["-c"] else ""),
            argv[0],
        )
    if isinstance(exc, PermissionError):
        return ExecutorError("permission_denied", f"cannot execute {argv[0]!r}: {exc.strerror}", argv[0])
    return ExecutorError("bad_request", f"cannot execute {argv[0]!r}: {exc}", argv[0])


class _Protocol(asyncio.SubprocessProtocol):
    def __init__(self, sink: OutputSink) -> None:
        self._sink = sink
        self._open = {1, 2}
        loop = asyncio.get_running_loop()
        self.exited: asyncio.Future[None] = loop.create_future()
        self.pipes_closed: asyncio.Future[None] = loop.create_future()

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        self._sink("stdout" if fd == 1 else "stderr", data)

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        self._open.discard(fd)
        if not self._open and not self.pipes_closed.done():
            self.pipes_closed.set_result(None)

    def process_exited(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)


class Running:
    """A started command; ``wait()`` enforces the timeout and returns the result."""

    def __init__(
        self,
        transport: asyncio.SubprocessTransport,
        protocol: _Protocol,
        timeout: float | None,
        started: float,
    ) -> None:
        self.transport = transport
        self._protocol = protocol
        self._timeout = timeout
        self._started = started
        self.pid: int = transport.get_pid()

    def pause_output(self, paused: bool) -> None:
        """Stop or resume reading the output pipes (backpressure for streams)."""
        for fd in (1, 2):
            pipe = self.transport.get_pipe_transport(fd)
            if pipe is None or pipe.is_closing():
                continue
            if paused:
                pipe.pause_reading()  # type: ignore[attr-defined]
            else:
                pipe.resume_reading()  # type: ignore[attr-defined]

    async def wait(self) -> tuple[int | None, int | None, bool, float]:
        """Wait for the end: (exit_code, signal, timed_out, duration)."""
        timed_out = False
        try:
            try:
                await asyncio.wait_for(asyncio.shield(self._protocol.exited), self._timeout)
            except TimeoutError:
                timed_out = True
                kill_tree(self.pid)
                await self._protocol.exited
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._protocol.pipes_closed), PIPE_GRACE)
        except asyncio.CancelledError:
            # The client went away: the command must not outlive its request.
            kill_tree(self.pid)
            raise
        finally:
            self.transport.close()
        duration = time.monotonic() - self._started
        code = self.transport.get_returncode()
        assert code is not None
        if code < 0:
            return None, -code, timed_out, duration
        return code, None, timed_out, duration


async def start(
    argv: list[str],
    *,
    cwd: str,
    env: dict[str, str],
    stdin: bytes | None,
    timeout: float | None,
    sink: OutputSink,
) -> Running:
    """Start ``argv`` in a new process group, output delivered to ``sink``."""
    loop = asyncio.get_running_loop()
    started = time.monotonic()
    try:
        transport, protocol = await loop.subprocess_exec(
            lambda: _Protocol(sink),
            *argv,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=cwd,
            env=env,
            start_new_session=True,
        )
    except OSError as exc:
        raise spawn_error(exc, argv, cwd) from exc
    if stdin is not None:
        pipe = transport.get_pipe_transport(0)
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.write(stdin)  # type: ignore[attr-defined]
            pipe.close()
    return Running(transport, protocol, timeout, started)


async def run(request: ExecRequest, *, cwd: str, env: dict[str, str], sink: OutputSink | None = None) -> ExecResult:
    """Run a command to the end, capturing (or streaming to ``sink``) its output."""
    # A streamed command's output goes to the sink; the buffers only count it.
    cap = 0 if sink else request.max_output
    buffers = {"stdout": OutputBuffer(cap), "stderr": OutputBuffer(cap)}

    def capture(stream: StreamName, data: bytes) -> None:
        buffers[stream].feed(data)
        if sink is not None:
            sink(stream, data)

    running = await start(
        build_argv(request.cmd, request.shell),
        cwd=request.cwd or cwd,
        env=env if request.env is None else env | request.env,
        stdin=request.stdin,
        timeout=request.timeout,
        sink=capture,
    )
    code, sig, timed_out, duration = await running.wait()
    out, err = buffers["stdout"], buffers["stderr"]
    return ExecResult(
        exit_code=code,
        signal=sig,
        stdout_bytes=out.getvalue(),
        stderr_bytes=err.getvalue(),
        stdout_truncated=sink is None and out.truncated,
        stderr_truncated=sink is None and err.truncated,
        stdout_total=out.total,
        stderr_total=err.total,
        timed_out=timed_out,
        duration=duration,
    )
