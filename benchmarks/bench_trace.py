"""What ``trace=`` adds to an exec, on the local backend, with and without it in the same run.

Two measures, both printed:

- ``paired``: one sandbox, execs of the same command with its trace on and
  off in turn (on, off, off, on, ...), so both see the same executor, cache
  and machine load. Printed: the p50 of each side, the difference of the
  two (``overhead``), and the p50 of the difference within each pair (less
  sensitive to drift). An exec takes milliseconds, so on a busy machine
  these are noisy at the tenth of a millisecond.
- ``recording``: the work trace= adds to each exec and nothing else, timed
  alone over many repetitions: describing the call, the result's fields
  (head and tail of its output), encoding the record and its one
  ``write(2)`` to the trace file, for the results of real execs (``true``,
  ``echo hello``, 64 KiB of text output).

    python benchmarks/bench_trace.py [--iterations 2000] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
import warnings
from typing import Any

from _stats import pct

import orchard
from orchard import _trace

#: 64 KiB of text: the record keeps its first and last 2 KiB.
COMMANDS = {"true": ["true"], "echo": ["echo", "hello"], "64kib": ["sh", "-c", "yes hello | head -c 65536"]}


async def paired(sb: orchard.Sandbox, recorder: _trace.Recorder, cmd: list[str], n: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {"trace": [], "plain": []}
    for _ in range(50):  # warm the connection and the executor
        await sb.exec(cmd)
    for i in range(n):
        # on, off, off, on: neither side is always first after the other.
        for traced in (True, False) if i % 2 == 0 else (False, True):
            sb._trace = recorder if traced else None
            t0 = time.perf_counter()
            await sb.exec(cmd)
            samples["trace" if traced else "plain"].append(time.perf_counter() - t0)
    sb._trace = recorder
    return samples


def recording(recorder: _trace.Recorder, cmd: list[str], result: orchard.ExecResult, n: int) -> list[float]:
    """The trace work of one exec, as ``traced`` does it around the call."""
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        fields, done = _trace.describe_exec(None, cmd, cwd=None, env={"A": "1"}, timeout=30)
        start, t1 = time.time(), time.perf_counter()
        assert done is not None
        fields.update(done(result))
        recorder.emit("exec", start, time.perf_counter() - t1, fields, None)
        samples.append(time.perf_counter() - t0)
    return samples


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=2000, help="execs per side, per command")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    warnings.simplefilter("ignore", orchard.errors.UnisolatedWarning)
    out: dict[str, Any] = {"python": sys.version.split()[0], "machine": platform.machine(), "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.jsonl")
        config = orchard.LocalConfig(root=os.path.join(tmp, "sandboxes"), isolation="none")
        async with orchard.Client(config) as client, client.sandbox(trace=path) as sb:
            recorder = sb._trace
            assert recorder is not None
            print(
                f"{'command':8} {'p50 plain':>11} {'p50 trace':>11} {'overhead':>10} {'pair p50':>10}"
                f" {'recording p50':>14} {'p99':>9}"
            )
            for name, cmd in COMMANDS.items():
                pair = paired(sb, recorder, cmd, args.iterations)
                got = await pair
                result = await sb.exec(cmd)
                rec = recording(recorder, cmd, result, 10 * args.iterations)
                row = {
                    "plain_p50_ms": pct(got["plain"], 50) * 1000,
                    "trace_p50_ms": pct(got["trace"], 50) * 1000,
                    "recording_p50_ms": pct(rec, 50) * 1000,
                    "recording_p99_ms": pct(rec, 99) * 1000,
                }
                row["overhead_p50_ms"] = row["trace_p50_ms"] - row["plain_p50_ms"]
                diffs = [t - p for t, p in zip(got["trace"], got["plain"], strict=True)]
                row["pair_diff_p50_ms"] = pct(diffs, 50) * 1000
                out[name] = row
                print(
                    f"{name:8} {row['plain_p50_ms']:9.3f}ms {row['trace_p50_ms']:9.3f}ms "
                    f"{row['overhead_p50_ms']:+8.3f}ms {row['pair_diff_p50_ms']:+8.3f}ms"
                    f" {row['recording_p50_ms']:12.4f}ms {row['recording_p99_ms']:7.4f}ms"
                )
            lines = sum(1 for _ in open(path))
            out["trace_lines"] = lines
            out["trace_bytes"] = os.path.getsize(path)
    print(
        f"trace file: {out['trace_lines']} records, {out['trace_bytes'] / out['trace_lines']:.0f} bytes each on average"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    asyncio.run(main())
