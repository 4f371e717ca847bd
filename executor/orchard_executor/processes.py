"""Background processes: output drained from pipes into capped files, read back from any offset."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time

from . import files
from .errors import ExecutorError
from .protocol import ExecRequest, OutputChunk, ProcessStatus
from .runner import PIPE_GRACE, READ_SIZE, Child, build_argv, kill_tree, write_all

MAX_READ = 4 * 1024 * 1024

log = logging.getLogger("orchard_executor")


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class _Drain:
    """Copies a process's output pipe into a file: the first ``cap`` bytes kept, the rest counted and dropped.

    The pipe is read as long as it has a writer, so the process never blocks
    on it; one chunk at a time is in memory, and file writes run in a thread.
    """

    def __init__(self, pipe: int, fd: int, cap: int) -> None:
        self.cap = cap
        #: Bytes written to the file, and bytes the process produced.
        self.kept = 0
        self.total = 0
        self._writing: asyncio.Future[None] | None = None
        self.task = asyncio.create_task(self._run(pipe, fd))

    @property
    def truncated(self) -> bool:
        """Whether bytes were dropped."""
        return self.total > self.kept

    async def _run(self, pipe: int, fd: int) -> None:
        loop = asyncio.get_running_loop()
        os.set_blocking(pipe, False)
        try:
            while True:
                readable = loop.create_future()
                loop.add_reader(pipe, _wake, readable)
                try:
                    await readable
                finally:
                    loop.remove_reader(pipe)
                try:
                    data = os.read(pipe, READ_SIZE)
                except BlockingIOError:
                    continue
                if not data:
                    return
                self.total += len(data)
                keep = data[: max(self.cap - self.kept, 0)]
                if not keep:
                    continue
                self._writing = loop.run_in_executor(None, write_all, fd, keep)
                try:
                    await asyncio.shield(self._writing)
                except OSError as exc:  # a full disk: keep what is there, drop the rest
                    log.warning("background output file write failed, dropping the rest: %s", exc)
                    self.cap = self.kept
                    continue
                self.kept += len(keep)
        finally:
            os.close(pipe)
            # A write still running in its thread owns the fd until it returns.
            if self._writing is not None and not self._writing.done():
                self._writing.add_done_callback(lambda _: os.close(fd))
            else:
                os.close(fd)


class BackgroundProcess:
    """One process started in the background, its output in two capped files."""

    def __init__(self, id_: str, child: Child, stdin: int, paths: dict[str, str], drains: dict[str, _Drain]) -> None:
        self.id = id_
        self.child = child
        #: Write end of the process's stdin pipe (-1 once closed).
        self.stdin = stdin
        self.paths = paths
        self.drains = drains
        self.started_at = time.time()
        self._started = time.monotonic()
        self.duration: float | None = None
        self.timed_out = False
        self.done = asyncio.Event()

    async def supervise(self, timeout: float | None) -> None:
        """Wait for the end, killing the process group at ``timeout``."""
        try:
            await asyncio.wait_for(self.child.wait(), timeout)
        except TimeoutError:
            self.timed_out = True
            kill_tree(self.child.pid)
            await self.child.wait()
        self.duration = time.monotonic() - self._started
        # The output still in the pipes belongs to the ended process; a child left holding them may write on.
        tasks = [asyncio.shield(d.task) for d in self.drains.values()]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), PIPE_GRACE)
        self.done.set()

    def status(self) -> ProcessStatus:
        """Where the process stands now."""
        code = self.child.returncode
        out, err = self.drains["stdout"], self.drains["stderr"]
        return ProcessStatus(
            id=self.id,
            pid=self.child.pid,
            running=code is None,
            exit_code=code if code is not None and code >= 0 else None,
            signal=-code if code is not None and code < 0 else None,
            stdout_size=out.kept,
            stderr_size=err.kept,
            started_at=self.started_at,
            duration=self.duration,
            timed_out=self.timed_out,
            stdout_total=out.total,
            stderr_total=err.total,
            stdout_truncated=out.truncated,
            stderr_truncated=err.truncated,
        )

    async def read(self, stream: str, offset: int, limit: int) -> OutputChunk:
        """Read up to ``limit`` bytes of a stream's output from ``offset``."""
        if stream not in self.paths:
            raise ExecutorError("bad_request", f"stream must be stdout or stderr, not {stream!r}")
        ended = self.done.is_set() and self.drains[stream].task.done()
        data, size = await asyncio.to_thread(_read, self.paths[stream], offset, min(limit, MAX_READ))
        next_offset = offset + len(data)
        return OutputChunk(data=data, offset=offset, next_offset=next_offset, eof=ended and next_offset >= size)


