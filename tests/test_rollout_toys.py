"""The toy tasks rolled out on the local backend: 6 tasks x 8 attempts of the scripted policy, swebench-graded.

The local backend has no images: each attempt's sandbox (bubblewrap, the
default isolation) gets the task's local_dir copied in and committed (the
same base_commit as in the toys image), the agent's and then a fresh one for
the reward. The pass rates are those the policy's seeded draws give in
advance (support.roll_out_toys).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import orchard
from support import roll_out_toys

pytestmark = pytest.mark.executor


@pytest.mark.timeout(600)
async def test_toy_rollout_pass_rates_are_the_policy_s_draws(local_root: Path, tmp_path: Path) -> None:
    async with orchard.Client(orchard.LocalConfig(root=str(local_root), isolation="bwrap")) as client:
        # Attempts in flight: two executor processes each at most (the agent's sandbox, then the reward's).
        said = await roll_out_toys(client, tmp_path / "run", concurrency=8)
        # The local backend's listing, while the client is open: one directory per sandbox that exists.
        assert not local_root.exists() or os.listdir(local_root) == []
    print(f"local: {said}")
