"""What ``Sandbox.reverse_forward`` costs: an HTTP server on the client's host reached from inside the sandbox.

    python benchmarks/bench_reverse_forward.py [--backend local|local-bwrap|docker|kubernetes] \
        [--transport direct|port-forward] [--reps 300] [--mib 64] [--json PATH]

One sandbox, one stdlib HTTP server on this host (bench_forward.py's
``SERVER``, in a subprocess of its own, so the tunnel's event loop is not
the server's), the same python3 ``http.client`` program as the client, same
run:

- ``direct``: the client on this host, against the server's own port; the
  baseline.
- ``reverse``: the client inside the sandbox, against the port that
  ``reverse_forward`` opened there: one keep-alive connection (one tunnel
  for all requests), and a new connection per request (each one announced
  by the executor, claimed by a websocket, then connected here).

Latency is p50/p90 of a GET of 100 bytes; throughput is a GET of ``--mib``
MiB (download, towards the sandbox) and a POST of as much (upload). Ratios
are reverse/direct.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_forward import PY_CLIENT, SERVER, config, summary

import orchard

#: A new connection (so a new tunnel) per request.
PY_NEW_CONNECTIONS = r"""
import http.client, sys, time
port, reps = int(sys.argv[1]), int(sys.argv[2])
times = []
for _ in range(reps):
    t0 = time.perf_counter()
    c = http.client.HTTPConnection("127.0.0.1", port); c.request("GET", "/small"); c.getresponse().read(); c.close()
    times.append(time.perf_counter() - t0)
print(" ".join(map(str, times)))
"""


def parse(out: str, mib: int) -> dict[str, Any]:
    lines = out.splitlines()
    result = summary([float(t) for t in lines[0].split()])
    if len(lines) > 1:
        down, up = map(float, lines[1].split())
        result |= {"down_mib_s": mib / down, "up_mib_s": mib / up}
    return result


async def on_host(script: str, *args: object) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, *map(str, args), stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    assert proc.returncode == 0
    return out.decode()


async def in_sandbox(sb: orchard.Sandbox, script: str, *args: object) -> str:
    await sb.write_file("client.py", script)
    r = await sb.exec(["python3", "client.py", *map(str, args)], timeout=600)
    assert r.exit_code == 0, r.stderr
    return r.stdout


async def main(args: argparse.Namespace) -> dict[str, Any]:
    cfg, image = config(args.backend, args.transport)
    with tempfile.TemporaryDirectory() as tmp:
        server = await asyncio.create_subprocess_exec(sys.executable, "-c", SERVER, cwd=tmp)
        try:
            while not os.path.exists(os.path.join(tmp, "port")):
                await asyncio.sleep(0.05)
            port = int(Path(tmp, "port").read_text())
            results: dict[str, Any] = {"backend": args.backend, "reps": args.reps, "mib": args.mib}
            if args.backend == "kubernetes":
                results["transport"] = args.transport
            new_reps = min(args.reps, 100)
            results["direct"] = parse(await on_host(PY_CLIENT, port, args.reps, args.mib), args.mib)
            results["direct_new_connection"] = parse(await on_host(PY_NEW_CONNECTIONS, port, new_reps), 0)
            async with orchard.Client(cfg) as client, client.sandbox(image) as sb:
                async with sb.reverse_forward(0, f"http://127.0.0.1:{port}") as remote:
                    out = await in_sandbox(sb, PY_CLIENT, remote, args.reps, args.mib)
                    results["reverse"] = parse(out, args.mib)
                    out = await in_sandbox(sb, PY_NEW_CONNECTIONS, remote, new_reps)
                    results["reverse_new_connection"] = parse(out, 0)
        finally:
            server.kill()
            await server.wait()
    base, rev = results["direct"], results["reverse"]
    results["ratios"] = {
        "latency_p50": rev["p50_ms"] / base["p50_ms"],
        "new_connection_latency_p50": results["reverse_new_connection"]["p50_ms"]
        / results["direct_new_connection"]["p50_ms"],
        "download": rev["down_mib_s"] / base["down_mib_s"],
        "upload": rev["up_mib_s"] / base["up_mib_s"],
    }
    return results


def show(r: dict[str, Any]) -> None:
    transport = f" ({r['transport']})" if "transport" in r else ""
    print(f"reverse_forward() on {r['backend']}{transport}: GET of 100 B, {r['mib']} MiB")
    print(f"{'':28} {'p50 ms':>8} {'p90 ms':>8} {'down MiB/s':>11} {'up MiB/s':>9}")
    for name in ("direct", "direct_new_connection", "reverse", "reverse_new_connection"):
        row = r[name]
        down, up = row.get("down_mib_s"), row.get("up_mib_s")
        print(
            f"{name:28} {row['p50_ms']:8.2f} {row['p90_ms']:8.2f} "
            f"{'' if down is None else f'{down:11.0f}'} {'' if up is None else f'{up:9.0f}'}"
        )
    ratios = r["ratios"]
    print(
        f"reverse / direct: latency p50 x{ratios['latency_p50']:.1f} "
        f"(new connection x{ratios['new_connection_latency_p50']:.1f}), "
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
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
