"""mini-swe-agent's real DefaultAgent loop, driven by its own deterministic test model, on an Orchard sandbox."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import minisweagent.config
import yaml
from minisweagent.agents.default import DefaultAgent
from minisweagent.models.test_models import DeterministicModel, make_output

from orchard.harness.minisweagent import OrchardEnvironment

CALC = "def add(a, b):\n    return a - b\n"
TEST = "from calc import add\n\nassert add(2, 3) == 5, add(2, 3)\nprint('tests pass')\n"


def scripted(task_dir: str) -> list[dict[str, Any]]:
    """A trajectory that runs the tests (they fail), fixes the bug, reruns them and submits.

    ``-B``: the fix keeps the file's size and may land in the same second, which a cached .pyc cannot tell apart.
    """
    steps = [
        ("Run the tests.", f"cd {task_dir} && python3 -B test_calc.py"),
        ("Fix add.", f"cd {task_dir} && sed -i 's/a - b/a + b/' calc.py && cat calc.py"),
        ("Rerun.", f"cd {task_dir} && python3 -B test_calc.py"),
        ("Submit.", f"cd {task_dir} && echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat calc.py"),
    ]
    return [
        make_output(f"THOUGHT: {text}\n\n```mswea_bash_command\n{cmd}\n```", [{"command": cmd}], cost=0.01)
        for text, cmd in steps
    ]


def run_agent(env: OrchardEnvironment, task_dir: str) -> tuple[dict[str, Any], DefaultAgent]:
    """Write the task into the sandbox, run DefaultAgent on mini-swe-agent's own mini.yaml, return its result."""
    env.sandbox.write_file(f"{task_dir}/calc.py", CALC)
    env.sandbox.write_file(f"{task_dir}/test_calc.py", TEST)
    config = yaml.safe_load((Path(minisweagent.config.__file__).parent / "mini.yaml").read_text())
    agent = DefaultAgent(DeterministicModel(outputs=scripted(task_dir)), env, **config["agent"])
    result = agent.run("make test_calc.py pass")
    return result, agent


def check_run(env: OrchardEnvironment, task_dir: str) -> None:
    result, agent = run_agent(env, task_dir)
    assert result["exit_status"] == "Submitted", result
    assert result["submission"] == "def add(a, b):\n    return a + b\n"
    observations = [m["content"] for m in agent.messages if m["role"] == "user"][1:]
    # The first test run failed, with the traceback (stderr) in the observation; the rerun passed.
    assert "<returncode>1</returncode>" in observations[0], observations[0]
    assert "AssertionError: -1" in observations[0], observations[0]
    assert "<returncode>0</returncode>" in observations[2], observations[2]
    assert "tests pass" in observations[2], observations[2]
    # The task's tests pass in the sandbox at the end.
    r = env.sandbox.exec("python3 -B test_calc.py", cwd=task_dir)
    assert (r.exit_code, r.stdout) == (0, "tests pass\n")
