"""Traces: one JSON record per request to a sandbox, written as each call ends.

``Client.create(..., trace=...)`` takes a path (appended to, one ``write`` per
record, so a client killed at any point leaves every finished call's record
whole) or a function called with each record as a dict. The record types and
their fields are documented in docs/trace.md; ``SCHEMA_VERSION`` is each
record's ``"v"``.

The Sandbox, Process and Shell methods are wrapped by ``traced`` (coroutine
methods), ``traced_stream`` (methods returning an async iterator) and
``traced_context`` (``forward``, an async context manager); each
names a describer below, which turns the call's arguments and outcome into
fields. Calls a traced call makes itself (the ``stat`` and ``write_file`` of
an ``upload``) are not recorded apart: one record per call of the user's.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import os
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Coroutine, Mapping
from contextlib import AbstractAsyncContextManager
from contextvars import ContextVar
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

import msgspec

from orchard_executor.protocol import ExecResult, ExitEvent, OutputEvent, ProcessStatus

from .errors import ConfigError, TraceError

#: The ``"v"`` of every record; raised when a field changes meaning or goes away.
SCHEMA_VERSION = 1
#: Bytes of a stream's output kept at the start and at the end of a record.
HEAD = TAIL = 2048

Record = dict[str, Any]
#: What ``trace=`` takes: a file path, or a function called with each record.
Trace = str | os.PathLike[str] | Callable[[Record], object]
P = ParamSpec("P")
T = TypeVar("T")


class _Traceable(Protocol):
    id: str
    timings: dict[str, float]
    _trace: Recorder | None

    async def aclose(self) -> None: ...


S = TypeVar("S", bound=_Traceable)

_ENCODE = msgspec.json.Encoder().encode
# Set while a traced call runs, so the calls it makes itself are not recorded again.
_inside: ContextVar[bool] = ContextVar("orchard_trace_inside", default=False)


class _File:
    """A trace file: each record one ``write(2)`` of one line, nothing buffered."""

    def __init__(self, path: str) -> None:
        try:
            # O_NONBLOCK: a FIFO without a reader fails (ENXIO) instead of hanging the open.
            self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
        except OSError as exc:
            raise TraceError(f"trace={path!r} cannot be written: {exc.strerror}", path=path) from exc
        os.set_blocking(self.fd, True)
        self.path = path

    def __call__(self, record: Record) -> None:
        data = _ENCODE(record) + b"\n"
        try:
            while data:
                data = data[os.write(self.fd, data) :]
        except OSError as exc:
            raise TraceError(
                f"trace={self.path!r}: a record could not be written: {exc.strerror}", path=self.path
            ) from exc


class Recorder:
    """Where one sandbox's records go: a file, or a function."""

    def __init__(self, sink: Callable[[Record], object]) -> None:
        self._sink = sink
        #: Set once the sandbox has an id; every record carries it.
        self.sandbox_id: str | None = None
        self.closed = False

    @classmethod
    def open(cls, trace: object) -> Recorder:
        """Open ``trace`` for appending, or take it as the function to call.

        Raises:
            TraceError: The file cannot be opened for writing.
            ConfigError: ``trace`` is neither a path nor a plain function.
        """
        if isinstance(trace, str | os.PathLike) and isinstance(path := os.fspath(trace), str):
            return cls(_File(path))
        if callable(trace) and not isinstance(trace, type):
            if inspect.iscoroutinefunction(trace):
                raise ConfigError("trace= takes a plain function of one record; an async one would never run")
            return cls(trace)
        raise ConfigError(f"trace= takes a file path (str or os.PathLike) or a function of one record, not {trace!r}")

    def emit(
        self, kind: str, start: float, duration: float, fields: Mapping[str, Any], error: BaseException | None
    ) -> None:
        """Send one record (nothing once closed)."""
        if self.closed:
            return
        err = None if error is None else {"type": type(error).__name__, "message": str(error)}
        self._sink(
            {
                "v": SCHEMA_VERSION,
                "type": kind,
                "sandbox": self.sandbox_id,
                "start": start,
                "end": start + duration,
                "duration": duration,
                **fields,
                "error": err,
            }
        )

    def close(self) -> None:
        """Record nothing more and close the file; safe to call twice."""
        if not self.closed and isinstance(self._sink, _File):
            os.close(self._sink.fd)
        self.closed = True

    async def record_create(self, create: Coroutine[Any, Any, S], fields: Record, kind: str = "sandbox_create") -> S:
        """Await ``create`` (a sandbox start or attach), trace the sandbox and record it as ``kind``.

        If the record cannot be written the sandbox is deleted and the error raised.
        """
        start, t0 = time.time(), time.perf_counter()
        try:
            sb = await create
        except BaseException as exc:
            self.sandbox_id = getattr(exc, "sandbox_id", None)
            _emit_failure(self, kind, start, time.perf_counter() - t0, fields, exc)
            self.close()
            raise
        self.sandbox_id = sb.id
        try:
            self.emit(kind, start, time.perf_counter() - t0, fields | {"timings": sb.timings}, None)
        except BaseException:
            self.close()
            await sb.aclose()
            raise
        sb._trace = self
        return sb


