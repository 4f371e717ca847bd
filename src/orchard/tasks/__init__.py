"""Tasks and rewards: SWE-bench instances as they are, generic tasks, and grading.

Example::

    import orchard
    from orchard import tasks

    async def main():
        todo = tasks.load("examples/tasks/swe-mini.jsonl")
        policy = tasks.ScriptedPolicy(p_right=0.5, seed=0)
        async with orchard.Client("docker") as client:
            for task in todo:
                async with tasks.task_sandbox(client, task) as sb:
                    patch = await policy(sb, task)
                reward = await tasks.swe_reward(client, task, patch)
                print(task.id, reward.value, reward.reason)

Grading uses the ``swebench`` package (the ``tasks`` extra), imported only
when a reward is computed. docs/tasks.md describes the task format.
"""

from ._load import load, swebench_image
from ._policy import ScriptedPolicy
from ._rewards import check_reward, reward, swe_reward
from ._sandbox import task_sandbox
from ._types import Reward, Task

__all__ = [
    "Reward",
    "ScriptedPolicy",
    "Task",
    "check_reward",
    "load",
    "reward",
    "swe_reward",
    "swebench_image",
    "task_sandbox",
]
