"""A harness's model call from inside a sandbox (reverse tunnel + gateway) against calling the upstream directly.

    python benchmarks/bench_model_path.py [--backend docker|kubernetes] [--reps 300] [--rounds 4] [--json PATH]

The upstream stand-in of bench_gateway.py (its own process, answers at once)
serves Chat Completions on 127.0.0.1. The same small client (CLIENT below:
Python's http.client, one keep-alive connection, as a harness's SDK keeps
one) makes ``reps`` non-streamed calls back to back, ``reps`` streamed ones
(each stream's first token timed) and ``reps`` non-streamed calls each after
a 20 ms pause:

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

Why the pause: the stand-in pauses 20 ms between a stream's first token and
the rest, so every process on the path is idle before the next streamed
call, and waking an idle process costs far more on a virtual machine than
waking one that just ran. Calls made back to back never pay that; a harness,
whose calls come after a tool ran or a model thought, mostly does. The
non-streamed calls after a pause of the same length show how much of the
first token's cost is that wakeup, not streaming.
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

#: argv: base URL, key, reps; prints {"whole": [...], "first": [...], "paused": [...]} in seconds.
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
def paused():
    time.sleep(0.02)  # as long as the stand-in's pause within a stream
    return call(False)[0]
print(json.dumps({"whole": whole, "first": first, "paused": [paused() for _ in range(reps)]}))
"""


def summary(direct: list[float], sandbox: list[float]) -> dict[str, float]:
    d, s = pct(direct, 50) * 1e3, pct(sandbox, 50) * 1e3
    return {"direct_p50_ms": d, "sandbox_p50_ms": s, "overhead_p50_ms": s - d, "ratio": s / d}


async def main(backend: str, reps: int, rounds: int) -> dict[str, Any]:
    loadavg_before = os.getloadavg()[0]
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
        samples: dict[str, dict[str, list[float]]] = {side: {"whole": [], "first": [], "paused": []} for side in sides}
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
                        for k in samples[side]:
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
        "non_streamed_after_pause": summary(samples["direct"]["paused"], samples["sandbox"]["paused"]),
        "parts_p50_ms": {
            side: {k: pct(v, 50) * 1e3 for k, v in samples[side].items()} for side in ("tunnel", "gateway")
        },
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "loadavg": [loadavg_before, os.getloadavg()[0]],  # 1-minute, before and after: other work on the machine
    }


def show(r: dict[str, Any]) -> None:
    print(f"model call from a {r['backend']} sandbox (tunnel + gateway) vs direct, {r['reps']} x {r['rounds']} rounds")
    for name, target in (
        ("non_streamed", "; target under 2 ms"),
        ("first_token", "; target within 1 ms"),
        ("non_streamed_after_pause", ""),
    ):
        s = r[name]
        print(
            f"  {name:24} direct p50 {s['direct_p50_ms']:6.2f} ms  sandbox p50 {s['sandbox_p50_ms']:6.2f} ms  "
            f"+{s['overhead_p50_ms']:5.2f} ms ({s['ratio']:.2f}x{target})"
        )
    for side, p in r["parts_p50_ms"].items():
        print(
            f"  {side} alone: non-streamed p50 {p['whole']:.2f} ms, first token p50 {p['first']:.2f} ms, "
            f"non-streamed after a pause p50 {p['paused']:.2f} ms"
        )
    print(
        f"  calls recorded by the gateway: {r['calls_recorded']}; load average {r['loadavg'][0]:.1f} to {r['loadavg'][1]:.1f}"
    )


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
