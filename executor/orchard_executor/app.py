"""The executor's HTTP application: ``create_app(settings) -> web.Application``."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import hmac
import logging
import os
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

import msgspec
from aiohttp import web

from . import __version__, files, ports, tarstream
from .errors import ExecutorError
from .processes import MAX_READ, ProcessTable
from .protocol import (
    API_VERSION,
    FRAME_HEADER,
    FRAMES,
    HEARTBEAT,
    JSON,
    MAX_BODY,
    MAX_INT,
    MSGPACK,
    SETID_BITS,
    WITH_STDIN,
    DataFrame,
    Empty,
    EndFrame,
    Error,
    ErrorEvent,
    ExecRequest,
    ExecResult,
    ExitEvent,
    FileList,
    HeartbeatEvent,
    Info,
    MkdirRequest,
    OutputEvent,
    ProcessList,
    RekeyRequest,
    RemoveRequest,
    SessionExecRequest,
    SessionInfo,
    SessionRequest,
    SignalRequest,
    StdinRequest,
    WaitRequest,
    decode,
    encode,
    frame,
)

if TYPE_CHECKING:
    from . import display
from .runner import StreamName, build_argv, run, start
from .sessions import SessionTable

T = TypeVar("T")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

#: Completed exec results kept for request-id deduplication, bounded by bytes.
DEDUP_BYTES = 64 * 1024 * 1024
DEDUP_ENTRIES = 4096
#: How long a run whose client disconnected waits for a retry to claim it.
RETRY_GRACE = 5.0
#: Streaming exec: stop reading the command's pipes above this many queued bytes.
STREAM_HIGH_WATER = 1024 * 1024
#: Seconds a structured body may take to arrive (a peer trickling bytes holds nothing longer).
BODY_TIMEOUT = 120.0

log = logging.getLogger("orchard_executor")
_HEARTBEAT_FRAME = frame(HeartbeatEvent())


class Settings(msgspec.Struct, kw_only=True):
    """How an executor runs."""

    #: SHA-256 (hex) of the bearer token every request but /healthz must carry.
    token_sha256: str
    #: Default working directory of commands and base of relative paths.
    workdir: str = "/"
    #: Where background output and session state live; a new temp dir if None.
    state_dir: str | None = None
    #: Exit after this many seconds without an authenticated request.
    idle_timeout: float | None = None
    #: The environment commands get (the executor's own, cleaned, if None).
    env: dict[str, str] | None = None
    #: Largest ``max_output`` a request may ask for, per stream.
    max_output_limit: int = 256 * 1024 * 1024


class State:
    """Everything the handlers share."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.state_dir = settings.state_dir or tempfile.mkdtemp(prefix="orchard-executor-")
        os.makedirs(self.state_dir, exist_ok=True)
        self.env = settings.env if settings.env is not None else clean_environ(os.environ)
        self.processes = ProcessTable(self.state_dir, max_output=settings.max_output_limit)
        self.sessions = SessionTable(self.state_dir)
        self.started = time.monotonic()
        #: Wall clock of the start: a changes-only tar takes what changed since.
        self.started_ns = time.time_ns()
        self.last_activity = time.monotonic()
        self.in_flight = 0
        self.stopped = asyncio.Event()
        self.stop_reason = ""
        self._token = bytes.fromhex(settings.token_sha256)
        self._dedup: collections.OrderedDict[str, asyncio.Future[ExecResult]] = collections.OrderedDict()
        self._dedup_bytes = 0
        self._waiters: collections.Counter[str] = collections.Counter()
        self._abandon: dict[str, asyncio.TimerHandle] = {}
        #: Connections to X displays, made on the first display request (display.py is imported then).
        self.displays: display.Displays | None = None

    def authorized(self, header: str | None) -> bool:
        """Constant-time check of an ``Authorization: Bearer`` header."""
        if not header or not header.startswith("Bearer "):
            return False
        # Header bytes that are not UTF-8 arrive as surrogates: they are a wrong token, not an error.
        given = hashlib.sha256(header[7:].encode("utf-8", "surrogateescape")).digest()
        return hmac.compare_digest(given, self._token)

    def rekey(self, token_sha256: str) -> None:
        """Accept only the token with this SHA-256 from now on (the old one stops working)."""
        try:
            digest = bytes.fromhex(token_sha256)
        except ValueError:
            digest = b""
        if len(digest) != 32:
            raise ExecutorError("bad_request", "token_sha256 must be 64 hex digits")
        self._token = digest

    def stop(self, reason: str) -> None:
        """Ask the server to shut down."""
        if not self.stopped.is_set():
            self.stop_reason = reason
            self.stopped.set()

    async def exec_once(self, request: ExecRequest, fn: Callable[[], Awaitable[ExecResult]]) -> ExecResult:
        """Run ``fn`` once per request id; a retry waits for and returns the first result.

        A run whose client went away keeps going for ``RETRY_GRACE`` seconds,
        so that a retry after a broken connection picks it up instead of
        running the command again; unclaimed after that, it is killed.
        """
        rid = request.request_id
        if rid is None:
            return await fn()
        task = self._dedup.get(rid)
        if task is None:
            task = asyncio.ensure_future(fn())
            self._dedup[rid] = task
            task.add_done_callback(lambda done: self._finished(rid, done))
        else:
            self._dedup.move_to_end(rid)
            timer = self._abandon.pop(rid, None)
            if timer is not None:
                timer.cancel()
        self._waiters[rid] += 1
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if self._waiters[rid] == 1 and not task.done():
                self._abandon[rid] = asyncio.get_running_loop().call_later(RETRY_GRACE, task.cancel)
            raise
        finally:
            self._waiters[rid] -= 1
            if not self._waiters[rid]:
                del self._waiters[rid]

    def _finished(self, rid: str, task: asyncio.Future[ExecResult]) -> None:
        timer = self._abandon.pop(rid, None)
        if timer is not None:
            timer.cancel()
        if task.cancelled() or not isinstance(task.exception() or ExecutorError("internal", ""), ExecutorError):
            # A killed or crashed run is not remembered: a retry runs it again.
            if self._dedup.get(rid) is task:
                del self._dedup[rid]
            return
        if task.exception() is None:
            result = task.result()
            self._dedup_bytes += len(result.stdout_bytes) + len(result.stderr_bytes) + len(result.output_bytes)
        while self._dedup_bytes > DEDUP_BYTES or len(self._dedup) > DEDUP_ENTRIES:
            # The oldest finished result goes; a run still going is never forgotten, and never
            # holds back the eviction of the results that finished after it.
            oldest_id = next((key for key, run in self._dedup.items() if run.done()), None)
            if oldest_id is None:
                break
            oldest = self._dedup.pop(oldest_id)
            if not oldest.cancelled() and oldest.exception() is None:
                old = oldest.result()
                self._dedup_bytes -= len(old.stdout_bytes) + len(old.stderr_bytes) + len(old.output_bytes)


