"""Overhead of orchard.sync per exec against the async call, on the local backend.

Both are measured in this run on the same sandbox, alternately so that
load on the machine falls on both alike: the async ``exec`` timed on
orchard.sync's own loop thread (the async library as it is), and the sync
``exec`` timed in the calling thread (the hop to the loop thread and back
added). Also the bare hop: a coroutine that does nothing, run through the
facade.

    python benchmarks/bench_sync.py [--iterations 2000] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
import warnings
from typing import Any

from _stats import pct

import orchard
import orchard.sync


async def async_exec(sb: orchard.Sandbox) -> float:
    t0 = time.perf_counter()
    await sb.exec(["true"])
    return time.perf_counter() - t0


def sync_exec(sb: orchard.sync.Sandbox) -> float:
    t0 = time.perf_counter()
    sb.exec(["true"])
    return time.perf_counter() - t0


async def nothing() -> None:
    return None


def hop_round(sb: orchard.sync.Sandbox, n: int) -> list[float]:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        sb._loop.run(nothing())
        samples.append(time.perf_counter() - t0)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=2000, help="execs per path")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    samples: dict[str, list[float]] = {"async": [], "sync": [], "hop": []}
    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings():
        warnings.simplefilter("ignore", orchard.errors.UnisolatedWarning)  # the host's own /proc, as bench_local
        config = orchard.LocalConfig(root=root, isolation="none")
        with orchard.sync.Client(config) as client, client.sandbox() as sb:
            for _ in range(50):  # warm up both paths and the connection
                sync_exec(sb)
            for _ in range(args.iterations):
                # Alternated, so the pair sees the same load: the async one timed on the loop thread.
                samples["async"].append(sb._loop.run(async_exec(sb._target)))
                samples["sync"].append(sync_exec(sb))
            samples["hop"] = hop_round(sb, args.iterations)
    p50 = {k: pct(v, 50) * 1000 for k, v in samples.items()}
    result: dict[str, Any] = {
        "backend": "local (isolation=none)",
        "iterations": args.iterations,
        "async_exec_p50_ms": p50["async"],
        "sync_exec_p50_ms": p50["sync"],
        "overhead_p50_ms": p50["sync"] - p50["async"],
        "overhead_ratio": p50["sync"] / p50["async"],
        "paired_overhead_p50_ms": pct([b - a for a, b in zip(samples["async"], samples["sync"], strict=True)], 50)
        * 1000,
        "hop_p50_ms": p50["hop"],
        "hop_p99_ms": pct(samples["hop"], 99) * 1000,
        "python": sys.version.split()[0],
        "machine": platform.machine(),
    }
    print(f"exec ['true'], local backend, {result['iterations']} each, alternated")
    print(f"  async exec      p50 {p50['async']:8.3f} ms")
    print(f"  orchard.sync    p50 {p50['sync']:8.3f} ms  ({result['overhead_ratio']:.3f}x the async call)")
    print(f"  overhead        p50 {result['overhead_p50_ms']:8.3f} ms per exec  (target: under 0.2 ms)")
    print(f"  paired          p50 {result['paired_overhead_p50_ms']:8.3f} ms (sync minus async, alternate pairs)")
    print(f"  bare hop        p50 {p50['hop']:8.3f} ms, p99 {result['hop_p99_ms']:.3f} ms (a no-op coroutine)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
