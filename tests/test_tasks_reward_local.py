"""Rewards on the local backend: the toy tasks graded by swebench's own code in real sandboxes.

Each grading starts a fresh sandbox, copies the task's local_dir in, applies
the patch and runs the tests: about half a second each here.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

import orchard
from orchard import tasks
from orchard.errors import ConfigError, TaskError

pytestmark = pytest.mark.executor

ROOT = Path(__file__).resolve().parents[1]
TOYS = {t.id: t for t in tasks.load(ROOT / "examples" / "tasks" / "swe-mini.jsonl")}

#: The tests each toy's wrong patches fail, in the order of its wrong_patches: F2P or P2P.
WRONG_FAILS = {
    "toys__roman-1": [("FAIL_TO_PASS", ["test_nineteen_ninety_four (test_roman.TestRoman.test_nineteen_ninety_four)"])],
    "toys__slugify-1": [
        ("FAIL_TO_PASS", ["test_collapses_separators (test_slugify.TestSlugify.test_collapses_separators)"]),
        ("PASS_TO_PASS", ["test_keeps_digits (test_slugify.TestSlugify.test_keeps_digits)"]),
    ],
    "toys__intervals-1": [("FAIL_TO_PASS", ["test_nested_unsorted (test_intervals.TestMerge.test_nested_unsorted)"])],
    "toys__lru-1": [("FAIL_TO_PASS", ["test_get_refreshes (test_lru.TestLRUCache.test_get_refreshes)"])],
    "toys__semver-1": [("FAIL_TO_PASS", ["test_minor_hundred (test_semver.TestCompare.test_minor_hundred)"])],
    "toys__median-1": [
        ("FAIL_TO_PASS", ["test_even_unsorted (test_median.TestMedian.test_even_unsorted)"]),
        ("PASS_TO_PASS", ["test_empty_raises (test_median.TestMedian.test_empty_raises)"]),
    ],
}
WRONG = [(task_id, i) for task_id, fails in WRONG_FAILS.items() for i in range(len(fails))]


def f2p(task: tasks.Task) -> list[str]:
    assert task.instance is not None
    return list(task.instance["FAIL_TO_PASS"])


def p2p(task: tasks.Task) -> list[str]:
    assert task.instance is not None
    return list(task.instance["PASS_TO_PASS"])


def test_every_toy_has_its_wrong_patches_listed_here() -> None:
    assert {t: len(task.instance["wrong_patches"]) for t, task in TOYS.items() if task.instance} == {
        t: len(fails) for t, fails in WRONG_FAILS.items()
    }


@pytest.mark.parametrize("task_id", sorted(TOYS))
async def test_the_right_patch_solves_the_task(local_client: orchard.Client, task_id: str) -> None:
    task = TOYS[task_id]
    assert task.instance is not None
    reward = await tasks.swe_reward(local_client, task, task.instance["patch"])
    assert (reward.value, reward.solved, reward.reason) == (1.0, True, None)
    assert reward.report == {
        "FAIL_TO_PASS": {"success": f2p(task), "failure": []},
        "PASS_TO_PASS": {"success": p2p(task), "failure": []},
    }
    assert {name: reward.tests[name] for name in f2p(task) + p2p(task)} == dict.fromkeys(
        f2p(task) + p2p(task), "PASSED"
    )
    assert "OK" in reward.log_tail


@pytest.mark.parametrize(("task_id", "index"), WRONG)
async def test_a_wrong_patch_scores_0_naming_the_tests_it_fails(
    local_client: orchard.Client, task_id: str, index: int
) -> None:
    task = TOYS[task_id]
    assert task.instance is not None
    reward = await tasks.swe_reward(local_client, task, task.instance["wrong_patches"][index])
    assert (reward.value, reward.solved, reward.reason) == (0.0, False, None)
    kind, failing = WRONG_FAILS[task_id][index]
    assert reward.report[kind]["failure"] == failing
    other = "PASS_TO_PASS" if kind == "FAIL_TO_PASS" else "FAIL_TO_PASS"
    assert reward.report[other]["failure"] == []
    assert all(reward.tests[name] in ("FAILED", "ERROR") for name in failing)
    assert "\nFAILED (" in reward.log_tail


async def test_no_patch_at_all_leaves_the_bug(local_client: orchard.Client) -> None:
    """The toys' FAIL_TO_PASS fail on the base commit: a comment-only patch changes nothing."""
    task = TOYS["toys__roman-1"]
    comment = "diff --git a/roman.py b/roman.py\n--- a/roman.py\n+++ b/roman.py\n@@ -1 +1,2 @@\n"
    comment += ' """Roman numerals."""\n+# looked at it\n'
    reward = await tasks.swe_reward(local_client, task, comment)
    assert reward.value == 0.0
    assert reward.reason is None
    assert reward.report["FAIL_TO_PASS"]["failure"] == f2p(task)
    assert reward.report["PASS_TO_PASS"]["failure"] == []


