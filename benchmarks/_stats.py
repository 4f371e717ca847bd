"""The one percentile every benchmark reports."""

from __future__ import annotations

import statistics


def pct(values: list[float], q: int) -> float:
    """The q-th percentile (inclusive method); a single value is its own percentile."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]
