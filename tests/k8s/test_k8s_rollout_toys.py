"""The toy tasks rolled out on kubernetes: 6 tasks x 8 attempts of the scripted policy, graded by swebench's code.

Each attempt is a pod from orchard-test/toys (imported into the dev cluster by
hack/devcluster): the agent's, at the task's base_commit, then a fresh one for
the reward. The pass rates are those the policy's seeded draws give in advance.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from kubernetes_asyncio.client.api_client import ApiClient
from test_k8s_backend import config, wait_no_pods

import orchard
import orchard.rollout
from orchard import tasks

pytestmark = pytest.mark.k8s

ROOT = Path(__file__).resolve().parents[2]
TOYS = tasks.load(ROOT / "examples" / "tasks" / "swe-mini.jsonl")
N = 8
#: Attempts in flight (two pods each at most: the agent's, then the reward's) on the single-node dev cluster.
CONCURRENCY = 16


@pytest.mark.timeout(600)
async def test_toy_rollout_pass_rates_are_the_policy_s_draws(
    kubeconfig: str, k8s_namespace: str, k8s_api: ApiClient, tmp_path: Path
) -> None:
    policy = tasks.ScriptedPolicy(p_right=0.5, seed=7)
    async with orchard.Client(config(kubeconfig, k8s_namespace)) as client:
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
        # Every attempt deleted its pods as it ended, while the client is still open.
        await wait_no_pods(k8s_api, k8s_namespace)
    assert results.counts == {"ok": len(TOYS) * N, "agent_error": 0, "infra_error": 0, "reward_error": 0, "skipped": 0}
    for r in results.records:
        task = next(t for t in TOYS if t.id == r["task"])
        assert (r["tries"], r["reason"]) == (1, None), r
        assert r["solved"] is policy.chooses_right(task, r["attempt"]), (r["task"], r["attempt"], r["log_tail"])
    expected = {t.id: sum(policy.chooses_right(t, a) for a in range(N)) / N for t in TOYS}
    assert results.pass_rate == expected
    print(f"kubernetes: {len(TOYS)} toy tasks x {N} attempts, concurrency {CONCURRENCY}: {elapsed:.1f} s; {expected}")