SETTINGS = web.AppKey("settings", Settings)
STATE = web.AppKey("state", State)


def clean_environ(environ: collections.abc.Mapping[str, str]) -> dict[str, str]:
    """The environment for commands: ours, minus the executor's own variables."""
    return {k: v for k, v in environ.items() if not k.startswith("ORCHARD_EXECUTOR_")}


def _content_type(request: web.Request) -> str:
    if request.content_type == JSON or (request.method == "GET" and JSON in request.headers.get("Accept", "")):
        return JSON
    return MSGPACK


async def _body(request: web.Request, type_: type[T]) -> T:
    try:
        raw = await asyncio.wait_for(request.read(), BODY_TIMEOUT)
    except web.HTTPRequestEntityTooLarge:
        raise ExecutorError(
            "bad_request",
            f"a {type_.__name__} body is limited to {MAX_BODY} bytes (stream a large stdin as a {WITH_STDIN} body)",
        ) from None
    except TimeoutError:
        raise ExecutorError("bad_request", f"the {type_.__name__} body took over {BODY_TIMEOUT:g}s") from None
    return _decoded(raw, type_, _content_type(request))


def _decoded(raw: bytes, type_: type[T], content_type: str) -> T:
    try:
        return decode(raw, type_, content_type)
    except msgspec.ValidationError as exc:
        raise ExecutorError("bad_request", f"invalid {type_.__name__}: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise ExecutorError("bad_request", f"undecodable {type_.__name__} body: {exc}") from exc


async def _exec_body(request: web.Request) -> tuple[ExecRequest, AsyncIterator[bytes] | None]:
    """An exec's request, and its stdin streamed from the rest of the body when sent as ``WITH_STDIN``."""
    if request.content_type != WITH_STDIN:
        return _checked(request, await _body(request, ExecRequest)), None
    try:
        async with asyncio.timeout(BODY_TIMEOUT):
            (size,) = FRAME_HEADER.unpack(await request.content.readexactly(FRAME_HEADER.size))
            if size > MAX_BODY:
                raise ExecutorError("bad_request", f"the ExecRequest of a {WITH_STDIN} body is over {MAX_BODY} bytes")
            raw = await request.content.readexactly(size)
    except asyncio.IncompleteReadError:
        raise ExecutorError("bad_request", f"the {WITH_STDIN} body ends inside its ExecRequest") from None
    except TimeoutError:
        raise ExecutorError("bad_request", f"the ExecRequest took over {BODY_TIMEOUT:g}s") from None
    req = _decoded(raw, ExecRequest, MSGPACK)
    if req.stdin is not None:
        raise ExecutorError("bad_request", f"a {WITH_STDIN} body carries stdin after the ExecRequest, not in it")
    if req.request_id is not None:
        # A retry could not send the stream again: there is nothing to deduplicate.
        raise ExecutorError("bad_request", f"a {WITH_STDIN} request takes no request_id")
    return _checked(request, req), _body_chunks(request)


def _reply(request: web.Request, obj: object, status: int = 200) -> web.Response:
    content_type = _content_type(request)
    return web.Response(body=encode(obj, content_type), status=status, content_type=content_type)


def _state(request: web.Request) -> State:
    return request.app[STATE]


def _query_int(request: web.Request, name: str, default: int, high: int = MAX_INT) -> int:
    """An integer query parameter, within 0..high."""
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw[:64], 0) if len(raw) <= 64 else None
    except ValueError:
        value = None
    if value is None:
        raise ExecutorError("bad_request", f"query parameter {name}={raw[:64]!r} is not an integer")
    if not 0 <= value <= high:
        raise ExecutorError("bad_request", f"query parameter {name}={value} is not within 0..{high}")
    return value


