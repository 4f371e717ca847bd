"""Pure translations between the APIs harnesses speak and the upstream's Chat Completions.

Requests: Anthropic Messages and OpenAI Responses bodies become Chat
Completions bodies (``messages_to_chat``, ``responses_to_chat``). Replies: a
Chat Completion becomes a Message or a Response (``chat_to_message``,
``chat_to_response``); a stream of Chat Completion chunks becomes the target
API's event stream, chunk by chunk (``MessagesStream``, ``ResponsesStream``),
while ``ChatAccumulator`` assembles the same chunks into one Chat Completion
for the record. Error bodies in each API's own shape are built here too.
No I/O.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

import msgspec

Json = dict[str, Any]

_encode = msgspec.json.Encoder().encode


class BadRequest(ValueError):
    """A request the gateway cannot serve or translate; answered with a 400."""


def new_id(prefix: str) -> str:
    """A random id in the style of the API (``msg_…``, ``resp_…``, ``call_…``)."""
    return prefix + secrets.token_hex(12)


# Error bodies ---------------------------------------------------------------

#: Anthropic error types by HTTP status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
#: OpenAI error types by HTTP status.
_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
}


def error_body(api: str, status: int, message: str, code: str) -> Json:
    """The error body ``api`` (``chat``, ``responses``, ``messages``) sends with ``status``."""
    if api == "messages":
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}
    kind = "insufficient_quota" if code == "insufficient_quota" else _OPENAI_TYPES.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def upstream_error_message(status: int, body: bytes) -> str:
    """The message of an upstream error reply (OpenAI's or vLLM's shape), else its text."""
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError:
        data = None
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])
        if isinstance(data.get("message"), str):
            return str(data["message"])
    text = body[:2048].decode(errors="replace").strip()
    return text or f"upstream answered HTTP {status}"


# Shared pieces ---------------------------------------------------------------


def _text_of(content: Any) -> str:
    """The text of a content value: a string, or a list of text blocks (other blocks are skipped)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest("content must be a string or a list of content blocks")
    texts = []
    for block in content:
        if isinstance(block, str):
            texts.append(block)
        elif isinstance(block, dict) and isinstance(block.get("text"), str):
            texts.append(block["text"])
    return "\n".join(texts)


def _user_content(parts: list[Json]) -> Any:
    """Chat content for ``parts``: one string when all are text (what every chat template takes)."""
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def _finish_usage(resp: Json) -> tuple[Json, str | None, Any, Json]:
    """The first choice's message, its finish reason and vLLM's ``stop_reason``, and the usage."""
    choices = resp.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    message = choice.get("message") or {}
    usage = resp.get("usage") or {}
    return message, choice.get("finish_reason"), choice.get("stop_reason"), usage


def _reasoning_of(message: Json) -> str:
    """Reasoning text as vLLM/SGLang return it (``reasoning_content``, or ``reasoning`` in newer vLLM)."""
    value = message.get("reasoning_content") or message.get("reasoning")
    return value if isinstance(value, str) else ""


def _loads_object(arguments: str) -> Json:
    """Tool call arguments as an object; text that is not a JSON object is kept under ``_raw``."""
    try:
        value = msgspec.json.decode(arguments) if arguments else {}
    except msgspec.DecodeError:
        return {"_raw": arguments}
    return value if isinstance(value, dict) else {"_raw": arguments}


def _stream_options(chat: Json, body: Json) -> None:
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}


# Anthropic Messages ----------------------------------------------------------

_ANTHROPIC_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "content_filter": "refusal"}