@pytest.mark.parametrize("patch", ["", "  \n", None])
async def test_an_empty_patch_scores_0(local_client: orchard.Client, patch: str | None) -> None:
    reward = await tasks.swe_reward(local_client, TOYS["toys__roman-1"], patch)
    assert reward == tasks.Reward(0.0, solved=False, reason="empty patch")


async def test_a_patch_that_does_not_apply_scores_0_with_the_reason(local_client: orchard.Client) -> None:
    # The slugify fix, given for the roman task: no such file there.
    other = TOYS["toys__slugify-1"].instance
    assert other is not None
    reward = await tasks.swe_reward(local_client, TOYS["toys__roman-1"], other["patch"])
    assert (reward.value, reward.solved, reward.tests, reward.report) == (0.0, False, {}, {})
    assert reward.reason is not None
    assert reward.reason.startswith("patch does not apply: $ git apply --verbose")
    assert "slugify.py: No such file or directory" in reward.reason
    assert "$ git apply --verbose --reject" in reward.log_tail  # every fallback was tried


async def test_a_patch_with_the_wrong_context_scores_0(local_client: orchard.Client) -> None:
    task = TOYS["toys__roman-1"]
    assert task.instance is not None
    stale = task.instance["patch"].replace('(500, "D")', '(501, "D")')
    reward = await tasks.swe_reward(local_client, task, stale)
    assert reward.value == 0.0
    assert reward.reason is not None
    assert "patch does not apply" in reward.reason


async def test_a_patch_that_rewrites_the_tests_does_not_pass(local_client: orchard.Client) -> None:
    """The files the test_patch touches are reset to base_commit before it applies, as SWE-bench's eval does."""
    task = TOYS["toys__roman-1"]
    names = [n.split()[0] for n in f2p(task) + p2p(task)]
    fake = "import unittest\n\n\nclass TestRoman(unittest.TestCase):\n" + "".join(
        f"    def {n}(self):\n        pass\n\n" for n in names
    )
    old = (Path(task.local_dir or "") / "test_roman.py").read_text().splitlines(keepends=True)
    new = fake.rstrip().splitlines(keepends=True)
    new[-1] += "\n"
    hack = "diff --git a/test_roman.py b/test_roman.py\n--- a/test_roman.py\n+++ b/test_roman.py\n"
    hack += f"@@ -1,{len(old)} +1,{len(new)} @@\n" + "".join("-" + x for x in old) + "".join("+" + x for x in new)
    reward = await tasks.swe_reward(local_client, task, hack)
    assert reward.value == 0.0
    assert reward.reason is None
    assert reward.report["FAIL_TO_PASS"]["failure"] == f2p(task)