def checked_mode(mode: int, setid: bool) -> int:
    """A file mode, its setuid/setgid bits only when asked for explicitly."""
    if mode & SETID_BITS and not setid:
        raise ExecutorError("bad_request", f"mode {mode:#o} has setuid/setgid bits; pass setid to allow them")
    return mode


def _query_path(request: web.Request) -> str:
    path = request.query.get("path")
    if path is None:
        raise ExecutorError("bad_request", "the 'path' query parameter is required")
    return files.resolve(path, _state(request).settings.workdir)


@web.middleware
async def _guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Auth, activity tracking for the idle timeout, and the error envelope."""
    if request.path == "/healthz":
        return await handler(request)
    state = _state(request)
    if not state.authorized(request.headers.get("Authorization")):
        return _reply(
            request,
            ExecutorError("unauthorized", "missing or wrong bearer token").error,
            status=401,
        )
    state.in_flight += 1
    try:
        response = await handler(request)
        if state.stopped.is_set() and not response.prepared:
            # The sandbox is ending (deleted, evicted, ttl): a command it killed on the way out
            # must not pass for the command's own result.
            raise ExecutorError("stopping", f"the executor is stopping ({state.stop_reason})")
        return response
    except ExecutorError as exc:
        return _reply(request, exc.error, status=exc.status)
    except web.HTTPException:
        raise
    except OSError as exc:
        err = ExecutorError.from_os_error(exc)
        return _reply(request, err.error, status=err.status)
    except (ValueError, OverflowError) as exc:
        # What the OS cannot take (a NUL byte, an unencodable name, a number out of range).
        return _reply(request, Error(code="bad_request", message=f"invalid request: {exc}"), status=400)
    finally:
        state.in_flight -= 1
        state.last_activity = time.monotonic()


async def _anonymous(request: web.Request, response: web.StreamResponse) -> None:
    """Drop the Server header: the port tells whoever reaches it nothing about the software."""
    response.headers.popall("Server", None)


async def healthz(request: web.Request) -> web.Response:
    """Liveness, for probes: no auth, reveals nothing."""
    return web.Response(text="ok")


async def info(request: web.Request) -> web.Response:
    """Version, uptime and load."""
    state = _state(request)
    return _reply(
        request,
        Info(
            version=__version__,
            api=API_VERSION,
            pid=os.getpid(),
            uptime=time.monotonic() - state.started,
            load=os.getloadavg(),
            idle_timeout=state.settings.idle_timeout,
            running_processes=len(state.processes),
            sessions=len(state.sessions),
            cwd=state.settings.workdir,
        ),
    )


def _checked(request: web.Request, req: ExecRequest) -> ExecRequest:
    limit = _state(request).settings.max_output_limit
    if req.max_output is not None and not 0 <= req.max_output <= limit:
        raise ExecutorError("bad_request", f"max_output must be between 0 and {limit}")
    if req.timeout is not None and req.timeout <= 0:
        raise ExecutorError("bad_request", "timeout must be positive")
    if req.cwd is not None:
        req.cwd = files.resolve(req.cwd, _state(request).settings.workdir)
    return req


async def exec_(request: web.Request) -> web.Response:
    """Run a command to the end and return its captured result."""
    state = _state(request)
    req, stdin = await _exec_body(request)
    result = await state.exec_once(req, lambda: run(req, cwd=state.settings.workdir, env=state.env, stdin=stdin))
    response = _reply(request, result)
    if not request.content.is_eof():
        # Stdin the command left unread: close the connection rather than read the rest of it.
        response.force_close()
    return response


async def _next(items: AsyncIterator[T]) -> T:
    return await anext(items)


def _error_event(exc: BaseException) -> ErrorEvent:
    if isinstance(exc, ExecutorError):
        return ErrorEvent(error=exc.error)
    if isinstance(exc, OSError):
        return ErrorEvent(error=ExecutorError.from_os_error(exc).error)
    log.error("a stream failed", exc_info=exc)
    return ErrorEvent(error=Error(code="internal", message=f"the stream failed: {exc!r}"))


async def _send_frames(
    request: web.Request, frames: AsyncIterator[bytes], *, force_close: bool = False
) -> web.StreamResponse:
    """Send encoded frames as a FRAMES reply.

    Gaps longer than ``HEARTBEAT`` get a heartbeat frame, and a failure of
    ``frames`` after the reply started becomes a last ``ErrorEvent`` frame
    (a second response on the same connection would hang the client).
    """
    response = web.StreamResponse(headers={"Content-Type": FRAMES})
    if force_close:
        response.force_close()
    await response.prepare(request)
    task: asyncio.Future[bytes] | None = None
    try:
        while True:
            task = asyncio.ensure_future(_next(frames))
            while not (await asyncio.wait({task}, timeout=HEARTBEAT))[0]:
                await response.write(_HEARTBEAT_FRAME)
            try:
                data = task.result()
            except StopAsyncIteration:
                break
            except Exception as exc:
                await response.write(frame(_error_event(exc)))
                break
            await response.write(data)
    finally:
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    await response.write_eof()
    return response


async def exec_stream(request: web.Request) -> web.StreamResponse:
    """Run a command, sending its output as framed events as it is produced."""
    state = _state(request)
    req, stdin = await _exec_body(request)
    frames: asyncio.Queue[tuple[bytes, int] | BaseException | None] = asyncio.Queue()
    queued = 0
    paused = False

    def sink(stream: StreamName, data: bytes) -> None:
        nonlocal queued, paused
        frames.put_nowait((frame(OutputEvent(stream=stream, data=data)), len(data)))
        queued += len(data)
        if queued > STREAM_HIGH_WATER and not paused:
            paused = True
            proc.pause_output(True)

    env = state.env if req.env is None else state.env | req.env
    proc = await start(
        build_argv(req.cmd, req.shell, login=req.login, path=env.get("PATH")),
        cwd=req.cwd or state.settings.workdir,
        env=env,
        stdin=req.stdin if stdin is None else stdin,
        timeout=req.timeout,
        sink=sink,
        merge=req.merge_output,
    )

    async def finish() -> None:
        # wait() returns after the pipes are drained, so every output frame is queued first.
        try:
            code, sig, timed_out, duration = await proc.wait()
        except Exception as exc:
            frames.put_nowait(exc)
            return
        result = ExecResult(exit_code=code, signal=sig, timed_out=timed_out, duration=duration)
        frames.put_nowait((frame(ExitEvent(result=result)), 0))
        frames.put_nowait(None)

    async def events() -> AsyncIterator[bytes]:
        nonlocal queued, paused
        while (item := await frames.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item[0]
            queued -= item[1]
            if paused and queued < STREAM_HIGH_WATER // 4:
                paused = False
                proc.pause_output(False)

    waiter = asyncio.create_task(finish())
    try:
        # Stdin the command leaves unread is not read either: the connection closes after the reply.
        return await _send_frames(request, events(), force_close=stdin is not None)
    finally:
        # A client that goes away mid-stream takes the command with it.
        waiter.cancel()


async def process_start(request: web.Request) -> web.Response:
    """Start a background process."""
    state = _state(request)
    req = _checked(request, await _body(request, ExecRequest))
    bg = await state.processes.start(req, cwd=state.settings.workdir, env=state.env)
    return _reply(request, bg.status())


async def process_list(request: web.Request) -> web.Response:
    """List background processes."""
    return _reply(request, ProcessList(processes=[p.status() for p in _state(request).processes.all()]))


async def process_status(request: web.Request) -> web.Response:
    """One background process's status."""
    return _reply(request, _state(request).processes.get(request.match_info["id"]).status())


