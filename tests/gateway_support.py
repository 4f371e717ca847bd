"""A scripted OpenAI-compatible upstream (Chat Completions, as vLLM answers) for the gateway tests.

Each reply is a ``Turn``: what the model "generates" (text, reasoning, tool
calls), with vLLM's extras (``prompt_token_ids``, per-choice ``token_ids``,
``logprobs``). A non-streamed request gets it as one Chat Completion; a
streamed one as chunks, one per token (a word of the text, half a tool
call's arguments), a finish chunk, the usage chunk when asked, ``[DONE]``.
A turn can also stall (before answering, or after some chunks), cut the
stream without ``[DONE]``, or answer an error status.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

Json = dict[str, Any]


@dataclasses.dataclass
class Turn:
    text: str = ""
    reasoning: str = ""
    tool_calls: list[tuple[str, str, Json]] = dataclasses.field(default_factory=list)  # (id, name, arguments)
    finish_reason: str | None = None  # default: tool_calls if any, else stop
    stop_reason: str | int | None = None
    prompt_tokens: int = 11
    with_ids: bool = True  # prompt_token_ids, token_ids and logprobs, as vLLM returns them when asked
    stall: float = 0.0  # seconds before answering
    stall_after: int | None = None  # streamed: chunks sent before stalling for good
    cut_after: int | None = None  # streamed: chunks sent before closing the connection without [DONE]
    status: int = 200
    error: str = ""

    def tokens(self) -> list[str]:
        words = self.text.split(" ")
        return [w if i == 0 else " " + w for i, w in enumerate(words)] if self.text else []

    def token_ids(self) -> list[int]:
        return [1000 + i for i in range(len(self.tokens()) + len(self.tool_calls))]

    def logprobs(self) -> list[Json]:
        pieces = self.tokens() + [name for _, name, _ in self.tool_calls]
        return [
            {"token": t, "logprob": -0.1 * (i + 1), "bytes": list(t.encode()), "top_logprobs": []}
            for i, t in enumerate(pieces)
        ]

    def usage(self) -> Json:
        n = len(self.token_ids())
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n, "total_tokens": self.prompt_tokens + n}

    def finish(self) -> str:
        return self.finish_reason or ("tool_calls" if self.tool_calls else "stop")

    def completion(self, model: str) -> Json:
        message: Json = {"role": "assistant", "content": self.text or None}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
                for cid, name, args in self.tool_calls
            ]
        choice: Json = {"index": 0, "message": message, "finish_reason": self.finish(), "stop_reason": self.stop_reason}
        out: Json = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": model, "choices": [choice]}
        if self.with_ids:
            choice["logprobs"] = {"content": self.logprobs()}
            choice["token_ids"] = self.token_ids()
            out["prompt_token_ids"] = list(range(self.prompt_tokens))
        out["usage"] = self.usage()
        return out

    def chunks(self, model: str, include_usage: bool) -> list[Json]:
        head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": model}
        ids, lps = self.token_ids(), self.logprobs()
        out: list[Json] = []

        def chunk(delta: Json, k: int | None = None, **extra: Any) -> None:
            choice: Json = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None, **extra}
            if self.with_ids and k is not None:
                choice["logprobs"] = {"content": [lps[k]]}
                choice["token_ids"] = [ids[k]]
            out.append({**head, "choices": [choice]})

        first: Json = {"role": "assistant", "content": ""}
        out.append({**head, "choices": [{"index": 0, "delta": first, "logprobs": None, "finish_reason": None}]})
        if self.with_ids:
            out[0]["prompt_token_ids"] = list(range(self.prompt_tokens))
        if self.reasoning:
            chunk({"reasoning_content": self.reasoning})
        k = 0
        for token in self.tokens():
            chunk({"content": token}, k)
            k += 1
        for i, (cid, name, args) in enumerate(self.tool_calls):
            arguments = json.dumps(args)
            half = len(arguments) // 2
            call = {"index": i, "id": cid, "type": "function", "function": {"name": name, "arguments": ""}}
            chunk({"tool_calls": [call]}, k)
            k += 1
            for part in (arguments[:half], arguments[half:]):
                chunk({"tool_calls": [{"index": i, "function": {"arguments": part}}]})
        chunk({}, None, finish_reason=self.finish(), stop_reason=self.stop_reason)
        if include_usage:
            out.append({**head, "choices": [], "usage": self.usage()})
        return out


class Upstream:
    """The scripted upstream: ``script(turn, ...)`` queues replies; ``requests`` holds every body received."""

    def __init__(self) -> None:
        self.turns: list[Turn] = []
        self.requests: list[Json] = []
        self.headers: list[dict[str, str]] = []
        #: Set when a client hung up on a streamed reply (or a stalled one) before its end.
        self.hung_up = asyncio.Event()
        self.url = ""
        #: Picks the reply to a request from its body, instead of the queue (a model that follows a script).
        self.choose: Callable[[Json], Turn] | None = None
        self._runner: web.AppRunner | None = None

    def script(self, *turns: Turn) -> None:
        self.turns.extend(turns)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        if self.choose is not None:
            turn = self.choose(body)
        else:
            turn = self.turns.pop(0) if self.turns else Turn(text="ok")
        model = body.get("model", "")
        try:
            if turn.stall:
                await asyncio.sleep(turn.stall)
            if turn.status != 200:
                err = {
                    "object": "error",
                    "message": turn.error,
                    "type": "BadRequestError",
                    "param": None,
                    "code": turn.status,
                }
                return web.json_response(err, status=turn.status)
            if not body.get("stream"):
                return web.json_response(turn.completion(model))
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            for i, c in enumerate(turn.chunks(model, include_usage)):
                if turn.stall_after is not None and i == turn.stall_after:
                    await asyncio.sleep(3600)
                if turn.cut_after is not None and i == turn.cut_after:
                    assert request.transport is not None
                    request.transport.close()
                    return resp
                await resp.write(b"data: " + json.dumps(c).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        except (asyncio.CancelledError, ConnectionError):
            self.hung_up.set()
            raise

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "up-model", "object": "model"}]})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}/v1"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@contextlib.asynccontextmanager
async def upstream() -> AsyncIterator[Upstream]:
    up = Upstream()
    await up.start()
    try:
        yield up
    finally:
        await up.stop()


def sse_events(raw: bytes) -> list[tuple[str | None, Any]]:
    """The (event name, decoded data) of each event of an SSE body; ``[DONE]`` is kept as a string."""
    events = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        name, data = None, None
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
        assert data is not None, block
        events.append((name, data if data == "[DONE]" else json.loads(data)))
    return events


def free_port() -> int:
    """A loopback port nothing listens on (bound then closed)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
