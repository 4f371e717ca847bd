"""``ModelGateway``: the HTTP server harnesses call, forwarding to one Chat Completions upstream."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from ..errors import ConfigError, GatewayClosed
from . import _translate as tr
from ._record import SCHEMA_VERSION, Record, Recorder, RecordTo

Json = dict[str, Any]

_decode = msgspec.json.decode
_encode = msgspec.json.Encoder().encode
#: Largest request body a harness may send (long conversations run to megabytes).
MAX_REQUEST = 64 << 20
_JSON = {"Content-Type": "application/json"}
_SSE = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
# Stainless-generated SDKs (openai, anthropic) do not retry a reply carrying this header.
_NO_RETRY = {"x-should-retry": "false"}


class _Sandbox:
    def __init__(self, sandbox_id: str, harness: str | None, key: str) -> None:
        self.id, self.harness, self.key = sandbox_id, harness, key
        self.calls = 0
        self.tokens = 0
        self.inflight: set[asyncio.Task[Any]] = set()
        self.gone = False


class _Failure(Exception):
    """A call that ends with an error reply: the HTTP status, a message, and a short code."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class _Call:
    """One call's state while it runs, and its record."""

    def __init__(self, api: str) -> None:
        self.api = api
        self.start = time.time()
        self.t0 = time.perf_counter()
        self.ttft: float | None = None
        self.sandbox: _Sandbox | None = None
        self.stream = False
        self.request: Any = None
        self.upstream_request: Json | None = None
        self.upstream_model: str | None = None
        self.response: Any = None
        self.completion: Json | None = None
        self.status = 0
        self.error: Json | None = None

    def first_token(self) -> None:
        if self.ttft is None:
            self.ttft = time.perf_counter() - self.t0

    def record(self, call_id: int) -> Record:
        latency = time.perf_counter() - self.t0
        comp = self.completion or {}
        choices = comp.get("choices") or [{}]
        choice = choices[0] if isinstance(choices[0], dict) else {}
        usage = comp.get("usage") or {}
        logprobs = choice.get("logprobs")
        body = self.request if isinstance(self.request, dict) else {}
        return {
            "v": SCHEMA_VERSION,
            "id": call_id,
            "sandbox": self.sandbox.id if self.sandbox else None,
            "harness": self.sandbox.harness if self.sandbox else None,
            "api": self.api,
            "stream": self.stream,
            "model": body.get("model"),
            "upstream_model": self.upstream_model,
            "request": self.request,
            "upstream_request": self.upstream_request,
            "response": self.response,
            "status": self.status,
            "error": self.error,
            "finish_reason": choice.get("finish_reason"),
            "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens"),
            "prompt_token_ids": comp.get("prompt_token_ids"),
            "completion_token_ids": choice.get("token_ids"),
            "logprobs": logprobs.get("content") if isinstance(logprobs, dict) else None,
            "start": self.start,
            "end": self.start + latency,
            "latency": latency,
            "ttft": self.ttft,
        }


def _has_output(chunk: Json) -> bool:
    """Whether a chunk carries generated output (text, reasoning or a tool call), not just a role."""
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content") or delta.get("reasoning"):
            return True
    return False