async def process_output(request: web.Request) -> web.Response:
    """Read a background process's output from an offset."""
    bg = _state(request).processes.get(request.match_info["id"])
    chunk = await bg.read(
        request.query.get("stream", "stdout"),
        _query_int(request, "offset", 0),
        # A larger limit is clamped to what one reply carries.
        min(_query_int(request, "limit", 1024 * 1024), MAX_READ),
    )
    return _reply(request, chunk)


async def process_stdin(request: web.Request) -> web.Response:
    """Write to (and optionally close) a background process's stdin."""
    state = _state(request)
    bg = state.processes.get(request.match_info["id"])
    req = await _body(request, StdinRequest)
    await state.processes.write_stdin(bg, req.data, close=req.close)
    return _reply(request, bg.status())


async def process_signal(request: web.Request) -> web.Response:
    """Signal a background process's process group."""
    bg = _state(request).processes.get(request.match_info["id"])
    req = await _body(request, SignalRequest)
    if req.signal not in signal.valid_signals() or req.signal == 0:
        raise ExecutorError("bad_request", f"invalid signal {req.signal}")
    if not bg.done.is_set():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(bg.child.pid, req.signal)
    return _reply(request, bg.status())


async def process_wait(request: web.Request) -> web.Response:
    """Wait for a background process to end, up to a timeout."""
    bg = _state(request).processes.get(request.match_info["id"])
    req = await _body(request, WaitRequest)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(bg.done.wait(), req.timeout)
    return _reply(request, bg.status())