def messages_to_chat(body: Json) -> Json:
    """An Anthropic Messages request as a Chat Completions request (without ``model``).

    ``system`` (and any ``{"role": "system"}`` entry) becomes a system message,
    ``tool_use`` blocks tool calls, ``tool_result`` blocks tool messages, images
    data URLs. Thinking blocks, cache control, server tools and beta options
    are dropped.

    Raises:
        BadRequest: The body is not a Messages request.
    """
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise BadRequest("messages: field required (a list)")
    out: list[Json] = []
    if body.get("system"):
        out.append({"role": "system", "content": _text_of(body["system"])})
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise BadRequest(f"messages.{i}: must be an object")
        role, content = msg.get("role"), msg.get("content")
        if role == "system":
            out.append({"role": "system", "content": _text_of(content)})
        elif role not in ("user", "assistant"):
            raise BadRequest(f"messages.{i}.role: must be user, assistant or system, not {role!r}")
        elif isinstance(content, str):
            out.append({"role": role, "content": content})
        elif not isinstance(content, list):
            raise BadRequest(f"messages.{i}.content: must be a string or a list of content blocks")
        elif role == "user":
            parts: list[Json] = []
            for block in content:
                kind = block.get("type") if isinstance(block, dict) else None
                if kind == "tool_result":
                    out.append(
                        {
                            "role": "tool",
                            "tool_call_id": block.get("tool_use_id"),
                            "content": _text_of(block.get("content")),
                        }
                    )
                elif kind == "text":
                    parts.append({"type": "text", "text": block.get("text", "")})
                elif kind == "image":
                    src = block.get("source") or {}
                    url = src.get("url") or f"data:{src.get('media_type')};base64,{src.get('data')}"
                    parts.append({"type": "image_url", "image_url": {"url": url}})
            if parts:
                out.append({"role": "user", "content": _user_content(parts)})
        else:
            texts, calls = [], []
            for block in content:
                kind = block.get("type") if isinstance(block, dict) else None
                if kind == "text":
                    texts.append(block.get("text", ""))
                elif kind == "tool_use":
                    arguments = _encode(block.get("input") or {}).decode()
                    calls.append(
                        {
                            "id": block.get("id"),
                            "type": "function",
                            "function": {"name": block.get("name"), "arguments": arguments},
                        }
                    )
            assistant: Json = {"role": "assistant", "content": "".join(texts) or None}
            if calls:
                assistant["tool_calls"] = calls
            out.append(assistant)
    chat: Json = {"messages": out}
    tools = [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                "description": t.get("description", ""),
                "parameters": t.get("input_schema") or {},
            },
        }
        for t in body.get("tools") or []
        if isinstance(t, dict) and t.get("type") in (None, "custom") and isinstance(t.get("name"), str)
    ]
    if tools:
        chat["tools"] = tools
        choice = body.get("tool_choice")
        if isinstance(choice, dict):
            kind = choice.get("type")
            if kind == "any":
                chat["tool_choice"] = "required"
            elif kind == "tool":
                chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
            elif kind in ("auto", "none"):
                chat["tool_choice"] = kind
            if choice.get("disable_parallel_tool_use"):
                chat["parallel_tool_calls"] = False
    for key in ("max_tokens", "temperature", "top_p", "top_k"):
        if key in body:
            chat[key] = body[key]
    if body.get("stop_sequences"):
        chat["stop"] = body["stop_sequences"]
    _stream_options(chat, body)
    return chat


