"""The Sandbox: exec, processes, shell sessions and files. No backend code here."""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Literal

from orchard_executor import tarstream
from orchard_executor.protocol import (
    DEFAULT_MAX_OUTPUT,
    OCTET,
    TAR,
    WITH_STDIN,
    Empty,
    ExecRequest,
    ExecResult,
    ExitEvent,
    FileList,
    FileStat,
    Info,
    MkdirRequest,
    OutputChunk,
    OutputEvent,
    ProcessList,
    ProcessStatus,
    RemoveRequest,
    SessionExecRequest,
    SessionInfo,
    SessionRequest,
    SignalRequest,
    StdinRequest,
    WaitRequest,
)

from . import _snapshot
from . import _trace as trace
from ._finish import finish
from ._handle import Handle
from ._rpc import MAX_REPLY, REPLY_SLACK, ExecutorClient, with_stdin
from ._snapshot import Snapshot
from ._spec import SandboxSpec
from .errors import OrchardError, PathNotFound, SandboxLost, SnapshotTooLarge, UnsafeArchive

Command = str | Sequence[str]
Data = bytes | str | AsyncIterable[bytes]
#: A command's stdin: bytes or text, chunks from an async iterable, or a local file's path.
Stdin = bytes | str | AsyncIterable[bytes] | os.PathLike[str]
_CHUNK = 256 * 1024
#: Default cap on the file bytes of one snapshot (1 GiB).
SNAPSHOT_MAX_BYTES = 1 << 30
#: Largest stdin sent inside the request (which a retry can repeat); more is streamed as the body.
INLINE_STDIN = 1024 * 1024


def _result_limit(max_output: int) -> int:
    """The largest exec reply to accept: both streams at their cap, and the rest."""
    return 2 * max(max_output, 0) + REPLY_SLACK


def _stdin(data: bytes | str | None) -> bytes | None:
    return data.encode() if isinstance(data, str) else data


def _split_stdin(stdin: Stdin | None) -> tuple[bytes | None, AsyncIterable[bytes] | None]:
    """Stdin to send inside the request (small bytes), or to stream after it (anything else)."""
    if isinstance(stdin, str):
        stdin = stdin.encode()
    if stdin is None or isinstance(stdin, bytes) and len(stdin) <= INLINE_STDIN:
        return stdin, None
    if isinstance(stdin, bytes):
        return None, _whole(stdin)
    if isinstance(stdin, os.PathLike):
        path = os.fspath(stdin)
        open(path, "rb").close()  # a missing or unreadable file fails here, before the command starts
        return None, _file_chunks(path)
    return None, stdin


async def _whole(data: bytes) -> AsyncIterator[bytes]:
    yield data


def _request(
    cmd: Command,
    cwd: str | None,
    env: Mapping[str, str] | None,
    stdin: bytes | str | None,
    timeout: float | None,
    shell: str | None,
    **extra: Any,
) -> ExecRequest:
    return ExecRequest(
        cmd=cmd if isinstance(cmd, str) else list(cmd),
        cwd=cwd,
        env=dict(env) if env else None,
        stdin=_stdin(stdin),
        timeout=timeout,
        shell=shell,
        **extra,
    )