async def process_delete(request: web.Request) -> web.Response:
    """Kill a background process and forget it."""
    bg = _state(request).processes.forget(request.match_info["id"])
    return _reply(request, bg.status())


async def session_create(request: web.Request) -> web.Response:
    """Start a persistent shell session."""
    state = _state(request)
    req = await _body(request, SessionRequest)
    env = state.env if req.env is None else state.env | req.env
    cwd = files.resolve(req.cwd, state.settings.workdir) if req.cwd else state.settings.workdir
    session = state.sessions.create(
        shell=req.shell, cwd=cwd, env=env, path=env.get("PATH", os.defpath), login=req.login
    )
    return _reply(request, SessionInfo(id=session.id, cwd=session.cwd))


async def session_exec(request: web.Request) -> web.Response:
    """Run a command in a session."""
    state = _state(request)
    session = state.sessions.get(request.match_info["id"])
    req = await _body(request, SessionExecRequest)
    as_exec = ExecRequest(cmd="", max_output=req.max_output, timeout=req.timeout, request_id=req.request_id)
    _checked(request, as_exec)
    result = await state.exec_once(as_exec, lambda: session.exec(req))
    return _reply(request, result)


async def session_delete(request: web.Request) -> web.Response:
    """Close a session."""
    session = _state(request).sessions.close(request.match_info["id"])
    return _reply(request, SessionInfo(id=session.id, cwd=session.cwd))


async def _body_chunks(request: web.Request) -> AsyncIterator[bytes]:
    async for chunk in request.content.iter_chunked(files.CHUNK):
        yield chunk


async def file_write(request: web.Request) -> web.Response:
    """Write a file atomically from the streamed request body."""
    path = _query_path(request)
    mode = checked_mode(_query_int(request, "mode", 0o644, 0o7777), request.query.get("setid") in ("1", "true"))
    await files.write_atomic(
        path,
        _body_chunks(request),
        mode=mode,
        parents=request.query.get("parents", "1") not in ("0", "false"),
    )
    return _reply(request, files.file_stat(path))


