"""The toy tasks rolled out on docker: 6 tasks x 8 attempts of the scripted policy, graded by swebench's code.

Each attempt is a container from orchard-test/toys (the agent's, at the
task's base_commit) and a fresh one for the reward; the pass rates are those
the policy's seeded draws give in advance (support.roll_out_toys).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from docker_support import containers, engine

import orchard
from support import roll_out_toys

pytestmark = pytest.mark.docker

IMAGE = "orchard-test/toys:latest"


@pytest.mark.timeout(600)
async def test_toy_rollout_pass_rates_are_the_policy_s_draws(
    client: orchard.Client, docker_ready: str, tmp_path: Path
) -> None:
    if engine("GET", f"/images/{IMAGE}/json")[0] != 200:
        pytest.fail(f"{IMAGE} is missing: run scripts/docker-setup.sh", pytrace=False)
    # Attempts in flight: two containers each at most (the agent's, then the reward's), on a 2-core machine.
    said = await roll_out_toys(client, tmp_path / "run", concurrency=16)
    assert containers(f"orchard.dev/session={client.session_id}") == []
    print(f"docker: {said}")
