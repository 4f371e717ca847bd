"""How the client talks to one executor: typed requests over the shared session."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

import aiohttp
import msgspec

from orchard_executor.protocol import FRAME_HEADER, MAX_FRAME, MSGPACK, Error, StreamEvent, decode, encode

from . import _retry
from .errors import EXECUTOR_ERRORS, ExecutorError, OrchardError, SandboxClosed, SandboxLost

T = TypeVar("T")
Body = bytes | AsyncIterable[bytes] | None

#: Added to a command's own timeout to get the HTTP read timeout.
TIMEOUT_MARGIN = 30.0
_STREAM_EVENT = msgspec.msgpack.Decoder(StreamEvent)
_NO_READ_TIMEOUT = aiohttp.ClientTimeout(total=None, connect=30.0, sock_read=None)


class _Source:
    """A streamed request body that remembers the exception it raised."""

    def __init__(self, chunks: AsyncIterable[bytes]) -> None:
        self._chunks = chunks
        self.error: Exception | None = None

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._chunks:
                yield chunk
        except Exception as exc:
            self.error = exc
            raise


class ExecutorClient:
    """Typed calls to one sandbox's executor, with retries and error mapping."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        token: str,
        *,
        sandbox_id: str,
        diagnose: Callable[[], Awaitable[OrchardError | None]],
    ) -> None:
        self._session = session
        self._base = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}", "Content-Type": MSGPACK, "Accept": MSGPACK}
        self._sandbox_id = sandbox_id
        self._diagnose = diagnose
        self.closed = False

    def _timeout(self, command_timeout: float | None) -> aiohttp.ClientTimeout:
        if command_timeout is None:
            return _NO_READ_TIMEOUT
        return aiohttp.ClientTimeout(total=None, connect=30.0, sock_read=command_timeout + TIMEOUT_MARGIN)

    async def _raise_for(self, resp: aiohttp.ClientResponse) -> None:
        body = await resp.read()
        try:
            error = decode(body, Error, resp.content_type)
        except (msgspec.DecodeError, msgspec.ValidationError):
            raise ExecutorError(
                f"sandbox {self._sandbox_id}: HTTP {resp.status} from the executor: {body[:200]!r}",
                code="internal",
                sandbox_id=self._sandbox_id,
            ) from None
        cls = EXECUTOR_ERRORS.get(error.code, ExecutorError)
        raise cls(error.message, code=error.code, path=error.path, sandbox_id=self._sandbox_id)

    async def _lost(self, exc: BaseException) -> OrchardError:
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
        timeout: float | None = 60.0,
        retry: bool = True,
    ) -> T:
        """One request with a msgpack body (or none) and a typed msgpack reply."""
        data = None if body is None else encode(body)

        async def once() -> T:
            async with self._session.request(
                method,
                self._base + path,
                data=data,
                params=params,
                headers=self._headers,
                timeout=self._timeout(timeout),
            ) as resp:
                if resp.status >= 400:
                    await self._raise_for(resp)
                return decode(await resp.read(), result)

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
        timeout: float | None = None,
    ) -> T:
        """A request with a raw (possibly streamed) body; retried only if it is bytes."""
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
                ) as resp:
                    if resp.status >= 400:
                        await self._raise_for(resp)
                    return decode(await resp.read(), result)
            except _retry.TRANSIENT:
                # aiohttp reports a failing body as a broken connection; the sandbox is fine.
                if source is not None and source.error is not None:
                    raise source.error from None
                raise

        return await self._run(once, isinstance(body, bytes))

    async def receive(self, path: str, params: Mapping[str, str], chunk_size: int = 256 * 1024) -> AsyncIterator[bytes]:
        """A GET whose raw reply body is yielded in chunks as it arrives."""
        self._check_open()
        try:
            async with self._session.get(
                self._base + path, params=params, headers=self._headers, timeout=self._timeout(None)
            ) as resp:
                if resp.status >= 400:
                    await self._raise_for(resp)
                async for chunk in resp.content.iter_chunked(chunk_size):
                    yield chunk
        except _retry.TRANSIENT as exc:
            raise await self._lost(exc) from exc

    async def frames(self, path: str, body: object, timeout: float | None) -> AsyncIterator[Any]:
        """A POST whose reply is a stream of framed msgpack events."""
        self._check_open()
        try:
            async with self._session.post(
                self._base + path, data=encode(body), headers=self._headers, timeout=self._timeout(timeout)
            ) as resp:
                if resp.status >= 400:
                    await self._raise_for(resp)
                while True:
                    try:
                        header = await resp.content.readexactly(FRAME_HEADER.size)
                    except EOFError:
                        return
                    (size,) = FRAME_HEADER.unpack(header)
                    if size > MAX_FRAME:
                        raise ExecutorError(f"frame of {size} bytes is too large", code="internal")
                    yield _STREAM_EVENT.decode(await resp.content.readexactly(size))
        except (*_retry.TRANSIENT, EOFError) as exc:
            raise await self._lost(exc) from exc

    def _check_open(self) -> None:
        if self.closed:
            raise SandboxClosed(f"sandbox {self._sandbox_id} is closed", sandbox_id=self._sandbox_id)

    async def _run(self, once: Callable[[], Awaitable[T]], retry: bool) -> T:
        self._check_open()
        try:
            # The first try goes without the retry controller: it is the hot path.
            return await once()
        except _retry.TRANSIENT as exc:
            if not retry:
                raise await self._lost(exc) from exc
        try:
            async for attempt in _retry.policy(attempts=3):
                with attempt:
                    return await once()
        except _retry.TRANSIENT as exc:
            raise await self._lost(exc) from exc
        raise AssertionError("unreachable: the retry policy reraises")
