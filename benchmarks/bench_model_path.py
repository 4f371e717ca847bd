"""A harness's model call from inside a sandbox (reverse tunnel + gateway) against calling the upstream directly.

    python benchmarks/bench_model_path.py [--backend docker|kubernetes] [--reps 300] [--rounds 4] [--json PATH]

The upstream stand-in of bench_gateway.py (its own process, answers at once)
serves Chat Completions on 127.0.0.1. The same small client (CLIENT below:
Python's http.client, one keep-alive connection, as a harness's SDK keeps
one) makes ``reps`` non-streamed calls and ``reps`` streamed ones, timing
each call and each stream's first token:

- ``direct``: on this host, straight to the upstream (the floor: what a
  harness outside any sandbox would pay).
- ``sandbox``: inside a sandbox of the SWE image with ``model=gateway`` and
  the network closed: to 127.0.0.1:4319, the reverse tunnel's end, through
  the executor's connection to the gateway in this process, which records
  the call and forwards it to the upstream.

And the two parts apart, in the same rounds: ``tunnel`` (inside the sandbox,
through a reverse tunnel straight to the upstream, no gateway) and
``gateway`` (on this host, through the gateway, no tunnel).

Rounds alternate (direct, sandbox, sandbox, direct, ...) so load falls on
both alike; the figures are p50 over all rounds, and their differences.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _stats import pct
from bench_gateway import UPSTREAM

import orchard

IMAGE = "orchard-test/swe:latest"

#: argv: base URL, key, reps; prints {"whole": [...], "first": [...]} in seconds.
CLIENT = r"""
import http.client, json, sys, time, urllib.parse
base, key, reps = sys.argv[1], sys.argv[2], int(sys.argv[3])
u = urllib.parse.urlsplit(base)
conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
headers = {"Content-Type": "application/json", "Authorization": "Bearer " + key}
msgs = [{"role": "user", "content": "x" * 3000}]
def call(stream):
    body = json.dumps({"model": "m", "messages": msgs, "stream": stream})
    t0 = time.perf_counter()
    conn.request("POST", u.path + "/chat/completions", body, headers)
    r = conn.getresponse()
    if r.status != 200:
        raise SystemExit(f"HTTP {r.status}: {r.read()[:300]!r}")
    if not stream:
        r.read()
        return time.perf_counter() - t0, None
    first = None
    while True:
        line = r.readline()
        if not line:
            break
        if first is None and b'Hello' in line:  # the first token the stand-in sends
            first = time.perf_counter() - t0
    return time.perf_counter() - t0, first
for _ in range(20):
    call(False); call(True)
whole = [call(False)[0] for _ in range(reps)]
first = [call(True)[1] for _ in range(reps)]
print(json.dumps({"whole": whole, "first": first}))
"""


def summary(direct: list[float], sandbox: list[float]) -> dict[str, float]:
    d, s = pct(direct, 50) * 1e3, pct(sandbox, 50) * 1e3
    return {"direct_p50_ms": d, "sandbox_p50_ms": s, "overhead_p50_ms": s - d, "ratio": s / d}


async def main(backend: str, reps: int, rounds: int) -> dict[str, Any]:
    proc = subprocess.Popen([sys.executable, "-c", UPSTREAM], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        upstream = f"http://127.0.0.1:{proc.stdout.readline().strip()}/v1"  # it prints its port once serving
        config: orchard.DockerConfig | orchard.KubernetesConfig = (
            orchard.DockerConfig()
            if backend == "docker"
            else orchard.KubernetesConfig(
                kubeconfig=os.environ.get("KUBECONFIG", "/var/lib/orchard-devcluster/kubeconfig")
            )
        )
        sides = ("direct", "sandbox", "tunnel", "gateway")
        samples: dict[str, dict[str, list[float]]] = {side: {"whole": [], "first": []} for side in sides}
        with tempfile.TemporaryDirectory() as tmp:
            async with (
                orchard.ModelGateway(upstream, model="m", record=str(Path(tmp) / "calls.jsonl")) as gateway,
                orchard.Client(config) as client,
                client.sandbox(IMAGE, model=gateway) as sb,
                sb.reverse_forward(4320, upstream.removesuffix("/v1")) as tunnel_port,
            ):
                await sb.write_file("/tmp/client.py", CLIENT)
                key = (await sb.exec(["printenv", "ORCHARD_MODEL_KEY"])).stdout.strip()
                where = {
                    "direct": ("host", upstream),
                    "gateway": ("host", f"{gateway.url}/v1"),
                    "sandbox": ("sandbox", "http://127.0.0.1:4319/v1"),
                    "tunnel": ("sandbox", f"http://127.0.0.1:{tunnel_port}/v1"),
                }
                for i in range(rounds):
                    for side in sides if i % 2 == 0 else tuple(reversed(sides)):
                        place, url = where[side]
                        if place == "host":
                            out = await asyncio.to_thread(
                                subprocess.run,
                                [sys.executable, "-c", CLIENT, url, key, str(reps)],
                                capture_output=True,
                                text=True,
                                check=True,
                            )
                            got = json.loads(out.stdout)
                        else:
                            r = await sb.exec(["python3", "/tmp/client.py", url, key, str(reps)], timeout=600)
                            assert r.exit_code == 0, r.stderr
                            got = json.loads(r.stdout)
                        for k in ("whole", "first"):
                            samples[side][k] += got[k]
                recorded = len(gateway.calls(sb))
    finally:
        proc.terminate()
        proc.wait()
    return {
        "backend": backend,
        "reps": reps,
        "rounds": rounds,
        "calls_recorded": recorded,
        "non_streamed": summary(samples["direct"]["whole"], samples["sandbox"]["whole"]),
        "first_token": summary(samples["direct"]["first"], samples["sandbox"]["first"]),
        "parts_p50_ms": {
            side: {k: pct(v, 50) * 1e3 for k, v in samples[side].items()} for side in ("tunnel", "gateway")
        },
        "python": sys.version.split()[0],
    }


def show(r: dict[str, Any]) -> None:
    print(f"model call from a {r['backend']} sandbox (tunnel + gateway) vs direct, {r['reps']} x {r['rounds']} rounds")
    for name, target in (("non_streamed", "under 2 ms"), ("first_token", "within 1 ms")):
        s = r[name]
        print(
            f"  {name:13} direct p50 {s['direct_p50_ms']:6.2f} ms  sandbox p50 {s['sandbox_p50_ms']:6.2f} ms  "
            f"+{s['overhead_p50_ms']:5.2f} ms ({s['ratio']:.2f}x; target {target})"
        )
    for side, p in r["parts_p50_ms"].items():
        print(f"  {side} alone: non-streamed p50 {p['whole']:.2f} ms, first token p50 {p['first']:.2f} ms")
    print(f"  calls recorded by the gateway: {r['calls_recorded']}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="docker", choices=["docker", "kubernetes"])
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results = asyncio.run(main(args.backend, args.reps, args.rounds))
    show(results)
    if args.json is not None:
        old = json.loads(args.json.read_text()) if args.json.exists() else {}
        runs = [r for r in old.get("runs", []) if r.get("backend") != args.backend]
        args.json.write_text(json.dumps({"runs": [*runs, results]}, indent=2) + "\n")