def _stop_sequence(finish: str | None, stop_reason: Any, request: Json) -> tuple[str | None, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for a chat finish reason."""
    if finish == "stop" and isinstance(stop_reason, str) and stop_reason in (request.get("stop_sequences") or ()):
        return "stop_sequence", stop_reason
    return _ANTHROPIC_STOP.get(finish or "stop", "end_turn"), None


def chat_to_message(resp: Json, request: Json) -> Json:
    """A Chat Completion (first choice) as an Anthropic Message answering ``request``."""
    message, finish, stop_reason, usage = _finish_usage(resp)
    content: list[Json] = []
    if reasoning := _reasoning_of(message):
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        content.append(
            {
                "type": "tool_use",
                "id": call.get("id") or new_id("toolu_"),
                "name": fn.get("name"),
                "input": _loads_object(fn.get("arguments") or ""),
            }
        )
    reason, sequence = _stop_sequence(finish, stop_reason, request)
    return {
        "id": new_id("msg_"),
        "type": "message",
        "role": "assistant",
        "model": request.get("model"),
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": usage.get("completion_tokens", 0)},
    }


def _sse(event: str, data: Json) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + _encode(data) + b"\n\n"


class MessagesStream:
    """Chat Completion chunks in, Anthropic Messages stream events out, one chunk at a time.

    ``final`` is the Message the events add up to, for the record.
    """

    def __init__(self, request: Json) -> None:
        self.request = request
        self.final: Json = {
            "id": new_id("msg_"),
            "type": "message",
            "role": "assistant",
            "model": request.get("model"),
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        self._open: str | None = None  # "text", "thinking", or "tool:<chat index>"
        self._args: dict[int, str] = {}
        self._finish: str | None = None
        self._stop_reason: Any = None

    def start(self) -> bytes:
        """The ``message_start`` event, sent as soon as the upstream answers."""
        return _sse("message_start", {"type": "message_start", "message": {**self.final, "content": []}}) + _sse(
            "ping", {"type": "ping"}
        )

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        index = len(self.final["content"]) - 1
        block = self.final["content"][index]
        if block["type"] == "tool_use":
            block["input"] = _loads_object(self._args.get(int(self._open[5:]), ""))
        self._open = None
        return _sse("content_block_stop", {"type": "content_block_stop", "index": index})

    def _begin(self, key: str, block: Json) -> bytes:
        out = self._close()
        self.final["content"].append(block)
        self._open = key
        start = dict(block, input={}) if block["type"] == "tool_use" else block
        index = len(self.final["content"]) - 1
        return out + _sse(
            "content_block_start", {"type": "content_block_start", "index": index, "content_block": dict(start)}
        )

    def _delta(self, delta: Json) -> bytes:
        index = len(self.final["content"]) - 1
        return _sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})

    def feed(self, chunk: Json) -> bytes:
        """The events for one upstream chunk (often none)."""
        if usage := chunk.get("usage"):
            self.final["usage"] = {
                "input_tokens": usage.get("prompt_tokens", 0),
                "output_tokens": usage.get("completion_tokens", 0),
            }
        out = b""
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if reasoning := _reasoning_of(delta):
                if self._open != "thinking":
                    out += self._begin("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                self.final["content"][-1]["thinking"] += reasoning
                out += self._delta({"type": "thinking_delta", "thinking": reasoning})
            if text := delta.get("content"):
                if self._open != "text":
                    out += self._begin("text", {"type": "text", "text": ""})
                self.final["content"][-1]["text"] += text
                out += self._delta({"type": "text_delta", "text": text})
            for call in delta.get("tool_calls") or ():
                index = call.get("index", 0)
                fn = call.get("function") or {}
                key = f"tool:{index}"
                if self._open != key:
                    block: Json = {
                        "type": "tool_use",
                        "id": call.get("id") or new_id("toolu_"),
                        "name": fn.get("name"),
                        "input": {},
                    }
                    out += self._begin(key, block)
                if arguments := fn.get("arguments"):
                    self._args[index] = self._args.get(index, "") + arguments
                    out += self._delta({"type": "input_json_delta", "partial_json": arguments})
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
                self._stop_reason = choice.get("stop_reason")
        return out

    def finish(self) -> bytes:
        """The closing events, once the upstream stream ended."""
        out = self._close()
        reason, sequence = _stop_sequence(self._finish, self._stop_reason, self.request)
        self.final["stop_reason"], self.final["stop_sequence"] = reason, sequence
        delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}}
        return (
            out
            + _sse("message_delta", delta | {"usage": self.final["usage"]})
            + _sse("message_stop", {"type": "message_stop"})
        )

    def error(self, status: int, message: str, code: str) -> bytes:
        """An ``error`` event, for a failure after the stream began."""
        return _sse("error", error_body("messages", status, message, code))


# OpenAI Responses -----------------------------------------------------------


def _response_content(content: Any) -> Any:
    """Responses content parts as chat content."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest("input: a message's content must be a string or a list of parts")
    parts: list[Json] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "refusal"):
            parts.append({"type": "text", "text": part.get("text") or part.get("refusal") or ""})
        elif kind == "input_image" and part.get("image_url"):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
    return _user_content(parts)


