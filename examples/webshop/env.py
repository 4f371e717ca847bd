"""The shop in a sandbox: start it, read its state, grade a task's end state."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import orchard
from orchard import tasks
from orchard.tasks import Reward, Task

from .shop import check_state

HERE = Path(__file__).resolve().parent
#: The five tasks: instructions, and each end state as the ``check`` command that tests it in the sandbox.
TASKS = HERE / "tasks.jsonl"
#: Where the shop's one file goes in the sandbox (the tasks' ``check`` commands run it from there).
REMOTE = "/opt/webshop/shop.py"
#: The shop's port inside the sandbox.
PORT = 8000
#: The shop's address, as Chromium in the sandbox sees it.
URL = f"http://127.0.0.1:{PORT}"

# Waits for the shop to answer, from inside the sandbox (which may have no curl).
_WAIT = """
import sys, time, urllib.request
for _ in range(200):
    try:
        urllib.request.urlopen(sys.argv[1], timeout=1).read()
        sys.exit(0)
    except OSError:
        time.sleep(0.05)
sys.exit(1)
"""
_STATE = "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"


def load_tasks(path: str | Path = TASKS) -> list[Task]:
    """The shop's tasks (generic ``orchard.tasks`` tasks: image, instruction, check)."""
    return tasks.load(path)


async def start_site(sb: orchard.Sandbox, port: int = PORT) -> None:
    """Copy the shop into ``sb``, start it on 127.0.0.1:``port`` and return once it answers.

    Raises:
        RuntimeError: the shop did not answer within 10 s (its output is in the message).
    """
    await sb.upload(HERE / "shop.py", REMOTE)
    process = await sb.start_process(["python3", REMOTE, str(port)], merge_output=True)
    waited = await sb.exec(["python3", "-c", _WAIT, f"http://127.0.0.1:{port}/api/state"], timeout=30)
    if waited.exit_code != 0:
        output = (await process.output()).decode(errors="replace")
        raise RuntimeError(f"the shop did not answer on port {port}: {output[-2000:]}")


async def read_state(sb: orchard.Sandbox, port: int = PORT) -> dict[str, Any]:
    """The shop's state, as its /api/state serves it inside ``sb``: the cart and the orders placed."""
    result = await sb.exec(["python3", "-c", _STATE, f"http://127.0.0.1:{port}/api/state"], timeout=30)
    if result.exit_code != 0:
        raise RuntimeError(f"reading the shop's state failed: {result.stderr[-2000:]}")
    state: dict[str, Any] = json.loads(result.stdout)
    return state


def goal_of(task: Task) -> dict[str, Any]:
    """The end state ``task`` asks for: the JSON goal its ``check`` command gives the shop's checker."""
    if task.check is None:
        raise ValueError(f"task {task.id} has no check")
    words = shlex.split(task.check)
    if words[:3] != ["python3", REMOTE, "check"] or len(words) != 4:
        raise ValueError(f"task {task.id}: the check is not `python3 {REMOTE} check GOAL`: {task.check}")
    goal: dict[str, Any] = json.loads(words[3])
    return goal


async def reward(client: orchard.Client, task: Task, answer: Any) -> Reward:
    """Grade the shop's end state, which the episode read from the sandbox before it closed.

    ``answer`` is the agent's dict: its ``"state"`` is /api/state as read at
    the end of the episode, by the environment (``episode``), not by the policy.
    The check is the task's own goal, the same function the task's ``check``
    command runs in a live sandbox.
    """
    state = answer.get("state") if isinstance(answer, dict) else None
    if not isinstance(state, dict):
        return Reward(value=0.0, solved=False, reason="the answer holds no state of the shop")
    solved, why = check_state(goal_of(task), state)
    return Reward(value=1.0 if solved else 0.0, solved=solved, reason=None if solved else why, log_tail=why)