async def file_read(request: web.Request) -> web.StreamResponse:
    """Send a file's bytes, streamed from disk."""
    path = _query_path(request)
    # A cheap check first, so that devices are never even opened; the open re-checks what it got.
    st = await asyncio.to_thread(files.file_stat, os.path.realpath(path))
    if st.type == "directory":
        raise ExecutorError("is_a_directory", f"{path} is a directory", path)
    if st.type != "file":
        raise ExecutorError("bad_request", f"{path} is not a regular file", path)
    fd = await asyncio.to_thread(files.open_regular, path)
    started = False

    async def chunks() -> AsyncIterator[bytes]:
        nonlocal started
        started = True
        read: asyncio.Future[bytes] | None = None
        try:
            # Read to EOF: pseudo-files (/proc, /sys) report a size of 0 yet have content.
            while True:
                read = asyncio.ensure_future(asyncio.to_thread(os.read, fd, files.CHUNK))
                if not (chunk := await asyncio.shield(read)):
                    break
                yield frame(DataFrame(data=chunk))
        finally:
            # A read still running in its thread owns the fd until it returns.
            if read is not None and not read.done():
                read.add_done_callback(lambda _: os.close(fd))
            else:
                os.close(fd)
        yield frame(EndFrame())

    try:
        return await _send_frames(request, chunks())
    finally:
        if not started:
            os.close(fd)


async def file_stat(request: web.Request) -> web.Response:
    """Stat a path."""
    return _reply(request, await asyncio.to_thread(files.file_stat, _query_path(request)))


async def file_list(request: web.Request) -> web.Response:
    """List a directory."""
    return _reply(request, FileList(entries=await asyncio.to_thread(files.list_dir, _query_path(request))))


def _displays(request: web.Request) -> display.Displays:
    from . import display  # stdlib only, but imported when a sandbox first uses a display

    state = _state(request)
    if state.displays is None:
        state.displays = display.Displays()
    return state.displays


async def display_info(request: web.Request) -> web.Response:
    """The size and depth of an X display in the sandbox (connecting to it if need be)."""
    from .protocol import DisplayQuery

    try:
        query = msgspec.convert(dict(request.query), DisplayQuery)
    except msgspec.ValidationError as exc:
        raise ExecutorError("bad_request", f"invalid display query: {exc}") from None
    async with _displays(request).use(query.display, query.xauthority) as conn:
        await conn.sync()  # the server is there now, not only when the connection was made
        return _reply(request, conn.info)


async def display_screenshot(request: web.Request) -> web.Response:
    """A PNG of an X display."""
    from .protocol import ScreenshotRequest

    req = await _body(request, ScreenshotRequest)
    async with _displays(request).use(req.display, req.xauthority) as conn:
        return _reply(request, await conn.screenshot(req.region, req.level))


async def display_input(request: web.Request) -> web.Response:
    """Synthetic pointer and key events on an X display, replied to once the server processed them."""
    from .protocol import InputRequest

    req = await _body(request, InputRequest)
    async with _displays(request).use(req.display, req.xauthority) as conn:
        await conn.send(req.events)
        return _reply(request, conn.info)


async def rekey(request: web.Request) -> web.Response:
    """Swap the bearer token (a pooled sandbox handed to its claimer): the token used here stops working."""
    req = await _body(request, RekeyRequest)
    _state(request).rekey(req.token_sha256)
    return web.Response(status=204)


async def file_mkdir(request: web.Request) -> web.Response:
    """Create a directory."""
    req = await _body(request, MkdirRequest)
    path = files.resolve(req.path, _state(request).settings.workdir)
    mode = checked_mode(req.mode, req.setid)
    await asyncio.to_thread(files.mkdir, path, parents=req.parents, mode=mode, exist_ok=req.exist_ok)
    return _reply(request, files.file_stat(path))


async def file_remove(request: web.Request) -> web.Response:
    """Remove a path."""
    req = await _body(request, RemoveRequest)
    path = files.resolve(req.path, _state(request).settings.workdir)
    await asyncio.to_thread(files.remove, path, recursive=req.recursive, missing_ok=req.missing_ok)
    return _reply(request, Empty())


async def tar_upload(request: web.Request) -> web.Response:
    """Extract a tar stream into a directory."""
    return await _extract(request, restore=False)


async def tar_restore(request: web.Request) -> web.Response:
    """Restore a snapshot's tar stream in place under a directory (``tarstream._restore``)."""
    return await _extract(request, restore=True)


