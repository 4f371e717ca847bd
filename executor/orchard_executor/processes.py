"""Background processes: output kept in files, read back from any offset."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time

from . import files
from .errors import ExecutorError
from .protocol import ExecRequest, OutputChunk, ProcessStatus
from .runner import Child, build_argv, kill_tree, write_all

MAX_READ = 4 * 1024 * 1024


class BackgroundProcess:
    """One process started in the background, its output in two files."""

    def __init__(self, id_: str, child: Child, stdin: int, out: str, err: str) -> None:
        self.id = id_
        self.child = child
        #: Write end of the process's stdin pipe (-1 once closed).
        self.stdin = stdin
        self.paths = {"stdout": out, "stderr": err}
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
        self.done.set()

    def status(self) -> ProcessStatus:
        """Where the process stands now."""
        code = self.child.returncode
        sizes = {}
        for name, path in self.paths.items():
            try:
                sizes[name] = os.stat(path).st_size
            except OSError:
                sizes[name] = 0
        return ProcessStatus(
            id=self.id,
            pid=self.child.pid,
            running=code is None,
            exit_code=code if code is not None and code >= 0 else None,
            signal=-code if code is not None and code < 0 else None,
            stdout_size=sizes["stdout"],
            stderr_size=sizes["stderr"],
            started_at=self.started_at,
            duration=self.duration,
            timed_out=self.timed_out,
        )

    async def read(self, stream: str, offset: int, limit: int) -> OutputChunk:
        """Read up to ``limit`` bytes of a stream's output from ``offset``."""
        if stream not in self.paths:
            raise ExecutorError("bad_request", f"stream must be stdout or stderr, not {stream!r}")
        ended = self.done.is_set()
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


class ProcessTable:
    """The executor's background processes, by id."""

    def __init__(self, state_dir: str) -> None:
        self._dir = os.path.join(state_dir, "processes")
        os.makedirs(self._dir, exist_ok=True)
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
        """Start a command whose output goes to files, stdin left open."""
        id_ = secrets.token_hex(8)
        argv = build_argv(request.cmd, request.shell)
        out = os.path.join(self._dir, f"{id_}.stdout")
        err = os.path.join(self._dir, f"{id_}.stderr")
        workdir = request.cwd or cwd
        in_r, in_w = os.pipe()
        try:
            with open(out, "wb") as fout, open(err, "wb") as ferr:
                child = Child(
                    argv,
                    cwd=workdir,
                    env=env if request.env is None else env | request.env,
                    stdin=in_r,
                    stdout=fout.fileno(),
                    stderr=ferr.fileno(),
                )
        except BaseException:
            os.close(in_w)
            raise
        finally:
            os.close(in_r)
        bg = BackgroundProcess(id_, child, in_w, out, err)
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