# Describers: each takes a method's arguments (and the object) and returns the fields to record
# and a function adding the fields of the call's result (or None).

Done = Callable[[Any], Record] | None
Describe = Callable[..., tuple[dict[str, Any], Done]]


def traced(
    kind: str, describe: Describe
) -> Callable[
    [Callable[Concatenate[Any, P], Coroutine[Any, Any, T]]], Callable[Concatenate[Any, P], Coroutine[Any, Any, T]]
]:
    """Record each call of a coroutine method as a ``kind`` record (the object's ``_trace`` says where)."""

    def wrap(
        method: Callable[Concatenate[Any, P], Coroutine[Any, Any, T]],
    ) -> Callable[Concatenate[Any, P], Coroutine[Any, Any, T]]:
        @functools.wraps(method)
        async def call(self: Any, /, *args: P.args, **kwargs: P.kwargs) -> T:
            rec: Recorder | None = self._trace
            if rec is None or rec.closed or _inside.get():
                return await method(self, *args, **kwargs)
            fields, done = describe(self, *args, **kwargs)
            # A describer may pass a streamed body on through a hasher instead.
            call_args: Any = fields.pop("_args", args)
            call_kwargs: Any = fields.pop("_kwargs", kwargs)
            token = _inside.set(True)
            start, t0 = time.time(), time.perf_counter()
            try:
                result = await method(self, *call_args, **call_kwargs)
            except BaseException as exc:
                _emit_failure(rec, kind, start, time.perf_counter() - t0, fields, exc)
                raise
            finally:
                _inside.reset(token)
            duration = time.perf_counter() - t0
            if done is not None:
                fields.update(done(result))
            rec.emit(kind, start, duration, fields, None)
            if kind == "sandbox_close":
                rec.close()
            return result

        return call

    return wrap


def traced_stream(
    kind: str, describe: Callable[..., tuple[dict[str, Any], _Watch]]
) -> Callable[[Callable[Concatenate[Any, P], AsyncIterator[T]]], Callable[Concatenate[Any, P], AsyncIterator[T]]]:
    """Record a method returning an async iterator as one ``kind`` record, when the iteration ends."""

    def wrap(
        method: Callable[Concatenate[Any, P], AsyncIterator[T]],
    ) -> Callable[Concatenate[Any, P], AsyncIterator[T]]:
        @functools.wraps(method)
        def call(self: Any, /, *args: P.args, **kwargs: P.kwargs) -> AsyncIterator[T]:
            rec: Recorder | None = self._trace
            if rec is None or rec.closed or _inside.get():
                return method(self, *args, **kwargs)
            fields, watch = describe(self, *args, **kwargs)
            return _watched(rec, kind, fields, watch, method(self, *args, **kwargs))

        return call

    return wrap


def traced_context(
    kind: str, describe: Describe
) -> Callable[
    [Callable[Concatenate[Any, P], AbstractAsyncContextManager[T]]],
    Callable[Concatenate[Any, P], AbstractAsyncContextManager[T]],
]:
    """Record a method returning an async context manager as one ``kind`` record, when the block exits."""

    def wrap(
        method: Callable[Concatenate[Any, P], AbstractAsyncContextManager[T]],
    ) -> Callable[Concatenate[Any, P], AbstractAsyncContextManager[T]]:
        @functools.wraps(method)
        def call(self: Any, /, *args: P.args, **kwargs: P.kwargs) -> AbstractAsyncContextManager[T]:
            rec: Recorder | None = self._trace
            if rec is None or rec.closed or _inside.get():
                return method(self, *args, **kwargs)
            fields, done = describe(self, *args, **kwargs)
            return _block(rec, kind, fields, done, method(self, *args, **kwargs))

        return call

    return wrap


@contextlib.asynccontextmanager
async def _block(
    rec: Recorder, kind: str, fields: Record, done: Done, inner: AbstractAsyncContextManager[T]
) -> AsyncIterator[T]:
    start, t0 = time.time(), time.perf_counter()
    in_block = False
    try:
        async with inner as value:
            if done is not None:
                fields |= done(value)
            in_block = True
            yield value
            in_block = False
    except BaseException as exc:
        # An error of the caller's block is not this call's: the block is then recorded as it went.
        _emit_failure(rec, kind, start, time.perf_counter() - t0, fields, exc, own=not in_block)
        raise
    rec.emit(kind, start, time.perf_counter() - t0, fields, None)


