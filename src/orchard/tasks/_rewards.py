"""Rewards: a SWE-bench patch graded by swebench's own code in a fresh sandbox; a generic task's check command."""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import tempfile
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..errors import TaskError
from ._sandbox import task_sandbox
from ._types import Reward, Task

if TYPE_CHECKING:
    from .._client import Client
    from .._sandbox import Sandbox

#: Characters of the test log kept in ``Reward.log_tail``.
LOG_TAIL = 4000
#: Default seconds the tests may run (swebench's harness default, 1800, is for real repositories).
TEST_TIMEOUT = 1800.0

# Inside the repository's .git: per sandbox, outside the working tree, so neither `git clean` nor the diff sees them.
_PATCH_FILE = ".git/orchard-model.patch"
_TEST_PATCH_FILE = ".git/orchard-test.patch"
_EVAL_FILE = ".git/orchard-eval.sh"
_DIFF_FILES = re.compile(r"^diff --git a/.* b/(.*)$", re.M)


async def swe_reward(
    client: Client, task: Task, patch: str | None, *, timeout: float = TEST_TIMEOUT, **spec: Any
) -> Reward:
    """Grade a patch for a SWE-bench-shaped task as SWE-bench's harness does, in a fresh sandbox.

    The sandbox starts from ``task.image`` (on the local backend: from
    ``task.local_dir``, see ``task_sandbox``). The patch is applied with
    swebench's chain of commands (``git apply``, then ``--3way``, ``--reject``,
    then ``patch --fuzz=5``, from a clean tree each time); then the
    instance's ``eval_script`` runs (Orchard's extension instead: the files
    the ``test_patch`` touches are reset to ``base_commit``, the
    ``test_patch`` is applied and ``test_cmd`` runs). The log is graded by
    swebench: its ``log_parser`` reads the per-test statuses and
    ``get_eval_report`` decides whether every FAIL_TO_PASS and PASS_TO_PASS
    test passes.

    A patch that is empty, does not apply, or whose tests time out or leave
    no results is ``Reward(0.0, solved=False, reason=...)``, never an
    exception. Sandbox failures (``SandboxStartError``, ``SandboxLost``,
    ``SandboxTimeout`` ...) propagate: they are the infrastructure's, not
    the patch's.

    Args:
        client: the Client whose backend runs the grading sandbox.
        task: a task loaded from a SWE-bench instance.
        patch: the model's patch (a unified diff, as ``git diff`` prints).
        timeout: seconds the tests may run.
        **spec: sandbox options for the grading sandbox (``cpu=``, ``memory=`` ...).
    """
    instance = _instance(task)
    if patch is None or not patch.strip():
        return Reward(0.0, solved=False, reason="empty patch")
    from swebench.harness.run_evaluation import GIT_APPLY_CMDS  # type: ignore[import-untyped]

    async with task_sandbox(client, task, **spec) as sb:
        await sb.write_file(_PATCH_FILE, patch if patch.endswith("\n") else patch + "\n")
        applied, apply_log = await _apply(sb, GIT_APPLY_CMDS)
        if not applied:
            first = apply_log.split("\n$ ", 1)[0]
            return Reward(
                0.0, solved=False, reason=f"patch does not apply: {first[-1000:]}", log_tail=apply_log[-LOG_TAIL:]
            )
        if instance.get("eval_script"):
            script = instance["eval_script"]
        else:
            await sb.write_file(_TEST_PATCH_FILE, instance["test_patch"])
            script = _eval_script(instance)
        spec_ = _test_spec(task, instance, script)
        await sb.write_file(_EVAL_FILE, spec_.eval_script)
        result = await sb.exec(["bash", _EVAL_FILE], timeout=timeout, merge_output=True)
    log = result.output
    if result.timed_out:
        return Reward(0.0, solved=False, reason=f"tests timed out after {timeout:g} s", log_tail=log[-LOG_TAIL:])
    return await asyncio.to_thread(_grade, task, spec_, log)


async def _apply(sb: Sandbox, commands: list[str]) -> tuple[bool, str]:
    """The swebench package's run_instance: each apply command from a pristine tree, then 'already applied?'."""
    outputs = []
    for attempt, command in enumerate(commands):
        if attempt:
            await sb.exec("git checkout -- . ; git clean -fdq", timeout=120)
        result = await sb.exec(f"{command} {_PATCH_FILE}", timeout=120, merge_output=True)
        outputs.append(f"$ {command}\n{result.output}")
        if result.exit_code == 0:
            return True, outputs[-1]
    # The first command's complaint says best why (the fuzzy ones fail for its reason or their own).
    out = "\n".join(outputs)
    reverse = await sb.exec(f"git apply --check --reverse {_PATCH_FILE}", timeout=120)
    return reverse.exit_code == 0, out


def _instance(task: Task) -> Mapping[str, Any]:
    if task.instance is None:
        raise TaskError(f"task {task.id} is a generic task: grade it with check_reward", task_id=task.id)
    return task.instance