def responses_to_chat(body: Json) -> Json:
    """An OpenAI Responses request as a Chat Completions request (without ``model``).

    ``instructions`` and developer/system items become system messages,
    ``function_call`` items tool calls of an assistant message,
    ``function_call_output`` items tool messages. Tools other than ``function``
    (``namespace``, ``web_search``, ...) and reasoning items are dropped.

    Raises:
        BadRequest: The body is not a Responses request.
    """
    items = body.get("input")
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    if not isinstance(items, list):
        raise BadRequest("input: field required (a string or a list of items)")
    out: list[Json] = []
    if body.get("instructions"):
        out.append({"role": "system", "content": _text_of(body["instructions"])})
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise BadRequest(f"input.{i}: must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise BadRequest(f"input.{i}.role: must be user, assistant, system or developer, not {role!r}")
            content = _response_content(item.get("content"))
            out.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind in ("function_call", "custom_tool_call"):
            arguments = item.get("arguments") if kind == "function_call" else item.get("input")
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": arguments or ""},
            }
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": _text_of(output)})
    chat: Json = {"messages": out}
    tools = [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                "description": t.get("description") or "",
                "parameters": t.get("parameters") or {},
            },
        }
        for t in body.get("tools") or []
        if isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("name"), str)
    ]
    if tools:
        chat["tools"] = tools
        choice = body.get("tool_choice")
        if choice in ("auto", "none", "required"):
            chat["tool_choice"] = choice
        elif isinstance(choice, dict) and choice.get("type") == "function":
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        if "parallel_tool_calls" in body:
            chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    if "max_output_tokens" in body:
        chat["max_tokens"] = body["max_output_tokens"]
    for key in ("temperature", "top_p"):
        if key in body:
            chat[key] = body[key]
    _stream_options(chat, body)
    return chat


def _response_usage(usage: Json) -> Json:
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.get("total_tokens", prompt + completion),
    }


def _response(request: Json, rid: str, status: str, output: list[Json], usage: Json | None) -> Json:
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.get("instructions"),
        "model": request.get("model"),
        "output": output,
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "tool_choice": request.get("tool_choice", "auto"),
        "tools": request.get("tools") or [],
        "usage": usage,
    }


