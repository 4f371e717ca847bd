"""The toy tasks rolled out on kubernetes: 6 tasks x 8 attempts of the scripted policy, graded by swebench's code.

Each attempt is a pod from orchard-test/toys (imported into the dev cluster by
hack/devcluster): the agent's, at the task's base_commit, then a fresh one for
the reward. The pass rates are those the policy's seeded draws give in
advance (support.roll_out_toys).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kubernetes_asyncio.client.api_client import ApiClient
from test_k8s_backend import config, wait_no_pods

import orchard
from support import roll_out_toys

pytestmark = pytest.mark.k8s


@pytest.mark.timeout(600)
async def test_toy_rollout_pass_rates_are_the_policy_s_draws(
    kubeconfig: str, k8s_namespace: str, k8s_api: ApiClient, tmp_path: Path
) -> None:
    async with orchard.Client(config(kubeconfig, k8s_namespace)) as client:
        # Attempts in flight (two pods each at most: the agent's, then the reward's) on the single-node dev cluster.
        said = await roll_out_toys(client, tmp_path / "run", concurrency=16)
        # Every attempt deleted its pods as it ended, while the client is still open.
        await wait_no_pods(k8s_api, k8s_namespace)
    print(f"kubernetes: {said}")
