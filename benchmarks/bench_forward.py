"""What ``Sandbox.forward`` costs: an HTTP server in the sandbox reached through it, against from inside.

    python benchmarks/bench_forward.py [--backend local|local-bwrap|docker|kubernetes] \
        [--transport direct|port-forward] [--reps 300] [--mib 64] [--json PATH]

One sandbox, one stdlib HTTP server in it (``SERVER`` below), same run:

- ``inside``: a client inside the sandbox, on one keep-alive connection to
  127.0.0.1: curl where the sandbox has it (one curl process for all the
  requests, its own ``time_total`` per request), and python3's http.client
  (the Debian task image has no curl); the baseline.
- ``forward``: aiohttp on the host against the URL ``forward()`` gives, on
  one keep-alive local connection (one tunnel for all requests), and with a
  new connection per request (a new tunnel each time: a websocket handshake
  with the executor, then its connection to the port).

Latency is p50/p90 of a GET of 100 bytes; throughput is a GET of ``--mib``
MiB (download) and a POST of as much (upload). Ratios are forward/inside.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import time
from pathlib import Path
from typing import Any

import aiohttp
from _stats import pct

import orchard

SERVER = r"""
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
BLOCK = b"x" * (1 << 20)
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    def log_message(self, *a): pass
    def do_GET(self):
        if self.path.startswith("/big/"):
            mib = int(self.path[5:])
            self.send_response(200); self.send_header("Content-Length", str(mib << 20)); self.end_headers()
            for _ in range(mib): self.wfile.write(BLOCK)
        else:
            self.send_response(200); self.send_header("Content-Length", "100"); self.end_headers()
            self.wfile.write(b"y" * 100)
    def do_POST(self):
        left = int(self.headers["Content-Length"])
        while left: left -= len(self.rfile.read(min(left, 1 << 20)))
        self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers(); self.wfile.write(b"ok")
s = ThreadingHTTPServer(("127.0.0.1", 0), H)
open("port.tmp", "w").write(str(s.server_port)); __import__("os").rename("port.tmp", "port")
s.serve_forever()
"""

PY_CLIENT = r"""
import http.client, sys, time
port, reps, mib = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
c = http.client.HTTPConnection("127.0.0.1", port)
times = []
for _ in range(reps):
    t0 = time.perf_counter(); c.request("GET", "/small"); c.getresponse().read(); times.append(time.perf_counter() - t0)