async def test_tests_past_their_deadline_score_0(local_client: orchard.Client) -> None:
    task = TOYS["toys__median-1"]
    hang = "diff --git a/median.py b/median.py\n--- a/median.py\n+++ b/median.py\n@@ -1 +1,4 @@\n"
    hang += ' """The median of a list of numbers."""\n+import time\n+\n+time.sleep(600)\n'
    reward = await tasks.swe_reward(local_client, task, hang, timeout=1)
    assert (reward.value, reward.solved, reward.reason) == (0.0, False, "tests timed out after 1 s")


async def test_a_swebench_task_without_local_dir_cannot_run_on_local(local_client: orchard.Client) -> None:
    task = TOYS["toys__roman-1"]
    bare = tasks.Task(id=task.id, image=task.image, workdir=task.workdir, instance=task.instance)
    with pytest.raises(TaskError, match="needs local_dir") as info:
        await tasks.swe_reward(local_client, bare, "diff --git a/x b/x\n")
    assert info.value.field == "local_dir"


async def test_swe_reward_refuses_a_generic_task(local_client: orchard.Client) -> None:
    with pytest.raises(TaskError, match="check_reward"):
        await tasks.swe_reward(local_client, tasks.Task(id="g", image="local", check="true"), "x")


# The local_dir rule and the scripted policy


async def test_the_local_dir_is_committed_as_the_task_s_base_commit(local_client: orchard.Client) -> None:
    for task in TOYS.values():
        assert task.instance is not None
        async with tasks.task_sandbox(local_client, task) as sb:
            head = await sb.exec("git rev-parse HEAD && git status --porcelain", timeout=30)
        assert head.stdout == task.instance["base_commit"] + "\n"


async def test_the_scripted_policy_edits_the_sandbox_and_returns_its_diff(local_client: orchard.Client) -> None:
    task = TOYS["toys__slugify-1"]
    assert task.instance is not None
    right = tasks.ScriptedPolicy(p_right=1.0)
    wrong = tasks.ScriptedPolicy(p_right=0.0)
    async with tasks.task_sandbox(local_client, task) as sb:
        patch = await right(sb, task)
        status = await sb.exec("git status --porcelain", timeout=30)
    assert patch == task.instance["patch"]
    assert status.stdout == " M slugify.py\n"
    # The first attempt of each wrong fix the draw picks (patch_for says which, touching no sandbox).
    firsts = {wrong.patch_for(task, a): a for a in reversed(range(20))}
    seen = set()
    for attempt in firsts.values():
        async with tasks.task_sandbox(local_client, task) as sb:
            seen.add(await wrong(sb, task, attempt=attempt))
    assert seen == set(task.instance["wrong_patches"])  # both wrong fixes, chosen by the draw


async def test_without_wrong_patches_the_policy_adds_a_comment_that_fixes_nothing(
    local_client: orchard.Client,
) -> None:
    task = TOYS["toys__lru-1"]
    assert task.instance is not None
    plain = tasks.Task(
        id=task.id,
        image=task.image,
        workdir=task.workdir,
        local_dir=task.local_dir,
        instance={k: v for k, v in task.instance.items() if k != "wrong_patches"},
    )
    async with tasks.task_sandbox(local_client, plain) as sb:
        patch = await tasks.ScriptedPolicy(p_right=0.0)(sb, plain)
    assert patch.startswith("diff --git a/lru.py b/lru.py")
    assert "+# TODO: fix the bug" in patch
    reward = await tasks.swe_reward(local_client, plain, patch)
    assert reward.value == 0.0
    assert reward.report["FAIL_TO_PASS"]["failure"] == f2p(task)