class Process:
    """A background process in a sandbox."""

    #: Where its calls are recorded (``trace=``), if anywhere.
    _trace: trace.Recorder | None = None

    def __init__(self, rpc: ExecutorClient, status: ProcessStatus) -> None:
        self._rpc = rpc
        self.id = status.id
        self.pid = status.pid
        self._path = f"/v1/processes/{status.id}"

    def __repr__(self) -> str:
        return f"<Process {self.id} pid={self.pid}>"

    @trace.traced("process_status", trace.describe_process_status)
    async def status(self) -> ProcessStatus:
        """Whether it is running, and how it ended."""
        return await self._rpc.call("GET", self._path, ProcessStatus)

    @trace.traced("process_read", trace.describe_read)
    async def read(
        self, stream: Literal["stdout", "stderr"] = "stdout", offset: int = 0, limit: int = 1024 * 1024
    ) -> OutputChunk:
        """Read output from ``offset``; pass ``chunk.next_offset`` to continue."""
        params = {"stream": stream, "offset": str(offset), "limit": str(limit)}
        return await self._rpc.call(
            "GET", f"{self._path}/output", OutputChunk, params=params, limit=max(MAX_REPLY, limit + REPLY_SLACK)
        )

    @trace.traced("process_output", trace.describe_output)
    async def output(self, stream: Literal["stdout", "stderr"] = "stdout") -> bytes:
        """All the output of ``stream`` produced so far."""
        parts, offset = [], 0
        while True:
            chunk = await self.read(stream, offset)
            parts.append(chunk.data)
            if not chunk.data:
                return b"".join(parts)
            offset = chunk.next_offset

    @trace.traced("process_stdin", trace.describe_stdin)
    async def write_stdin(self, data: bytes | str, *, close: bool = False) -> None:
        """Write to its stdin, and close it with ``close=True``."""
        await self._rpc.call(
            "POST",
            f"{self._path}/stdin",
            ProcessStatus,
            StdinRequest(data=_stdin(data) or b"", close=close),
            retry=False,
        )

    @trace.traced("process_signal", trace.describe_signal)
    async def signal(self, sig: int) -> ProcessStatus:
        """Send a signal to its whole process group."""
        return await self._rpc.call("POST", f"{self._path}/signal", ProcessStatus, SignalRequest(signal=int(sig)))

    @trace.traced("process_wait", trace.describe_wait)
    async def wait(self, timeout: float | None = None) -> ProcessStatus:
        """Wait until it ends (or ``timeout`` passes) and return its status."""
        return await self._rpc.call(
            "POST", f"{self._path}/wait", ProcessStatus, WaitRequest(timeout=timeout), timeout=timeout
        )

    @trace.traced("process_kill", trace.describe_process_status)
    async def kill(self) -> ProcessStatus:
        """Kill its process group and forget it (its output is deleted)."""
        return await self._rpc.call("DELETE", self._path, ProcessStatus)