def _emit_failure(
    rec: Recorder,
    kind: str,
    start: float,
    duration: float,
    fields: Record,
    exc: BaseException,
    *,
    own: bool = True,
) -> None:
    # The call's own error matters more than its record: keep it, and say what was lost.
    try:
        rec.emit(kind, start, duration, fields, exc if own else None)
    except Exception as trace_exc:
        exc.add_note(f"orchard: this call's trace record was lost: {trace_exc}")


async def _watched(
    rec: Recorder, kind: str, fields: Record, watch: _Watch, inner: AsyncIterator[T]
) -> AsyncIterator[T]:
    start, t0 = time.time(), time.perf_counter()
    try:
        # Not under _inside: the caller's own code runs between the items.
        async for item in inner:
            watch.see(item)
            yield item
    except GeneratorExit:  # the caller left the loop early: no error, but not the whole stream
        rec.emit(kind, start, time.perf_counter() - t0, fields | watch.fields() | {"closed_early": True}, None)
        raise
    except BaseException as exc:
        _emit_failure(rec, kind, start, time.perf_counter() - t0, fields | watch.fields(), exc)
        raise
    finally:
        aclose = getattr(inner, "aclose", None)
        if aclose is not None:
            await aclose()
    rec.emit(kind, start, time.perf_counter() - t0, fields | watch.fields() | {"closed_early": False}, None)


class _Watch:
    """Sees each item of a stream; ``fields()`` says what it saw."""

    def see(self, item: Any) -> None:
        raise NotImplementedError

    def fields(self) -> Record:
        raise NotImplementedError