def _eval_script(instance: Mapping[str, Any]) -> str:
    """The eval script of SWE-bench's shape for Orchard's test_cmd extension (markers as swebench greps them)."""
    from swebench.harness.constants import END_TEST_OUTPUT, START_TEST_OUTPUT  # type: ignore[import-untyped]

    base = shlex.quote(instance["base_commit"])
    files = " ".join(shlex.quote(f) for f in dict.fromkeys(_DIFF_FILES.findall(instance["test_patch"])))
    reset = f"git checkout {base} -- {files}" if files else ":"
    return "\n".join(
        [
            reset,
            f"git apply --verbose {_TEST_PATCH_FILE}",
            f"echo {shlex.quote(START_TEST_OUTPUT)}",
            instance["test_cmd"],
            f"echo {shlex.quote(END_TEST_OUTPUT)}",
            reset,
        ]
    )


def _test_spec(task: Task, instance: Mapping[str, Any], script: str) -> Any:
    from swebench.harness.constants import FAIL_ONLY_REPOS
    from swebench.harness.utils import make_test_spec  # type: ignore[import-untyped]

    eval_type = instance.get("eval_type") or ("fail_only" if instance["repo"] in FAIL_ONLY_REPOS else "pass_and_fail")
    return make_test_spec(
        {
            "instance_id": task.id,
            "image": task.image,
            "eval_script": script,
            "repo": instance["repo"],
            "version": instance.get("version") or "",
            "FAIL_TO_PASS": instance["FAIL_TO_PASS"],
            "PASS_TO_PASS": instance["PASS_TO_PASS"],
            "log_parser": instance["log_parser"],
            "eval_type": eval_type,
            "image_assets": instance.get("image_assets"),
        }
    )


def _grade(task: Task, test_spec: Any, log: str) -> Reward:
    """The swebench package's grading of a test log: the per-test statuses, then resolved or not."""
    from swebench.harness.constants import FAIL_TO_PASS, PASS_TO_PASS
    from swebench.harness.grading import get_eval_report, get_logs_eval  # type: ignore[import-untyped]

    tail = log[-LOG_TAIL:]
    with tempfile.TemporaryDirectory(prefix="orchard-grade-") as tmp:
        path = os.path.join(tmp, "test_output.txt")
        with open(path, "w", encoding="utf-8") as f:
            f.write(log)
        statuses, found = get_logs_eval(test_spec, path)
        prediction = {"instance_id": task.id, "model_patch": "(applied)", "model_name_or_path": "orchard"}
        report = get_eval_report(test_spec, prediction, path, include_tests_status=True)[task.id]
    if not found:
        why = report.get("infra_failure_reason")
        return Reward(
            0.0,
            solved=False,
            reason="the tests left no results in the log" + (f" ({why})" if why else ""),
            log_tail=tail,
        )
    tests_status = report.get("tests_status", {})
    graded = {key: tests_status[key] for key in (FAIL_TO_PASS, PASS_TO_PASS) if key in tests_status}
    solved = bool(report["resolved"])
    return Reward(1.0 if solved else 0.0, solved=solved, tests=dict(statuses), log_tail=tail, report=graded)


async def check_reward(
    client: Client, task: Task, answer: str | None, *, timeout: float = 600.0, **spec: Any
) -> Reward:
    """Grade a generic task's answer with its ``check`` command, in a fresh sandbox from the task.

    The sandbox is made as the agent's was (image, local_dir, setup), never
    the agent's own: what the agent did there cannot touch the grading. The
    answer is the only thing carried over: the check reads it on stdin and
    in the file named by ``$ORCHARD_ANSWER``. Exit status 0 is solved
    (1.0), anything else 0.0 with the check's output in ``log_tail``; a
    check past ``timeout`` is 0.0 with the reason. An agent whose work is
    files returns them as a patch, which the check applies
    (``git apply "$ORCHARD_ANSWER" && ...``).

    Sandbox failures propagate, as for ``swe_reward``.

    Raises:
        TaskError: the task has no ``check``.
    """
    if task.check is None:
        raise TaskError(f"task {task.id} has no check command to grade with", field="check", task_id=task.id)
    if answer is None:
        return Reward(0.0, solved=False, reason="no answer")
    async with task_sandbox(client, task, **spec) as sb:
        made = await sb.exec(
            'f=$(mktemp "${TMPDIR:-/tmp}/orchard-answer.XXXXXX") && cat >"$f" && printf %s "$f"',
            stdin=answer,
            timeout=60,
        )
        if made.exit_code != 0:
            raise TaskError(f"task {task.id}: cannot write the answer in the sandbox: {made.stderr[-1000:]}")
        result = await sb.exec(
            task.check, env={"ORCHARD_ANSWER": made.stdout}, stdin=answer, timeout=timeout, merge_output=True
        )
    tail = result.output[-LOG_TAIL:]
    if result.timed_out:
        return Reward(0.0, solved=False, reason=f"the check timed out after {timeout:g} s", log_tail=tail)
    solved = result.exit_code == 0
    return Reward(1.0 if solved else 0.0, solved=solved, log_tail=tail)


async def reward(client: Client, task: Task, answer: str | None, **options: Any) -> Reward:
    """``swe_reward`` for a SWE-bench task, ``check_reward`` for a generic one."""
    if task.instance is not None:
        return await swe_reward(client, task, answer, **options)
    return await check_reward(client, task, answer, **options)
