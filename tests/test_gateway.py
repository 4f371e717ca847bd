"""ModelGateway: Chat Completions through the gateway to a scripted upstream, keys, and the call records."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest

import orchard
from gateway_support import Turn, Upstream, sse_events
from orchard import errors
from support import listening

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "run",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]


def file_records(path: Path) -> list[dict[str, Any]]:
    text = path.read_text()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


async def test_chat_non_streamed_passes_through_maps_the_model_and_is_recorded(
    up: Upstream, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    up.script(Turn(text="hello there"))
    path = tmp_path / "calls.jsonl"
    async with orchard.ModelGateway(up.url, model="up-model", record=path) as gw:
        key = gw.register("sb-1", harness="opencode")
        body = {"model": "harness-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
        async with http.post(
            f"{gw.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        ) as r:
            assert r.status == 200
            reply = await r.json()
        assert reply["choices"][0]["message"]["content"] == "hello there"
        assert up.requests[0]["model"] == "up-model"
        assert up.requests[0]["messages"] == body["messages"]
        assert up.requests[0]["max_tokens"] == 5
        [rec] = gw.calls("sb-1")
    assert file_records(path) == [rec]
    assert key not in path.read_text()
    assert rec["v"] == 1
    assert (rec["sandbox"], rec["harness"], rec["api"], rec["stream"]) == ("sb-1", "opencode", "chat", False)
    assert (rec["model"], rec["upstream_model"]) == ("harness-model", "up-model")
    assert rec["request"] == body
    assert rec["upstream_request"] is None
    assert rec["response"] == reply
    assert (rec["status"], rec["error"], rec["finish_reason"]) == (200, None, "stop")
    assert (rec["prompt_tokens"], rec["completion_tokens"]) == (11, 2)
    assert rec["prompt_token_ids"] == list(range(11))
    assert rec["completion_token_ids"] == [1000, 1001]
    assert [lp["token"] for lp in rec["logprobs"]] == ["hello", " there"]
    assert rec["start"] <= rec["end"]
    assert rec["latency"] >= 0
    assert rec["ttft"] is None


async def test_chat_streamed_chunks_pass_through_as_they_come_and_the_record_assembles_them(
    up: Upstream, http: aiohttp.ClientSession
) -> None:
    up.script(Turn(text="one two three"), Turn(text="four five"))
    async with orchard.ModelGateway(up.url) as gw:
        key = gw.register("sb")
        headers = {"Authorization": f"Bearer {key}"}
        messages = [{"role": "user", "content": "count"}]
        body = {"model": "m", "messages": messages, "stream": True, "stream_options": {"include_usage": True}}
        async with http.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            events = sse_events(await r.read())
        assert events[-1] == (None, "[DONE]")
        chunks = [data for _, data in events[:-1]]
        assert chunks == Turn(text="one two three").chunks("m", include_usage=True)
        # Without include_usage the client gets no usage chunk, but the gateway asks the upstream for one.
        body = {"model": "m", "messages": messages, "stream": True}
        async with http.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers) as r:
            events = sse_events(await r.read())
        assert all(data == "[DONE]" or data["choices"] for _, data in events)
        assert up.requests[1]["stream_options"] == {"include_usage": True}
        first, second = gw.calls("sb")
    assert first["stream"] is True
    assert first["response"]["choices"][0]["message"]["content"] == "one two three"
    assert first["response"]["usage"]["completion_tokens"] == 3
    assert first["completion_token_ids"] == [1000, 1001, 1002]
    assert [lp["token"] for lp in first["logprobs"]] == ["one", " two", " three"]
    assert first["prompt_token_ids"] == list(range(11))
    assert 0 <= first["ttft"] <= first["latency"]
    assert (second["prompt_tokens"], second["completion_tokens"]) == (11, 2)
    assert second["response"]["choices"][0]["message"]["content"] == "four five"


async def test_litellm_client_gets_tool_calls_and_text_through_the_gateway(up: Upstream) -> None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    up.script(Turn(tool_calls=[("call_1", "bash", {"command": "ls -la"})]), Turn(text="done here"))
    async with orchard.ModelGateway(up.url, model="up-model") as gw:
        key = gw.register("sb-lite", harness="mini-swe-agent")
        messages = [{"role": "user", "content": "list files"}]
        first = await litellm.acompletion(
            model="openai/policy", api_base=f"{gw.url}/v1", api_key=key, messages=messages, tools=TOOLS
        )
        [call] = first.choices[0].message.tool_calls
        assert (call.id, call.function.name, json.loads(call.function.arguments)) == (
            "call_1",
            "bash",
            {"command": "ls -la"},
        )
        assert first.choices[0].finish_reason == "tool_calls"
        stream = await litellm.acompletion(
            model="openai/policy", api_base=f"{gw.url}/v1", api_key=key, messages=messages, stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
        assert text == "done here"
        records = gw.calls("sb-lite")
    assert [r["api"] for r in records] == ["chat", "chat"]
    assert records[0]["request"]["tools"][0]["function"]["name"] == "bash"
    assert records[0]["response"]["choices"][0]["message"]["tool_calls"][0]["id"] == "call_1"
    assert records[1]["response"]["choices"][0]["message"]["content"] == "done here"
    assert up.requests[0]["model"] == "up-model"


async def test_the_gateway_listens_on_loopback_only(up: Upstream) -> None:
    async with orchard.ModelGateway(up.url, model="up-model") as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        # 127.0.0.1 as /proc/net/tcp writes it (in the host's byte order): no wildcard, no other interface, no IPv6.
        assert listening(port) == ["0100007F"]
    assert listening(port) == []


async def test_keys_a_missing_or_wrong_or_revoked_key_is_a_401_in_the_apis_shape_and_recorded(
    up: Upstream, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    path = tmp_path / "calls.jsonl"
    async with orchard.ModelGateway(up.url, record=path) as gw:
        key_a = gw.register("a")
        key_b = gw.register("b")
        chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
        msg = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
        async with http.post(f"{gw.url}/v1/chat/completions", json=chat) as r:
            assert r.status == 401
            assert (await r.json())["error"]["code"] == "invalid_api_key"
        async with http.post(f"{gw.url}/v1/messages", json=msg, headers={"x-api-key": key_a + "x"}) as r:
            assert r.status == 401
            assert (await r.json())["error"]["type"] == "authentication_error"
        # Each sandbox's key names it; calls() keeps each sandbox's own, in order.
        for key in (key_a, key_b, key_a):
            async with http.post(f"{gw.url}/v1/messages", json=msg, headers={"x-api-key": key}) as r:
                assert r.status == 200
        gw.unregister("a")
        async with http.post(
            f"{gw.url}/v1/chat/completions", json=chat, headers={"Authorization": f"Bearer {key_a}"}
        ) as r:
            assert r.status == 401
        assert len(up.requests) == 3
        assert [r["status"] for r in gw.calls("a")] == [200, 200]
        assert [r["status"] for r in gw.calls("b")] == [200]
        every = gw.calls()
        assert [(r["sandbox"], r["status"]) for r in every] == [
            (None, 401),
            (None, 401),
            ("a", 200),
            ("b", 200),
            ("a", 200),
            (None, 401),
        ]
        assert every[0]["error"]["type"] == "invalid_api_key"
        assert [r["id"] for r in every] == sorted(r["id"] for r in every)
    text = path.read_text()
    assert key_a not in text
    assert key_b not in text
    assert len(text.splitlines()) == 6


async def test_environment_models_root_and_options(up: Upstream, http: aiohttp.ClientSession, tmp_path: Path) -> None:
    seen: list[dict[str, Any]] = []
    async with orchard.ModelGateway(up.url, model="up-model", record=seen.append) as gw:
        key = gw.register("sb-env", harness="claude")
        env = gw.environment("sb-env", "http://10.0.0.1:9/")
        assert env == {
            "OPENAI_BASE_URL": "http://10.0.0.1:9/v1",
            "OPENAI_API_KEY": key,
            "ANTHROPIC_BASE_URL": "http://10.0.0.1:9",
            "ANTHROPIC_API_KEY": key,
            "ANTHROPIC_MODEL": "up-model",
            "ANTHROPIC_SMALL_FAST_MODEL": "up-model",
            "ORCHARD_MODEL": "up-model",
        }
        assert gw.environment("sb-env")["OPENAI_BASE_URL"] == gw.url + "/v1"
        with pytest.raises(errors.ConfigError, match="register"):
            gw.environment("nope", gw.url)
        with pytest.raises(errors.ConfigError, match="already registered"):
            gw.register("sb-env")
        async with http.head(f"{gw.url}/") as r:
            assert r.status == 200
        async with http.get(f"{gw.url}/v1/models", headers={"Authorization": f"Bearer {key}"}) as r:
            assert [m["id"] for m in (await r.json())["data"]] == ["up-model"]
        async with http.get(f"{gw.url}/v1/models") as r:
            assert r.status == 401
        async with http.post(
            f"{gw.url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}]},
            headers={"Authorization": f"Bearer {key}"},
        ) as r:
            assert r.status == 200
    assert [r["sandbox"] for r in seen] == ["sb-env"]
    with pytest.raises(errors.GatewayClosed):
        _ = gw.url
    # Without model=, the upstream's own list is served and the harness's model name passes through.
    async with orchard.ModelGateway(up.url) as gw:
        key = gw.register("sb")
        assert "ANTHROPIC_MODEL" not in gw.environment("sb")
        async with http.get(f"{gw.url}/v1/models", headers={"Authorization": f"Bearer {key}"}) as r:
            assert [m["id"] for m in (await r.json())["data"]] == ["up-model"]
    with pytest.raises(errors.RecordError) as info:
        orchard.ModelGateway(up.url, record=tmp_path / "missing" / "calls.jsonl")
    assert info.value.path == str(tmp_path / "missing" / "calls.jsonl")
    with pytest.raises(errors.ConfigError, match="upstream"):
        orchard.ModelGateway("127.0.0.1:8000")
    with pytest.raises(errors.ConfigError, match="max_calls"):
        orchard.ModelGateway(up.url, max_calls=-1)


async def test_extra_body_is_added_to_every_upstream_request(up: Upstream, http: aiohttp.ClientSession) -> None:
    async with orchard.ModelGateway(
        up.url, extra_body={"logprobs": True, "return_token_ids": True}, upstream_key="up-key"
    ) as gw:
        key = gw.register("sb")
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
        async with http.post(
            f"{gw.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        ) as r:
            assert r.status == 200
    assert up.requests[0]["logprobs"] is True
    assert up.requests[0]["return_token_ids"] is True
    assert up.headers[0]["Authorization"] == "Bearer up-key"


async def test_model_on_a_sandbox_refuses_what_is_not_an_open_gateway_with_a_model_and_starts_nothing(
    up: Upstream, local_client: orchard.Client, local_root: Path
) -> None:
    with pytest.raises(errors.ConfigError, match="model= takes an orchard.ModelGateway"):
        await local_client.create(model="http://127.0.0.1:8000/v1")
    closed = orchard.ModelGateway(up.url, model="policy")
    with pytest.raises(errors.GatewayClosed):
        await local_client.create(model=closed)
    async with orchard.ModelGateway(up.url) as nameless:
        with pytest.raises(errors.ConfigError, match=r"ModelGateway\(model=\.\.\.\)"):
            await local_client.create(model=nameless)
        assert nameless.calls() == []
    async with orchard.ModelGateway(up.url, model="policy") as gateway:
        # A start that fails revokes the key it was given.
        with pytest.raises(errors.ConfigError, match="no such harness"):
            await local_client.create(model=gateway, tools=["vim"])
        assert not gateway._by_id
    assert not local_client._live
    assert not local_root.exists() or not any(local_root.iterdir())


async def test_a_request_body_over_the_limit_is_a_413_in_the_apis_shape_never_sent_upstream(
    up: Upstream, http: aiohttp.ClientSession
) -> None:
    from orchard.gateway._server import MAX_REQUEST

    async with orchard.ModelGateway(up.url) as gw:
        key = gw.register("a")
        huge = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * MAX_REQUEST + b'"}]}'
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        async with http.post(f"{gw.url}/v1/chat/completions", data=huge, headers=headers) as r:
            assert r.status == 413
            assert (await r.json())["error"]["code"] == "request_too_large"
        assert up.requests == []
        [record] = gw.calls("a")
        assert record["status"] == 413
