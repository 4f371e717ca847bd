"""How the client talks to one executor: typed requests over the shared session.

Nothing an executor does can hang the client or make it swallow unbounded
data. Every request has a deadline: ``read_timeout`` for a reply that needs
no command to finish (plus the command's own timeout when it has one), and
``read_timeout`` again for the body once the reply has begun. A request with
no deadline of its own (``exec(timeout=None)``, ``wait()``) is covered by a
liveness watchdog: once the executor has been silent for ``liveness_timeout``
while a request waits, the client probes ``/healthz`` on another connection,
and fails the waiting requests with ``SandboxTimeout`` when no answer comes
within ``liveness_timeout``. Replies are capped (``MAX_REPLY``, or what the
request can legitimately return) and must decode to the wire schema, else
``ProtocolError``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping
from types import TracebackType
from typing import Any, TypeVar

import aiohttp
import msgspec

from orchard_executor.protocol import (
    FRAME_HEADER,
    MAX_FRAME,
    MSGPACK,
    WITH_STDIN,
    ByteFrame,
    DataFrame,
    EndFrame,
    Error,
    ErrorEvent,
    ExitEvent,
    HeartbeatEvent,
    OutputEvent,
    StreamEvent,
    decode,
    encode,
    frame,
)

from . import _retry, _tls
from .errors import (
    EXECUTOR_ERRORS,
    ExecutorError,
    OrchardError,
    ProtocolError,
    SandboxClosed,
    SandboxLost,
    SandboxTimeout,
)

T = TypeVar("T")
Body = bytes | AsyncIterable[bytes] | None

#: Default seconds an executor may take to answer a request that runs no command,
#: and to send a whole reply once it has begun.
READ_TIMEOUT = 60.0
#: Default seconds of executor silence, while a request waits, before a liveness
#: probe; and the probe's own deadline. A frozen executor fails requests within twice this, plus the few
#: seconds a backend that watches its sandboxes (kubernetes: 3) waits to learn why.
LIVENESS_TIMEOUT = 20.0
#: Largest structured reply read from an executor unless a request allows more.
MAX_REPLY = 64 * 1024 * 1024
#: Largest error reply read from an executor.
MAX_ERROR_REPLY = 64 * 1024
#: Room beyond a reply's payload for its framing (field names, numbers).
REPLY_SLACK = 64 * 1024
_CONNECT_TIMEOUT = 30.0
_STREAM_EVENT = msgspec.msgpack.Decoder(StreamEvent)
_BYTE_FRAME = msgspec.msgpack.Decoder(ByteFrame)
#: Seconds of silence after which a stream is given up as frozen (a quiet
#: stream carries a heartbeat every ``protocol.HEARTBEAT`` second).
STREAM_IDLE_TIMEOUT = 30.0
#: The wire error code of each status an executor refuses a websocket with (see ``orchard_executor.ports``).
_WS_REFUSALS = {400: "bad_request", 401: "unauthorized", 429: "too_many_tunnels", 502: "port_closed", 503: "stopping"}


class _Source:
    """A streamed request body that remembers the exception it raised."""

    def __init__(self, chunks: AsyncIterable[bytes]) -> None:
        self._chunks = chunks
        self.error: Exception | None = None
        #: Called when the source fails (aiohttp does not fail a reply already under way).
        self.on_error: Callable[[], None] | None = None

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._chunks:
                yield chunk
        except Exception as exc:
            self.error = exc
            if self.on_error is not None:
                self.on_error()
            raise


async def with_stdin(request: object, stdin: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """A ``WITH_STDIN`` body: the request struct as one frame, then the stdin chunks (empty ones dropped)."""
    yield frame(request)
    async for chunk in stdin:
        if chunk:
            yield chunk


class _Flight:
    """One request in progress, to be failed if its sandbox closes or its executor freezes.

    Used as ``with``: failing it cancels the task awaiting the request and
    turns that cancellation into the given error where the ``with`` ends, the
    way ``asyncio.timeout`` turns one into ``TimeoutError``.
    """

    __slots__ = ("_flights", "_cancelling", "error", "started", "task")

    def __init__(self, flights: set[_Flight], task: asyncio.Task[Any], started: float) -> None:
        self._flights = flights
        self.task = task
        self.started = started
        self.error: OrchardError | None = None
        self._cancelling = 0

    def fail(self, error: OrchardError) -> None:
        if self.error is None:
            self.error = error
            self.task.cancel()

    def __enter__(self) -> _Flight:
        self._cancelling = self.task.cancelling()
        self._flights.add(self)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._flights.discard(self)
        if self.error is None:
            return
        if exc_type is not None and issubclass(exc_type, asyncio.CancelledError):
            if self.task.uncancel() <= self._cancelling:
                raise self.error from None
        elif self.task.cancelling() > self._cancelling:
            # Our cancel was swallowed below (Python 3.11's wait_for drops one that comes in the step it
            # ends): take it back, or the task stays cancelling and whatever checks that ends it later.
            self.task.uncancel()


class _Stream:
    """A streamed reply being read, to be cut if its sandbox closes or ends.

    Used as ``with`` around the reading: failing it closes the reply, and the
    error is raised where the ``with`` ends, whatever the cut reply raised.
    (A generator belongs to no task, so it cannot be cancelled as a
    ``_Flight`` is.)
    """

    __slots__ = ("_resp", "_streams", "error")

    def __init__(self, streams: set[_Stream], resp: aiohttp.ClientResponse) -> None:
        self._streams = streams
        self._resp = resp
        self.error: OrchardError | None = None

    def fail(self, error: OrchardError) -> None:
        if self.error is None:
            self.error = error
            self._resp.close()

    def __enter__(self) -> _Stream:
        self._streams.add(self)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._streams.discard(self)
        # Not over a cancel, nor over GeneratorExit: the reader left, and needs no error.
        if self.error is not None and (exc_type is None or issubclass(exc_type, Exception)):
            raise self.error from None


class ExecutorClient:
    """Typed calls to one sandbox's executor, with retries, deadlines and error mapping.

    Args:
        session: the Client's shared HTTP session.
        base_url: where the executor answers.
        token: the sandbox's bearer token.
        sandbox_id: named in errors.
        fingerprint: SHA-256 of the executor's TLS certificate, the only one
            accepted (for an ``https`` base_url).
        diagnose: asks the backend why the executor stopped answering.
        read_timeout: see ``READ_TIMEOUT``.
        liveness_timeout: see ``LIVENESS_TIMEOUT``.
    """

    #: Seconds a stream may stay silent (no data, no heartbeat) before ``SandboxTimeout``.
    stream_idle_timeout: float = STREAM_IDLE_TIMEOUT

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        token: str,
        *,
        sandbox_id: str,
        diagnose: Callable[[], Awaitable[OrchardError | None]],
        fingerprint: bytes | None = None,
        read_timeout: float = READ_TIMEOUT,
        liveness_timeout: float = LIVENESS_TIMEOUT,
    ) -> None:
        self._session = session
        self._base = base_url.rstrip("/")
        if self._base.startswith("https:") and fingerprint is None:
            raise ValueError(f"{base_url}: an https executor needs the fingerprint of its certificate")
        self._ssl = _tls.pin(fingerprint)
        self._headers = {"Authorization": f"Bearer {token}", "Content-Type": MSGPACK, "Accept": MSGPACK}
        self._sandbox_id = sandbox_id
        self._diagnose = diagnose
        self._read_timeout = read_timeout
        self._liveness_timeout = liveness_timeout
        self._flights: set[_Flight] = set()
        self._streams: set[_Stream] = set()
        self._watchdog: asyncio.Task[None] | None = None
        #: Loop time of the executor's last reply: proof that it was alive then.
        self._alive_at = 0.0
        self.closed = False
        #: Why the sandbox ended, once its backend saw it end (``ended``): every request fails with it.
        self._ended: Callable[[], OrchardError] | None = None

    def _timeout(self, command_timeout: float | None) -> aiohttp.ClientTimeout:
        """The reply deadline: ``read_timeout`` past the command's own timeout; None is the watchdog's."""
        if command_timeout is None:
            return aiohttp.ClientTimeout(total=None, connect=_CONNECT_TIMEOUT, sock_read=None)
        return aiohttp.ClientTimeout(
            total=None, connect=_CONNECT_TIMEOUT, sock_read=command_timeout + self._read_timeout
        )

    def _protocol_error(self, resp: aiohttp.ClientResponse, what: str) -> ProtocolError:
        resp.close()  # never read the rest, never reuse the connection
        return ProtocolError(
            f"sandbox {self._sandbox_id}: the executor's reply to {resp.method} {resp.url.path} {what}",
            sandbox_id=self._sandbox_id,
        )

    async def _read(self, resp: aiohttp.ClientResponse, limit: int) -> bytes:
        """A whole reply body, refused beyond ``limit`` bytes or ``read_timeout`` seconds."""
        self._alive_at = asyncio.get_running_loop().time()
        size = resp.content_length
        if size is not None and size > limit:
            raise self._protocol_error(resp, f"is too large ({size} bytes, the limit is {limit})")
        try:
            async with asyncio.timeout(self._read_timeout):
                if size is not None:
                    return await resp.read()
                data = bytearray()
                async for chunk in resp.content.iter_any():
                    data += chunk
                    if len(data) > limit:
                        raise self._protocol_error(resp, f"is too large (over {limit} bytes)")
                return bytes(data)
        except TimeoutError:
            resp.close()
            raise SandboxTimeout(
                f"sandbox {self._sandbox_id}: the executor began a reply to {resp.method} {resp.url.path} "
                f"but did not finish it within read_timeout={self._read_timeout:g}s (a Client option)",
                sandbox_id=self._sandbox_id,
            ) from None

    async def _reply(self, resp: aiohttp.ClientResponse, result: type[T], limit: int) -> T:
        """The typed body of a reply, or the typed error it carries."""
        if resp.status >= 400:
            await self._raise_for(resp)
        if resp.content_type != MSGPACK:
            raise self._protocol_error(resp, f"has content type {resp.content_type!r}, not {MSGPACK}")
        body = await self._read(resp, limit)
        try:
            return decode(body, result)
        except msgspec.MsgspecError as exc:
            raise self._protocol_error(resp, f"is not a valid {result.__name__}: {exc}") from None

    async def _raise_for(self, resp: aiohttp.ClientResponse) -> None:
        body = await self._read(resp, MAX_ERROR_REPLY)
        try:
            error = decode(body, Error, resp.content_type)
        except msgspec.MsgspecError:
            raise ExecutorError(
                f"sandbox {self._sandbox_id}: HTTP {resp.status} from the executor: {body[:200]!r}",
                code="internal",
                sandbox_id=self._sandbox_id,
            ) from None
        if error.code == "stopping":
            # The backend usually knows why (Deleted, Evicted, ttl); the executor only that it ends.
            raise await self._lost(ConnectionResetError(error.message))
        cls = EXECUTOR_ERRORS.get(error.code, ExecutorError)
        raise cls(error.message, code=error.code, path=error.path, sandbox_id=self._sandbox_id)

    async def _timed_out(self, exc: BaseException) -> OrchardError:
        found = await self._diagnose()
        if found is not None:
            return found
        return SandboxTimeout(
            f"sandbox {self._sandbox_id}: the executor at {self._base} did not answer in time ({exc}); "
            f"a request may take read_timeout={self._read_timeout:g}s, plus the command's timeout "
            "if it has one (a Client option)",
            sandbox_id=self._sandbox_id,
        )

    async def _lost(self, exc: BaseException) -> OrchardError:
        if isinstance(exc, aiohttp.ServerFingerprintMismatch):
            return ProtocolError(
                f"sandbox {self._sandbox_id}: whatever answers at {self._base} is not its executor: it presented "
                f"a TLS certificate with SHA-256 {exc.got.hex()}, not the one made for the sandbox "
                f"({exc.expected.hex()})",
                sandbox_id=self._sandbox_id,
            )
        found = await self._diagnose()
        if found is not None:
            return found
        return SandboxLost(
            f"sandbox {self._sandbox_id}: the executor at {self._base} is unreachable: {exc!r}",
            sandbox_id=self._sandbox_id,
            reason="unreachable",
        )

    async def call(
        self,
        method: str,
        path: str,
        result: type[T],
        body: object = None,
        *,
        params: Mapping[str, str] | None = None,
        timeout: float | None = 0.0,
        retry: bool = True,
        limit: int = MAX_REPLY,
    ) -> T:
        """One request with a msgpack body (or none) and a typed msgpack reply.

        Args:
            method: the HTTP method.
            path: the route, e.g. ``/v1/exec``.
            result: the type of the reply.
            body: a wire struct, or None.
            params: the query.
            timeout: the command's own timeout, after which the executor
                answers (0: it answers at once; None: no deadline but the
                liveness watchdog).
            retry: whether a broken connection may be retried.
            limit: the largest reply accepted, in bytes.
        """
        data = None if body is None else encode(body)

        async def once() -> T:
            async with self._session.request(
                method,
                self._base + path,
                data=data,
                params=params,
                headers=self._headers,
                timeout=self._timeout(timeout),
                ssl=self._ssl,
            ) as resp:
                return await self._reply(resp, result, limit)

        return await self._run(once, retry)

    async def send(
        self,
        method: str,
        path: str,
        result: type[T],
        body: Body,
        *,
        params: Mapping[str, str],
        content_type: str,
        timeout: float | None = 0.0,
        limit: int = MAX_REPLY,
    ) -> T:
        """A request with a raw (possibly streamed) body; retried only if it is bytes.

        The reply deadline starts once the body is sent; ``timeout`` and ``limit`` are as for ``call``.
        """
        source = None if body is None or isinstance(body, bytes) else _Source(body)

        async def once() -> T:
            headers = self._headers | {"Content-Type": content_type}
            try:
                async with self._session.request(
                    method,
                    self._base + path,
                    data=body if source is None else source,
                    params=params,
                    headers=headers,
                    timeout=self._timeout(timeout),
                    ssl=self._ssl,
                ) as resp:
                    return await self._reply(resp, result, limit)
            except _retry.TRANSIENT:
                # aiohttp reports a failing body as a broken connection; the sandbox is fine.
                if source is not None and source.error is not None:
                    raise source.error from None
                raise

        return await self._run(once, isinstance(body, bytes))

    def _stream_timeout(self) -> aiohttp.ClientTimeout:
        # The executor sends a heartbeat every second on a quiet stream: silence means it is gone or frozen.
        return aiohttp.ClientTimeout(total=None, connect=_CONNECT_TIMEOUT, sock_read=self.stream_idle_timeout)

    def _failed(self, error: Error) -> ExecutorError:
        cls = EXECUTOR_ERRORS.get(error.code, ExecutorError)
        return cls(error.message, code=error.code, path=error.path, sandbox_id=self._sandbox_id)

    def _silent(self) -> SandboxTimeout:
        return SandboxTimeout(
            f"sandbox {self._sandbox_id}: the executor sent nothing on a stream for "
            f"stream_idle_timeout={self.stream_idle_timeout:g}s, not even a heartbeat: it is frozen or unreachable",
            sandbox_id=self._sandbox_id,
        )

    async def _decoded(self, resp: aiohttp.ClientResponse, decoder: msgspec.msgpack.Decoder[T]) -> AsyncIterator[T]:
        """The frames of a streamed reply (see protocol.py), until the connection ends."""
        while True:
            try:
                header = await resp.content.readexactly(FRAME_HEADER.size)
            except asyncio.IncompleteReadError as exc:
                if exc.partial:
                    raise
                return
            self._alive_at = asyncio.get_running_loop().time()
            (size,) = FRAME_HEADER.unpack(header)
            if size > MAX_FRAME:
                raise self._protocol_error(resp, f"has a frame of {size} bytes (the limit is {MAX_FRAME})")
            try:
                yield decoder.decode(await resp.content.readexactly(size))
            except msgspec.MsgspecError as exc:
                raise self._protocol_error(resp, f"has an undecodable frame: {exc}") from None

    async def receive(self, path: str, params: Mapping[str, str]) -> AsyncIterator[bytes]:
        """A GET whose reply is a framed byte stream (see protocol.py), yielded as raw chunks.

        Raises the typed error the executor sent if it failed after the reply
        began, ``SandboxLost`` if the stream was cut before its end frame, and
        ``SandboxTimeout`` after ``stream_idle_timeout`` seconds of silence.
        """
        self._check_open()
        try:
            async with self._session.get(
                self._base + path, params=params, headers=self._headers, timeout=self._stream_timeout(), ssl=self._ssl
            ) as resp:
                with _Stream(self._streams, resp):
                    if resp.status >= 400:
                        await self._raise_for(resp)
                    async for event in self._decoded(resp, _BYTE_FRAME):
                        if isinstance(event, DataFrame):
                            yield event.data
                        elif isinstance(event, EndFrame):
                            return
                        elif isinstance(event, ErrorEvent):
                            raise self._failed(event.error)
            raise SandboxLost(
                f"sandbox {self._sandbox_id}: the stream from {path} ended before its last frame",
                sandbox_id=self._sandbox_id,
                reason="stream",
            )
        except aiohttp.ServerTimeoutError:
            raise self._silent() from None
        except (*_retry.TRANSIENT, EOFError) as exc:
            raise await self._lost(exc) from exc

    async def frames(
        self, path: str, body: object, timeout: float | None, *, stdin: AsyncIterable[bytes] | None = None
    ) -> AsyncIterator[OutputEvent | ExitEvent]:
        """A POST whose reply is a stream of framed events: heartbeats dropped, an error frame raised.

        ``timeout`` is the command's own; the stream's deadline is
        ``stream_idle_timeout`` of silence, which heartbeats prevent. With
        ``stdin``, the body is ``WITH_STDIN``: ``body`` framed, then ``stdin``
        streamed; an exception ``stdin`` raises is raised as itself.
        """
        self._check_open()
        source = None if stdin is None else _Source(with_stdin(body, stdin))
        headers = self._headers if source is None else self._headers | {"Content-Type": WITH_STDIN}
        try:
            async with self._session.post(
                self._base + path,
                data=encode(body) if source is None else source,
                headers=headers,
                timeout=self._stream_timeout(),
                ssl=self._ssl,
            ) as resp:
                with _Stream(self._streams, resp):
                    if source is not None:
                        # The stdin may fail while the reply streams in: the connection is then closed,
                        # which ends the reply here and kills the command there.
                        source.on_error = resp.close
                        if source.error is not None:
                            resp.close()
                    if resp.status >= 400:
                        await self._raise_for(resp)
                    async for event in self._decoded(resp, _STREAM_EVENT):
                        if isinstance(event, ErrorEvent):
                            raise self._failed(event.error)
                        if not isinstance(event, HeartbeatEvent):
                            yield event
        except aiohttp.ServerTimeoutError:
            raise self._silent() from None
        except (*_retry.TRANSIENT, EOFError) as exc:
            # aiohttp reports a failing body as a broken connection; the sandbox is fine.
            if source is not None and source.error is not None:
                raise source.error from None
            raise await self._lost(exc) from exc
        if source is not None and source.error is not None:
            raise source.error

    async def websocket(self, path: str, *, max_msg_size: int) -> aiohttp.ClientWebSocketResponse:
        """Open a websocket on ``path`` (a port tunnel), within ``read_timeout``; a refusal is typed by its status.

        Under ``_watch`` for as long as it is used, so that the sandbox's close or death ends it.
        """
        self._check_open()
        try:
            async with asyncio.timeout(self._read_timeout):
                return await self._session.ws_connect(
                    self._base + path,
                    headers={"Authorization": self._headers["Authorization"]},
                    ssl=self._ssl,
                    max_msg_size=max_msg_size,
                    autoping=True,
                    # Closing waits this long for the executor's reply: a frozen one holds up no exit.
                    timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=2.0),
                )
        except aiohttp.WSServerHandshakeError as exc:
            # The handshake's error body is not kept by aiohttp: the status says which error it was.
            code = _WS_REFUSALS.get(exc.status, "internal")
            if code == "stopping":
                raise await self._lost(ConnectionResetError("the executor is stopping")) from None
            raise EXECUTOR_ERRORS[code](
                f"sandbox {self._sandbox_id}: the executor refused {path} with HTTP {exc.status} ({code})",
                code=code,
                sandbox_id=self._sandbox_id,
            ) from None
        except TimeoutError as exc:
            raise await self._timed_out(exc) from None
        except _retry.TRANSIENT as exc:
            raise await self._lost(exc) from exc

    def _check_open(self) -> None:
        if self.closed or self._session.closed:
            raise SandboxClosed(f"sandbox {self._sandbox_id} is closed", sandbox_id=self._sandbox_id)
        if self._ended is not None:
            raise self._ended()

    def ended(self, error: Callable[[], OrchardError]) -> None:
        """The backend saw the sandbox end: fail the requests and streams in flight with ``error()``, and every later one.

        Without it a request waits for its own deadline: a pod that vanished with its
        address takes no connection and refuses none, so a connect waits its whole timeout.
        """
        if self._ended is None:
            self._ended = error
            self._fail_all(error)

    def close(self, why: str) -> None:
        """Refuse new requests and fail those in flight, and the streams being read, with ``SandboxClosed`` at once."""
        self.closed = True
        self._fail_all(lambda: SandboxClosed(f"sandbox {self._sandbox_id}: {why}", sandbox_id=self._sandbox_id))
        if self._watchdog is not None:
            self._watchdog.cancel()

    def _fail_all(self, error: Callable[[], OrchardError]) -> None:
        current = asyncio.current_task()
        for flight in list(self._flights):
            if flight.task is not current:
                flight.fail(error())
        for stream in list(self._streams):
            stream.fail(error())

    def _watch(self) -> _Flight:
        """Put the current task's request under the liveness watchdog and ``close``; use as ``with``.

        Not across a ``yield``: the task that resumes a generator may be another.
        """
        task = asyncio.current_task()
        assert task is not None
        flight = _Flight(self._flights, task, task.get_loop().time())
        if self._watchdog is None and not self.closed:
            self._watchdog = asyncio.create_task(self._watch_liveness())
        return flight

    async def _watch_liveness(self) -> None:
        """While requests wait, probe an executor that has been silent for ``liveness_timeout``."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                # A flight already failed is leaving: waiting for it would spin, since it leaves when its
                # task next runs, and a probe that fails without awaiting (a closed session) never yields.
                waiting = [f for f in self._flights if f.error is None]
                if not waiting:
                    break
                due = max(min(f.started for f in waiting), self._alive_at) + self._liveness_timeout
                if loop.time() < due:
                    await asyncio.sleep(due - loop.time())
                    continue
                error = await self._probe()
                if error is None:
                    self._alive_at = loop.time()
                else:
                    self._fail_all(lambda e=error: e)  # type: ignore[misc]
        finally:
            self._watchdog = None

    async def _probe(self) -> OrchardError | None:
        """None if ``/healthz`` answers within ``liveness_timeout``, else why the sandbox is gone or stuck."""
        if self._session.closed:
            return SandboxClosed(
                f"sandbox {self._sandbox_id}: its HTTP session was closed", sandbox_id=self._sandbox_id
            )
        try:
            async with asyncio.timeout(self._liveness_timeout):
                # Retried within the deadline: one refused connection (a port-forward's, say) proves nothing.
                async for attempt in _retry.policy(attempts=1000):
                    with attempt:
                        async with self._session.get(self._base + "/healthz", ssl=self._ssl) as resp:
                            resp.close()  # any answer shows the executor's loop is running
                            return None
        except (TimeoutError, aiohttp.ClientError):
            pass
        found = await self._diagnose()
        if found is not None:
            return found
        return SandboxTimeout(
            f"sandbox {self._sandbox_id}: the executor at {self._base} stopped answering: a request waited "
            f"{self._liveness_timeout:g}s and /healthz then got no answer within liveness_timeout="
            f"{self._liveness_timeout:g}s (a Client option); it is frozen, overloaded or cut off by the network",
            sandbox_id=self._sandbox_id,
        )

    async def _run(self, once: Callable[[], Awaitable[T]], retry: bool) -> T:
        self._check_open()
        with self._watch():
            try:
                # The first try goes without the retry controller: it is the hot path.
                return await once()
            except _retry.TOO_SLOW as exc:
                raise await self._timed_out(exc) from None
            except _retry.TRANSIENT as exc:
                if not retry or isinstance(exc, _retry.IMPOSTOR):
                    raise await self._lost(exc) from exc
            try:
                async for attempt in _retry.policy(attempts=3):
                    with attempt:
                        return await once()
            except _retry.TOO_SLOW as exc:
                raise await self._timed_out(exc) from None
            except _retry.TRANSIENT as exc:
                raise await self._lost(exc) from exc
        raise AssertionError("unreachable: the retry policy reraises")