def _read(path: str, offset: int, size: int) -> tuple[bytes, int]:
    # The sandbox may have swapped the file for a FIFO or a symlink: open_regular refuses both.
    fd = files.open_regular(path, follow=False)
    try:
        return files.read_at(fd, offset, size), os.fstat(fd).st_size
    finally:
        os.close(fd)


def _create(path: str) -> int:
    """A new output file: never an existing path, never through a symlink."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


class ProcessTable:
    """The executor's background processes, by id."""

    def __init__(self, state_dir: str, *, max_output: int) -> None:
        self._dir = os.path.join(state_dir, "processes")
        os.makedirs(self._dir, exist_ok=True)
        #: Bytes kept per stream when a request names no ``max_output``.
        self._max_output = max_output
        self._procs: dict[str, BackgroundProcess] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return sum(1 for p in self._procs.values() if not p.done.is_set())

    def get(self, id_: str) -> BackgroundProcess:
        """The process with this id, or a process_not_found error."""
        try:
            return self._procs[id_]
        except KeyError:
            raise ExecutorError("process_not_found", f"no background process {id_!r}") from None

    def all(self) -> list[BackgroundProcess]:
        """Every known process, oldest first."""
        return list(self._procs.values())

    async def start(self, request: ExecRequest, *, cwd: str, env: dict[str, str]) -> BackgroundProcess:
        """Start a command whose output is drained into capped files, stdin left open."""
        id_ = secrets.token_hex(8)
        env = env if request.env is None else env | request.env
        argv = build_argv(request.cmd, request.shell, login=request.login, path=env.get("PATH"))
        cap = self._max_output if request.max_output is None else request.max_output
        paths = {name: os.path.join(self._dir, f"{id_}.{name}") for name in ("stdout", "stderr")}
        # Every fd that is ours stays ours until handed on: the drains then own the pipes' read ends and the files.
        owned: list[int] = []
        try:
            in_r, in_w = os.pipe()
            owned += [in_r, in_w]
            out_r, out_w = os.pipe()
            owned += [out_r, out_w]
            err_r, err_w = os.pipe()
            owned += [err_r, err_w]
            out_fd = _create(paths["stdout"])
            owned.append(out_fd)
            err_fd = _create(paths["stderr"])
            owned.append(err_fd)
            child = Child(
                argv,
                cwd=request.cwd or cwd,
                env=env,
                stdin=in_r,
                stdout=out_w,
                # Merged: stderr shares the stdout pipe, and the stderr drain sees its end at once.
                stderr=out_w if request.merge_output else err_w,
            )
        except BaseException:
            for fd in owned:
                os.close(fd)
            for path in paths.values():
                with contextlib.suppress(OSError):
                    os.unlink(path)
            raise
        for fd in (in_r, out_w, err_w):
            os.close(fd)
        drains = {"stdout": _Drain(out_r, out_fd, cap), "stderr": _Drain(err_r, err_fd, cap)}
        bg = BackgroundProcess(id_, child, in_w, paths, drains)
        if request.stdin:
            await self.write_stdin(bg, request.stdin, close=False)
        self._procs[id_] = bg
        task = asyncio.create_task(bg.supervise(request.timeout))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return bg

    async def write_stdin(self, bg: BackgroundProcess, data: bytes, *, close: bool) -> None:
        """Write to the process's stdin; a process that closed it is not an error."""
        if bg.stdin < 0:
            if data:
                raise ExecutorError("bad_request", f"the stdin of process {bg.id} is closed")
            return
        if data:
            await asyncio.get_running_loop().run_in_executor(None, write_all, bg.stdin, data)
        if close:
            os.close(bg.stdin)
            bg.stdin = -1

    def forget(self, id_: str) -> BackgroundProcess:
        """Kill a process (if running) and drop it and its output files."""
        bg = self.get(id_)
        if not bg.done.is_set():
            kill_tree(bg.child.pid)
        if bg.stdin >= 0:
            os.close(bg.stdin)
        for drain in bg.drains.values():
            drain.task.cancel()
        del self._procs[id_]
        for path in bg.paths.values():
            with contextlib.suppress(OSError):
                os.unlink(path)
        return bg

    def kill_all(self) -> None:
        """Kill every running process group (at executor shutdown)."""
        for bg in self._procs.values():
            if not bg.done.is_set():
                kill_tree(bg.child.pid)
