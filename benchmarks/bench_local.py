"""Exec round trip, executor memory and start-to-ready on the local backend.

Every figure is measured in this run, next to its baseline in the same run
(without bubblewrap, so that host /proc shows the executor itself):
the exec round trip of ``true`` through the whole library path (client,
HTTP on loopback, executor, process spawn) against a bare
``asyncio.create_subprocess_exec`` of the same command in this process.

    python benchmarks/bench_local.py [--iterations 1000] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any

from _stats import pct

import orchard


def summarize(values: list[float]) -> dict[str, float]:
    return {
        "p50_ms": pct(values, 50) * 1000,
        "p99_ms": pct(values, 99) * 1000,
        "mean_ms": statistics.fmean(values) * 1000,
    }


async def bare_spawn(iterations: int) -> list[float]:
    samples = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(
            "true", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        await proc.communicate()
        samples.append(time.perf_counter() - t0)
    return samples


async def orchard_exec(sb: orchard.Sandbox, iterations: int) -> list[float]:
    samples = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        result = await sb.exec(["true"])
        samples.append(time.perf_counter() - t0)
        assert result.exit_code == 0
    return samples


def rss_kb(pid: int, field: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise LookupError(field)


def pss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    raise LookupError("Pss")


async def main(iterations: int, starts: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as root:
        async with orchard.Client(orchard.LocalConfig(root=root, isolation="none")) as client:
            # Start-to-ready, one sandbox at a time so the figures are not queueing.
            ready = []
            for _ in range(starts):
                async with client.sandbox() as sb:
                    ready.append(sb.timings["executor_ready"])
            async with client.sandbox() as sb:
                # Warm both paths (connection pool, page cache) before measuring.
                await orchard_exec(sb, 50)
                await bare_spawn(50)
                # Interleave the two in blocks so background noise hits both alike.
                bare: list[float] = []
                lib: list[float] = []
                block = max(1, iterations // 10)
                for _ in range(10):
                    bare += await bare_spawn(block)
                    lib += await orchard_exec(sb, block)
                info = await sb.info()
                await asyncio.sleep(1.0)
                idle_rss = rss_kb(info.pid)
                idle_pss = pss_kb(info.pid)
    b, o = summarize(bare), summarize(lib)
    return {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "load_before": os.getloadavg(),
        },
        "iterations": len(lib),
        "exec_true": {
            "bare_spawn": b,
            "orchard_local": o,
            "p50_overhead_ms": o["p50_ms"] - b["p50_ms"],
            "p99_overhead_ms": o["p99_ms"] - b["p99_ms"],
        },
        "executor": {
            "idle_rss_mb": idle_rss / 1024,
            "idle_pss_mb": idle_pss / 1024,
            "start_to_ready_ms": {
                "p50": pct(ready, 50) * 1000 if len(ready) > 1 else ready[0] * 1000,
                "max": max(ready) * 1000,
            },
        },
    }


def report(r: dict[str, Any]) -> str:
    e = r["exec_true"]
    x = r["executor"]
    return "\n".join(
        [
            f"machine: {r['machine']['cpus']} cpus, {r['machine']['platform']}, Python {r['machine']['python']}",
            f"exec round trip of `true`, {r['iterations']} each, interleaved:",
            f"  {'':<34} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8}",
            *(
                f"  {name:<34} {v['p50_ms']:>8.3f} {v['p99_ms']:>8.3f} {v['mean_ms']:>8.3f}"
                for name, v in (
                    ("bare asyncio.create_subprocess_exec", e["bare_spawn"]),
                    ("orchard sb.exec (local backend)", e["orchard_local"]),
                )
            ),
            f"  overhead: p50 {e['p50_overhead_ms']:+.3f} ms (target within 1 ms), p99 {e['p99_overhead_ms']:+.3f} ms",
            f"executor idle RSS: {x['idle_rss_mb']:.1f} MB (PSS {x['idle_pss_mb']:.1f} MB; target RSS <= 30 MB)",
            f"executor start to ready: p50 {x['start_to_ready_ms']['p50']:.0f} ms, "
            f"max {x['start_to_ready_ms']['max']:.0f} ms (target <= 300 ms)",
        ]
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=1000)
    parser.add_argument("--starts", type=int, default=10)
    parser.add_argument("--json", default=None, help="also write the results as JSON here")
    args = parser.parse_args()
    results = asyncio.run(main(args.iterations, args.starts))
    print(report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