async def _extract(request: web.Request, *, restore: bool) -> web.Response:
    path = _query_path(request)
    await files.extract_tar(
        path,
        _body_chunks(request),
        max_bytes=_query_int(request, "max_bytes", tarstream.MAX_BYTES),
        max_members=_query_int(request, "max_members", tarstream.MAX_MEMBERS),
        restore=restore,
    )
    return _reply(request, files.file_stat(path))


async def tar_download(request: web.Request) -> web.StreamResponse:
    """Send a directory (or file) as a tar stream; ``changed=1``: only what changed since the executor started."""
    state = request.app[STATE]
    changed = request.query.get("changed") == "1"
    chunks = files.stream_tar(
        _query_path(request),
        changed_since_ns=state.started_ns if changed else None,
        excluded=(state.state_dir,),
        # No caps unless asked (a snapshot asks): a download checks its own as it unpacks.
        max_bytes=_query_int(request, "max_bytes", MAX_INT),
        max_members=_query_int(request, "max_members", MAX_INT),
    )
    first = await anext(chunks, b"")  # errors such as a missing path surface before the headers

    async def framed() -> AsyncIterator[bytes]:
        yield frame(DataFrame(data=first))
        async for chunk in chunks:
            yield frame(DataFrame(data=chunk))
        yield frame(EndFrame())

    return await _send_frames(request, framed())


async def _idle_watch(state: State) -> None:
    timeout = state.settings.idle_timeout
    if timeout is None:
        return
    while not state.stopped.is_set():
        await asyncio.sleep(min(timeout / 4, 1.0))
        if state.in_flight == 0 and time.monotonic() - state.last_activity > timeout:
            state.stop(f"idle for {timeout:g}s")


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    watcher = asyncio.create_task(_idle_watch(state))
    yield
    watcher.cancel()
    state.processes.kill_all()
    if state.displays is not None:
        state.displays.close()


def create_app(settings: Settings) -> web.Application:
    """Build the executor's application."""
    if len(bytes.fromhex(settings.token_sha256)) != 32:
        raise ValueError("token_sha256 must be 64 hex digits")
    # File and tar bodies are streamed, not read whole: the limit is on structured bodies.
    app = web.Application(middlewares=[_guard], client_max_size=MAX_BODY)
    app[SETTINGS] = settings
    app[STATE] = State(settings)
    app.cleanup_ctx.append(_lifecycle)
    app.on_response_prepare.append(_anonymous)
    v = f"/{API_VERSION}"
    app.router.add_get("/healthz", healthz)
    app.router.add_get(f"{v}/info", info)
    app.router.add_post(f"{v}/rekey", rekey)
    app.router.add_post(f"{v}/exec", exec_)
    app.router.add_post(f"{v}/exec/stream", exec_stream)
    app.router.add_post(f"{v}/processes", process_start)
    app.router.add_get(f"{v}/processes", process_list)
    app.router.add_get(f"{v}/processes/{{id}}", process_status)
    app.router.add_get(f"{v}/processes/{{id}}/output", process_output)
    app.router.add_post(f"{v}/processes/{{id}}/stdin", process_stdin)
    app.router.add_post(f"{v}/processes/{{id}}/signal", process_signal)
    app.router.add_post(f"{v}/processes/{{id}}/wait", process_wait)
    app.router.add_delete(f"{v}/processes/{{id}}", process_delete)
    app.router.add_post(f"{v}/sessions", session_create)
    app.router.add_post(f"{v}/sessions/{{id}}/exec", session_exec)
    app.router.add_delete(f"{v}/sessions/{{id}}", session_delete)
    app.router.add_put(f"{v}/files", file_write)
    app.router.add_get(f"{v}/files", file_read)
    app.router.add_get(f"{v}/files/stat", file_stat)
    app.router.add_get(f"{v}/files/list", file_list)
    app.router.add_post(f"{v}/files/mkdir", file_mkdir)
    app.router.add_post(f"{v}/files/remove", file_remove)
    app.router.add_put(f"{v}/files/tar", tar_upload)
    app.router.add_get(f"{v}/files/tar", tar_download)
    app.router.add_put(f"{v}/files/restore", tar_restore)
    app.router.add_get(f"{v}/display", display_info)
    app.router.add_post(f"{v}/display/screenshot", display_screenshot)
    app.router.add_post(f"{v}/display/input", display_input)
    ports.setup(app, app[STATE].stopped)
    return app