t0 = time.perf_counter(); r = c.request("GET", f"/big/{mib}"); resp = c.getresponse()
while resp.read(1 << 20): pass
down = time.perf_counter() - t0
body = b"z" * (mib << 20)
t0 = time.perf_counter(); c.request("POST", "/sink", body=body); c.getresponse().read(); up = time.perf_counter() - t0
print(" ".join(map(str, times))); print(down, up)
"""


def summary(times: list[float]) -> dict[str, float]:
    return {"p50_ms": pct(times, 50) * 1e3, "p90_ms": pct(times, 90) * 1e3}


async def inside_curl(sb: orchard.Sandbox, port: int, reps: int, mib: int) -> dict[str, Any] | None:
    if (await sb.exec("command -v curl")).exit_code != 0:
        return None
    url = f"http://127.0.0.1:{port}"
    small = " ".join([f"-o /dev/null {shlex.quote(url + '/small')}"] * reps)
    r = await sb.exec(f"curl -s -w '%{{time_total}}\\n' {small}", timeout=600)
    times = [float(t) for t in r.stdout.split()]
    r = await sb.exec(f"curl -s -o /dev/null -w '%{{time_total}}' {url}/big/{mib}", timeout=600)
    down = float(r.stdout)
    await sb.exec(f"head -c {mib << 20} /dev/zero > blob", timeout=600)
    r = await sb.exec(
        f"curl -s -o /dev/null -w '%{{time_total}}' -H 'Expect:' --data-binary @blob {url}/sink", timeout=600
    )
    up = float(r.stdout)
    await sb.remove("blob")
    return summary(times) | {"down_mib_s": mib / down, "up_mib_s": mib / up}


async def inside_python(sb: orchard.Sandbox, port: int, reps: int, mib: int) -> dict[str, Any]:
    await sb.write_file("client.py", PY_CLIENT)
    r = await sb.exec(["python3", "client.py", str(port), str(reps), str(mib)], timeout=600)
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.splitlines()
    down, up = map(float, lines[1].split())
    return summary([float(t) for t in lines[0].split()]) | {"down_mib_s": mib / down, "up_mib_s": mib / up}


async def through_forward(url: str, reps: int, mib: int, new_conn: bool) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=1, force_close=new_conn)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as http:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            async with http.get(f"{url}/small") as resp:
                await resp.read()
            times.append(time.perf_counter() - t0)
        out: dict[str, Any] = summary(times)
        if new_conn:
            return out
        t0 = time.perf_counter()
        async with http.get(f"{url}/big/{mib}") as resp:
            async for _ in resp.content.iter_chunked(1 << 20):
                pass
        out["down_mib_s"] = mib / (time.perf_counter() - t0)
        body = b"z" * (mib << 20)
        t0 = time.perf_counter()
        async with http.post(f"{url}/sink", data=body) as resp:
            await resp.read()
        out["up_mib_s"] = mib / (time.perf_counter() - t0)
        return out


def config(backend: str, transport: str) -> tuple[Any, str]:
    if backend in ("local", "local-bwrap"):
        return orchard.LocalConfig(isolation="none" if backend == "local" else "bwrap"), "local"
    if backend == "docker":
        return orchard.DockerConfig(), "orchard-test/swe:latest"
    kubeconfig = os.environ.get("KUBECONFIG", "/var/lib/orchard-devcluster/kubeconfig")
    return orchard.KubernetesConfig(kubeconfig=kubeconfig, transport=transport), "orchard-test/swe:latest"


async def main(args: argparse.Namespace) -> dict[str, Any]:
    cfg, image = config(args.backend, args.transport)
    async with orchard.Client(cfg) as client, client.sandbox(image) as sb:
        await sb.write_file("server.py", SERVER)
        await sb.start_process(["python3", "server.py"])
        while not await sb.exists("port"):
            await asyncio.sleep(0.05)
        port = int(await sb.read_file("port"))
        results: dict[str, Any] = {"backend": args.backend, "reps": args.reps, "mib": args.mib}
        if args.backend == "kubernetes":
            results["transport"] = args.transport
        results["inside_curl"] = await inside_curl(sb, port, args.reps, args.mib)
        results["inside_python"] = await inside_python(sb, port, args.reps, args.mib)
        async with sb.forward(port) as url:
            results["forward"] = await through_forward(url, args.reps, args.mib, new_conn=False)
            results["forward_new_connection"] = await through_forward(url, min(args.reps, 100), 0, new_conn=True)
        info = []
        for _ in range(min(args.reps, 100)):
            t0 = time.perf_counter()
            await sb.info()
            info.append(time.perf_counter() - t0)
        results["executor_request"] = summary(info)
    base = results["inside_curl"] or results["inside_python"]
    fwd = results["forward"]
    results["ratios"] = {
        "latency_p50": fwd["p50_ms"] / base["p50_ms"],
        "download": fwd["down_mib_s"] / base["down_mib_s"],
        "upload": fwd["up_mib_s"] / base["up_mib_s"],
    }
    return results


def show(r: dict[str, Any]) -> None:
    print(
        f"forward() on {r['backend']}{' (' + r['transport'] + ')' if 'transport' in r else ''}: GET of 100 B, {r['mib']} MiB"
    )
    print(f"{'':28} {'p50 ms':>8} {'p90 ms':>8} {'down MiB/s':>11} {'up MiB/s':>9}")
    for name in ("inside_curl", "inside_python", "forward", "forward_new_connection", "executor_request"):
        row = r.get(name)
        if row is None:
            continue
        down, up = row.get("down_mib_s"), row.get("up_mib_s")
        print(
            f"{name:28} {row['p50_ms']:8.2f} {row['p90_ms']:8.2f} "
            f"{'' if down is None else f'{down:11.0f}'} {'' if up is None else f'{up:9.0f}'}"
        )
    ratios = r["ratios"]
    print(
        f"forward / inside: latency p50 x{ratios['latency_p50']:.1f}, "
        f"download x{ratios['download']:.2f}, upload x{ratios['upload']:.2f}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="local", choices=["local", "local-bwrap", "docker", "kubernetes"])
    parser.add_argument("--transport", default="direct", choices=["direct", "port-forward"])
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results = asyncio.run(main(args))
    show(results)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
