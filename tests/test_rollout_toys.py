"""The toy tasks rolled out on the local backend: 6 tasks x 8 attempts of the scripted policy, swebench-graded.

The local backend has no images: each attempt's sandbox (bubblewrap, the
default isolation) gets the task's local_dir copied in and committed (the
same base_commit as in the toys image), the agent's and then a fresh one for
the reward. The pass rates are those the policy's seeded draws give in
advance.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import orchard
import orchard.rollout
from orchard import tasks

pytestmark = pytest.mark.executor

ROOT = Path(__file__).resolve().parents[1]
TOYS = tasks.load(ROOT / "examples" / "tasks" / "swe-mini.jsonl")
N = 8
#: Attempts in flight: two executor processes each at most (the agent's sandbox, then the reward's).
CONCURRENCY = 8


@pytest.mark.timeout(600)
async def test_toy_rollout_pass_rates_are_the_policy_s_draws(local_root: Path, tmp_path: Path) -> None:
    policy = tasks.ScriptedPolicy(p_right=0.5, seed=7)
    async with orchard.Client(orchard.LocalConfig(root=str(local_root), isolation="bwrap")) as client:
        t0 = time.monotonic()
        results = await orchard.rollout.run(
            client,
            TOYS,
            agent=policy,
            reward=tasks.reward,
            n=N,
            concurrency=CONCURRENCY,
            out=tmp_path / "run",
            progress=False,
        )
        elapsed = time.monotonic() - t0
        # The local backend's listing, while the client is open: one directory per sandbox that exists.
        assert not local_root.exists() or os.listdir(local_root) == []
    assert results.counts == {"ok": len(TOYS) * N, "agent_error": 0, "infra_error": 0, "reward_error": 0, "skipped": 0}
    for r in results.records:
        task = next(t for t in TOYS if t.id == r["task"])
        assert (r["tries"], r["reason"]) == (1, None), r
        assert r["solved"] is policy.chooses_right(task, r["attempt"]), (r["task"], r["attempt"], r["log_tail"])
    expected = {t.id: sum(policy.chooses_right(t, a) for a in range(N)) / N for t in TOYS}
    assert results.pass_rate == expected
    print(f"local: {len(TOYS)} toy tasks x {N} attempts, concurrency {CONCURRENCY}: {elapsed:.1f} s; {expected}")
