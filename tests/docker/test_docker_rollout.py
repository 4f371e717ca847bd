"""orchard.rollout on the docker backend: a task whose image does not exist fails as infrastructure, the rest runs."""

from __future__ import annotations

from typing import Any

import pytest
from docker_support import BUSYBOX, containers

import orchard
import orchard.rollout
from orchard.tasks import Reward, Task

pytestmark = pytest.mark.docker


async def agent(sb: orchard.Sandbox, task: Task, *, attempt: int) -> str:
    return (await sb.exec(["cat", "/etc/hostname"])).stdout


async def reward(client: orchard.Client, task: Task, answer: Any) -> Reward:
    return Reward(value=1.0, solved=bool(answer))


async def test_a_missing_image_is_infra_and_the_run_goes_on(client: orchard.Client) -> None:
    tasks = [Task(id="missing", image="orchard-test/no-such-image:1"), Task(id="busybox", image=BUSYBOX)]
    results = await orchard.rollout.run(
        client,
        tasks,
        agent=agent,
        reward=reward,
        n=2,
        retries=1,
        sandbox={"image_pull_policy": "Never"},
        progress=False,
    )
    assert results.pass_rate == {"missing": None, "busybox": 1.0}
    for r in results.groups["missing"]:
        assert (r["kind"], r["reward"], r["tries"]) == ("infra_error", None, 2)
        assert [(f["phase"], f["error"], f["reason"]) for f in r["infra"]] == [
            ("start", "SandboxStartError", "ErrImageNeverPull")
        ] * 2
        assert "orchard-test/no-such-image:1" in r["error"]
    assert containers(f"orchard.dev/session={client.session_id}") == []
