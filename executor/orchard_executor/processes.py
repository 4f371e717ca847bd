"""Background processes: output kept in files, read back from any offset."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time

from .errors import ExecutorError
from .protocol import ExecRequest, OutputChunk, ProcessStatus
from .runner import build_argv, kill_tree, spawn_error

MAX_READ = 4 * 1024 * 1024


class BackgroundProcess:
    """One process started in the background, its output in two files."""

    def __init__(self, id_: str, proc: asyncio.subprocess.Process, out: str, err: str) -> None:
        self.id = id_
        self.proc = proc
        self.paths = {"stdout": out, "stderr": err}
        self.started_at = time.time()
        self._started = time.monotonic()
        self.duration: float | None = None
        self.timed_out = False
        self.done = asyncio.Event()

    async def supervise(self, timeout: float | None) -> None:
        """Wait for the end, killing the process group at ``timeout``."""
        try:
            await asyncio.wait_for(self.proc.wait(), timeout)
        except TimeoutError:
            self.timed_out = True
            kill_tree(self.proc.pid)
            await self.proc.wait()
        self.duration = time.monotonic() - self._started
        self.done.set()

    def status(self) -> ProcessStatus:
        """Where the process stands now."""
        code = self.proc.returncode
        sizes = {}
        for name, path in self.paths.items():
            try:
                sizes[name] = os.stat(path).st_size
            except OSError:
                sizes[name] = 0
        return ProcessStatus(
            id=self.id,
            pid=self.proc.pid,
            running=code is None,
            exit_code=code if code is not None and code >= 0 else None,
            signal=-code if code is not None and code < 0 else None,
            stdout_size=sizes["stdout"],
            stderr_size=sizes["stderr"],
            started_at=self.started_at,
            duration=self.duration,
            timed_out=self.timed_out,
        )

    def read(self, stream: str, offset: int, limit: int) -> OutputChunk:
        """Read up to ``limit`` bytes of a stream's output from ``offset``."""
        if stream not in self.paths:
            raise ExecutorError("bad_request", f"stream must be stdout or stderr, not {stream!r}")
        ended = self.done.is_set()
        with open(self.paths[stream], "rb") as f:
            f.seek(offset)
            data = f.read(min(limit, MAX_READ))
            size = os.fstat(f.fileno()).st_size
        next_offset = offset + len(data)
        return OutputChunk(data=data, offset=offset, next_offset=next_offset, eof=ended and next_offset >= size)


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
        with open(out, "wb") as fout, open(err, "wb") as ferr:
            try:
                proc = await asyncio.create_subprocess_exec(
                    *argv,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=fout,
                    stderr=ferr,
                    cwd=workdir,
                    env=env if request.env is None else env | request.env,
                    start_new_session=True,
                )
            except OSError as exc:
                raise spawn_error(exc, argv, workdir) from exc
        bg = BackgroundProcess(id_, proc, out, err)
        if request.stdin:
            await self.write_stdin(bg, request.stdin, close=False)
        self._procs[id_] = bg
        task = asyncio.create_task(bg.supervise(request.timeout))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return bg

    async def write_stdin(self, bg: BackgroundProcess, data: bytes, *, close: bool) -> None:
        """Write to the process's stdin; a process that closed it is not an error."""
        stdin = bg.proc.stdin
        if stdin is None:
            return
        try:
            if data:
                stdin.write(data)
                await stdin.drain()
            if close:
                stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            pass

    def forget(self, id_: str) -> BackgroundProcess:
        """Kill a process (if running) and drop it and its output files."""
        bg = self.get(id_)
        if not bg.done.is_set():
            kill_tree(bg.proc.pid)
        del self._procs[id_]
        for path in bg.paths.values():
            with contextlib.suppress(OSError):
                os.unlink(path)
        return bg

    def kill_all(self) -> None:
        """Kill every running process group (at executor shutdown)."""
        for bg in self._procs.values():
            if not bg.done.is_set():
                kill_tree(bg.proc.pid)
