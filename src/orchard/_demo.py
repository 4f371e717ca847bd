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
from ._console import Progress, table
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
COLUMNS = ("operation", "ok", "failed", "p50 ms", "p95 ms", "p99 ms", "max ms")
#: The image ``orchard demo`` runs on the container backends: Debian with python3 (scripts/docker-setup.sh).
DEMO_IMAGE = "orchard-test/swe:latest"


class Recorder:
    """Latency samples and failures per operation, and the progress."""

    def __init__(self, total: int, out: TextIO, *, quiet: bool = False) -> None:
        self.samples: dict[str, list[float]] = defaultdict(list)
        self.failures: dict[str, int] = defaultdict(int)
        self.errors: list[str] = []
        self.total = total
        self.progress = Progress(total, out, quiet=quiet)

    @property
    def done(self) -> int:
        """Sandboxes whose task ended."""
        return self.progress.done

    @property
    def failed(self) -> int:
        """Sandboxes whose task failed."""
        return self.progress.failed

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
        self.progress.advance(ok)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


async def rollout(client: Client, rec: Recorder, image: str, sb: Sandbox | None = None) -> None:
    """One sandbox (``sb``, or a new one): write code, run it, watch a test fail, fix it, watch it pass."""
    if sb is None:
        sb = await rec.time("create", lambda: client.create(image))
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


def summary(rec: Recorder, wall: float, out: TextIO) -> None:
    """Print the results: successes, failures and latency percentiles per operation, then the totals."""
    rows: list[dict[str, Any]] = []
    for op in OPS:
        values = rec.samples.get(op, [])
        failed = rec.failures.get(op, 0)
        if not values and not failed:
            continue
        stats = [_pct(values, 50), _pct(values, 95), _pct(values, 99), max(values)] if values else []
        cells = [f"{v * 1000:.1f}" for v in stats] or ["-"] * 4
        rows.append(dict(zip(COLUMNS, [op, len(values), failed, *cells], strict=True)))
    table(rows, COLUMNS, out)
    ok = rec.done - rec.failed
    commands = sum(len(rec.samples.get(op, [])) for op in ("run", "test_fail", "fix", "test_pass"))
    print(
        f"\nsandboxes: {ok}/{rec.total} succeeded, {rec.failed} failed in {wall:.2f}s "
        f"({rec.total / wall:.1f} sandboxes/s, {commands / wall:.1f} commands/s)",
        file=out,
    )


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
    image: str | None = None,
    out: TextIO = sys.stderr,
    report: TextIO = sys.stdout,
    quiet: bool = False,
    **backend_options: Any,
) -> Recorder:
    """Run the demo: progress and notices to ``out``, the results table to ``report``; returns the recorder.

    ``image`` defaults to ``DEMO_IMAGE`` on the container backends (the local backend has none). The first
    sandbox starts alone: if it cannot (a missing image, a backend that is not there), its error is raised
    once, rather than reported for every sandbox.
    """
    name = backend if isinstance(backend, str) else str(type(backend).__struct_config__.tag)
    image = image or ("local" if name == "local" else DEMO_IMAGE)
    if not quiet:
        where = "" if name == "local" else f" ({image})"
        print(f"orchard demo: {sandboxes} sandboxes on the {name} backend{where}, in parallel", file=out)
    chosen = name == "local" and isinstance(backend, str) and "isolation" not in backend_options
    if chosen:
        backend_options["isolation"] = _local_isolation(out)
    rec = Recorder(sandboxes, out, quiet=quiet)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        # The notice above already said it, where the demo chose "none" itself.
        if chosen:
            warnings.simplefilter("ignore", UnisolatedWarning)
        client = await Client(backend, **backend_options).__aenter__()
    try:
        async with client:
            first = await rec.time("create", lambda: client.create(image))

            async def one(sb: Sandbox | None = None) -> None:
                try:
                    await rollout(client, rec, image, sb)
                except Exception as exc:  # noqa: BLE001 - every failure is reported below
                    rec.errors.append(f"{type(exc).__name__}: {exc}")
                    rec.finished(False)
                else:
                    rec.finished(True)

            await asyncio.gather(one(first), *(one() for _ in range(sandboxes - 1)))
    finally:
        rec.progress.close()
    wall = time.perf_counter() - t0
    summary(rec, wall, report)
    for error in rec.errors[:5]:
        print(f"  failure: {error}", file=report)
    return rec
