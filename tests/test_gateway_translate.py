"""ModelGateway: Anthropic Messages and OpenAI Responses translated to and from the upstream's Chat Completions.

Requests are shaped like the ones claude and codex send (/work/shared/notes/harnesses.md): claude's
``POST /v1/messages?beta=true`` with a ``{"role": "system"}`` entry in ``messages``, thinking and beta
options; codex's ``POST /v1/responses`` with ``stream: true`` and non-function tools. The OpenAI SDK's
own Responses stream helper checks that the events add up.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp

import orchard
from gateway_support import Turn, Upstream, sse_events

BASH_SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
CLAUDE_HEADERS = {
    "anthropic-version": "2023-06-01",
    "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27",
    "x-app": "cli",
    "User-Agent": "claude-cli/2.1.197 (external, sdk-cli)",
}


def claude_body(messages: list[dict[str, Any]], stream: bool) -> dict[str, Any]:
    return {
        "model": "claude-opus-4-8",
        "max_tokens": 32000,
        "system": [
            {"type": "text", "text": "You are Claude Code."},
            {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": messages,
        "tools": [
            {"name": "Bash", "description": "Run a command", "input_schema": BASH_SCHEMA},
            {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
        ],
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015"}]},
        "output_config": {"effort": "high"},
        "metadata": {"user_id": "u"},
        "stream": stream,
    }


def codex_body(items: list[dict[str, Any]], stream: bool = True) -> dict[str, Any]:
    return {
        "model": "gpt-5-codex",
        "instructions": "You are codex.",
        "input": items,
        "tools": [
            {
                "type": "function",
                "name": "shell",
                "description": "Run a command",
                "strict": False,
                "parameters": BASH_SCHEMA,
            },
            {"type": "namespace", "name": "mcp__files", "tools": []},
            {"type": "web_search"},
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "stream": stream,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "thread-1",
    }


async def test_messages_streamed_like_claude_thinking_text_and_tool_use(
    up: Upstream, http: aiohttp.ClientSession
) -> None:
    up.script(
        Turn(reasoning="Let me look.", text="I will list files", tool_calls=[("call_9", "Bash", {"command": "ls -la"})])
    )
    async with orchard.ModelGateway(up.url, model="up-model") as gw:
        key = gw.register("sb", harness="claude")
        messages = [
            {"role": "user", "content": [{"type": "text", "text": "List the files."}]},
            {"role": "system", "content": "Mid-conversation system note."},
        ]
        headers = CLAUDE_HEADERS | {"x-api-key": key}
        async with http.post(f"{gw.url}/v1/messages?beta=true", json=claude_body(messages, True), headers=headers) as r:
            assert r.status == 200
            events = sse_events(await r.read())
        [rec] = gw.calls("sb")
    names = [name for name, _ in events]
    assert names == [
        "message_start",
        "ping",
        *["content_block_start", "content_block_delta", "content_block_stop"],  # thinking
        *["content_block_start"] + ["content_block_delta"] * 4 + ["content_block_stop"],  # text, a word each
        *["content_block_start"]
        + ["content_block_delta"] * 2
        + ["content_block_stop"],  # tool_use, arguments in halves
        "message_delta",
        "message_stop",
    ]
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert (start["role"], start["model"], start["content"]) == ("assistant", "claude-opus-4-8", [])
    blocks: dict[int, dict[str, Any]] = {}
    for name, data in events:
        if name == "content_block_start":
            blocks[data["index"]] = dict(data["content_block"], _json="")
        elif name == "content_block_delta":
            block, delta = blocks[data["index"]], data["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            else:
                assert delta["type"] == "input_json_delta"
                block["_json"] += delta["partial_json"]
    assert blocks[0]["thinking"] == "Let me look."
    assert blocks[1]["text"] == "I will list files"
    assert (blocks[2]["type"], blocks[2]["id"], blocks[2]["name"]) == ("tool_use", "call_9", "Bash")
    assert json.loads(blocks[2]["_json"]) == {"command": "ls -la"}
    end = events[-2][1]
    assert end["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert end["usage"] == {"input_tokens": 11, "output_tokens": 5}
    # The upstream got Chat Completions: system blocks joined, the system entry kept in place, tools as functions.
    sent = up.requests[0]
    assert sent["model"] == "up-model"
    assert sent["messages"] == [
        {"role": "system", "content": "You are Claude Code.\nBe brief."},
        {"role": "user", "content": "List the files."},
        {"role": "system", "content": "Mid-conversation system note."},
    ]
    assert sent["tools"] == [
        {"type": "function", "function": {"name": "Bash", "description": "Run a command", "parameters": BASH_SCHEMA}}
    ]
    assert (sent["max_tokens"], sent["stream"], sent["stream_options"]) == (32000, True, {"include_usage": True})
    assert "thinking" not in sent
    # The record: the request as sent, the upstream request, the message the events add up to.
    assert rec["api"] == "messages"
    assert rec["harness"] == "claude"
    assert rec["upstream_request"] == sent
    assert rec["response"]["content"] == [
        {"type": "thinking", "thinking": "Let me look.", "signature": ""},
        {"type": "text", "text": "I will list files"},
        {"type": "tool_use", "id": "call_9", "name": "Bash", "input": {"command": "ls -la"}},
    ]
    assert rec["response"]["stop_reason"] == "tool_use"
    assert (rec["prompt_tokens"], rec["completion_tokens"]) == (11, 5)
    assert rec["completion_token_ids"] == [1000, 1001, 1002, 1003, 1004]
    assert rec["ttft"] is not None


async def test_messages_non_streamed_tool_result_history_and_stop_reasons(
    up: Upstream, http: aiohttp.ClientSession
) -> None:
    up.script(Turn(text="Two files."), Turn(text="a b", stop_reason="###"), Turn(text="cut", finish_reason="length"))
    async with orchard.ModelGateway(up.url) as gw:
        key = gw.register("sb")
        messages = [
            {"role": "user", "content": "List the files."},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                    {"type": "text", "text": "Listing."},
                    {"type": "tool_use", "id": "call_9", "name": "Bash", "input": {"command": "ls"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "call_9",
                        "content": [{"type": "text", "text": "a.py\nb.py"}],
                    },
                    {"type": "text", "text": "Go on."},
                ],
            },
        ]
        url = f"{gw.url}/v1/messages"
        async with http.post(url, json=claude_body(messages, False), headers={"x-api-key": key}) as r:
            assert r.status == 200
            reply = await r.json()
        body = claude_body(messages[:1], False) | {"stop_sequences": ["###"], "tool_choice": {"type": "any"}}
        async with http.post(url, json=body, headers={"x-api-key": key}) as r:
            stopped = await r.json()
        async with http.post(url, json=claude_body(messages[:1], False), headers={"x-api-key": key}) as r:
            cut = await r.json()
        records = gw.calls("sb")
    assert reply["type"] == "message"
    assert reply["model"] == "claude-opus-4-8"
    assert reply["content"] == [{"type": "text", "text": "Two files."}]
    assert (reply["stop_reason"], reply["stop_sequence"]) == ("end_turn", None)
    assert reply["usage"] == {"input_tokens": 11, "output_tokens": 2}
    assert up.requests[0]["messages"][1:] == [
        {"role": "user", "content": "List the files."},
        {
            "role": "assistant",
            "content": "Listing.",
            "tool_calls": [
                {"id": "call_9", "type": "function", "function": {"name": "Bash", "arguments": '{"command":"ls"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_9", "content": "a.py\nb.py"},
        {"role": "user", "content": "Go on."},
    ]
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", "###")
    assert up.requests[1]["stop"] == ["###"]
    assert up.requests[1]["tool_choice"] == "required"
    assert cut["stop_reason"] == "max_tokens"
    assert [r["response"] for r in records] == [reply, stopped, cut]
    assert records[0]["logprobs"][0]["token"] == "Two"


async def test_responses_streamed_like_codex_through_the_openai_sdk_stream_helper(up: Upstream) -> None:
    from openai import AsyncOpenAI

    up.script(
        Turn(reasoning="Plan.", text="Running it", tool_calls=[("call_7", "shell", {"command": "ls"})]),
        Turn(text="All done"),
    )
    async with orchard.ModelGateway(up.url, model="up-model") as gw:
        key = gw.register("sb", harness="codex")
        client = AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)
        items = [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sandbox rules."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List files."}]},
        ]
        body = codex_body(items)
        extra = {k: v for k, v in body.items() if k not in ("model", "input", "instructions", "tools", "stream")}
        async with client.responses.stream(
            model=body["model"],
            input=items,  # type: ignore[arg-type]
            instructions=body["instructions"],
            tools=body["tools"],
            extra_body=extra,
            extra_headers={"originator": "codex_exec", "accept": "text/event-stream"},
        ) as stream:
            kinds = [event.type async for event in stream]
            final = await stream.get_final_response()
        # The second turn sends the tool call and its output back, as codex does.
        call = next(item for item in final.output if item.type == "function_call")
        items2 = [
            *items,
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "xx"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "a.py"},
        ]
        second = await client.responses.create(model="gpt-5-codex", input=items2, tools=body["tools"], store=False)  # type: ignore[arg-type]
        await client.close()
        records = gw.calls("sb")
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    assert "response.function_call_arguments.delta" in kinds
    assert final.status == "completed"
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == "Running it"
    assert (call.call_id, call.name, json.loads(call.arguments)) == ("call_7", "shell", {"command": "ls"})
    assert final.usage is not None
    assert (final.usage.input_tokens, final.usage.output_tokens) == (11, 3)
    sent = up.requests[0]
    assert sent["messages"] == [
        {"role": "system", "content": "You are codex."},
        {"role": "system", "content": "Sandbox rules."},
        {"role": "user", "content": "List files."},
    ]
    # Only the function tool goes upstream: namespace and web_search are dropped.
    assert sent["tools"] == [
        {"type": "function", "function": {"name": "shell", "description": "Run a command", "parameters": BASH_SCHEMA}}
    ]
    assert (sent["tool_choice"], sent["parallel_tool_calls"], sent["model"]) == ("auto", True, "up-model")
    assert up.requests[1]["messages"][2:] == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_7", "type": "function", "function": {"name": "shell", "arguments": call.arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_7", "content": "a.py"},
    ]
    assert second.output_text == "All done"
    assert second.status == "completed"
    assert [r["api"] for r in records] == ["responses", "responses"]
    assert records[0]["response"]["id"] == final.id
    assert records[0]["response"]["output"][2]["arguments"] == call.arguments
    assert records[0]["stream"] is True
    assert records[1]["stream"] is False
    assert records[1]["response"]["output"][0]["content"][0]["text"] == "All done"


async def test_responses_raw_codex_request_events_and_incomplete(up: Upstream, http: aiohttp.ClientSession) -> None:
    up.script(Turn(text="hello world"), Turn(text="trunc", finish_reason="length"))
    async with orchard.ModelGateway(up.url) as gw:
        key = gw.register("sb")
        headers = {"Authorization": f"Bearer {key}", "accept": "text/event-stream", "originator": "codex_exec"}
        items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]
        async with http.post(f"{gw.url}/v1/responses", json=codex_body(items), headers=headers) as r:
            events = sse_events(await r.read())
        async with http.post(
            f"{gw.url}/v1/responses", json=codex_body(items, stream=False) | {"max_output_tokens": 1}, headers=headers
        ) as r:
            incomplete = await r.json()
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert [name for name, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    done = events[-1][1]["response"]
    assert done["output"][0]["content"][0]["text"] == "hello world"
    assert done["output"][0]["id"] == events[2][1]["item"]["id"]
    assert incomplete["status"] == "incomplete"
    assert incomplete["incomplete_details"] == {"reason": "max_output_tokens"}
    assert up.requests[1]["max_tokens"] == 1
