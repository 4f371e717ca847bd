"""Running one command: process groups, timeouts, bounded output capture."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterable, Callable
from typing import Literal

from .errors import ExecutorError
from .protocol import DEFAULT_MAX_OUTPUT, ExecRequest, ExecResult

#: "output" is stdout and stderr merged in one pipe (``merge_output``).
StreamName = Literal["stdout", "stderr", "output"]
OutputSink = Callable[[StreamName, bytes], None]
#: A command's stdin: bytes, or chunks as they arrive (a streamed request body).
Stdin = bytes | AsyncIterable[bytes] | None

#: After the command exits, how long to wait for processes it left behind to
#: close the output pipes before returning what was read.
PIPE_GRACE = 0.5
READ_SIZE = 256 * 1024

#: Pids spawned here and not yet reaped. A zombie reaper (the executor as PID 1)
#: must leave these alone: ``Child`` waits for them itself.
TRACKED: set[int] = set()


class OutputBuffer:
    """Captures a stream, keeping its first ``cap - cap // 2`` and last ``cap // 2`` bytes.

    The tail is a ring allocated once at its exact size, so memory stays at
    ``cap`` whatever the command prints.
    """

    def __init__(self, cap: int) -> None:
        self._head_cap = cap - cap // 2
        self._tail_cap = cap // 2
        self._head = bytearray()
        self._ring: bytearray | None = None
        #: Where the next tail byte goes in the ring, and how many it holds.
        self._pos = 0
        self._held = 0
        self.total = 0

    def feed(self, data: bytes) -> None:
        """Add a chunk."""
        self.total += len(data)
        view = memoryview(data)
        room = self._head_cap - len(self._head)
        if room > 0:
            self._head += view[:room]
            view = view[room:]
        if not view or not self._tail_cap:
            return
        if self._ring is None:
            self._ring = bytearray(self._tail_cap)
        view = view[-self._tail_cap :]
        n = len(view)
        first = min(n, self._tail_cap - self._pos)
        self._ring[self._pos : self._pos + first] = view[:first]
        self._ring[: n - first] = view[first:]
        self._pos = (self._pos + n) % self._tail_cap
        self._held = min(self._held + n, self._tail_cap)

    @property
    def truncated(self) -> bool:
        """Whether bytes were dropped."""
        return self.total > self._head_cap + self._tail_cap

    def getvalue(self) -> bytes:
        """The kept bytes: the head, then the tail."""
        if self._ring is None:
            return bytes(self._head)
        if self._held < self._tail_cap:
            return bytes(self._head) + self._ring[: self._held]
        return bytes(self._head) + self._ring[self._pos :] + self._ring[: self._pos]


def parents() -> dict[int, int]:
    """The parent pid of every process in /proc."""
    found: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name may hold spaces and parentheses: split after the last ')'.
        found[int(entry)] = int(stat[stat.rfind(b")") + 2 :].split()[1])
    return found


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``, found through /proc."""
    children: dict[int, list[int]] = {}
    for child, parent in parents().items():
        children.setdefault(parent, []).append(child)
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


