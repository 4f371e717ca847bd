"""What a task is and what grading it gives: the two types the rollout runner and the rewards share."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Task:
    """One task: the image its sandboxes start from and what the agent is asked to do.

    A SWE-bench instance keeps its fields as given in ``instance`` (``instance_id``,
    ``repo``, ``base_commit``, ``patch``, ``test_patch``, ``FAIL_TO_PASS``,
    ``PASS_TO_PASS``, ...); a generic task has ``setup`` commands and a ``check``
    command instead.
    """

    #: Unique within a run: a SWE-bench ``instance_id``, or the task's own id.
    id: str
    #: The image every sandbox of this task starts from.
    image: str
    #: What the agent is asked to do (a SWE-bench ``problem_statement``).
    instruction: str = ""
    #: The working directory of the task's sandboxes (SWE-bench images: /testbed).
    workdir: str | None = None
    #: Shell commands run in a fresh sandbox before the agent starts (generic tasks).
    setup: tuple[str, ...] = ()
    #: A shell command whose exit status 0 means solved (generic tasks).
    check: str | None = None
    #: The SWE-bench instance as given, or None for a generic task.
    instance: Mapping[str, Any] | None = None
    #: A host directory holding the task's repository, for the ``local`` backend (which has no images): copied
    #: into the sandbox's own working directory, and committed there if it is no git repository, before the
    #: agent or the tests run. Other backends ignore it: their image holds the repository.
    local_dir: str | None = None


@dataclass(frozen=True)
class Reward:
    """A grade: the number a trainer takes, and the evidence behind it."""

    value: float
    #: Solved or not, by the task's own criterion (all FAIL_TO_PASS and PASS_TO_PASS pass; the check exits 0).
    solved: bool
    #: Why, when the answer could not be graded as given (a patch that does not apply, ...); None otherwise.
    reason: str | None = None
    #: Test name -> "PASSED" / "FAILED" / ..., as the log parser read them.
    tests: Mapping[str, str] = field(default_factory=dict)
    #: The last few KiB of the test log.
    log_tail: str = ""
    #: swebench's grading of a SWE-bench task: ``{"FAIL_TO_PASS": {"success": [...], "failure": [...]},
    #: "PASS_TO_PASS": {...}}``, so the tests that decided a 0 are named; empty when there were no test results.
    report: Mapping[str, Mapping[str, Sequence[str]]] = field(default_factory=dict)
