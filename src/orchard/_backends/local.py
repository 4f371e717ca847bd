"""The ``local`` backend: an executor child process per sandbox, on this machine.

The "image" is recorded but not used: commands run on the host, as the user
running the client, in a private directory that is deleted with the sandbox.
This is a development and CI backend, not an isolation boundary.

Nothing leaks: deleting the sandbox kills the executor and every process it
started; the executor also exits (and deletes the directory) when the client
process dies, because it watches the pipe the client holds on its stdin, and
deletes the directory then.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import aiohttp
import msgspec

import orchard_executor

from .._spec import SandboxSpec
from ..errors import ConfigError, OrchardError, SandboxLost, SandboxStartError, SandboxTimeout
from . import LocalConfig

_LAUNCH = "import sys; sys.path[:0] = {paths!r}; from orchard_executor.__main__ import main; main()"


def _import_paths() -> list[str]:
    """Where this process found the executor and its dependencies."""
    import multidict
    import yarl

    paths: list[str] = []
    for module in (orchard_executor, aiohttp, msgspec, multidict, yarl):
        assert module.__file__ is not None
        parent = os.path.dirname(os.path.dirname(module.__file__))
        if parent not in paths:
            paths.append(parent)
    return paths


def _tail(path: str, limit: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - limit))
            return f.read().decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _bwrap_argv(bwrap: str, directory: str, workdir: str, runtime: list[str]) -> list[str]:
    """Bubblewrap options: the host read-only, a private /tmp, the sandbox's own directories writable.

    ``runtime`` lists what the executor itself needs (the interpreter, its
    prefix, its import paths); those under /tmp are bound back read-only
    over the private /tmp, so a virtualenv there still works.
    """
    tmp = tempfile.gettempdir()
    argv = [bwrap, "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    argv += ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", tmp]
    for path in sorted({p for p in runtime if p == tmp or p.startswith(tmp + os.sep)}):
        if os.path.exists(path):
            argv += ["--ro-bind", path, path]
    argv += ["--bind", directory, directory]
    if not workdir.startswith(directory + os.sep):
        argv += ["--bind", workdir, workdir]
    return [*argv, "--cap-drop", "ALL", "--chdir", workdir, "--"]


def _find_bwrap(isolation: str) -> str | None:
    """The bwrap binary to use, None for no isolation, or a ConfigError."""
    if isolation == "none":
        return None
    bwrap = shutil.which("bwrap")
    works = bwrap is not None and (
        subprocess.run(
            [bwrap, "--unshare-user", "--unshare-pid", "--ro-bind", "/", "/", "--", "true"],
            capture_output=True,
            check=False,
        ).returncode
        == 0
    )
    if works:
        return bwrap
    if isolation == "bwrap":
        raise ConfigError(
            "isolation='bwrap' but bubblewrap is not installed or cannot create namespaces here; "
            "install it (apt-get install bubblewrap) or use isolation='none'"
        )
    return None


class LocalInstance:
    """One executor process and its directory."""

    def __init__(self, sandbox_id: str, directory: str, proc: asyncio.subprocess.Process, ttl: float | None) -> None:
        self.id = sandbox_id
        self.dir = directory
        self.proc = proc
        self.log = os.path.join(directory, "executor.log")
        self.base_url = ""
        self.timings: dict[str, float] = {}
        self._deleted = False
        self._expired = False
        self._ttl = asyncio.get_running_loop().call_later(ttl, self._expire) if ttl else None

    def _expire(self) -> None:
        self._expired = True
        if self.proc.stdin is not None:
            self.proc.stdin.close()

    async def diagnose(self) -> OrchardError | None:
        """The executor process's fate, with the tail of its log."""
        if self._deleted:
            return SandboxLost("the sandbox was deleted", sandbox_id=self.id, reason="deleted")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.proc.wait()), 0.5)
        code = self.proc.returncode
        # Past its ttl the sandbox is ending, even if the executor is still shutting down.
        if code is None and not self._expired:
            return None
        reason = "ttl" if self._expired else f"exited({code})"
        tail = _tail(self.log)
        return SandboxLost(
            f"sandbox {self.id}: the executor process ended ({reason})" + (f": {tail}" if tail else ""),
            sandbox_id=self.id,
            reason=reason,
        )

    async def delete(self) -> None:
        """Stop the executor (it kills its commands) and remove the directory."""
        if self._deleted:
            return
        self._deleted = True
        if self._ttl is not None:
            self._ttl.cancel()
        # Closing its stdin is the executor's cue to kill its commands and exit,
        # which also works through bubblewrap (signals to bwrap are not forwarded).
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        if self.proc.returncode is None:
            try:
                await asyncio.wait_for(self.proc.wait(), 5)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                await self.proc.wait()
        await asyncio.to_thread(shutil.rmtree, self.dir, True)


