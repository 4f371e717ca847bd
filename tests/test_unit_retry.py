"""The pauses between /healthz polls while a sandbox starts."""

from __future__ import annotations

import itertools

import pytest

from orchard._retry import poll_delays

pytestmark = pytest.mark.unit


def test_polls_fast_at_first_then_back_off_to_the_cap() -> None:
    delays = list(itertools.islice(poll_delays(), 400))
    elapsed = list(itertools.accumulate(delays))
    fast = [d for d, t in zip(delays, elapsed, strict=True) if t <= 0.5 + 1e-9]
    assert len(fast) == 50
    assert set(fast) == {0.01}  # a quick executor is seen within 10 ms
    assert delays[50:54] == [0.02, 0.04, 0.08, 0.1]  # then doubling, from the first poll after 0.5 s
    assert delays == sorted(delays)  # never faster again once it backs off
    assert max(delays) == 0.1
    assert delays[-1] == 0.1
    # After the first half second, ten polls a second instead of a hundred.
    assert sum(1 for t in elapsed if 10.5 < t <= 20.5) == pytest.approx(100, abs=1)
