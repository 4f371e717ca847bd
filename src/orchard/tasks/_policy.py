"""A scripted policy: an agent without a model that fixes a task right or wrong, reproducibly."""

from __future__ import annotations

import random
import re
import shlex
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..errors import ConfigError, TaskError

if TYPE_CHECKING:
    from .._sandbox import Sandbox
    from ._types import Task

_PATCH_FILE = ".git/orchard-policy.patch"
_FIRST_FILE = re.compile(r"^diff --git a/.* b/(.*)$", re.M)
_NEW_FILES = re.compile(r"^--- /dev/null\n\+\+\+ b/(.*)$", re.M)


class ScriptedPolicy:
    """An agent for SWE-bench-shaped tasks that needs no model: ``await policy(sandbox, task, attempt=i)``.

    Each attempt writes either the right fix (the task's ``patch``) or a
    wrong one into the sandbox's repository, and returns what ``git diff``
    then prints there, so the patch really comes from the sandbox. Which
    one is decided by a random draw seeded by ``(seed, task.id, attempt)``:
    the same seed gives the same choices in any order, on any backend, and
    ``chooses_right`` tells them in advance.

    The wrong fix is one of the task's ``wrong_patches`` (an Orchard
    extension field: plausible wrong fixes, such as the toy tasks carry),
    chosen by the same draw; for a task without them, a comment line
    appended to the first file the right fix touches (a real diff that
    fixes nothing).

    Args:
        p_right: the probability of the right fix: one number, or a mapping
            of task id to probability (which must name every task it meets).
        seed: the run's seed.
    """

    def __init__(self, p_right: float | Mapping[str, float] = 0.5, seed: int = 0) -> None:
        values = p_right.values() if isinstance(p_right, Mapping) else [p_right]
        for p in values:
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
                raise ConfigError(f"p_right={p!r}: a probability is a number from 0 to 1")
        self.p_right = p_right
        self.seed = seed

    def __repr__(self) -> str:
        return f"ScriptedPolicy(p_right={self.p_right!r}, seed={self.seed!r})"

    def _draw(self, task: Task, attempt: int) -> tuple[bool, float]:
        if isinstance(self.p_right, Mapping):
            if task.id not in self.p_right:
                raise ConfigError(f"ScriptedPolicy p_right names no probability for task {task.id!r}")
            p = self.p_right[task.id]
        else:
            p = self.p_right
        rng = random.Random(f"{self.seed}:{task.id}:{attempt}")
        return rng.random() < p, rng.random()

    def chooses_right(self, task: Task, attempt: int = 0) -> bool:
        """Whether attempt ``attempt`` of ``task`` writes the right fix (without touching any sandbox)."""
        return self._draw(task, attempt)[0]

    def patch_for(self, task: Task, attempt: int = 0) -> str | None:
        """The patch attempt ``attempt`` of ``task`` applies in the sandbox (None: the appended comment)."""
        if task.instance is None or not task.instance.get("patch"):
            raise TaskError(f"task {task.id}: ScriptedPolicy needs a SWE-bench task with a patch", task_id=task.id)
        right, pick = self._draw(task, attempt)
        gold: str = task.instance["patch"]
        if right:
            return gold
        wrong = task.instance.get("wrong_patches")
        if wrong:
            return str(wrong[int(pick * len(wrong))])
        return None

    async def __call__(self, sandbox: Sandbox, task: Task, *, attempt: int = 0) -> str:
        """Edit the task's repository in ``sandbox`` and return its ``git diff``."""
        patch = self.patch_for(task, attempt)
        if patch is None:
            assert task.instance is not None
            first = _FIRST_FILE.search(task.instance["patch"])
            name = first.group(1) if first else "README"
            edit = ["sh", "-c", 'printf "\\n# TODO: fix the bug\\n" >>"$1"', "sh", name]
            applied = await sandbox.exec(edit, timeout=60)
        else:
            await sandbox.write_file(_PATCH_FILE, patch)
            # New files are marked intent-to-add, so `git diff` shows them (git apply --intent-to-add, in
            # git 2.39, empties the rest of the index instead).
            new = _NEW_FILES.findall(patch)
            add = " && git add -N -- " + " ".join(shlex.quote(f) for f in new) if new else ""
            applied = await sandbox.exec(f"git apply {_PATCH_FILE}{add}", timeout=60)
        if applied.exit_code != 0:
            raise TaskError(
                f"task {task.id}: the scripted patch does not apply to the repository: {applied.stderr[-1000:]}",
                task_id=task.id,
            )
        diff = await sandbox.exec(["git", "-c", "core.fileMode=false", "diff"], timeout=60)
        if diff.exit_code != 0:
            raise TaskError(f"task {task.id}: git diff failed: {diff.stderr[-1000:]}", task_id=task.id)
        return diff.stdout
