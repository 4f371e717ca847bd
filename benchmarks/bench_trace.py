"""What ``trace=`` adds to an exec, on the local backend, with and without it in the same run.

One sandbox runs the same command with its trace on and off in turn (on,
off, off, on, ...), so both sides see the same executor, cache and machine
load. Three measures:

- ``e2e``: the exec's whole latency; printed, the p50 of each side and the
  p50 of the difference within each pair. An exec takes milliseconds, and
  on a busy machine these move by a tenth of a millisecond from run to run.
- ``client``: the time the exec spends in the client outside its request
  (the exec's latency minus the time inside ``ExecutorClient.call``,
  measured around it in the same call), p50 of each side: what trace= adds
  per exec, in the real path, without the executor's and the network's
  noise. The overhead figure is the difference of these two p50s.
- ``recording``: the record's own work alone over many repetitions
  (describing the call, the result's head and tail, encoding, the one
  ``write(2)``), for the result of a real exec of the command.

Commands: ``true``, ``echo hello`` and 64 KiB of text (the record keeps its
first and last 2 KiB).

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


async def paired(
    sb: orchard.Sandbox, recorder: _trace.Recorder, cmd: list[str], n: int
) -> dict[str, dict[str, list[float]]]:
    """Latency and client-side time of each exec, with the trace on and off in turn."""
    rpc = sb._rpc
    call = rpc.call
    inside = [0.0]

    async def timed_call(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return await call(*args, **kwargs)
        finally:
            inside[0] = time.perf_counter() - t0

    rpc.call = timed_call  # type: ignore[method-assign]
    samples: dict[str, dict[str, list[float]]] = {side: {"e2e": [], "client": []} for side in ("trace", "plain")}
    for _ in range(50):  # warm the connection and the executor
        await sb.exec(cmd)
    try:
        for i in range(n):
            for traced in (True, False) if i % 2 == 0 else (False, True):
                sb._trace = recorder if traced else None
                t0 = time.perf_counter()
                await sb.exec(cmd)
                total = time.perf_counter() - t0
                side = samples["trace" if traced else "plain"]
                side["e2e"].append(total)
                side["client"].append(total - inside[0])
    finally:
        sb._trace = recorder
        rpc.call = call  # type: ignore[method-assign]
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
                f"{'command':8} {'e2e p50 plain':>14} {'trace':>9} {'pair diff':>10}"
                f" {'client p50 plain':>17} {'trace':>9} {'overhead':>9} {'recording p50':>14}"
            )
            for name, cmd in COMMANDS.items():
                got = await paired(sb, recorder, cmd, args.iterations)
                result = await sb.exec(cmd)
                rec = recording(recorder, cmd, result, 10 * args.iterations)
                diffs = [t - p for t, p in zip(got["trace"]["e2e"], got["plain"]["e2e"], strict=True)]
                row = {
                    "e2e_plain_p50_ms": pct(got["plain"]["e2e"], 50) * 1000,
                    "e2e_trace_p50_ms": pct(got["trace"]["e2e"], 50) * 1000,
                    "e2e_pair_diff_p50_ms": pct(diffs, 50) * 1000,
                    "client_plain_p50_ms": pct(got["plain"]["client"], 50) * 1000,
                    "client_trace_p50_ms": pct(got["trace"]["client"], 50) * 1000,
                    "recording_p50_ms": pct(rec, 50) * 1000,
                    "recording_p99_ms": pct(rec, 99) * 1000,
                }
                row["overhead_p50_ms"] = row["client_trace_p50_ms"] - row["client_plain_p50_ms"]
                out[name] = row
                print(
                    f"{name:8} {row['e2e_plain_p50_ms']:12.3f}ms {row['e2e_trace_p50_ms']:7.3f}ms"
                    f" {row['e2e_pair_diff_p50_ms']:+8.3f}ms {row['client_plain_p50_ms']:15.4f}ms"
                    f" {row['client_trace_p50_ms']:7.4f}ms {row['overhead_p50_ms']:+7.4f}ms"
                    f" {row['recording_p50_ms']:12.4f}ms"
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
