"""``orchard demo``: a batch of sandboxes each doing a small fix-the-bug task."""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
import warnings
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any, TextIO, TypeVar

from ._backends import BackendConfig
from ._backends.local import bwrap_available
from ._client import Client
from ._sandbox import Sandbox
from .errors import UnisolatedWarning

T = TypeVar("T")

CALC = """\
def add(a, b):
    return a - b


def mean(values):
    return add(*values[:2]) / 2
"""

TEST = """\
import unittest

from calc import add, mean


class CalcTest(unittest.TestCase):
    def test_add(self):
        self.assertEqual(add(2, 3), 5)

    def test_mean(self):
        self.assertEqual(mean([2, 4]), 3)


if __name__ == "__main__":
    unittest.main()
"""

# -B everywhere: the fix keeps calc.py's size and lands within the second of its
# compiled copy, so a cached .pyc would still look fresh and the rerun would
# test the old code (the classic trap for agents that edit and rerun quickly).
OPS = ("create", "write", "run", "test_fail", "fix", "test_pass", "read", "delete")


class Recorder:
    """Latency samples and failures per operation, and a progress line."""

    def __init__(self, total: int, out: TextIO) -> None:
        self.samples: dict[str, list[float]] = defaultdict(list)
        self.failures: dict[str, int] = defaultdict(int)
        self.errors: list[str] = []
        self.total = total
        self.done = 0
        self.failed = 0
        self._out = out
        self._tty = out.isatty()

    async def time(self, op: str, fn: Callable[[], Awaitable[T]]) -> T:
        """Run and time one operation; a failure is counted and re-raised."""
        t0 = time.perf_counter()
        try:
            result = await fn()
        except BaseException:
            self.failures[op] += 1
            raise
        self.samples[op].append(time.perf_counter() - t0)
        return result

    def finished(self, ok: bool) -> None:
        """One sandbox's task ended."""
        self.done += 1
        self.failed += not ok
        self.progress()

    def progress(self) -> None:
        """Redraw the progress bar (on a terminal) or print every tenth step."""
        width = 30
        filled = width * self.done // max(self.total, 1)
        line = (
            f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} sandboxes"
            f"  ok={self.done - self.failed} failed={self.failed}"
        )
        if self._tty:
            self._out.write("\r" + line)
            if self.done == self.total:
                self._out.write("\n")
        elif self.done == self.total or self.done % max(1, self.total // 10) == 0:
            self._out.write(line + "\n")
        self._out.flush()


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


async def rollout(client: Client, rec: Recorder, image: str) -> None:
    """One sandbox: write code, run it, watch a test fail, fix it, watch it pass."""
    sb: Sandbox = await rec.time("create", lambda: client.create(image))
    try:

        async def write() -> None:
            await sb.write_file("calc.py", CALC)
            await sb.write_file("test_calc.py", TEST)

        await rec.time("write", write)
        r = await rec.time("run", lambda: sb.exec("python3 -B -c 'import calc; print(calc.add(2, 3))'", timeout=60))
        _check(r.exit_code == 0 and r.stdout.strip() == "-1", f"run: {r.exit_code} {r.stdout!r} {r.stderr[-300:]!r}")
        r = await rec.time("test_fail", lambda: sb.exec("python3 -B -m unittest -q test_calc", timeout=60))
        _check(r.exit_code == 1 and "FAILED" in r.stderr, f"the buggy test should fail: {r.stderr[-300:]!r}")
        r = await rec.time("fix", lambda: sb.exec("sed -i 's/return a - b/return a + b/' calc.py", timeout=60))
        _check(r.exit_code == 0, f"fix: {r.stderr!r}")
        r = await rec.time("test_pass", lambda: sb.exec("python3 -B -m unittest -q test_calc", timeout=60))
        _check(r.exit_code == 0 and "OK" in r.stderr, f"the fixed test should pass: {r.stderr[-300:]!r}")
        fixed = await rec.time("read", lambda: sb.read_file("calc.py"))
        _check(b"return a + b" in fixed, "calc.py should hold the fix")
    finally:
        await rec.time("delete", sb.aclose)


def _pct(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def summary(rec: Recorder, wall: float) -> str:
    """The results table: successes, failures and latency percentiles per operation."""
    rows = [f"{'operation':<10} {'ok':>5} {'failed':>6} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'max ms':>8}"]
    for op in OPS:
        values = rec.samples.get(op, [])
        failed = rec.failures.get(op, 0)
        if not values and not failed:
            continue
        if values:
            stats = [_pct(values, 50), _pct(values, 95), _pct(values, 99), max(values)]
            cells = " ".join(f"{v * 1000:>8.1f}" for v in stats)
        else:
            cells = " ".join(f"{'-':>8}" for _ in range(4))
        rows.append(f"{op:<10} {len(values):>5} {failed:>6} {cells}")
    ok = rec.done - rec.failed
    commands = sum(len(rec.samples.get(op, [])) for op in ("run", "test_fail", "fix", "test_pass"))
    rows.append("")
    rows.append(
        f"sandboxes: {ok}/{rec.total} succeeded, {rec.failed} failed in {wall:.2f}s "
        f"({rec.total / wall:.1f} sandboxes/s, {commands / wall:.1f} commands/s)"
    )
    return "\n".join(rows)


def _local_isolation(out: TextIO) -> str:
    """Bubblewrap where it works; otherwise run unisolated, and say so (the demo's code is trusted)."""
    if bwrap_available():
        return "bwrap"
    print(
        "orchard demo: NOTICE: bubblewrap is not available here, so these sandboxes run UNISOLATED on the host "
        "(fine for the demo's own code; install bubblewrap before running untrusted code)",
        file=out,
    )
    return "none"


async def run_demo(
    sandboxes: int = 32,
    *,
    backend: str | BackendConfig = "local",
    image: str = "local",
    out: TextIO = sys.stderr,
    **backend_options: Any,
) -> Recorder:
    """Run the demo and print its progress and summary; returns the recorder."""
    rec = Recorder(sandboxes, out)
    print(f"orchard demo: {sandboxes} sandboxes on the {backend!s} backend, in parallel", file=out)
    chosen = backend == "local" and "isolation" not in backend_options
    if chosen:
        backend_options["isolation"] = _local_isolation(out)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        # The notice above already said it, where the demo chose "none" itself.
        if chosen:
            warnings.simplefilter("ignore", UnisolatedWarning)
        client = await Client(backend, **backend_options).__aenter__()
    async with client:

        async def one() -> None:
            try:
                await rollout(client, rec, image)
            except Exception as exc:  # noqa: BLE001 - every failure is reported below
                rec.errors.append(f"{type(exc).__name__}: {exc}")
                rec.finished(False)
            else:
                rec.finished(True)

        rec.progress()
        await asyncio.gather(*(one() for _ in range(sandboxes)))
    wall = time.perf_counter() - t0
    print(summary(rec, wall), file=out)
    for error in rec.errors[:5]:
        print(f"  failure: {error}", file=out)
    return rec