class ModelGateway:
    """A model endpoint for harnesses in sandboxes: forwards to one upstream, records every call.

    Serves OpenAI Chat Completions (``/v1/chat/completions``), OpenAI
    Responses (``/v1/responses``) and Anthropic Messages (``/v1/messages``),
    streamed and not, on 127.0.0.1 in this process. The upstream speaks Chat
    Completions (vLLM, SGLang): chat requests pass through with the model name
    mapped; Responses and Messages are translated both ways, streams chunk by
    chunk. Each sandbox calls with its own key (``register``); every call is
    recorded (schema in docs/gateway.md).

    Example::

        async with orchard.ModelGateway("http://127.0.0.1:8000/v1", model="Qwen/Qwen3-8B",
                                        record="calls.jsonl", max_calls=200) as gateway:
            key = gateway.register("sb-1", harness="claude")
            env = gateway.environment("sb-1", gateway.url)  # OPENAI_*, ANTHROPIC_* variables
            ...
            records = gateway.calls("sb-1")

    Args:
        upstream: The upstream's base URL, ending in ``/v1`` (``/chat/completions`` is appended).
        record: A JSON-lines file to append each call's record to, a function called with each
            record (a dict), or None to keep records only in memory (``calls``).
        model: The upstream model name every request is sent with; None passes the harness's own.
        max_calls: Calls allowed per sandbox; the next one is answered 429 without calling upstream.
        max_tokens: Tokens (prompt plus completion, as the upstream counts them) allowed per sandbox;
            once reached, further calls are answered 429 without calling upstream.
        timeout: Seconds the upstream has to answer a call (the whole reply when not streamed;
            the headers and then each chunk when streamed) before the harness gets a 504.
        upstream_key: Sent to the upstream as ``Authorization: Bearer``, if set.
        extra_body: Fields added to every upstream request, such as
            ``{"logprobs": True, "return_token_ids": True}`` for vLLM to return what RL needs.
        port: The port to listen on, on 127.0.0.1 (0: any free port).
    """

    def __init__(
        self,
        upstream: str,
        *,
        record: RecordTo = None,
        model: str | None = None,
        max_calls: int | None = None,
        max_tokens: int | None = None,
        timeout: float = 300.0,
        upstream_key: str | None = None,
        extra_body: Json | None = None,
        port: int = 0,
    ) -> None:
        if not isinstance(upstream, str) or not upstream.startswith(("http://", "https://")):
            raise ConfigError(f"upstream= must be an http(s) URL ending in /v1, not {upstream!r}")
        for name, value in (("max_calls", max_calls), ("max_tokens", max_tokens)):
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ConfigError(f"{name}= must be a non-negative int or None, not {value!r}")
        if not timeout > 0:
            raise ConfigError(f"timeout= must be a positive number of seconds, not {timeout!r}")
        self.upstream = upstream.rstrip("/")
        self.model = model
        self.max_calls, self.max_tokens, self.timeout = max_calls, max_tokens, float(timeout)
        self._extra = dict(extra_body or {})
        self._headers = {"Content-Type": "application/json"}
        if upstream_key:
            self._headers["Authorization"] = f"Bearer {upstream_key}"
        self._port = port
        self._recorder = Recorder(record)
        self._by_key: dict[str, _Sandbox] = {}
        self._by_id: dict[str, _Sandbox] = {}
        self._next_id = 0
        self._runner: web.AppRunner | None = None
        self._http: aiohttp.ClientSession | None = None
        self._url: str | None = None
        self._whole = aiohttp.ClientTimeout(total=self.timeout)
        self._each = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout, sock_read=self.timeout)

    # Lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        """Start serving on 127.0.0.1 (``url`` says where)."""
        if self._runner is not None:
            return
        app = web.Application(client_max_size=MAX_REQUEST)
        app.router.add_get("/", self._root)
        app.router.add_post("/v1/chat/completions", self._handler("chat"))
        app.router.add_post("/v1/responses", self._handler("responses"))
        app.router.add_post("/v1/messages", self._handler("messages"))
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model:.+}", self._models)
        # handler_cancellation: a harness that hangs up cancels its call, which closes the upstream request.
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", self._port)
        await site.start()
        sockets = runner.addresses
        self._url = f"http://127.0.0.1:{sockets[0][1]}"
        self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)
        self._runner = runner

    async def aclose(self) -> None:
        """Stop serving; calls still running are cancelled and recorded as ``gateway_closed``.

        Raises:
            RecordError: A record could not be written while the gateway ran (it was logged then).
        """
        runner, self._runner = self._runner, None
        if runner is not None:
            for sandbox in self._by_id.values():
                for task in list(sandbox.inflight):
                    task.cancel("gateway_closed")
            await runner.cleanup()
        if self._http is not None:
            await self._http.close()
            self._http = None
        self._url = None
        self._recorder.close()
        if self._recorder.failure is not None:
            raise self._recorder.failure

    async def __aenter__(self) -> ModelGateway:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def url(self) -> str:
        """The gateway's base URL, ``http://127.0.0.1:PORT`` (APIs under ``/v1``)."""
        if self._url is None:
            raise GatewayClosed("the gateway is not running: use it inside `async with ModelGateway(...)`")
        return self._url

    # Sandboxes -----------------------------------------------------------------

    def register(self, sandbox_id: str, harness: str | None = None) -> str:
        """Admit a sandbox; returns the key its harness must send (``Authorization: Bearer`` or ``x-api-key``).

        Raises:
            ConfigError: ``sandbox_id`` is already registered.
        """
        if sandbox_id in self._by_id:
            raise ConfigError(f"sandbox {sandbox_id!r} is already registered with this gateway; unregister it first")
        key = "orchard-" + secrets.token_urlsafe(32)
        sandbox = _Sandbox(sandbox_id, harness, key)
        self._by_id[sandbox_id] = self._by_key[key] = sandbox
        return key

    def unregister(self, sandbox_id: str) -> None:
        """Revoke a sandbox's key and cancel its calls still running (recorded as ``sandbox_unregistered``).

        Its records stay available from ``calls``. Unknown ids are ignored.
        """
        sandbox = self._by_id.pop(sandbox_id, None)
        if sandbox is None:
            return
        del self._by_key[sandbox.key]
        sandbox.gone = True
        for task in list(sandbox.inflight):
            task.cancel("sandbox_unregistered")

    def environment(self, sandbox_id: str, base_url: str | None = None, *, model: str | None = None) -> dict[str, str]:
        """The environment variables pointing a harness in that sandbox at this gateway.

        Args:
            sandbox_id: A registered sandbox.
            base_url: The gateway's URL as seen from inside the sandbox (the reverse tunnel's
                end); default ``url``.
            model: The model name the harness should ask for; default the gateway's ``model``.
                Without either, the model variables are left out.

        Raises:
            ConfigError: The sandbox is not registered.
        """
        sandbox = self._by_id.get(sandbox_id)
        if sandbox is None:
            raise ConfigError(f"sandbox {sandbox_id!r} is not registered with this gateway: call register() first")
        base = (base_url or self.url).rstrip("/")
        env = {
            "OPENAI_BASE_URL": base + "/v1",
            "OPENAI_API_KEY": sandbox.key,
            "ANTHROPIC_BASE_URL": base,
            "ANTHROPIC_API_KEY": sandbox.key,
        }
        if name := model or self.model:
            env |= {"ANTHROPIC_MODEL": name, "ANTHROPIC_SMALL_FAST_MODEL": name, "ORCHARD_MODEL": name}
        return env

    def calls(self, sandbox: object = None) -> list[Record]:
        """The records of one sandbox (an id, or an object with ``.id``) in the order its calls ended.

        With no argument, every record, including the refused calls of no known sandbox.
        """
        if sandbox is None:
            return list(self._recorder.all)
        sandbox_id = sandbox if isinstance(sandbox, str) else getattr(sandbox, "id", None)
        if not isinstance(sandbox_id, str):
            raise ConfigError(f"calls() takes a sandbox id or an object with .id, not {sandbox!r}")
        return list(self._recorder.by_sandbox.get(sandbox_id, []))

    # Serving -----------------------------------------------------------------

    async def _root(self, request: web.Request) -> web.Response:
        return web.Response(text="orchard model gateway\n")

    def _key_of(self, request: web.Request) -> _Sandbox | None:
        key = request.headers.get("x-api-key")
        if key is None:
            auth = request.headers.get("Authorization", "")
            key = auth[7:].strip() if auth[:7].lower() == "bearer " else None
        return self._by_key.get(key) if key else None

    async def _models(self, request: web.Request) -> web.Response:
        if self._key_of(request) is None:
            return self._error_response("chat", 401, _UNAUTHORIZED, "invalid_api_key")
        wanted = request.match_info.get("model")
        if self.model is not None:
            entry = {"id": self.model, "object": "model", "created": 0, "owned_by": "orchard"}
            return web.json_response(entry if wanted else {"object": "list", "data": [entry]})
        assert self._http is not None
        path = "/models" + (f"/{wanted}" if wanted else "")
        try:
            async with self._http.get(self.upstream + path, headers=self._headers, timeout=self._whole) as resp:
                return web.Response(body=await resp.read(), status=resp.status, headers=_JSON)
        except TimeoutError:
            return self._error_response(
                "chat", 504, f"the upstream did not answer within timeout={self.timeout:g}s", "upstream_timeout"
            )
        except aiohttp.ClientError as exc:
            return self._error_response("chat", 502, f"the upstream is unreachable: {exc}", "upstream_unreachable")

    def _error_response(self, api: str, status: int, message: str, code: str) -> web.Response:
        headers = _NO_RETRY if status == 429 else None
        return web.json_response(tr.error_body(api, status, message, code), status=status, headers=headers)

    def _handler(self, api: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            return await self._serve(api, request)

        return handle

    async def _serve(self, api: str, request: web.Request) -> web.StreamResponse:
        call = _Call(api)
        sandbox = call.sandbox = self._key_of(request)
        task = asyncio.current_task()
        assert task is not None
        if sandbox is not None:
            sandbox.inflight.add(task)
        try:
            return await self._call(call, request)
        except _Failure as failure:
            call.status = failure.status
            call.error = {"type": failure.code, "message": failure.message}
            call.response = tr.error_body(api, failure.status, failure.message, failure.code)
            headers = _NO_RETRY if failure.status == 429 else None
            return web.json_response(call.response, status=failure.status, headers=headers)
        except asyncio.CancelledError:
            reason = "client_disconnected"
            if sandbox is not None and sandbox.gone:
                reason = "sandbox_unregistered"
            elif self._runner is None:
                reason = "gateway_closed"
            call.error = {
                "type": reason,
                "message": f"the call was cancelled ({reason}); the upstream request was closed",
            }
            raise
        finally:
            if sandbox is not None:
                sandbox.inflight.discard(task)
                if call.completion:
                    usage = call.completion.get("usage") or {}
                    sandbox.tokens += (usage.get("prompt_tokens") or 0) + (usage.get("completion_tokens") or 0)
            self._next_id += 1
            self._recorder.emit(call.record(self._next_id))

    async def _call(self, call: _Call, request: web.Request) -> web.StreamResponse:
        api, sandbox = call.api, call.sandbox
        if sandbox is None:
            raise _Failure(401, _UNAUTHORIZED, "invalid_api_key")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise _Failure(413, f"the request body is larger than {MAX_REQUEST} bytes", "request_too_large") from None
        try:
            body = call.request = _decode(raw)
        except msgspec.DecodeError as exc:
            call.request = raw[:65536].decode(errors="replace")
            raise _Failure(400, f"the request body is not valid JSON: {exc}", "invalid_json") from None
        if not isinstance(body, dict):
            raise _Failure(400, "the request body must be a JSON object", "invalid_request")
        call.stream = bool(body.get("stream"))
        if self.max_calls is not None and sandbox.calls >= self.max_calls:
            raise _Failure(429, f"this sandbox reached the gateway's max_calls={self.max_calls}", "insufficient_quota")
        if self.max_tokens is not None and sandbox.tokens >= self.max_tokens:
            message = f"this sandbox used {sandbox.tokens} tokens, reaching the gateway's max_tokens={self.max_tokens}"
            raise _Failure(429, message, "insufficient_quota")
        try:
            if api == "chat":
                if not isinstance(body.get("messages"), list):
                    raise tr.BadRequest("messages: field required (a list)")
                chat = dict(body)
            elif api == "messages":
                chat = tr.messages_to_chat(body)
            else:
                chat = tr.responses_to_chat(body)
        except (tr.BadRequest, TypeError, AttributeError, KeyError) as exc:
            raise _Failure(400, f"invalid request: {exc}", "invalid_request") from None
        model = self.model or body.get("model")
        if not isinstance(model, str):
            raise _Failure(400, "model: field required (a string)", "invalid_request")
        chat["model"] = call.upstream_model = model
        if call.stream:
            chat["stream_options"] = {**(chat.get("stream_options") or {}), "include_usage": True}
        chat.update(self._extra)
        if api != "chat":
            call.upstream_request = chat
        sandbox.calls += 1
        if call.stream:
            return await self._stream(call, request, chat)
        return await self._whole_call(call, chat)

    async def _post(self, chat: Json, timeout: aiohttp.ClientTimeout) -> aiohttp.ClientResponse:
        if self._http is None:
            raise _Failure(503, "the gateway is closing", "gateway_closed")
        try:
            return await self._http.post(
                self.upstream + "/chat/completions", data=_encode(chat), headers=self._headers, timeout=timeout
            )
        except TimeoutError:
            raise _Failure(
                504, f"the upstream did not answer within timeout={self.timeout:g}s", "upstream_timeout"
            ) from None
        except aiohttp.ClientError as exc:
            raise _Failure(502, f"the upstream is unreachable: {exc}", "upstream_unreachable") from None

    async def _upstream_status(self, resp: aiohttp.ClientResponse) -> None:
        """Raise the upstream's own error (status and message) if it did not answer 200."""
        if resp.status != 200:
            message = tr.upstream_error_message(resp.status, await resp.read())
            raise _Failure(resp.status, f"upstream: {message}", "upstream_error")

    async def _whole_call(self, call: _Call, chat: Json) -> web.Response:
        resp = await self._post(chat, self._whole)
        try:
            await self._upstream_status(resp)
            data = await resp.read()
        except TimeoutError:
            raise _Failure(
                504, f"the upstream did not answer within timeout={self.timeout:g}s", "upstream_timeout"
            ) from None
        except aiohttp.ClientError as exc:
            raise _Failure(502, f"the upstream failed mid-reply: {exc}", "upstream_error") from None
        finally:
            resp.close()
        try:
            completion = _decode(data)
        except msgspec.DecodeError:
            raise _Failure(502, "the upstream's reply is not JSON", "upstream_error") from None
        if not isinstance(completion, dict):
            raise _Failure(502, "the upstream's reply is not a JSON object", "upstream_error")
        call.completion = completion
        call.status = 200
        if call.api == "chat":
            call.response = completion
            return web.Response(body=data, headers=_JSON)
        request = call.request
        assert isinstance(request, dict)
        if call.api == "messages":
            call.response = tr.chat_to_message(completion, request)
        else:
            call.response = tr.chat_to_response(completion, request)
        return web.Response(body=_encode(call.response), headers=_JSON)

    async def _stream(self, call: _Call, request: web.Request, chat: Json) -> web.StreamResponse:
        body = call.request
        assert isinstance(body, dict)
        translator: tr.ChatStream | tr.MessagesStream | tr.ResponsesStream
        if call.api == "chat":
            translator = tr.ChatStream(body)
        elif call.api == "messages":
            translator = tr.MessagesStream(body)
        else:
            translator = tr.ResponsesStream(body)
        acc = tr.ChatAccumulator()
        resp = await self._post(chat, self._each)
        out: web.StreamResponse | None = None
        # The pieces made from one read of the upstream go to the harness in one write: a write is a
        # packet, and through the reverse tunnel a websocket message, each waking every process on the way.
        pending: list[bytes] = []
        try:
            await self._upstream_status(resp)
            out = web.StreamResponse(headers=_SSE)
            await out.prepare(request)
            call.status = 200
            if head := translator.start():
                await out.write(head)
            done = False
            buffer = b""
            async for data in resp.content.iter_any():
                buffer += data
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        done = True
                        break
                    chunk = _decode(payload)
                    acc.add(chunk)
                    if isinstance(translator, tr.ChatStream):
                        piece = b"data: " + payload + b"\n\n" if translator.passes(chunk) else b""
                    else:
                        piece = translator.feed(chunk)
                    if piece:
                        if call.ttft is None and _has_output(chunk):
                            call.first_token()
                        pending.append(piece)
                if done:
                    break
                if pending:
                    joined, pending = b"".join(pending), []
                    await out.write(joined)
            if not done:
                raise _Failure(502, "the upstream closed the stream before its end ([DONE])", "upstream_error")
            await out.write_eof(b"".join(pending) + translator.finish())
            # Read the upstream reply to its end, so its connection is kept for the next call.
            with contextlib.suppress(TimeoutError, aiohttp.ClientError):
                await resp.read()
            call.completion = acc.completion()
            call.response = translator.final if translator.final is not None else call.completion
            return out
        except (_Failure, TimeoutError, aiohttp.ClientError, msgspec.DecodeError) as exc:
            failure = _stream_failure(exc, self.timeout)
            if out is None:
                raise failure from None
            # The stream began: the failure goes in the stream, in the API's shape.
            call.completion = acc.completion()
            call.response = translator.final if translator.final is not None else call.completion
            call.error = {"type": failure.code, "message": failure.message}
            with contextlib.suppress(ConnectionError):
                await out.write_eof(b"".join(pending) + translator.error(failure.status, failure.message, failure.code))
            return out
        except asyncio.CancelledError:
            call.completion = acc.completion()
            raise
        except ConnectionError:
            # The harness hung up between two writes (without cancelling the handler first).
            call.completion = acc.completion()
            call.error = {
                "type": "client_disconnected",
                "message": "the client closed the connection mid-stream; the upstream request was closed",
            }
            return out if out is not None else web.Response(status=499)
        finally:
            resp.close()


_UNAUTHORIZED = (
    "invalid API key: a sandbox calls with the key gateway.register() gave it, as Authorization: Bearer or x-api-key"
)


def _stream_failure(exc: BaseException, timeout: float) -> _Failure:
    if isinstance(exc, _Failure):
        return exc
    if isinstance(exc, TimeoutError):
        return _Failure(504, f"the upstream stopped sending for timeout={timeout:g}s", "upstream_timeout")
    if isinstance(exc, msgspec.DecodeError):
        return _Failure(502, "the upstream sent a chunk that is not JSON", "upstream_error")
    return _Failure(502, f"the upstream failed mid-stream: {exc}", "upstream_error")
