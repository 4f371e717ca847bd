"""The toy tasks rolled out on docker: 6 tasks x 8 attempts of the scripted policy, graded by swebench's code.

Each attempt is a container from orchard-test/toys (the agent's, at the
task's base_commit) and a fresh one for the reward; the pass rates are those
the policy's seeded draws give in advance.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from docker_support import containers, engine

import orchard
import orchard.rollout
from orchard import tasks

pytestmark = pytest.mark.docker

ROOT = Path(__file__).resolve().parents[2]
TOYS = tasks.load(ROOT / "examples" / "tasks" / "swe-mini.jsonl")
IMAGE = "orchard-test/toys:latest"
N = 8
#: Attempts in flight: two containers each at most (the agent's, then the reward's), on a 2-core machine.
CONCURRENCY = 16


@pytest.mark.timeout(600)
async def test_toy_rollout_pass_rates_are_the_policy_s_draws(
    client: orchard.Client, docker_ready: str, tmp_path: Path
) -> None:
    if engine("GET", f"/images/{IMAGE}/json")[0] != 200:
        pytest.fail(f"{IMAGE} is missing: run scripts/docker-setup.sh", pytrace=False)
    policy = tasks.ScriptedPolicy(p_right=0.5, seed=7)
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
    assert results.counts == {"ok": len(TOYS) * N, "agent_error": 0, "infra_error": 0, "reward_error": 0, "skipped": 0}
    for r in results.records:
        task = next(t for t in TOYS if t.id == r["task"])
        assert (r["tries"], r["reason"]) == (1, None), r
        assert r["solved"] is policy.chooses_right(task, r["attempt"]), (r["task"], r["attempt"], r["log_tail"])
    expected = {t.id: sum(policy.chooses_right(t, a) for a in range(N)) / N for t in TOYS}
    assert results.pass_rate == expected
    assert containers(f"orchard.dev/session={client.session_id}") == []
    print(f"docker: {len(TOYS)} toy tasks x {N} attempts, concurrency {CONCURRENCY}: {elapsed:.1f} s; {expected}")