class _Bytes(_Watch):
    """Counts and hashes a byte stream as it passes (a file read or written, a tar)."""

    def __init__(self) -> None:
        self.size = 0
        self.sha = hashlib.sha256()

    def see(self, item: bytes) -> None:
        self.size += len(item)
        self.sha.update(item)

    def fields(self) -> Record:
        return {"bytes": self.size, "sha256": self.sha.hexdigest()}

    async def through(self, chunks: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
        """``chunks``, seen on their way (a streamed upload's body)."""
        async for chunk in chunks:
            self.see(chunk)
            yield chunk


class _Output:
    """A bounded head and tail of one output stream."""

    __slots__ = ("head", "tail", "total")

    def __init__(self) -> None:
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = HEAD - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            del self.tail[:-TAIL]

    def fields(self, name: str) -> Record:
        return {
            f"{name}_total": self.total,
            f"{name}_head": _text(self.head),
            f"{name}_tail": _text(self.tail),
        }


class _ExecStream(_Watch):
    def __init__(self) -> None:
        self.streams: dict[str, _Output] = {}
        self.result: ExecResult | None = None

    def see(self, item: OutputEvent | ExitEvent) -> None:
        if isinstance(item, OutputEvent):
            out = self.streams.get(item.stream)
            if out is None:
                out = self.streams[item.stream] = _Output()
            out.add(item.data)
        else:
            self.result = item.result

    def fields(self) -> Record:
        found: Record = {}
        for name in ("stdout", "stderr"):
            found |= self.streams.get(name, _Output()).fields(name)
        if "output" in self.streams:
            found |= self.streams["output"].fields("output")
        if self.result is not None:
            r = self.result
            found |= {"exit_code": r.exit_code, "signal": r.signal, "timed_out": r.timed_out}
        return found


def _text(data: bytes | bytearray) -> str:
    return data.decode("utf-8", "replace")


_STREAMS = ("output", "stdout", "stderr")


def _head_tail(data: bytes) -> tuple[str, str]:
    """The first HEAD bytes, and the last TAIL if there is more (else ``""``), as text."""
    if len(data) <= HEAD + TAIL:
        return _text(data), ""
    return _text(data[:HEAD]), _text(data[-TAIL:])


def _scalars(options: Mapping[str, Any]) -> Record:
    """Options of simple value (``login``, ``merge_output``): recorded; anything else may be a secret."""
    return {k: v for k, v in options.items() if isinstance(v, bool | int | float) or v is None}


def _stdin_bytes(stdin: object) -> int | None:
    """Bytes of stdin sent, or None when it was streamed from an iterable or a file."""
    if stdin is None:
        return 0
    if isinstance(stdin, bytes):
        return len(stdin)
    if isinstance(stdin, str):
        return len(stdin.encode())
    return None


def _command(
    cmd: object,
    *,
    cwd: str | None = None,
    env: Mapping[str, str] | None = None,
    stdin: object = None,
    timeout: float | None = None,
    **options: Any,
) -> Record:
    fields = {
        "cmd": cmd if isinstance(cmd, str) else list(cmd),  # type: ignore[call-overload]
        "cwd": cwd,
        "env_keys": sorted(env) if env else [],
        "stdin_bytes": _stdin_bytes(stdin),
        "timeout": timeout,
        **_scalars(options),
    }
    if isinstance(shell := options.get("shell"), str):
        fields["shell"] = shell
    return fields


def exec_result(result: ExecResult, merged: bool = False) -> Record:
    """The fields of an exec's outcome."""
    found: Record = {"exit_code": result.exit_code, "signal": result.signal, "timed_out": result.timed_out}
    if merged:
        _stream(found, _KEYS["output"], result.output_bytes, result.output_total, result.output_truncated)
    _stream(found, _KEYS["stdout"], result.stdout_bytes, result.stdout_total, result.stdout_truncated)
    _stream(found, _KEYS["stderr"], result.stderr_bytes, result.stderr_total, result.stderr_truncated)
    return found


# Field names per stream, made once: this runs on every exec.
_KEYS = {name: tuple(f"{name}_{field}" for field in ("total", "truncated", "head", "tail")) for name in _STREAMS}


def _stream(found: Record, keys: tuple[str, ...], data: bytes, total: int, truncated: bool) -> None:
    head, tail = _head_tail(data)
    found[keys[0]] = total
    found[keys[1]] = truncated
    found[keys[2]] = head
    found[keys[3]] = tail


def _status(status: ProcessStatus) -> Record:
    return {
        "running": status.running,
        "exit_code": status.exit_code,
        "signal": status.signal,
        "timed_out": status.timed_out,
        "stdout_total": status.stdout_total,
        "stderr_total": status.stderr_total,
    }


def describe_create(image: str, backend: str, spec: Mapping[str, Any]) -> Record:
    """``Client.create``: the image, backend and options (env names, not values)."""
    env = spec.get("env") or {}
    options = {k: v for k, v in spec.items() if isinstance(v, str | bool | int | float) or v is None}
    return {"image": image, "backend": backend, "env_keys": sorted(env), **options}


def describe_exec(_: object, cmd: object, **kwargs: Any) -> tuple[Record, Done]:
    """``Sandbox.exec``."""
    fields = _command(cmd, **kwargs)
    merged = bool(kwargs.get("merge_output"))
    return fields, lambda result: exec_result(result, merged)


def describe_exec_stream(_: object, cmd: object, **kwargs: Any) -> tuple[Record, _Watch]:
    """``Sandbox.exec_stream``."""
    return _command(cmd, **kwargs), _ExecStream()


def describe_start_process(sb: object, cmd: object, **kwargs: Any) -> tuple[Record, Done]:
    """``Sandbox.start_process``: the Process it returns is traced too."""

    def done(process: Any) -> Record:
        process._trace = sb._trace  # type: ignore[attr-defined]
        return {"process": process.id, "pid": process.pid}

    return _command(cmd, **kwargs), done


def describe_shell(
    sb: object, *, cwd: str | None = None, env: Mapping[str, str] | None = None, **options: Any
) -> tuple[Record, Done]:
    """``Sandbox.shell``: the Shell it returns is traced too."""

    def done(shell: Any) -> Record:
        shell._trace = sb._trace  # type: ignore[attr-defined]
        return {"session": shell.id}

    fields = {"cwd": cwd, "env_keys": sorted(env) if env else [], **_scalars(options)}
    if isinstance(shell := options.get("shell"), str):
        fields["shell"] = shell
    return fields, done


def describe_shell_exec(
    shell: Any, command: str, *, stdin: object = None, timeout: float | None = None, **options: Any
) -> tuple[Record, Done]:
    """``Shell.exec``."""
    fields = {"session": shell.id, "command": command, "stdin_bytes": _stdin_bytes(stdin), "timeout": timeout}
    merged = bool(options.get("merge_output"))
    return fields | _scalars(options), lambda result: exec_result(result, merged)


def describe_session(shell: Any) -> tuple[Record, Done]:
    """``Shell.aclose``."""
    return {"session": shell.id}, None


def describe_signal(process: Any, sig: int) -> tuple[Record, Done]:
    """``Process.signal``."""
    return {"process": process.id, "sent_signal": int(sig)}, _status


def describe_wait(process: Any, timeout: float | None = None) -> tuple[Record, Done]:
    """``Process.wait``."""
    return {"process": process.id, "timeout": timeout}, _status


def describe_process_status(process: Any) -> tuple[Record, Done]:
    """``Process.status`` and ``Process.kill``."""
    return {"process": process.id}, _status


def describe_stdin(process: Any, data: bytes | str, *, close: bool = False) -> tuple[Record, Done]:
    """``Process.write_stdin``."""
    return {"process": process.id, "bytes": _stdin_bytes(data), "close": close}, None


def describe_read(
    process: Any, stream: str = "stdout", offset: int = 0, limit: int = 1024 * 1024
) -> tuple[Record, Done]:
    """``Process.read``."""
    fields = {"process": process.id, "stream": stream, "offset": offset}
    return fields, lambda chunk: {"bytes": len(chunk.data), "eof": chunk.eof}


def describe_output(process: Any, stream: str = "stdout") -> tuple[Record, Done]:
    """``Process.output``."""
    return {"process": process.id, "stream": stream}, lambda data: {"bytes": len(data)}


def describe_processes(_: object) -> tuple[Record, Done]:
    """``Sandbox.processes``."""
    return {}, lambda found: {"count": len(found)}


def describe_nothing(_: object) -> tuple[Record, Done]:
    """Calls with nothing to record but that they happened (``info``, ``aclose``)."""
    return {}, None


def describe_write_file(_: object, path: str, data: Any, **options: Any) -> tuple[Record, Done]:
    """``Sandbox.write_file``: size and sha256 of the data, hashed as it streams if it does."""
    fields: Record = {"path": path, **_scalars(options)}
    if isinstance(data, bytes | str):
        body = data.encode() if isinstance(data, str) else data
        fields |= {"bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}
        return fields, None
    if not isinstance(data, AsyncIterable):
        return fields, None  # not data at all: the call itself says so
    seen = _Bytes()
    fields["_args"] = (path, seen.through(data))
    fields["_kwargs"] = options
    return fields, lambda _: seen.fields()


def describe_read_file(_: object, path: str) -> tuple[Record, Done]:
    """``Sandbox.read_file``."""
    return {"path": path}, lambda data: {
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "closed_early": False,
    }


def describe_receive(_: object, path: str) -> tuple[Record, _Watch]:
    """``Sandbox.stream_file`` and ``download_tar``: counted and hashed as they stream."""
    return {"path": path}, _Bytes()


def describe_forward(_: object, port: int, **options: Any) -> tuple[Record, Done]:
    """``Sandbox.forward``: recorded when its block exits; ``url`` is the local end."""
    return {"port": port, **_scalars(options)}, lambda url: {"url": url}


def describe_path(_: object, path: str = ".", **options: Any) -> tuple[Record, Done]:
    """``stat``, ``list_dir``, ``mkdir``, ``remove``: the path and options; what was found."""
    return {"path": path, **_scalars(options)}, _path_result


def _path_result(result: Any) -> Record:
    if isinstance(result, bool):
        return {"result": result}
    if isinstance(result, list):
        return {"count": len(result)}
    if result is None:
        return {}
    return {"file_type": result.type, "size": result.size}


def describe_upload(_: object, local_path: Any, path: str, **options: Any) -> tuple[Record, Done]:
    """``Sandbox.upload``."""
    return {"local_path": os.fspath(local_path), "path": path, **_scalars(options)}, _path_result


def describe_download(_: object, path: str, local_path: Any, **options: Any) -> tuple[Record, Done]:
    """``Sandbox.download``."""
    return {"path": path, "local_path": os.fspath(local_path), **_scalars(options)}, None


def describe_snapshot(_: object, paths: Any = None, **options: Any) -> tuple[Record, Done]:
    """``Sandbox.snapshot``: the paths asked for (None: what changed); the tar's size and parts."""
    fields = {"paths": None if paths is None else [str(p) for p in paths], **_scalars(options)}
    return fields, lambda snap: {"bytes": snap.size, "parts": [part.path for part in snap.parts]}


def describe_restore(_: object, snapshot: Any, **options: Any) -> tuple[Record, Done]:
    """``Sandbox.restore``: the snapshot's size and parts."""
    return {"bytes": snapshot.size, "parts": [part.path for part in snapshot.parts], **_scalars(options)}, None


def describe_upload_tar(_: object, path: str, tar: Any, **options: Any) -> tuple[Record, Done]:
    """``Sandbox.upload_tar``: the stream's size and sha256, hashed as it goes."""
    fields, done = describe_write_file(_, path, tar, **options)
    return fields, lambda result: (done(result) if done else {}) | {"file_type": result.type}
