"""The rollout schedule (pure logic): the adaptive rule, the budget, and what a resume restores."""

from __future__ import annotations

import random

import pytest

from orchard.rollout import settle_after
from orchard.rollout._plan import Plan

pytestmark = pytest.mark.unit


def test_settle_after_follows_the_uniform_prior_rule() -> None:
    # The chance that a group agreeing on its first k would have been mixed is (n - k) / (n + 1).
    assert [settle_after(8, t) for t in (0.5, 0.25, 0.1, 0.01)] == [4, 6, 8, 8]
    assert settle_after(4, 0.5) == 2
    assert settle_after(2, 0.5) == 2  # never on one outcome
    assert settle_after(1, 0.5) == 1
    for n in range(2, 40):
        k = settle_after(n, 0.5)
        assert (n - k) / (n + 1) < 0.5 <= (n - k + 1) / (n + 1) or k == 2


@pytest.mark.parametrize("seed", range(30))
def test_the_budget_is_never_exceeded_and_every_attempt_is_handed_out_once(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 8)
    rates = [rng.choice([0.0, 1.0, 0.5, rng.random()]) for _ in range(rng.randint(1, 6))]
    ids = [f"t{i}" for i in range(len(rates))]
    plan = Plan(ids, n, settle_after(n, 0.5) if seed % 3 else None)
    running: list[tuple[str, int]] = []
    handed: list[tuple[str, int]] = []
    while True:
        nxt = plan.start() if len(running) < rng.randint(1, 4) else None
        if nxt is not None:
            running.append(nxt)
            handed.append(nxt)
            continue
        if not running:
            break
        tid, a = running.pop(rng.randrange(len(running)))
        outcome = None if rng.random() < 0.1 else rng.random() < rates[ids.index(tid)]
        plan.finish(tid, a, outcome)
    skipped = [(t, a) for t, a, _ in plan.take_skips()]
    assert len(handed) == len(set(handed))
    assert not set(handed) & set(skipped)
    assert len(handed) <= len(ids) * n
    assert plan.used() == len(handed)
    if plan.settle is None:
        assert sorted(handed) == sorted((t, a) for t in ids for a in range(n))
        assert not skipped
    else:
        # Every base attempt either ran or was skipped; extras only where both outcomes were seen.
        base = {(t, a) for t, a in handed if a < n} | set(skipped)
        assert base == {(t, a) for t in ids for a in range(n)}
        for t, a in handed:
            if a >= n:
                assert plan.groups[t].mixed()
        # What was skipped came back as budget, used up while a mixed group was left to take it.
        if any(g.mixed() for g in plan.groups.values()):
            assert len(handed) == len(ids) * n


def test_a_resume_restores_outcomes_skips_and_extras_but_reruns_failures() -> None:
    plan = Plan(["a", "b"], 4, 2)
    plan.restore("a", 0, "ok", True)
    plan.restore("a", 1, "agent_error", False)
    plan.restore("b", 0, "ok", True)
    plan.restore("b", 1, "ok", True)
    plan.restore("b", 2, "infra_error", None)  # run again
    plan.restore("a", 4, "ok", False)  # an extra attempt of the earlier run
    plan.restore("gone", 0, "ok", True)  # a task no longer in the run
    plan.restored()
    assert sorted((t, a) for t, a, _ in plan.take_skips()) == [("b", 2), ("b", 3)]
    handed = []
    while (nxt := plan.start()) is not None:
        handed.append(nxt)
    # a: its base attempts 2 and 3, then the extras the budget (8) leaves: 5 run, 2 skipped, so one (a, 5).
    assert handed == [("a", 2), ("a", 3), ("a", 5)]
    assert plan.used() == 8


def test_adaptive_puts_off_the_base_attempts_of_groups_already_mixed() -> None:
    plan = Plan(["a", "b", "c"], 4, 4)
    first = [plan.start() for _ in range(3)]
    assert first == [("a", 0), ("b", 0), ("c", 0)]
    for tid, a in first:
        plan.finish(tid, a, tid != "c")
    assert [plan.start() for _ in range(3)] == [("a", 1), ("b", 1), ("c", 1)]
    plan.finish("a", 1, False)  # a is mixed now: its attempts 2 and 3 wait for b's and c's
    plan.finish("b", 1, True)
    plan.finish("c", 1, False)
    order = []
    while (nxt := plan.start()) is not None:
        order.append(nxt)
        plan.finish(*nxt, True)
    assert order == [("b", 2), ("c", 2), ("b", 3), ("c", 3), ("a", 2), ("a", 3)]
    # Without adaptive the order stays attempt-major.
    plain = Plan(["a", "b"], 2, None)
    plain.finish(*plain.start(), True)  # type: ignore[misc]
    assert plain.start() == ("b", 0)


def mixed_groups_after_each_attempt(settle: int | None, rates: dict[str, float], n: int) -> list[int]:
    """Run a plan one attempt at a time, outcomes drawn per (task, attempt) with the same seed in both modes."""
    plan = Plan(rates, n, settle)
    mixed_after = []
    while (nxt := plan.start()) is not None:
        tid, a = nxt
        plan.finish(tid, a, random.Random(f"{tid}:{a}").random() < rates[tid])
        mixed_after.append(sum(g.mixed() for g in plan.groups.values()))
    return mixed_after


@pytest.mark.parametrize("seed", range(5))
def test_adaptive_reaches_as_many_mixed_groups_in_fewer_attempts(seed: int) -> None:
    # A pool as RL's often are: 40% never solved, 20% always, 40% in between.
    rng = random.Random(seed)
    rates = {f"t{i:02d}": (0.0, 0.0, 1.0, rng.uniform(0.1, 0.9), rng.uniform(0.1, 0.9))[i % 5] for i in range(30)}
    plain = mixed_groups_after_each_attempt(None, rates, 8)
    adaptive = mixed_groups_after_each_attempt(settle_after(8, 0.5), rates, 8)
    assert len(plain) == len(adaptive) == 240
    target = min(plain[-1], adaptive[-1])
    assert target > 0
    assert adaptive.index(target) < plain.index(target)
