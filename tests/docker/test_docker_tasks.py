"""The toy tasks on the docker backend, from orchard-test/toys: graded by swebench's code, and the scripted policy."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from docker_support import engine

import orchard
from orchard import tasks
from orchard.errors import SandboxStartError

pytestmark = pytest.mark.docker

ROOT = Path(__file__).resolve().parents[2]
TOYS = tasks.load(ROOT / "examples" / "tasks" / "swe-mini.jsonl")
IMAGE = "orchard-test/toys:latest"


@pytest.fixture
def toys_image(docker_ready: str) -> None:
    """The toy tasks' image is on the engine."""
    if engine("GET", f"/images/{IMAGE}/json")[0] != 200:
        pytest.fail(f"{IMAGE} is missing: run scripts/docker-setup.sh", pytrace=False)


async def test_every_toy_task_grades_its_right_patch_1_and_its_wrong_patches_0(
    client: orchard.Client, toys_image: None
) -> None:
    gate = asyncio.Semaphore(4)

    async def grade(task: tasks.Task, patch: str) -> tasks.Reward:
        async with gate:
            return await tasks.swe_reward(client, task, patch)

    jobs = []
    for task in TOYS:
        assert task.instance is not None
        assert task.image == IMAGE
        jobs.append((task, True, grade(task, task.instance["patch"])))
        jobs += [(task, False, grade(task, wrong)) for wrong in task.instance["wrong_patches"]]
    rewards = await asyncio.gather(*(job for _, _, job in jobs))
    for (task, right, _), reward in zip(jobs, rewards, strict=True):
        assert reward.reason is None, (task.id, reward.reason, reward.log_tail)
        assert (reward.value, reward.solved) == ((1.0, True) if right else (0.0, False)), task.id
        failures = reward.report["FAIL_TO_PASS"]["failure"] + reward.report["PASS_TO_PASS"]["failure"]
        assert bool(failures) is not right, (task.id, reward.report)


async def test_the_scripted_policy_s_rewards_are_its_draws(client: orchard.Client, toys_image: None) -> None:
    """Each attempt: the agent's sandbox (at the task's base_commit), its diff, a fresh grading sandbox."""
    policy = tasks.ScriptedPolicy(p_right=0.5, seed=0)
    attempts = [(task, a) for task in TOYS for a in range(2)]
    gate = asyncio.Semaphore(4)

    async def attempt(task: tasks.Task, index: int) -> tuple[str, tasks.Reward]:
        async with gate:
            async with tasks.task_sandbox(client, task) as sb:
                head = (await sb.exec("git rev-parse HEAD", timeout=30)).stdout.strip()
                patch = await policy(sb, task, attempt=index)
            return head, await tasks.swe_reward(client, task, patch)

    results = await asyncio.gather(*(attempt(t, a) for t, a in attempts))
    expected = [policy.chooses_right(t, a) for t, a in attempts]
    for (task, _), (head, _) in zip(attempts, results, strict=True):
        assert task.instance is not None
        assert head == task.instance["base_commit"], task.id
    assert [r.solved for _, r in results] == expected
    # Seed 0 at p_right=0.5 over these 12 attempts: the known pass rate.
    assert sum(expected) == 6
    print(f"scripted policy p_right=0.5 seed=0: {sum(expected)}/{len(expected)} solved on docker")


async def test_a_missing_task_image_is_an_infrastructure_error_not_a_reward(
    client: orchard.Client, toys_image: None
) -> None:
    task = TOYS[0]
    assert task.instance is not None
    gone = tasks.Task(
        id=task.id, image="orchard-test/no-such-toys:latest", workdir=task.workdir, instance=task.instance
    )
    with pytest.raises(SandboxStartError):
        await tasks.swe_reward(client, gone, task.instance["patch"])
