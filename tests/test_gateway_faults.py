"""ModelGateway faults and limits: each answered in the API's own error shape, recorded, nothing hanging."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

import orchard
from gateway_support import Turn, Upstream, free_port, sse_events
from orchard import errors
from support import eventually

CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
MSG = {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "x"}]}
RESP = {"model": "m", "input": "x"}


async def post(http: aiohttp.ClientSession, url: str, key: str, body: Any) -> tuple[int, dict[str, Any], Any]:
    kwargs: dict[str, Any] = {"data": body} if isinstance(body, bytes) else {"json": body}
    async with http.post(url, headers={"Authorization": f"Bearer {key}"}, **kwargs) as r:
        return r.status, dict(r.headers), await r.json()


async def test_max_calls_cuts_off_a_runaway_client_without_calling_upstream(
    up: Upstream, http: aiohttp.ClientSession
) -> None:
    async with orchard.ModelGateway(up.url, max_calls=3) as gw:
        key = gw.register("runaway")
        other = gw.register("other")
        statuses = []
        for _ in range(50):  # a harness retrying forever
            status, headers, body = await post(http, f"{gw.url}/v1/chat/completions", key, CHAT)
            statuses.append(status)
            if status != 200:
                break
        assert statuses == [200, 200, 200, 429]
        assert body["error"]["type"] == body["error"]["code"] == "insufficient_quota"
        assert "max_calls=3" in body["error"]["message"]
        assert headers["x-should-retry"] == "false"
        status, _, body = await post(http, f"{gw.url}/v1/messages", key, MSG)
        assert (status, body["type"], body["error"]["type"]) == (429, "error", "rate_limit_error")
        status, _, body = await post(http, f"{gw.url}/v1/responses", key, RESP)
        assert (status, body["error"]["code"]) == (429, "insufficient_quota")
        # The OpenAI SDK honours x-should-retry: one refused request, no retries.
        from openai import AsyncOpenAI, RateLimitError

        client = AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=5)
        with pytest.raises(RateLimitError):
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        await client.close()
        # The limit is per sandbox.
        status, _, _ = await post(http, f"{gw.url}/v1/chat/completions", other, CHAT)
        assert status == 200
        records = gw.calls("runaway")
    assert len(up.requests) == 4
    assert [r["status"] for r in records] == [200, 200, 200, 429, 429, 429, 429]
    assert records[3]["error"]["type"] == "insufficient_quota"
    assert records[4]["api"] == "messages"
    assert records[3]["request"] == CHAT


async def test_max_tokens_refuses_calls_once_the_sandbox_used_its_tokens(
    up: Upstream, http: aiohttp.ClientSession
) -> None:
    up.script(Turn(text="a b"), Turn(text="c d"))  # 11 prompt + 2 completion tokens each
    async with orchard.ModelGateway(up.url, max_tokens=20) as gw:
        key = gw.register("sb")
        first = await post(http, f"{gw.url}/v1/chat/completions", key, CHAT)
        second = await post(http, f"{gw.url}/v1/messages", key, MSG)
        third = await post(http, f"{gw.url}/v1/messages", key, MSG)
        records = gw.calls("sb")
    assert (first[0], second[0], third[0]) == (200, 200, 429)
    assert third[2]["error"]["type"] == "rate_limit_error"
    assert "used 26 tokens" in third[2]["error"]["message"]
    assert len(up.requests) == 2
    assert records[2]["error"]["type"] == "insufficient_quota"


async def test_upstream_down_is_a_502_in_each_apis_shape_and_recorded(http: aiohttp.ClientSession) -> None:
    async with orchard.ModelGateway(f"http://127.0.0.1:{free_port()}/v1") as gw:
        key = gw.register("sb")
        chat = await post(http, f"{gw.url}/v1/chat/completions", key, CHAT | {"stream": True})
        msg = await post(http, f"{gw.url}/v1/messages", key, MSG)
        resp = await post(http, f"{gw.url}/v1/responses", key, RESP | {"stream": True})
        records = gw.calls("sb")
    assert chat[0] == msg[0] == resp[0] == 502
    assert chat[2]["error"]["code"] == "upstream_unreachable"
    assert chat[2]["error"]["type"] == "server_error"
    assert (msg[2]["type"], msg[2]["error"]["type"]) == ("error", "api_error")
    assert "unreachable" in msg[2]["error"]["message"]
    assert resp[2]["error"]["code"] == "upstream_unreachable"
    assert [(r["api"], r["status"], r["error"]["type"]) for r in records] == [
        ("chat", 502, "upstream_unreachable"),
        ("messages", 502, "upstream_unreachable"),
        ("responses", 502, "upstream_unreachable"),
    ]
    assert records[0]["response"] == chat[2]


async def test_slow_upstream_is_a_504_and_its_request_is_closed(up: Upstream, http: aiohttp.ClientSession) -> None:
    up.script(Turn(text="late", stall=3600), Turn(text="one two three four", stall_after=2))
    async with orchard.ModelGateway(up.url, timeout=0.5) as gw:
        key = gw.register("sb")
        status, _, body = await post(http, f"{gw.url}/v1/messages", key, MSG)
        assert (status, body["error"]["type"]) == (504, "api_error")
        assert "timeout=0.5s" in body["error"]["message"]
        await eventually(up.hung_up.is_set, what="the upstream request closed")
        up.hung_up.clear()
        # Streamed: the stream began, then the upstream stopped sending: an error event ends it.
        async with http.post(f"{gw.url}/v1/messages", json=MSG | {"stream": True}, headers={"x-api-key": key}) as r:
            assert r.status == 200
            events = sse_events(await r.read())
        await eventually(up.hung_up.is_set, what="the upstream stream closed")
        records = gw.calls("sb")
    assert events[-1][0] == "error"
    assert events[-1][1]["error"]["type"] == "api_error"
    assert "content_block_delta" in [name for name, _ in events]  # what came before the stall got through
    assert [(r["status"], r["error"]["type"]) for r in records] == [
        (504, "upstream_timeout"),
        (200, "upstream_timeout"),
    ]
    assert records[1]["response"]["content"] == [{"type": "text", "text": "one"}]


async def test_malformed_requests_are_400s_in_each_apis_shape_and_recorded(
    up: Upstream, http: aiohttp.ClientSession
) -> None:
    async with orchard.ModelGateway(up.url) as gw:
        key = gw.register("sb")
        bad_json = await post(http, f"{gw.url}/v1/chat/completions", key, b'{"model": "m", "messages": [')
        no_messages = await post(http, f"{gw.url}/v1/messages", key, {"model": "m", "max_tokens": 5})
        bad_role = await post(
            http, f"{gw.url}/v1/messages", key, MSG | {"messages": [{"role": "tool", "content": "x"}]}
        )
        no_input = await post(http, f"{gw.url}/v1/responses", key, {"model": "m"})
        no_model = await post(http, f"{gw.url}/v1/chat/completions", key, {"messages": []})
        not_object = await post(http, f"{gw.url}/v1/responses", key, [1, 2])
        records = gw.calls("sb")
    assert bad_json[0] == 400
    assert bad_json[2]["error"]["type"] == "invalid_request_error"
    assert "not valid JSON" in bad_json[2]["error"]["message"]
    assert no_messages[0] == bad_role[0] == 400
    assert no_messages[2]["error"] == {
        "type": "invalid_request_error",
        "message": "invalid request: messages: field required (a list)",
    }
    assert "messages.0.role" in bad_role[2]["error"]["message"]
    assert (no_input[0], no_input[2]["error"]["type"]) == (400, "invalid_request_error")
    assert "input" in no_input[2]["error"]["message"]
    assert no_model[0] == not_object[0] == 400
    assert up.requests == []
    assert [r["status"] for r in records] == [400] * 6
    assert records[0]["request"] == '{"model": "m", "messages": ['
    assert records[1]["request"] == {"model": "m", "max_tokens": 5}


async def test_upstream_errors_and_broken_streams_reach_the_harness_in_its_shape(
    up: Upstream, http: aiohttp.ClientSession
) -> None:
    up.script(
        Turn(status=400, error="This model's maximum context length is 32768 tokens."),
        Turn(text="one two three", cut_after=2),
        Turn(text="one two three", cut_after=2),
    )
    async with orchard.ModelGateway(up.url) as gw:
        key = gw.register("sb")
        status, _, body = await post(http, f"{gw.url}/v1/messages", key, MSG)
        assert (status, body["error"]["type"]) == (400, "invalid_request_error")
        assert body["error"]["message"] == "upstream: This model's maximum context length is 32768 tokens."
        async with http.post(
            f"{gw.url}/v1/responses", json=RESP | {"stream": True}, headers={"Authorization": f"Bearer {key}"}
        ) as r:
            events = sse_events(await r.read())
        async with http.post(
            f"{gw.url}/v1/chat/completions", json=CHAT | {"stream": True}, headers={"Authorization": f"Bearer {key}"}
        ) as r:
            chunks = sse_events(await r.read())
        records = gw.calls("sb")
    assert events[-1][0] == "response.failed"
    assert events[-1][1]["response"]["status"] == "failed"
    assert events[-1][1]["response"]["error"]["code"] == "upstream_error"
    assert chunks[-1][1]["error"]["code"] == "upstream_error"
    assert [c for _, c in chunks[:-1]][1]["choices"][0]["delta"]["content"] == "one"
    assert [(r["status"], r["error"]["type"]) for r in records] == [
        (400, "upstream_error"),
        (200, "upstream_error"),
        (200, "upstream_error"),
    ]


async def test_client_disconnecting_mid_stream_closes_the_upstream_request_and_is_recorded(up: Upstream) -> None:
    up.script(Turn(text="one two three four", stall_after=3))
    async with orchard.ModelGateway(up.url) as gw:
        key = gw.register("sb")
        async with aiohttp.ClientSession() as http:
            r = await http.post(
                f"{gw.url}/v1/chat/completions",
                json=CHAT | {"stream": True},
                headers={"Authorization": f"Bearer {key}"},
            )
            first = await r.content.readuntil(b"\n\n")
            assert b'"role"' in first
            r.close()  # the harness (or its sandbox) goes away mid-stream
        await eventually(up.hung_up.is_set, what="the upstream request closed")
        await eventually(lambda: len(gw.calls("sb")) == 1, what="the call recorded")
        [rec] = gw.calls("sb")
    assert rec["error"]["type"] == "client_disconnected"
    assert rec["status"] == 200
    assert rec["response"] is None
    assert rec["prompt_token_ids"] == list(range(11))


async def test_unregistering_a_sandbox_cancels_its_running_calls(up: Upstream, http: aiohttp.ClientSession) -> None:
    up.script(Turn(text="never", stall=3600))
    async with orchard.ModelGateway(up.url) as gw:
        key = gw.register("sb")
        call = asyncio.ensure_future(post(http, f"{gw.url}/v1/chat/completions", key, CHAT))
        await eventually(lambda: len(up.requests) == 1, what="the call reached the upstream")
        gw.unregister("sb")
        with pytest.raises(aiohttp.ClientError):
            await call
        await eventually(up.hung_up.is_set, what="the upstream request closed")
        [rec] = gw.calls("sb")
    assert rec["error"]["type"] == "sandbox_unregistered"


async def test_a_record_function_that_fails_is_raised_when_the_gateway_closes(
    up: Upstream, http: aiohttp.ClientSession
) -> None:
    def broken(record: dict[str, Any]) -> None:
        raise OSError(28, "No space left on device")

    gw = orchard.ModelGateway(up.url, record=broken)
    await gw.start()
    key = gw.register("sb")
    status, _, _ = await post(http, f"{gw.url}/v1/chat/completions", key, CHAT)
    assert status == 200  # the call itself was answered
    with pytest.raises(errors.RecordError, match="No space left"):
        await gw.aclose()
    assert len(gw.calls("sb")) == 1
