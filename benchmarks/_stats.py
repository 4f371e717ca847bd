"""The one percentile every benchmark reports."""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Awaitable, Callable
from typing import Any


def pct(values: list[float], q: int) -> float:
    """The q-th percentile (inclusive method); a single value is its own percentile."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


async def per_backend(
    backends: list[str],
    namespace: str,
    measure: Callable[[str], Awaitable[dict[str, Any]]],
    show: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """``measure`` each backend in turn (kubernetes in ``namespace``), shown as it ends; with the machine's figures."""
    load_before = os.getloadavg()
    out = []
    for backend in backends:
        if backend == "kubernetes":
            from bench_rollout import ensure_namespace  # this script's directory is on sys.path

            await ensure_namespace(namespace)
        r = await measure(backend)
        show(r)
        out.append(r)
    machine = {"cpus": os.cpu_count(), "python": sys.version.split()[0], "load_before": load_before}
    return {"runs": out, "machine": machine | {"load_after": os.getloadavg()}}
