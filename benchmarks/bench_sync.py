"""Overhead of orchard.sync per exec against the async call, on the local backend.

Both are measured in this run on the same sandbox, in interleaved rounds so
that load on the machine falls on both alike: the async ``exec`` timed on
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


async def async_round(sb: orchard.Sandbox, n: int) -> list[float]:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        await sb.exec(["true"])
        samples.append(time.perf_counter() - t0)
    return samples


def sync_round(sb: orchard.sync.Sandbox, n: int) -> list[float]:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        sb.exec(["true"])
        samples.append(time.perf_counter() - t0)
    return samples


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
    parser.add_argument("--iterations", type=int, default=2000, help="execs per path (in rounds of 50)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    rounds, per_round = max(1, args.iterations // 50), 50
    samples: dict[str, list[float]] = {"async": [], "sync": [], "hop": []}
    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings():
        warnings.simplefilter("ignore", orchard.errors.UnisolatedWarning)  # the host's own /proc, as bench_local
        config = orchard.LocalConfig(root=root, isolation="none")
        with orchard.sync.Client(config) as client, client.sandbox() as sb:
            sync_round(sb, 50)  # warm up both paths and the connection
            for _ in range(rounds):
                samples["async"] += sb._loop.run(async_round(sb._target, per_round))
                samples["sync"] += sync_round(sb, per_round)
                samples["hop"] += hop_round(sb, per_round)
    p50 = {k: pct(v, 50) * 1000 for k, v in samples.items()}
    result: dict[str, Any] = {
        "backend": "local (isolation=none)",
        "iterations": rounds * per_round,
        "async_exec_p50_ms": p50["async"],
        "sync_exec_p50_ms": p50["sync"],
        "overhead_p50_ms": p50["sync"] - p50["async"],
        "overhead_ratio": p50["sync"] / p50["async"],
        "hop_p50_ms": p50["hop"],
        "hop_p99_ms": pct(samples["hop"], 99) * 1000,
        "python": sys.version.split()[0],
        "machine": platform.machine(),
    }
    print(f"exec ['true'], local backend, {result['iterations']} each, interleaved rounds")
    print(f"  async exec      p50 {p50['async']:8.3f} ms")
    print(f"  orchard.sync    p50 {p50['sync']:8.3f} ms  ({result['overhead_ratio']:.3f}x the async call)")
    print(f"  overhead        p50 {result['overhead_p50_ms']:8.3f} ms per exec  (target: under 0.2 ms)")
    print(f"  bare hop        p50 {p50['hop']:8.3f} ms, p99 {result['hop_p99_ms']:.3f} ms (a no-op coroutine)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