class Shell:
    """A persistent shell session: cwd, env, variables and functions carry over.

    A command that times out is killed and leaves the session as it was.
    """

    #: Where its calls are recorded (``trace=``), if anywhere.
    _trace: trace.Recorder | None = None

    def __init__(self, rpc: ExecutorClient, info: SessionInfo) -> None:
        self._rpc = rpc
        self.id = info.id

    def __repr__(self) -> str:
        return f"<Shell {self.id}>"

    @trace.traced("shell_exec", trace.describe_shell_exec)
    async def exec(
        self,
        command: str,
        *,
        timeout: float | None = None,
        stdin: bytes | str | None = None,
        max_output: int = DEFAULT_MAX_OUTPUT,
        merge_output: bool = False,
    ) -> ExecResult:
        """Run ``command`` in the session (``merge_output`` as for ``Sandbox.exec``)."""
        req = SessionExecRequest(
            command=command,
            timeout=timeout,
            stdin=_stdin(stdin),
            max_output=max_output,
            request_id=uuid.uuid4().hex,
            merge_output=merge_output,
        )
        return await self._rpc.call(
            "POST", f"/v1/sessions/{self.id}/exec", ExecResult, req, timeout=timeout, limit=_result_limit(max_output)
        )

    @trace.traced("shell_close", trace.describe_session)
    async def aclose(self) -> None:
        """End the session."""
        await self._rpc.call("DELETE", f"/v1/sessions/{self.id}", SessionInfo)

    async def __aenter__(self) -> Shell:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class Sandbox:
    """One isolated environment: run commands in it and move files in and out.

    Get one from ``Client.sandbox()``; it is deleted when the block exits.
    """

    #: Where its calls are recorded (``trace=``), if anywhere.
    _trace: trace.Recorder | None = None

    def __init__(
        self,
        *,
        sandbox_id: str,
        spec: SandboxSpec,
        rpc: ExecutorClient,
        timings: dict[str, float],
        close: Callable[[], Awaitable[None]],
        handle: Callable[[], Handle] | None = None,
        changes_root: str | None = "/",
    ) -> None:
        self.id = sandbox_id
        self.spec = spec
        #: Seconds from the create request to each startup phase.
        self.timings = timings
        self._rpc = rpc
        self._close = close
        self._closed = False
        self._handle = handle
        #: Where ``snapshot()`` looks for changes: the root, or (None) the working directory.
        self._changes_root = changes_root
        #: Run (last added first) when the sandbox closes, while its connection is still open.
        self._on_close: list[Callable[[], Awaitable[None]]] = []

    def __repr__(self) -> str:
        return f"<Sandbox {self.id} image={self.spec.image!r}>"

    @property
    def image(self) -> str:
        """The image the sandbox was started from."""
        return self.spec.image

    def handle(self) -> Handle:
        """A string another process (or host) gives to ``Client.attach`` to use this sandbox.

        It carries the sandbox's token, so it is a secret: whoever has it can
        run commands here. Its ``repr`` hides the token; never log its ``str``.
        See ``Client.attach`` for who deletes the sandbox then.
        """
        if self._handle is None:
            raise OrchardError(f"sandbox {self.id} was not made by a Client, so it has no handle", sandbox_id=self.id)
        return self._handle()

    @trace.traced("sandbox_close", trace.describe_nothing)
    async def aclose(self) -> None:
        """Delete the sandbox and everything running in it; safe to call twice.

        A sandbox attached without ``owner=True`` is not deleted: only this
        client's connection to it is closed.

        Calls still in flight (an ``exec`` of another task, say) fail at once
        with ``SandboxClosed``; their commands are killed with the sandbox.
        A task cancelled while this runs is cancelled once the sandbox is
        deleted: a close is never left half done.
        """
        if self._closed:
            return
        self._closed = True
        await finish(self._closing())

    async def _closing(self) -> None:
        try:
            for hook in reversed(self._on_close):
                await hook()
        finally:
            self._rpc.close("closed while this call was in flight")
            await self._close()

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()  # it finishes whatever cancels come

    # Commands

    @trace.traced("exec", trace.describe_exec)
    async def exec(
        self,
        cmd: Command,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: Stdin | None = None,
        timeout: float | None = None,
        max_output: int = DEFAULT_MAX_OUTPUT,
        shell: str | None = None,
        login: bool = False,
        merge_output: bool = False,
    ) -> ExecResult:
        """Run a command to the end and return its result.

        Args:
            cmd: an argv list, or a string run by ``shell -c``.
            cwd: working directory (default: the sandbox's workdir).
            env: variables added to the sandbox's environment.
            stdin: fed to the command's stdin (default: empty): bytes or text,
                an async iterable of bytes, or the path (``os.PathLike``) of a
                local file. Beyond 1 MiB it is streamed as the command reads
                it, in any size; a command that exits without reading it all
                does not wait for the rest. An exception the iterable raises
                kills the command and is raised here.
            timeout: seconds after which the whole process group is killed;
                the result then has ``timed_out=True`` and the output so far.
            max_output: bytes kept per stream; beyond it the first and last
                halves are kept and ``stdout_truncated``/``stderr_truncated`` set.
            shell: the shell that runs a string ``cmd`` (default ``/bin/sh``).
            login: run under a login shell, ``shell -l -c cmd``, so profile
                scripts (conda, /etc/profile.d) load; the shell is then
                ``bash`` unless named, or ``/bin/sh`` where there is no bash.
                An argv list runs as given (no splitting or globbing) once
                the profile loaded; a missing program is then exit 127.
            merge_output: send stderr to stdout's pipe, as ``2>&1`` does: one
                stream in true order, in ``output``/``output_bytes`` with
                the same cap, ``output_truncated`` and ``output_total``;
                ``stdout`` and ``stderr`` are then empty.

        Without a ``timeout`` the command may run for hours; the client then
        watches the executor instead (``Client(liveness_timeout=...)``) and
        raises ``SandboxTimeout`` if it stops answering. With one, the reply
        is due ``read_timeout`` after it.
        """
        inline, streamed = _split_stdin(stdin)
        if streamed is not None:
            # Not retried, so without a request id: the stream cannot be sent twice.
            req = _request(
                cmd, cwd, env, None, timeout, shell, max_output=max_output, login=login, merge_output=merge_output
            )
            return await self._rpc.send(
                "POST",
                "/v1/exec",
                ExecResult,
                with_stdin(req, streamed),
                params={},
                content_type=WITH_STDIN,
                timeout=timeout,
                limit=_result_limit(max_output),
            )
        req = _request(
            cmd,
            cwd,
            env,
            inline,
            timeout,
            shell,
            max_output=max_output,
            request_id=uuid.uuid4().hex,
            login=login,
            merge_output=merge_output,
        )
        return await self._rpc.call(
            "POST", "/v1/exec", ExecResult, req, timeout=timeout, limit=_result_limit(max_output)
        )

    @trace.traced_stream("exec_stream", trace.describe_exec_stream)
    async def exec_stream(
        self,
        cmd: Command,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: Stdin | None = None,
        timeout: float | None = None,
        shell: str | None = None,
        login: bool = False,
        merge_output: bool = False,
    ) -> AsyncIterator[OutputEvent | ExitEvent]:
        """Run a command, yielding ``OutputEvent`` chunks as they are produced.

        The last event is an ``ExitEvent`` whose ``result`` has the exit code,
        ``timed_out`` and byte counts (its output fields are empty). Leaving
        the loop early kills the command. ``stdin``, ``login`` and
        ``merge_output`` are as for ``exec``; merged chunks have the stream
        name ``"output"`` and the count is ``output_total``.
        """
        inline, streamed = _split_stdin(stdin)
        req = _request(cmd, cwd, env, inline, timeout, shell, login=login, merge_output=merge_output)
        totals = {"stdout": 0, "stderr": 0, "output": 0}
        async for event in self._rpc.frames("/v1/exec/stream", req, timeout, stdin=streamed):
            if isinstance(event, OutputEvent):
                totals[event.stream] += len(event.data)
                yield event
            else:
                event.result.stdout_total = totals["stdout"]
                event.result.stderr_total = totals["stderr"]
                event.result.output_total = totals["output"]
                yield event
                return
        raise SandboxLost(
            f"sandbox {self.id}: the output stream ended before the command did", sandbox_id=self.id, reason="stream"
        )

    @trace.traced("process_start", trace.describe_start_process)
    async def start_process(
        self,
        cmd: Command,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | str | None = None,
        timeout: float | None = None,
        shell: str | None = None,
        max_output: int | None = None,
        login: bool = False,
        merge_output: bool = False,
    ) -> Process:
        """Start a command in the background; its output is kept in the sandbox.

        Each stream keeps its first ``max_output`` bytes (default: the
        executor's cap, 256 MiB) in a file in the sandbox; the rest is read
        and dropped, so the process never blocks on it, and its status counts
        it (``stdout_total``) and sets ``stdout_truncated``/``stderr_truncated``.
        ``login`` is as for ``exec``; with ``merge_output`` stderr goes into
        the stdout stream, in true order, and the stderr stream stays empty.
        """
        req = _request(
            cmd, cwd, env, stdin, timeout, shell, max_output=max_output, login=login, merge_output=merge_output
        )
        status = await self._rpc.call("POST", "/v1/processes", ProcessStatus, req, retry=False)
        return Process(self._rpc, status)

    @trace.traced("processes", trace.describe_processes)
    async def processes(self) -> list[ProcessStatus]:
        """Every background process started in this sandbox."""
        return (await self._rpc.call("GET", "/v1/processes", ProcessList)).processes

    @trace.traced("shell_open", trace.describe_shell)
    async def shell(
        self, *, cwd: str | None = None, env: Mapping[str, str] | None = None, shell: str = "bash", login: bool = False
    ) -> Shell:
        """Open a persistent shell session (needs bash in the sandbox).

        With ``login``, the session starts as a login shell would: its first
        command runs under ``bash --login``, so /etc/profile and ~/.bash_profile
        (or ~/.profile) load, and what they set carries over.
        """
        req = SessionRequest(cwd=cwd, env=dict(env) if env else None, shell=shell, login=login)
        return Shell(self._rpc, await self._rpc.call("POST", "/v1/sessions", SessionInfo, req, retry=False))

    @trace.traced("info", trace.describe_nothing)
    async def info(self) -> Info:
        """The executor's version, uptime and load."""
        return await self._rpc.call("GET", "/v1/info", Info)

    @trace.traced_context("forward", trace.describe_forward)
    def forward(self, port: int, *, wait: float = 0.0, check: bool = True) -> AbstractAsyncContextManager[str]:
        """A local URL for a TCP port inside the sandbox, for an ``async with`` block.

        ``async with sb.forward(8100) as url:`` gives ``"http://127.0.0.1:PORT"``;
        each connection to it is tunnelled through the executor (authenticated,
        over the sandbox's TLS or unix socket) to 127.0.0.1:8100 in the sandbox,
        as raw TCP, so streaming replies and websockets pass through. The
        tunnels close when the block exits or the sandbox closes or dies.

        Like ``kubectl port-forward``, the local port binds 127.0.0.1 only, but
        any process on this host can use it while the block is open.

        Args:
            port: the port inside the sandbox, 1..65535.
            wait: seconds to wait for a server to listen on ``port`` (one just
                started with ``start_process`` may need a moment).
            check: connect once at entry (and close at once) to check that
                something listens; without it, a connection to the URL is
                reset instead when nothing does.

        Raises:
            PortClosed: Nothing listens on ``port`` at entry (after ``wait``).
        """
        from ._forward import forward

        return forward(self._rpc, self.id, port, wait=wait, check=check)

    def reverse_forward(self, remote_port: int, local_url: str) -> AbstractAsyncContextManager[int]:
        """A port inside the sandbox that leads to ``local_url`` on this side, for an ``async with`` block.

        ``async with sb.reverse_forward(8000, "http://127.0.0.1:9000") as port:``
        makes the executor listen on 127.0.0.1:8000 in the sandbox; each
        connection a process there makes to it is tunnelled back through the
        executor (authenticated, over the sandbox's TLS or unix socket) to
        127.0.0.1:9000 here, as raw TCP, so streaming replies and websockets
        pass through. The sandbox needs no network of its own. The port closes,
        and its connections are reset, when the block exits, this client
        closes or dies, or the sandbox closes.

        Any process in the sandbox can use the port while the block is open.

        Args:
            remote_port: the port to listen on inside the sandbox, 1..65535, or
                0 for a free one; the block gets the port bound.
            local_url: where connections lead, reached from this process:
                ``http://host:port``, ``host:port`` (no path: the tunnel is TCP).

        Raises:
            ConfigError: A port or ``local_url`` that cannot be used.
            InvalidRequest: ``remote_port`` is in use in the sandbox.
            PermissionDenied: The executor may not bind ``remote_port`` (below 1024).
            ExecutorError: ``too_many_tunnels``: the executor has ``MAX_LISTENERS`` ports listening.
        """
        from ._reverse import reverse_forward

        return reverse_forward(self._rpc, self.id, remote_port, local_url)

    # Files

    @trace.traced("file_write", trace.describe_write_file)
    async def write_file(self, path: str, data: Data, *, mode: int = 0o644, parents: bool = True) -> FileStat:
        """Write a file atomically (streamed if ``data`` is an async iterable)."""
        body = data.encode() if isinstance(data, str) else data
        params = {"path": path, "mode": str(mode), "parents": "1" if parents else "0"}
        return await self._rpc.send("PUT", "/v1/files", FileStat, body, params=params, content_type=OCTET)

    @trace.traced_stream("file_read", trace.describe_receive)
    def stream_file(self, path: str) -> AsyncIterator[bytes]:
        """Yield a file's bytes in chunks, without holding it all in memory."""
        return self._rpc.receive("/v1/files", {"path": path})

    @trace.traced("file_read", trace.describe_read_file)
    async def read_file(self, path: str) -> bytes:
        """A file's whole content."""
        return b"".join([chunk async for chunk in self.stream_file(path)])

    @trace.traced("stat", trace.describe_path)
    async def stat(self, path: str) -> FileStat:
        """Type, size, mode and mtime of a path (a final symlink is not followed)."""
        return await self._rpc.call("GET", "/v1/files/stat", FileStat, params={"path": path})

    @trace.traced("exists", trace.describe_path)
    async def exists(self, path: str) -> bool:
        """Whether the path exists."""
        try:
            await self.stat(path)
        except PathNotFound:
            return False
        return True

    @trace.traced("list_dir", trace.describe_path)
    async def list_dir(self, path: str = ".") -> list[FileStat]:
        """The entries of a directory, sorted by name."""
        return (await self._rpc.call("GET", "/v1/files/list", FileList, params={"path": path})).entries

    @trace.traced("mkdir", trace.describe_path)
    async def mkdir(self, path: str, *, parents: bool = True, mode: int = 0o755, exist_ok: bool = True) -> FileStat:
        """Create a directory."""
        req = MkdirRequest(path=path, parents=parents, mode=mode, exist_ok=exist_ok)
        return await self._rpc.call("POST", "/v1/files/mkdir", FileStat, req)

    @trace.traced("remove", trace.describe_path)
    async def remove(self, path: str, *, recursive: bool = False, missing_ok: bool = False) -> None:
        """Remove a file or symlink, or a directory (a whole tree with ``recursive``)."""
        await self._rpc.call(
            "POST", "/v1/files/remove", Empty, RemoveRequest(path=path, recursive=recursive, missing_ok=missing_ok)
        )

    @trace.traced("upload", trace.describe_upload)
    async def upload(
        self,
        local_path: str | os.PathLike[str],
        path: str,
        *,
        max_bytes: int = tarstream.MAX_BYTES,
        max_members: int = tarstream.MAX_MEMBERS,
    ) -> FileStat:
        """Copy a local file or directory tree (as a tar stream) to ``path``.

        Modes lose setuid, setgid and sticky bits and group/other write. A tree
        goes by the rules of ``download``, checked by the executor, which
        writes nothing of a stream it refuses (``UnsafeUpload``) or that is
        over ``max_bytes`` or ``max_members``.
        """
        local = os.fspath(local_path)
        if os.path.isdir(local):
            return await self.upload_tar(path, tarstream.archive(local), max_bytes=max_bytes, max_members=max_members)
        mode = os.stat(local).st_mode & tarstream.SAFE_MODE
        return await self.write_file(path, _file_chunks(local), mode=mode)

    @trace.traced("download", trace.describe_download)
    async def download(
        self,
        path: str,
        local_path: str | os.PathLike[str],
        *,
        max_bytes: int = tarstream.MAX_BYTES,
        max_members: int = tarstream.MAX_MEMBERS,
    ) -> None:
        """Copy a sandbox file or directory tree to ``local_path``, trusting nothing the sandbox made.

        A tree comes as a plain tar stream, unpacked into a staging directory
        beside ``local_path`` and moved into place (merged with what is
        there) only if all of it was accepted: device nodes, FIFOs, symlinks
        that are absolute or resolve outside ``local_path``, hardlinks to
        outside, compressed streams and more than ``max_bytes`` (default
        4 GiB) or ``max_members`` (default 100,000) are refused. Setuid,
        setgid and sticky bits and group/other write are dropped, and files
        belong to this process, whatever owner the sandbox gave them.

        Raises:
            UnsafeArchive: A rule was broken; ``local_path`` is as it was.
        """
        local = os.fspath(local_path)
        st = await self.stat(path)
        if st.type == "directory":
            try:
                await tarstream.extract(self.download_tar(path), local, max_bytes=max_bytes, max_members=max_members)
            except tarstream.Refused as exc:
                raise UnsafeArchive(
                    f"sandbox {self.id}: {path}: {exc}", member=exc.member, rule=exc.rule, sandbox_id=self.id
                ) from exc
            return
        if st.type == "other":
            raise UnsafeArchive(
                f"sandbox {self.id}: {path} is a device, FIFO or socket, not a file",
                member=path,
                rule="type",
                sandbox_id=self.id,
            )
        # A symlink is followed in the sandbox; its own mode (0o777) says nothing of the file's.
        mode = st.mode & tarstream.SAFE_MODE if st.type == "file" else 0o644
        fd, tmp = tempfile.mkstemp(
            prefix=f".{os.path.basename(local)}.", suffix=".orchard-part", dir=os.path.dirname(os.path.abspath(local))
        )
        chunks = self.stream_file(path)
        try:
            with os.fdopen(fd, "wb") as f:
                size = 0
                async for chunk in chunks:
                    size += len(chunk)
                    if size > max_bytes:
                        raise UnsafeArchive(
                            f"sandbox {self.id}: {path} is over the limit of {max_bytes} bytes (max_bytes)",
                            member=path,
                            rule="bytes",
                            sandbox_id=self.id,
                        )
                    f.write(chunk)
                os.fchmod(f.fileno(), mode)
            os.replace(tmp, local)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()

    @trace.traced_stream("download_tar", trace.describe_receive)
    def download_tar(self, path: str) -> AsyncIterator[bytes]:
        """A tar stream of a sandbox directory's contents (or of one file)."""
        return self._rpc.receive("/v1/files/tar", {"path": path})

    @trace.traced("upload_tar", trace.describe_upload_tar)
    async def upload_tar(
        self,
        path: str,
        tar: bytes | AsyncIterable[bytes],
        *,
        max_bytes: int = tarstream.MAX_BYTES,
        max_members: int = tarstream.MAX_MEMBERS,
    ) -> FileStat:
        """Extract a plain tar stream into the sandbox directory ``path``, all or nothing (rules of ``upload``)."""
        params = {"path": path, "max_bytes": str(max_bytes), "max_members": str(max_members)}
        return await self._rpc.send("PUT", "/v1/files/tar", FileStat, tar, params=params, content_type=TAR)

    @trace.traced("snapshot", trace.describe_snapshot)
    async def snapshot(
        self,
        paths: Sequence[str] | None = None,
        *,
        file: str | os.PathLike[str] | None = None,
        max_bytes: int = SNAPSHOT_MAX_BYTES,
        max_members: int = tarstream.MAX_MEMBERS,
    ) -> Snapshot:
        """Capture what this sandbox's filesystem gained, to start others from (``restore=``).

        With no ``paths``: every file, directory and symlink changed (by
        ctime, which its code cannot set back) since the sandbox started, on
        its root file system (the working directory on the local backend,
        whose sandboxes share the host's). Deletions are not captured.
        With ``paths`` (relative ones are under the working directory): those
        files and trees, whole. Kept in memory, or streamed to ``file``.

        Raises:
            SnapshotTooLarge: Files of more than ``max_bytes`` (default 1 GiB)
                in all, or more than ``max_members`` entries; ``path`` names
                the one that took it over. Nothing is kept.
        """
        workdir = (await self.info()).cwd
        if paths is None:
            wanted = [(self._changes_root or workdir, True)]
        else:
            wanted = [(p if p.startswith("/") else os.path.join(workdir, p), False) for p in paths]
        store = _snapshot.Store(file)
        parts: list[_snapshot.Part] = []
        try:
            for path, changed in wanted:
                st = await self.stat(path)
                # A file is archived under its own name: its part goes in the directory holding it.
                where = path if st.type == "directory" else os.path.dirname(path)
                start = store.size
                params = {
                    "path": path,
                    "changed": "1" if changed else "0",
                    "max_bytes": str(max_bytes),
                    "max_members": str(max_members),
                }
                async for chunk in self._rpc.receive("/v1/files/tar", params):
                    await store.write(chunk)
                    # The executor counts file bytes; this bounds what a lying one can send (headers and padding).
                    if store.size > max_bytes + 1024 * max_members:
                        raise SnapshotTooLarge(
                            f"sandbox {self.id}: the snapshot passed its limit of {max_bytes} bytes (max_bytes)",
                            code="too_large",
                            sandbox_id=self.id,
                        )
                parts.append(_snapshot.Part(where, start, store.size))
        except BaseException:
            store.discard()
            raise
        return store.finish(parts, workdir)

    @trace.traced("restore", trace.describe_restore)
    async def restore(self, snapshot: Snapshot, *, max_members: int = tarstream.MAX_MEMBERS) -> None:
        """Write a snapshot's files into this sandbox, in place (``client.sandbox(image, restore=)`` calls it).

        Paths the snapshot took under its sandbox's working directory go
        under this one's. Raises the typed error of the path that could not
        be written (``PermissionDenied`` for a read-only one, ``NoSpace``);
        what was written before stays, so a sandbox whose restore failed is
        best discarded.
        """
        workdir = (await self.info()).cwd
        for part in snapshot.parts:
            params = {
                "path": snapshot.where(part, workdir),
                "max_bytes": str(snapshot.size),  # file bytes are fewer than the tar's
                "max_members": str(max_members),
            }
            await self._rpc.send(
                "PUT", "/v1/files/restore", FileStat, snapshot.chunks(part), params=params, content_type=TAR
            )


async def _file_chunks(path: str) -> AsyncIterator[bytes]:
    with open(path, "rb") as f:
        while chunk := await asyncio.to_thread(f.read, _CHUNK):
            yield chunk