def _message_item(text: str, item_id: str | None = None) -> Json:
    return {
        "type": "message",
        "id": item_id or new_id("msg_"),
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def _reasoning_item(text: str, item_id: str | None = None) -> Json:
    return {
        "type": "reasoning",
        "id": item_id or new_id("rs_"),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def chat_to_response(resp: Json, request: Json) -> Json:
    """A Chat Completion (first choice) as an OpenAI Response answering ``request``."""
    message, finish, _, usage = _finish_usage(resp)
    output: list[Json] = []
    if reasoning := _reasoning_of(message):
        output.append(_reasoning_item(reasoning))
    if message.get("content"):
        output.append(_message_item(message["content"]))
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        output.append(
            {
                "type": "function_call",
                "id": new_id("fc_"),
                "call_id": call.get("id") or new_id("call_"),
                "name": fn.get("name"),
                "arguments": fn.get("arguments") or "",
                "status": "completed",
            }
        )
    status = "incomplete" if finish == "length" else "completed"
    return _response(request, new_id("resp_"), status, output, _response_usage(usage))


class ResponsesStream:
    """Chat Completion chunks in, OpenAI Responses stream events out, one chunk at a time.

    ``final`` is the Response the events add up to (the one
    ``response.completed`` carries), for the record.
    """

    def __init__(self, request: Json) -> None:
        self.request = request
        self.final = _response(request, new_id("resp_"), "in_progress", [], None)
        self._seq = 0
        self._open: str | None = None  # "text", "reasoning", or "tool:<chat index>"
        self._finish: str | None = None

    def _event(self, kind: str, fields: Json) -> bytes:
        data = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return _sse(kind, data)

    def start(self) -> bytes:
        """``response.created`` and ``response.in_progress``, sent as soon as the upstream answers."""
        snapshot = {**self.final, "output": []}
        return self._event("response.created", {"response": snapshot}) + self._event(
            "response.in_progress", {"response": snapshot}
        )

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        index = len(self.final["output"]) - 1
        item = self.final["output"][index]
        self._open = None
        item["status"] = "completed"
        if item["type"] == "message":
            part = item["content"][0]
            base = {"item_id": item["id"], "output_index": index, "content_index": 0}
            out = self._event("response.output_text.done", base | {"text": part["text"]})
            out += self._event("response.content_part.done", base | {"part": part})
        elif item["type"] == "reasoning":
            base = {"item_id": item["id"], "output_index": index, "content_index": 0}
            out = self._event("response.reasoning_text.done", base | {"text": item["content"][0]["text"]})
            del item["status"]
        else:
            base = {"item_id": item["id"], "output_index": index}
            out = self._event("response.function_call_arguments.done", base | {"arguments": item["arguments"]})
        return out + self._event("response.output_item.done", {"output_index": index, "item": item})

    def _begin(self, key: str, item: Json) -> bytes:
        out = self._close()
        self.final["output"].append(item)
        self._open = key
        index = len(self.final["output"]) - 1
        added = dict(item, status="in_progress")
        if item["type"] == "message":
            added["content"] = []
        elif item["type"] == "reasoning":
            added = dict(item, content=[])
        out += self._event("response.output_item.added", {"output_index": index, "item": added})
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": []}
            base = {"item_id": item["id"], "output_index": index, "content_index": 0}
            out += self._event("response.content_part.added", base | {"part": part})
        return out

    def _last(self, **fields: int) -> tuple[Json, Json]:
        """The open (last) output item, and the fields naming it in a delta event."""
        index = len(self.final["output"]) - 1
        item = self.final["output"][index]
        return item, {"item_id": item["id"], "output_index": index, **fields}

    def feed(self, chunk: Json) -> bytes:
        """The events for one upstream chunk (often none)."""
        if usage := chunk.get("usage"):
            self.final["usage"] = _response_usage(usage)
        out = b""
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if reasoning := _reasoning_of(delta):
                if self._open != "reasoning":
                    out += self._begin("reasoning", _reasoning_item(""))
                item, base = self._last(content_index=0)
                item["content"][0]["text"] += reasoning
                out += self._event("response.reasoning_text.delta", base | {"delta": reasoning})
            if text := delta.get("content"):
                if self._open != "text":
                    out += self._begin("text", _message_item(""))
                item, base = self._last(content_index=0)
                item["content"][0]["text"] += text
                out += self._event("response.output_text.delta", base | {"delta": text})
            for call in delta.get("tool_calls") or ():
                fn = call.get("function") or {}
                key = f"tool:{call.get('index', 0)}"
                if self._open != key:
                    item = {
                        "type": "function_call",
                        "id": new_id("fc_"),
                        "call_id": call.get("id") or new_id("call_"),
                        "name": fn.get("name"),
                        "arguments": "",
                        "status": "in_progress",
                    }
                    out += self._begin(key, item)
                if arguments := fn.get("arguments"):
                    item, base = self._last()
                    item["arguments"] += arguments
                    out += self._event("response.function_call_arguments.delta", base | {"delta": arguments})
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
        return out

    def finish(self) -> bytes:
        """The closing events, once the upstream stream ended."""
        out = self._close()
        status = "incomplete" if self._finish == "length" else "completed"
        self.final["status"] = status
        if self.final["usage"] is None:
            self.final["usage"] = _response_usage({})
        if status == "incomplete":
            self.final["incomplete_details"] = {"reason": "max_output_tokens"}
        return out + self._event(f"response.{status}", {"response": self.final})

    def error(self, status: int, message: str, code: str) -> bytes:
        """A ``response.failed`` event, for a failure after the stream began."""
        failed = dict(self.final, status="failed", error={"code": code, "message": message})
        return self._event("response.failed", {"response": failed})


# Chat Completions -------------------------------------------------------------


class ChatStream:
    """Chat Completion chunks passed through as they came (the usage-only chunk dropped if not asked for)."""

    def __init__(self, request: Json) -> None:
        options = request.get("stream_options")
        self._usage = isinstance(options, dict) and bool(options.get("include_usage"))
        self.final: Json | None = None

    def start(self) -> bytes:
        """Nothing: a chat stream begins with its first chunk."""
        return b""

    def passes(self, chunk: Json) -> bool:
        """Whether the client gets this chunk."""
        return self._usage or bool(chunk.get("choices")) or not chunk.get("usage")

    def finish(self) -> bytes:
        """The end of a chat stream."""
        return b"data: [DONE]\n\n"

    def error(self, status: int, message: str, code: str) -> bytes:
        """An error chunk, as OpenAI sends one mid-stream."""
        return b"data: " + _encode(error_body("chat", status, message, code)) + b"\n\n"


class ChatAccumulator:
    """Assembles a stream of Chat Completion chunks into the Chat Completion they add up to.

    Keeps what vLLM streams besides text: ``logprobs``, ``token_ids`` per
    choice and ``prompt_token_ids``.
    """

    def __init__(self) -> None:
        self.head: Json = {}
        self.choices: dict[int, Json] = {}
        self.usage: Json | None = None
        self.prompt_token_ids: list[int] | None = None

    def add(self, chunk: Json) -> None:
        """Take one chunk."""
        if not self.head:
            self.head = {k: chunk.get(k) for k in ("id", "created", "model")}
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if chunk.get("prompt_token_ids") is not None:
            self.prompt_token_ids = chunk["prompt_token_ids"]
        for choice in chunk.get("choices") or ():
            index = choice.get("index", 0)
            acc = self.choices.get(index)
            if acc is None:
                acc = self.choices[index] = {"content": "", "reasoning": "", "calls": {}, "finish": None}
            delta = choice.get("delta") or {}
            acc["content"] += delta.get("content") or ""
            acc["reasoning"] += _reasoning_of(delta)
            for call in delta.get("tool_calls") or ():
                slot = acc["calls"].setdefault(call.get("index", 0), {"id": None, "name": None, "arguments": ""})
                fn = call.get("function") or {}
                slot["id"] = slot["id"] or call.get("id")
                slot["name"] = slot["name"] or fn.get("name")
                slot["arguments"] += fn.get("arguments") or ""
            if choice.get("finish_reason"):
                acc["finish"] = choice["finish_reason"]
                if "stop_reason" in choice:
                    acc["stop_reason"] = choice["stop_reason"]
            logprobs = choice.get("logprobs")
            if isinstance(logprobs, dict) and logprobs.get("content"):
                acc.setdefault("logprobs", []).extend(logprobs["content"])
            if choice.get("token_ids"):
                acc.setdefault("token_ids", []).extend(choice["token_ids"])

    def completion(self) -> Json:
        """The Chat Completion so far."""
        choices = []
        for index in sorted(self.choices):
            acc = self.choices[index]
            message: Json = {"role": "assistant", "content": acc["content"] or None}
            if acc["reasoning"]:
                message["reasoning_content"] = acc["reasoning"]
            if acc["calls"]:
                message["tool_calls"] = [
                    {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                    for _, c in sorted(acc["calls"].items())
                ]
            choice: Json = {"index": index, "message": message, "finish_reason": acc["finish"]}
            if "stop_reason" in acc:
                choice["stop_reason"] = acc["stop_reason"]
            if "logprobs" in acc:
                choice["logprobs"] = {"content": acc["logprobs"]}
            if "token_ids" in acc:
                choice["token_ids"] = acc["token_ids"]
            choices.append(choice)
        out: Json = {**self.head, "object": "chat.completion", "choices": choices, "usage": self.usage}
        if self.prompt_token_ids is not None:
            out["prompt_token_ids"] = self.prompt_token_ids
        return out