class LocalBackend:
    """Runs each sandbox's executor as a child of this process."""

    name = "local"

    def __init__(self, config: LocalConfig) -> None:
        self._python = config.python or sys.executable
        self._root = config.root or os.path.join(tempfile.gettempdir(), f"orchard-{os.getuid()}")
        paths = _import_paths()
        self._launch = _LAUNCH.format(paths=paths)
        python = os.path.realpath(self._python)
        #: What the executor needs to start: the interpreter, its prefixes and import paths.
        self._runtime = [os.path.dirname(self._python), os.path.dirname(python), sys.prefix, sys.base_prefix, *paths]
        self._bwrap = _find_bwrap(config.isolation)

    def _environment(self, spec: SandboxSpec, workdir: str, tmp: str) -> dict[str, str]:
        env = {
            "PATH": os.environ.get("PATH", os.defpath),
            "HOME": workdir,
            "TMPDIR": tmp,
            "LANG": "C.UTF-8",
        }
        return env | spec.env

    async def start(self, spec: SandboxSpec, *, sandbox_id: str, token_sha256: str) -> LocalInstance:
        """Start an executor process and wait for its ready line."""
        t0 = time.monotonic()
        if spec.workdir and not os.path.isabs(spec.workdir):
            raise ConfigError(f"workdir={spec.workdir!r} must be an absolute path")
        try:
            os.makedirs(self._root, mode=0o700, exist_ok=True)
            directory = tempfile.mkdtemp(prefix=f"{sandbox_id}-", dir=self._root)
            work, state, tmp = (os.path.join(directory, d) for d in ("work", "state", "tmp"))
            for d in (work, state, tmp):
                os.mkdir(d, 0o700)
        except OSError as exc:
            raise SandboxStartError(
                f"cannot create the sandbox directory under {self._root}: {exc}",
                sandbox_id=sandbox_id,
                reason="directory",
            ) from exc
        workdir = spec.workdir or work
        try:
            os.makedirs(workdir, exist_ok=True)
        except OSError as exc:
            shutil.rmtree(directory, ignore_errors=True)
            raise ConfigError(f"workdir={spec.workdir!r} cannot be created: {exc}") from exc
        ready_r, ready_w = os.pipe()
        argv = [
            *(_bwrap_argv(self._bwrap, directory, workdir, self._runtime) if self._bwrap else []),
            self._python,
            "-I",
            "-c",
            self._launch,
            "--host=127.0.0.1",
            "--port=0",
            f"--token-sha256={token_sha256}",
            f"--workdir={workdir}",
            f"--state-dir={state}",
            f"--ready-fd={ready_w}",
            "--exit-with-stdin",
            f"--orphan-dir={directory}",
        ]
        if spec.idle_timeout is not None:
            argv.append(f"--idle-timeout={spec.idle_timeout}")
        try:
            with open(os.path.join(directory, "executor.log"), "wb") as log:
                proc = await asyncio.create_subprocess_exec(
                    *argv,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=log,
                    cwd=workdir,
                    env=self._environment(spec, workdir, tmp),
                    pass_fds=(ready_w,),
                )
        except OSError as exc:
            os.close(ready_r)
            shutil.rmtree(directory, ignore_errors=True)
            raise SandboxStartError(
                f"cannot run the executor with {self._python!r}: {exc}; set LocalConfig(python=...)",
                sandbox_id=sandbox_id,
                reason="spawn",
            ) from exc
        finally:
            os.close(ready_w)
        instance = LocalInstance(sandbox_id, directory, proc, spec.ttl)
        instance.timings["spawned"] = time.monotonic() - t0
        try:
            port = await asyncio.wait_for(self._read_ready(ready_r, instance), spec.start_timeout)
        except TimeoutError:
            await instance.delete()
            raise SandboxTimeout(
                f"sandbox {sandbox_id}: the executor was not ready within start_timeout={spec.start_timeout:g}s",
                sandbox_id=sandbox_id,
            ) from None
        except BaseException:
            await instance.delete()
            raise
        instance.base_url = f"http://127.0.0.1:{port}"
        instance.timings["executor_ready"] = time.monotonic() - t0
        return instance

    async def _read_ready(self, fd: int, instance: LocalInstance) -> int:
        """The port from the executor's ready line, or why it died first."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0)
        )
        try:
            line = await reader.readline()
        finally:
            transport.close()
        if not line:
            await instance.proc.wait()
            raise SandboxStartError(
                f"sandbox {instance.id}: the executor exited at start ({instance.proc.returncode}): "
                + _tail(instance.log),
                sandbox_id=instance.id,
                reason="exited",
            )
        port: int = json.loads(line)["port"]
        return port

    async def aclose(self) -> None:
        """Nothing to release: sandboxes are deleted by the client."""
