"""What ``orchard.ModelGateway`` adds to a model call, against calling the upstream directly, same run.

An upstream stand-in (``UPSTREAM`` below: aiohttp in its own process, a fixed
Chat Completion with logprobs and token ids, as vLLM sends when asked)
answers at once, so the figures are the gateway's own cost. The client
(aiohttp, one keep-alive session) and the gateway run in this process, as in
a rollout; the gateway records every call to a JSON-lines file. Calls go
direct and through the gateway in turn (direct, gateway, gateway, direct,
...), so both sides see the same machine load.

- ``chat``: a non-streamed Chat Completions call (a 3.4 KB request with one
  tool, like mini-swe-agent's); p50 of each side, the p50 overhead
  (gateway p50 - direct p50) and the ratio.
- ``chat_stream``: time to first token of a streamed call (to the first
  chunk carrying text); the upstream sends its first token at once and the
  rest 20 ms later.
- ``messages_stream``: the same upstream stream through the Anthropic
  Messages translation (first ``content_block_delta``), against the direct
  Chat Completions stream.

    python benchmarks/bench_gateway.py [--reps 1000] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any

import aiohttp
from _stats import pct

import orchard

UPSTREAM = r"""
import asyncio, json, sys
from aiohttp import web
tokens = ["Hello", " there", ",", " world", "."]
def lp(t): return {"token": t, "logprob": -0.25, "bytes": list(t.encode()), "top_logprobs": []}
completion = json.dumps({
    "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(tokens)}, "finish_reason": "stop",
                 "logprobs": {"content": [lp(t) for t in tokens]}, "token_ids": list(range(5))}],
    "prompt_token_ids": list(range(900)),
    "usage": {"prompt_tokens": 900, "completion_tokens": 5, "total_tokens": 905}}).encode()
def chunk(delta, **kw):
    c = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
         "choices": [{"index": 0, "delta": delta, "finish_reason": None, **kw}]}
    return b"data: " + json.dumps(c).encode() + b"\n\n"
async def chat(request):
    body = await request.json()
    if not body.get("stream"):
        return web.Response(body=completion, content_type="application/json")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(chunk({"role": "assistant", "content": ""}) + chunk({"content": tokens[0]}))
    await asyncio.sleep(0.02)
    for t in tokens[1:]:
        await resp.write(chunk({"content": t}))
    await resp.write(chunk({}, finish_reason="stop"))
    usage = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
             "usage": {"prompt_tokens": 900, "completion_tokens": 5, "total_tokens": 905}}
    await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
    await resp.write_eof()
    return resp
app = web.Application()
app.router.add_post("/v1/chat/completions", chat)
async def main():
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    print(runner.addresses[0][1], flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""

TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Execute a bash command. " + "Describe the command and what it does. " * 60,
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
}
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant that can interact with a computer."},
    {"role": "user", "content": "Please solve this issue: the tests in tests/test_x.py fail. " * 8},
]


async def first_token(http: aiohttp.ClientSession, url: str, headers: dict[str, str], body: dict[str, Any]) -> float:
    """Seconds from sending a streamed request to the first chunk carrying text, then read to the end."""
    t0 = time.perf_counter()
    ttft = None
    async with http.post(url, json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        buffer = b""
        async for data in r.content.iter_any():
            buffer += data
            if ttft is None and (
                b'"content_block_delta"' in buffer or b'"content": "Hello"' in buffer or b'"content":"Hello"' in buffer
            ):
                ttft = time.perf_counter() - t0
    assert ttft is not None, buffer[:500]
    return ttft


async def whole(http: aiohttp.ClientSession, url: str, headers: dict[str, str], body: dict[str, Any]) -> float:
    t0 = time.perf_counter()
    async with http.post(url, json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        await r.read()
    return time.perf_counter() - t0


def summary(direct: list[float], gateway: list[float]) -> dict[str, float]:
    d, g = pct(direct, 50), pct(gateway, 50)
    return {
        "direct_p50_ms": d * 1e3,
        "gateway_p50_ms": g * 1e3,
        "direct_p90_ms": pct(direct, 90) * 1e3,
        "gateway_p90_ms": pct(gateway, 90) * 1e3,
        "overhead_p50_ms": (g - d) * 1e3,
        "ratio_p50": g / d,
    }


async def run(reps: int, out: dict[str, Any]) -> None:
    proc = subprocess.Popen([sys.executable, "-c", UPSTREAM], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        upstream = f"http://127.0.0.1:{port}/v1"
        with tempfile.TemporaryDirectory() as tmp:
            record = os.path.join(tmp, "calls.jsonl")
            async with (
                orchard.ModelGateway(upstream, model="m", record=record) as gw,
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http,
            ):
                key = gw.register("bench")
                auth = {"Authorization": f"Bearer {key}"}
                chat = {"model": "m", "messages": MESSAGES, "tools": [TOOL], "max_tokens": 256}
                out["request_bytes"] = len(json.dumps(chat))
                cases: dict[str, tuple[Any, str, dict[str, Any]]] = {
                    "chat": (whole, "/v1/chat/completions", chat),
                    "chat_stream": (first_token, "/v1/chat/completions", chat | {"stream": True}),
                    "messages_stream": (
                        first_token,
                        "/v1/messages",
                        {
                            "model": "m",
                            "max_tokens": 256,
                            "messages": MESSAGES[1:],
                            "system": MESSAGES[0]["content"],
                            "stream": True,
                        },
                    ),
                }
                for name, (measure, path, body) in cases.items():
                    n = reps if measure is whole else max(reps // 10, 50)
                    direct_body = chat | {"stream": True} if name == "messages_stream" else body
                    for _ in range(min(n, 50)):  # warm both paths
                        await measure(http, upstream + "/chat/completions", {}, direct_body)
                        await measure(http, gw.url + path, auth, body)
                    direct: list[float] = []
                    gateway: list[float] = []
                    for i in range(n):
                        for via in (False, True) if i % 2 == 0 else (True, False):
                            if via:
                                gateway.append(await measure(http, gw.url + path, auth, body))
                            else:
                                direct.append(await measure(http, upstream + "/chat/completions", {}, direct_body))
                    out[name] = summary(direct, gateway) | {"calls": n}
                    s = out[name]
                    what = "per call" if measure is whole else "time to first token"
                    print(
                        f"{name:16s} {what:20s} direct p50 {s['direct_p50_ms']:.3f} ms, gateway p50 {s['gateway_p50_ms']:.3f} ms: "
                        f"+{s['overhead_p50_ms']:.3f} ms ({s['ratio_p50']:.2f}x), n={n}"
                    )
                out["records"] = len(gw.calls("bench"))
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=1000, help="non-streamed calls per side (streamed: a tenth)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    out: dict[str, Any] = {"python": sys.version.split()[0], "machine": platform.machine(), "cpus": os.cpu_count()}
    out["loadavg_before"] = os.getloadavg()[0]
    asyncio.run(run(args.reps, out))
    out["loadavg_after"] = os.getloadavg()[0]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