def build_argv(cmd: list[str] | str, shell: str | None, *, login: bool = False, path: str | None = None) -> list[str]:
    """The argv to execute: a list as is, a string through ``shell -c`` (see ``ExecRequest.login``).

    Under ``login`` with no ``shell`` named, the shell is ``bash`` if ``path``
    (the command's PATH) has it, else ``/bin/sh``, whose ``-l`` (dash, busybox)
    reads /etc/profile and ~/.profile.
    """
    if not isinstance(cmd, str) and not cmd:
        raise ExecutorError("bad_request", "cmd is an empty list")
    if not login:
        return [shell or "/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
    if shell is None:
        shell = shutil.which("bash", path=os.defpath if path is None else path) or "/bin/sh"
    if isinstance(cmd, str):
        return [shell, "-l", "-c", cmd]
    # The list goes in as positional parameters, so the shell neither splits nor expands it.
    return [shell, "-l", "-c", 'exec "$@"', shell, *cmd]


def spawn_error(exc: OSError, argv: list[str], cwd: str) -> ExecutorError:
    """Turn an exec failure into the error the client should see."""
    if not os.path.isdir(cwd):
        return ExecutorError("file_not_found", f"working directory {cwd!r} does not exist", cwd)
    if isinstance(exc, FileNotFoundError):
        hint = ""
        if argv[1:2] == ["-c"]:
            hint = " (a string cmd needs a shell; pass an argv list instead)"
        elif argv[1:3] == ["-l", "-c"]:
            hint = " (login=True needs a shell, bash or /bin/sh, in the sandbox)"
        return ExecutorError("command_not_found", f"{argv[0]!r} was not found in the sandbox{hint}", argv[0])
    if isinstance(exc, PermissionError):
        return ExecutorError("permission_denied", f"cannot execute {argv[0]!r}: {exc.strerror}", argv[0])
    return ExecutorError("bad_request", f"cannot execute {argv[0]!r}: {exc}", argv[0])


def write_all(fd: int, data: bytes) -> None:
    """Write everything to a blocking fd (run in a thread); a closed reader is not an error."""
    view = memoryview(data)
    with contextlib.suppress(BrokenPipeError):
        while view:
            view = view[os.write(fd, view) :]


class Child:
    """A process started in a session of its own, its exit watched through a pidfd.

    Lighter than asyncio's subprocess machinery (no transports, no child
    watcher), and every pid it has not yet reaped is in ``TRACKED``, so a
    zombie reaper running as PID 1 knows which children are ours to wait for.
    """

    def __init__(self, argv: list[str], *, cwd: str, env: dict[str, str], stdin: int, stdout: int, stderr: int) -> None:
        try:
            popen = subprocess.Popen(
                argv, cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr, start_new_session=True
            )
        except OSError as exc:
            raise spawn_error(exc, argv, cwd) from exc
        self._popen = popen
        self.pid: int = popen.pid
        self.returncode: int | None = None
        TRACKED.add(self.pid)
        self._loop = asyncio.get_running_loop()
        self._exited: asyncio.Future[None] = self._loop.create_future()
        try:
            self._pidfd = os.pidfd_open(self.pid)
        except OSError:  # no pidfd (Linux < 5.3): a thread waits instead
            self._pidfd = -1
            waiter = self._loop.run_in_executor(None, os.waitpid, self.pid, 0)
            waiter.add_done_callback(lambda f: self._set(f.result()[1]))
        else:
            self._loop.add_reader(self._pidfd, self._reap)

    def _reap(self) -> None:
        self._loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        try:
            status = os.waitpid(self.pid, 0)[1]
        except ChildProcessError:  # reaped at shutdown by kill_descendants
            status = signal.SIGKILL
        self._set(status)

    def _set(self, status: int) -> None:
        self.returncode = self._popen.returncode = os.waitstatus_to_exitcode(status)
        TRACKED.discard(self.pid)
        self._exited.set_result(None)

    async def wait(self) -> int:
        """Wait for the exit; the return code is negative for a signal."""
        await asyncio.shield(self._exited)
        assert self.returncode is not None
        return self.returncode


class _Pipes:
    """Reads a command's stdout and stderr pipes into a sink as data arrives."""

    def __init__(self, fds: dict[int, StreamName], sink: OutputSink) -> None:
        self._loop = asyncio.get_running_loop()
        self._fds = fds
        self._sink = sink
        self.closed: asyncio.Future[None] = self._loop.create_future()
        for fd in fds:
            os.set_blocking(fd, False)
        self.pause(False)

    def _read(self, fd: int) -> None:
        try:
            data = os.read(fd, READ_SIZE)
        except BlockingIOError:
            return
        if data:
            self._sink(self._fds[fd], data)
        else:
            self._close(fd)

    def _close(self, fd: int) -> None:
        self._loop.remove_reader(fd)
        os.close(fd)
        del self._fds[fd]
        if not self._fds and not self.closed.done():
            self.closed.set_result(None)

    def pause(self, paused: bool) -> None:
        """Stop or resume reading (backpressure for streamed output)."""
        for fd in self._fds:
            if paused:
                self._loop.remove_reader(fd)
            else:
                self._loop.add_reader(fd, self._read, fd)

    def close(self) -> None:
        """Stop reading and close whatever is still open."""
        for fd in list(self._fds):
            self._close(fd)


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class _Feeder:
    """Writes stdin into a command's pipe from the loop, one chunk at a time, as the pipe takes it.

    A chunk is taken from the source only once the previous one is in the
    pipe, so a streamed request body is read no faster than the command
    reads: bounded memory, and backpressure down to the client. A command
    that closes its stdin ends the feeding; a source that fails kills the
    command, which must not take a cut stdin for a whole one.
    """

    def __init__(self, fd: int, source: bytes | AsyncIterable[bytes], child: Child) -> None:
        self._child = child
        #: Why the source failed, if it did.
        self.error: BaseException | None = None
        self.task = asyncio.create_task(self._run(fd, source))

    async def _run(self, fd: int, source: bytes | AsyncIterable[bytes]) -> None:
        loop = asyncio.get_running_loop()
        os.set_blocking(fd, False)
        try:
            async for chunk in _chunks(source):
                view = memoryview(chunk)
                while view:
                    try:
                        view = view[os.write(fd, view) :]
                    except BlockingIOError:
                        writable = loop.create_future()
                        loop.add_writer(fd, _wake, writable)
                        try:
                            await writable
                        finally:
                            loop.remove_writer(fd)
        except BrokenPipeError:
            pass  # the command closed its stdin: what it did not read is dropped
        except Exception as exc:
            self.error = exc
            if self._child.returncode is None:  # a reaped command's pid may already be another's
                kill_tree(self._child.pid)
        finally:
            os.close(fd)


async def _chunks(source: bytes | AsyncIterable[bytes]) -> AsyncIterable[bytes]:
    if isinstance(source, bytes):
        yield source
        return
    async for chunk in source:
        yield chunk


class Running:
    """A started command; ``wait()`` enforces the timeout and returns the result."""

    def __init__(
        self, child: Child, pipes: _Pipes, timeout: float | None, started: float, feeder: _Feeder | None = None
    ) -> None:
        self._child = child
        self._pipes = pipes
        self._timeout = timeout
        self._started = started
        self._feeder = feeder
        self.pid = child.pid

    def pause_output(self, paused: bool) -> None:
        """Stop or resume reading the output pipes (backpressure for streams)."""
        self._pipes.pause(paused)

    async def wait(self) -> tuple[int | None, int | None, bool, float]:
        """Wait for the end: (exit_code, signal, timed_out, duration)."""
        timed_out = False
        try:
            try:
                await asyncio.wait_for(self._child.wait(), self._timeout)
            except TimeoutError:
                timed_out = True
                kill_tree(self.pid)
                await self._child.wait()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._pipes.closed), PIPE_GRACE)
        except asyncio.CancelledError:
            # The client went away: the command must not outlive its request.
            kill_tree(self.pid)
            raise
        finally:
            self._pipes.close()
            if self._feeder is not None:
                # Stdin the command left unread (a child may still hold the pipe) is not waited for.
                self._feeder.task.cancel()
        duration = time.monotonic() - self._started
        if self._feeder is not None and self._feeder.error is not None:
            raise ExecutorError(
                "bad_request", f"the command's stdin ended early, so it was killed: {self._feeder.error!r}"
            )
        code = await self._child.wait()
        if code < 0:
            return None, -code, timed_out, duration
        return code, None, timed_out, duration