def test_the_policy_s_draws_are_seeded_per_task_and_attempt() -> None:
    policy = tasks.ScriptedPolicy(p_right=0.3, seed=7)
    draws = {(t, a): policy.chooses_right(TOYS[t], a) for t in TOYS for a in range(200)}
    # Any order, any instance: the same draws.
    again = tasks.ScriptedPolicy(p_right=0.3, seed=7)
    keys = list(draws)
    random.Random(1).shuffle(keys)
    assert {k: again.chooses_right(TOYS[k[0]], k[1]) for k in keys} == draws
    assert draws != {k: tasks.ScriptedPolicy(p_right=0.3, seed=8).chooses_right(TOYS[k[0]], k[1]) for k in draws}
    rate = sum(draws.values()) / len(draws)
    assert 0.25 < rate < 0.35, rate  # 1,200 draws of p=0.3
    assert not any(tasks.ScriptedPolicy(p_right=0.0).chooses_right(t, a) for t in TOYS.values() for a in range(50))
    assert all(tasks.ScriptedPolicy(p_right=1.0).chooses_right(t, a) for t in TOYS.values() for a in range(50))


def test_the_policy_takes_a_probability_per_task() -> None:
    probabilities = dict.fromkeys(TOYS, 0.0) | {"toys__lru-1": 1.0}
    policy = tasks.ScriptedPolicy(p_right=probabilities)
    assert [t for t in TOYS if policy.chooses_right(TOYS[t], 0)] == ["toys__lru-1"]
    with pytest.raises(ConfigError, match="toys__lru-1"):
        tasks.ScriptedPolicy(p_right={"other": 0.5}).chooses_right(TOYS["toys__lru-1"])


@pytest.mark.parametrize("p", [-0.1, 1.5, "0.5", True, float("nan")])
def test_the_policy_refuses_what_is_not_a_probability(p: object) -> None:
    with pytest.raises(ConfigError, match="p_right"):
        tasks.ScriptedPolicy(p_right=p)  # type: ignore[arg-type]


# Generic tasks: check_reward


def answer_task(**fields: object) -> tasks.Task:
    item = {
        "id": "answer",
        "image": "local",
        "setup": ["echo 42 > expected"],
        "check": 'test "$(cat "$ORCHARD_ANSWER")" = "$(cat expected)" && grep -qx 42 && echo right',
    } | fields
    (task,) = tasks.load([item])
    return task


async def test_check_reward_runs_the_check_on_the_answer(local_client: orchard.Client) -> None:
    task = answer_task()
    right = await tasks.check_reward(local_client, task, "42\n")
    assert right == tasks.Reward(1.0, solved=True, log_tail="right\n")
    wrong = await tasks.check_reward(local_client, task, "41\n")
    assert (wrong.value, wrong.solved, wrong.reason) == (0.0, False, None)
    assert await tasks.check_reward(local_client, task, None) == tasks.Reward(0.0, solved=False, reason="no answer")
    assert (await tasks.reward(local_client, task, "42\n")).solved  # reward() dispatches on the kind


async def test_check_reward_grades_in_a_fresh_sandbox_not_the_agent_s(local_client: orchard.Client) -> None:
    task = answer_task(check="test ! -e tampered && grep -qx 42")
    async with tasks.task_sandbox(local_client, task) as agent_sb:
        await agent_sb.write_file("tampered", "the agent was here")
        assert (await tasks.check_reward(local_client, task, "42")).solved


async def test_check_reward_output_and_deadline(local_client: orchard.Client) -> None:
    shown = await tasks.check_reward(local_client, answer_task(check="echo checked; echo oops >&2; exit 3"), "x")
    assert (shown.value, shown.log_tail) == (0.0, "checked\noops\n")
    slow = await tasks.check_reward(local_client, answer_task(check="sleep 600"), "x", timeout=1)
    assert (slow.value, slow.reason) == (0.0, "the check timed out after 1 s")


async def test_a_failing_setup_or_no_check_is_a_task_error(local_client: orchard.Client) -> None:
    with pytest.raises(TaskError, match=r"setup\[1\] exited 7: broken") as info:
        await tasks.check_reward(local_client, answer_task(setup=["true", "echo broken; exit 7"]), "42")
    assert (info.value.field, info.value.task_id) == ("setup", "answer")
    with pytest.raises(TaskError, match="no check command"):
        await tasks.check_reward(local_client, tasks.Task(id="t", image="local"), "42")
