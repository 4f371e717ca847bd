"""Rollouts: tasks x n attempts, each in a fresh sandbox, graded, streamed to disk, resumable.

Example::

    import orchard
    import orchard.rollout
    from orchard.tasks import Task

    async def agent(sb, task, *, attempt):
        await sb.exec("echo fixed > answer.txt")
        return (await sb.read_file("answer.txt")).decode()

    async with orchard.Client() as client:
        results = await orchard.rollout.run(
            client, tasks, agent=agent, reward=my_reward, n=8, concurrency=32, adaptive=True, out="runs/exp1/"
        )
    print(results.pass_rate)
    results.table()  # a rich Table (displays in a notebook)
    results.plot()  # a matplotlib Figure

docs/rollout.md describes the record schema, the adaptive rule, resuming and the chat export.
"""

from ._plan import settle_after
from ._results import Results
from ._runner import INFRA_ERRORS, run

__all__ = ["INFRA_ERRORS", "Results", "run", "settle_after"]
