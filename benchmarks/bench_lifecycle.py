"""The published lifecycle protocol: N sandboxes, each create, 4 commands, delete.

Each sandbox runs ``python -c 'import sys; print(sys.version)'``, ``ls /``
and ``cat /etc/os-release | head -1`` twice, all N in parallel from one
Client. Reports success rate, wall time, commands/s, per-phase percentiles
and what was left behind.

    python benchmarks/bench_lifecycle.py --backend local -n 1 -n 10 -n 50 [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections import defaultdict
from typing import Any

import orchard

COMMANDS = (
    "python3 -c 'import sys; print(sys.version)'",
    "ls /",
    "cat /etc/os-release | head -1",
    "cat /etc/os-release | head -1",
)


def pct(values: list[float], q: int) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


async def one(client: orchard.Client, image: str, phases: dict[str, list[float]]) -> bool:
    t0 = time.perf_counter()
    sb = await client.create(image)
    phases["create"].append(time.perf_counter() - t0)
    try:
        for cmd in COMMANDS:
            t = time.perf_counter()
            r = await sb.exec(cmd, timeout=120)
            phases["command"].append(time.perf_counter() - t)
            if r.exit_code != 0:
                return False
    finally:
        t = time.perf_counter()
        await sb.aclose()
        phases["delete"].append(time.perf_counter() - t)
    return True


async def run(n: int, backend: str, image: str, options: dict[str, Any]) -> dict[str, Any]:
    phases: dict[str, list[float]] = defaultdict(list)
    async with orchard.Client(backend, **options) as client:
        t0 = time.perf_counter()
        outcomes = await asyncio.gather(*(one(client, image, phases) for _ in range(n)), return_exceptions=True)
        wall = time.perf_counter() - t0
    ok = sum(1 for o in outcomes if o is True)
    errors = [repr(o) for o in outcomes if isinstance(o, BaseException)][:3]
    return {
        "n": n,
        "backend": backend,
        "succeeded": ok,
        "success_rate": ok / n,
        "wall_s": wall,
        "commands_per_s": len(phases["command"]) / wall,
        "phases_ms": {
            name: {"p50": pct(v, 50) * 1000, "p95": pct(v, 95) * 1000, "p99": pct(v, 99) * 1000, "max": max(v) * 1000}
            for name, v in phases.items()
            if v
        },
        "errors": errors,
    }


def leftovers_local(root: str) -> int:
    return len(os.listdir(root)) if os.path.isdir(root) else 0


async def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    results = []
    for n in args.n:
        options: dict[str, Any] = {}
        if args.backend == "local":
            options["root"] = args.root
        r = await run(n, args.backend, args.image, options)
        if args.backend == "local":
            r["left_over"] = leftovers_local(args.root)
        results.append(r)
        p = r["phases_ms"]
        print(
            f"{args.backend:<10} N={n:<5} ok {r['succeeded']}/{n}  wall {r['wall_s']:.2f}s  "
            f"{r['commands_per_s']:.1f} cmd/s  create p50 {p['create']['p50']:.0f} ms  "
            f"command p50 {p['command']['p50']:.1f} ms p99 {p['command']['p99']:.1f} ms  "
            f"delete p50 {p['delete']['p50']:.0f} ms  left over {r.get('left_over', '?')}"
        )
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="local")
    parser.add_argument("--image", default="local")
    parser.add_argument("-n", type=int, action="append", help="sandboxes (repeat for several runs)")
    parser.add_argument("--root", default=f"/tmp/orchard-bench-{os.getpid()}")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    args.n = args.n or [1, 10, 50]
    out = asyncio.run(main(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