async def start(
    argv: list[str],
    *,
    cwd: str,
    env: dict[str, str],
    stdin: Stdin,
    timeout: float | None,
    sink: OutputSink,
    merge: bool = False,
) -> Running:
    """Start ``argv`` in a new process group, ``stdin`` fed to it, output delivered to ``sink``.

    With ``merge``, stderr shares the stdout pipe, so the two interleave in the
    order the command wrote them, delivered as the stream "output".
    """
    started = time.monotonic()
    out_r, out_w = os.pipe()
    err_r, err_w = (-1, out_w) if merge else os.pipe()
    in_r, in_w = os.pipe() if stdin is not None and stdin != b"" else (os.open(os.devnull, os.O_RDONLY), -1)
    try:
        child = Child(argv, cwd=cwd, env=env, stdin=in_r, stdout=out_w, stderr=err_w)
    except BaseException:
        for fd in (out_r, err_r, in_w):
            if fd >= 0:
                os.close(fd)
        raise
    finally:
        for fd in {out_w, err_w, in_r}:
            os.close(fd)
    feeder = None if stdin is None or in_w < 0 else _Feeder(in_w, stdin, child)
    fds: dict[int, StreamName] = {out_r: "output"} if merge else {out_r: "stdout", err_r: "stderr"}
    return Running(child, _Pipes(fds, sink), timeout, started, feeder)


async def run(
    request: ExecRequest,
    *,
    cwd: str,
    env: dict[str, str],
    sink: OutputSink | None = None,
    stdin: AsyncIterable[bytes] | None = None,
) -> ExecResult:
    """Run a command to the end, capturing (or streaming to ``sink``) its output.

    ``stdin``, when given, is streamed to the command in place of ``request.stdin``.
    """
    # A streamed command's output goes to the sink; the buffers only count it.
    cap = 0 if sink else DEFAULT_MAX_OUTPUT if request.max_output is None else request.max_output
    buffers: dict[StreamName, OutputBuffer] = {"stdout": OutputBuffer(cap), "stderr": OutputBuffer(cap)}
    if request.merge_output:
        buffers = {"output": OutputBuffer(cap)}

    def capture(stream: StreamName, data: bytes) -> None:
        buffers[stream].feed(data)
        if sink is not None:
            sink(stream, data)

    env = env if request.env is None else env | request.env
    running = await start(
        build_argv(request.cmd, request.shell, login=request.login, path=env.get("PATH")),
        cwd=request.cwd or cwd,
        env=env,
        stdin=request.stdin if stdin is None else stdin,
        timeout=request.timeout,
        sink=capture,
        merge=request.merge_output,
    )
    code, sig, timed_out, duration = await running.wait()
    none = OutputBuffer(0)
    out, err, both = (buffers.get(name, none) for name in ("stdout", "stderr", "output"))
    return ExecResult(
        exit_code=code,
        signal=sig,
        stdout_bytes=out.getvalue(),
        stderr_bytes=err.getvalue(),
        stdout_truncated=sink is None and out.truncated,
        stderr_truncated=sink is None and err.truncated,
        stdout_total=out.total,
        stderr_total=err.total,
        output_bytes=both.getvalue(),
        output_truncated=sink is None and both.truncated,
        output_total=both.total,
        timed_out=timed_out,
        duration=duration,
    )
