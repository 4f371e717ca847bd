"""orchard.rollout on the local backend, with real sandboxes: pass rates, faults, resume, adaptive, bounds."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import pytest

import orchard
import orchard.rollout
import orchard.tasks
from orchard.errors import ConfigError, TaskError
from orchard.rollout._runner import RETRY_DELAY
from orchard.tasks import Reward, Task
from support import unisolated_ok

pytestmark = pytest.mark.executor

#: Each task's chance that the seeded agent writes the right answer.
CHANCE = {"always": 1.0, "never": 0.0, "half": 0.5}


def make_tasks(*names: str) -> list[Task]:
    """Generic tasks: setup writes the question, the check wants 42 in answer.txt."""
    return [
        Task(
            id=name,
            image="local",
            instruction=f"write 42 to answer.txt ({name})",
            setup=("echo 'what is 6 x 7' > question.txt",),
            check='test "$(cat answer.txt)" = 42',
        )
        for name in names
    ]


def right(task: Task, attempt: int) -> bool:
    """Whether the seeded agent answers right: a function of (task, attempt) alone, so retries repeat it."""
    return random.Random(f"{task.id}:{attempt}").random() < CHANCE[task.id]


async def seeded_agent(sb: orchard.Sandbox, task: Task, *, attempt: int) -> str:
    """Reads the question in its sandbox (setup ran), answers right or wrong by the seed; the answer is a script."""
    assert (await sb.read_file("question.txt")).startswith(b"what is")
    script = "echo 42 > answer.txt" if right(task, attempt) else "echo 41 > answer.txt"
    result = await sb.exec(script)
    assert result.exit_code == 0
    return script


async def check_reward(client: orchard.Client, task: Task, answer: Any) -> Reward:
    """A generic reward: in a fresh sandbox, run the setup, then the answer script, then ``task.check``."""
    async with client.sandbox(task.image, workdir=task.workdir) as sb:
        for command in task.setup:
            assert (await sb.exec(command, timeout=30)).exit_code == 0
        await sb.exec(str(answer), timeout=30)
        assert task.check is not None
        result = await sb.exec(task.check, timeout=30)
    solved = result.exit_code == 0
    return Reward(value=float(solved), solved=solved, log_tail=(result.stdout + result.stderr)[-500:])


def expected_rate(task: Task, n: int) -> float:
    return sum(right(task, a) for a in range(n)) / n


def no_sandboxes(local_root: Path) -> bool:
    """The local backend's listing: one directory per sandbox that exists."""
    return not local_root.exists() or not os.listdir(local_root)


def lines(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


async def test_pass_rates_records_and_outputs(local_client: orchard.Client, local_root: Path, tmp_path: Path) -> None:
    tasks = make_tasks("always", "never", "half")
    out = tmp_path / "run"
    results = await orchard.rollout.run(
        local_client, tasks, agent=seeded_agent, reward=check_reward, n=4, concurrency=4, out=out, progress=False
    )
    assert results.counts == {"ok": 12, "agent_error": 0, "infra_error": 0, "reward_error": 0, "skipped": 0}
    assert results.pass_rate == {t.id: expected_rate(t, 4) for t in tasks}
    assert results.pass_rate["always"] == 1.0
    assert results.pass_rate["never"] == 0.0
    for r in results.records:
        assert r["tries"] == 1
        assert r["infra"] == []
        assert r["reward"] == (1.0 if r["solved"] else 0.0)
        assert r["sandbox_id"].startswith("sb-")
        assert set(r["durations"]) == {"start", "setup", "agent", "reward"}
        assert r["started_at"] <= r["ended_at"]
        assert r["answer"].startswith("echo 4")
    # Streamed to out=: one line per attempt, and the parameters.
    written = lines(out)
    assert sorted((r["task"], r["attempt"]) for r in written) == sorted((t.id, a) for t in tasks for a in range(4))
    params = json.loads((out / "run.json").read_text())
    assert (params["n"], params["adaptive"], params["concurrency"]) == (4, False, 4)
    assert [t["id"] for t in params["tasks"]] == ["always", "never", "half"]
    # Each attempt's sandbox calls were traced.
    trace = Path(written[0]["trace"])
    assert trace.is_relative_to(out)
    assert any(json.loads(line)["type"] == "exec" for line in trace.read_text().splitlines())
    assert no_sandboxes(local_root)

    # Results read back from out= are the same; the table, the plot and the chat export.
    loaded = orchard.rollout.Results.load(out)
    assert loaded.pass_rate == results.pass_rate
    text = str(loaded)
    assert "always" in text
    assert "100%" in text
    fig = loaded.plot()
    assert len(fig.axes) == 3
    chat = loaded.to_chat(tmp_path / "chat.jsonl")
    assert len(chat) == 12
    first = chat[0]
    assert first["messages"] == [
        {"role": "user", "content": "write 42 to answer.txt (always)"},
        {"role": "assistant", "content": "echo 42 > answer.txt"},
    ]
    assert (first["reward"], first["solved"], first["task"], first["attempt"]) == (1.0, True, "always", 0)
    assert len((tmp_path / "chat.jsonl").read_text().splitlines()) == 12


async def test_infra_faults_are_retried_and_rewards_unchanged(
    local_client: orchard.Client, local_root: Path, tmp_path: Path
) -> None:
    tasks = make_tasks("always", "half")
    clean = await orchard.rollout.run(
        local_client, tasks, agent=seeded_agent, reward=check_reward, n=3, concurrency=3, progress=False
    )
    tries: dict[tuple[str, int], int] = {}
    began: dict[tuple[str, int], list[float]] = collections.defaultdict(list)

    async def faulty_agent(sb: orchard.Sandbox, task: Task, *, attempt: int) -> str:
        key = (task.id, attempt)
        tries[key] = tries.get(key, 0) + 1
        began[key].append(time.monotonic())
        if tries[key] == 1 and attempt == 0:
            # The executor killed from outside the sandbox, as the host sees it.
            pid = int((await sb.exec("echo $PPID")).stdout)
            os.kill(pid, 9)
        elif tries[key] == 1 and attempt == 1:
            # The sandbox deleted through the client while a command runs in it.
            command = asyncio.ensure_future(sb.exec("sleep 30", timeout=60))
            await asyncio.sleep(0.2)
            await sb.aclose()
            await command
        return await seeded_agent(sb, task, attempt=attempt)

    faulted = await orchard.rollout.run(
        local_client, tasks, agent=faulty_agent, reward=check_reward, n=3, concurrency=3, retries=2, progress=False
    )
    assert faulted.counts["ok"] == 6
    assert [(r["task"], r["attempt"], r["reward"], r["solved"]) for r in faulted.records] == [
        (r["task"], r["attempt"], r["reward"], r["solved"]) for r in clean.records
    ]
    assert faulted.pass_rate == clean.pass_rate
    by_key = {(r["task"], r["attempt"]): r for r in faulted.records}
    for tid in ("always", "half"):
        killed, deleted, plain = by_key[(tid, 0)], by_key[(tid, 1)], by_key[(tid, 2)]
        assert killed["tries"] == 2
        # The retry waited: at least half of RETRY_DELAY (jitter), not at once.
        assert began[(tid, 0)][1] - began[(tid, 0)][0] >= RETRY_DELAY / 2
        [failure] = killed["infra"]
        assert (failure["phase"], failure["error"], failure["reason"]) == ("agent", "SandboxLost", "exited(-9)")
        assert failure["sandbox_id"] != killed["sandbox_id"]  # the retry ran in a new sandbox
        assert deleted["tries"] == 2
        assert [(f["phase"], f["error"]) for f in deleted["infra"]] == [("agent", "SandboxClosed")]
        assert (plain["tries"], plain["infra"]) == (1, [])
    assert no_sandboxes(local_root)

    # Retries used up: an infra failure, with each try's reason, out of the pass rate (never a zero reward).
    async def killing_agent(sb: orchard.Sandbox, task: Task, *, attempt: int) -> str:
        if attempt == 0:
            os.kill(int((await sb.exec("echo $PPID")).stdout), 9)
        return await seeded_agent(sb, task, attempt=attempt)

    out = tmp_path / "run"
    lost = await orchard.rollout.run(
        local_client,
        make_tasks("always"),
        agent=killing_agent,
        reward=check_reward,
        n=2,
        retries=1,
        out=out,
        progress=False,
    )
    failed = lost.records[0]
    assert (failed["kind"], failed["reward"], failed["solved"], failed["tries"]) == ("infra_error", None, None, 2)
    assert [f["reason"] for f in failed["infra"]] == ["exited(-9)", "exited(-9)"]
    assert failed["error"].startswith("SandboxLost: ")
    assert lost.pass_rate == {"always": 1.0}  # the one counted attempt
    assert lost.to_chat() == [lost.to_chat()[0]]
    assert lost.to_chat()[0]["attempt"] == 1
    # A rerun with the same out= runs the infra-failed attempt again (the finished one not).
    rerun = await orchard.rollout.run(
        local_client, make_tasks("always"), agent=seeded_agent, reward=check_reward, n=2, out=out, progress=False
    )
    assert rerun.counts["ok"] == 2
    assert sorted(r["kind"] for r in lines(out)) == ["infra_error", "ok", "ok"]
    assert len(orchard.rollout.Results.load(out)) == 2
    assert no_sandboxes(local_root)


async def test_setup_failure_is_infra_and_the_run_goes_on(local_client: orchard.Client, local_root: Path) -> None:
    broken = Task(id="broken", image="local", setup=("echo no disk >&2; exit 3",), check="true")
    tasks = [broken, *make_tasks("always")]
    results = await orchard.rollout.run(
        local_client, tasks, agent=seeded_agent, reward=check_reward, n=2, retries=1, progress=False
    )
    assert results.pass_rate == {"broken": None, "always": 1.0}
    for r in results.groups["broken"]:
        assert (r["kind"], r["tries"]) == ("infra_error", 2)
        assert r["infra"][0]["phase"] == "setup"
        assert (r["infra"][0]["error"], r["infra"][0]["reason"]) == ("TaskError", "setup")
        assert r["infra"][0]["message"] == "task broken: setup[0] exited 3: no disk\n"
    assert no_sandboxes(local_root)


async def test_a_start_failure_is_infra_with_its_reason(local_root: Path) -> None:
    config = orchard.LocalConfig(root=str(local_root), isolation="none", python="/nonexistent/python3")
    with unisolated_ok():  # the backend is built (and warns) at the first start
        async with orchard.Client(config) as client:
            results = await orchard.rollout.run(
                client, make_tasks("always"), agent=seeded_agent, reward=check_reward, n=2, retries=1, progress=False
            )
    assert results.counts["infra_error"] == 2
    for r in results.records:
        assert [(f["phase"], f["error"], f["reason"]) for f in r["infra"]] == [
            ("start", "SandboxStartError", "spawn")
        ] * 2
        assert r["sandbox_id"] is None
    assert results.pass_rate == {"always": None}
    assert no_sandboxes(local_root)


async def test_agent_and_reward_exceptions(local_client: orchard.Client, local_root: Path) -> None:
    async def agent(sb: orchard.Sandbox, task: Task, *, attempt: int) -> str:
        if attempt == 1:
            await sb.exec("true")
            raise ValueError("the policy produced garbage")
        return await seeded_agent(sb, task, attempt=attempt)

    async def reward(client: orchard.Client, task: Task, answer: Any) -> Reward:
        if "42" in answer and task.id == "half":
            raise KeyError("grader bug")
        return await check_reward(client, task, answer)

    results = await orchard.rollout.run(
        local_client, make_tasks("always", "half"), agent=agent, reward=reward, n=3, concurrency=3, progress=False
    )
    by_key = {(r["task"], r["attempt"]): r for r in results.records}
    failed = by_key[("always", 1)]
    assert (failed["kind"], failed["reward"], failed["solved"], failed["tries"]) == ("agent_error", 0.0, False, 1)
    assert failed["error"] == "ValueError: the policy produced garbage"
    assert "in agent" in failed["traceback"]
    assert "raise ValueError" in failed["traceback"]
    assert failed["infra"] == []
    assert results.pass_rate["always"] == 2 / 3  # the agent's failure counts as unsolved
    bugs = [r for r in results.groups["half"] if r["kind"] == "reward_error"]
    assert bugs == [r for r in results.groups["half"] if r["answer"] and "42" in r["answer"]]
    for r in bugs:
        assert r["error"] == "KeyError: 'grader bug'"
        assert r["reward"] is None
    assert no_sandboxes(local_root)


async def test_concurrency_bound(local_client: orchard.Client, local_root: Path) -> None:
    in_flight = 0
    peak = 0
    full = asyncio.Event()

    async def agent(sb: orchard.Sandbox, task: Task, *, attempt: int) -> str:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        if in_flight >= 3:
            full.set()
        try:
            # Hold the slot until the bound is reached, then a while longer: an attempt beyond the bound
            # would start meanwhile and raise the peak.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(full.wait(), 10)
            await asyncio.sleep(1)
            return await seeded_agent(sb, task, attempt=attempt)
        finally:
            in_flight -= 1

    results = await orchard.rollout.run(
        local_client,
        make_tasks("always", "never"),
        agent=agent,
        reward=check_reward,
        n=3,
        concurrency=3,
        progress=False,
    )
    assert results.counts["ok"] == 6
    assert peak == 3
    assert no_sandboxes(local_root)


async def test_cancel_then_resume_runs_each_attempt_once(
    local_client: orchard.Client, local_root: Path, tmp_path: Path
) -> None:
    tasks = make_tasks("always", "half")
    out = tmp_path / "run"
    started: list[tuple[str, int]] = []
    blocked = asyncio.Event()

    async def stalling_agent(sb: orchard.Sandbox, task: Task, *, attempt: int) -> str:
        started.append((task.id, attempt))
        if attempt >= 2:
            blocked.set()
            await asyncio.sleep(3600)  # cancelled with the run
        return await seeded_agent(sb, task, attempt=attempt)

    run = asyncio.ensure_future(
        orchard.rollout.run(
            local_client, tasks, agent=stalling_agent, reward=check_reward, n=4, concurrency=2, out=out, progress=False
        )
    )
    await blocked.wait()
    await asyncio.wait_for(asyncio.shield(_until(lambda: len(lines(out)) >= 2)), 60)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert no_sandboxes(local_root)  # the in-flight sandboxes were deleted
    first = lines(out)
    assert 2 <= len(first) < 8
    assert all(r["kind"] == "ok" for r in first)

    second: list[tuple[str, int]] = []

    async def agent(sb: orchard.Sandbox, task: Task, *, attempt: int) -> str:
        second.append((task.id, attempt))
        return await seeded_agent(sb, task, attempt=attempt)

    results = await orchard.rollout.run(
        local_client, tasks, agent=agent, reward=check_reward, n=4, concurrency=2, out=out, progress=False
    )
    done = {(r["task"], r["attempt"]) for r in first}
    assert not done & set(second)  # finished attempts were not run again
    keys = [(r["task"], r["attempt"]) for r in lines(out)]
    assert sorted(keys) == sorted((t.id, a) for t in tasks for a in range(4))  # each attempt exactly once
    assert results.counts["ok"] == 8
    assert results.pass_rate == {t.id: expected_rate(t, 4) for t in tasks}
    assert len(json.loads((out / "run.json").read_text())["runs"]) == 2
    assert no_sandboxes(local_root)


async def test_a_cancel_lost_in_the_start_still_ends_the_attempt(
    local_client: orchard.Client, local_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run cancelled as an attempt's sandbox gets ready ends that attempt even if the cancel was lost below.

    Python 3.11's asyncio.wait_for (the local backend waits for the executor's ready line with it) returns and
    drops a cancel that comes in the step it ends: the attempt went on to its agent, and the cancelled run
    waited for it (test_cancel_then_resume's stalls for an hour).
    """
    create = local_client.create
    created = asyncio.Event()
    ran: list[tuple[str, int]] = []

    async def losing_create(image: str = "local", **spec: Any) -> orchard.Sandbox:
        sb = await create(image, **spec)
        if not created.is_set():  # the attempt's sandbox; the reward's start as usual
            created.set()
            with contextlib.suppress(asyncio.CancelledError):  # the run's cancel, lost as wait_for loses it
                await asyncio.Event().wait()
        return sb

    async def agent(sb: orchard.Sandbox, task: Task, *, attempt: int) -> str:
        ran.append((task.id, attempt))
        return await seeded_agent(sb, task, attempt=attempt)

    monkeypatch.setattr(local_client, "create", losing_create)
    run = asyncio.ensure_future(
        orchard.rollout.run(local_client, make_tasks("always"), agent=agent, reward=check_reward, progress=False)
    )
    await created.wait()
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert ran == []  # the cancelled attempt did not go on to its agent
    assert no_sandboxes(local_root)


async def _until(check: Any) -> None:
    while not check():
        await asyncio.sleep(0.05)


async def test_adaptive_stops_settled_groups(local_client: orchard.Client, local_root: Path) -> None:
    tasks = make_tasks("always", "never") + [Task(id="mixed", image="local", setup=("true",), check="true")]

    async def agent(sb: orchard.Sandbox, task: Task, *, attempt: int) -> str:
        if task.id == "mixed":
            return "true" if attempt % 2 == 0 else "false"
        return await seeded_agent(sb, task, attempt=attempt)

    async def reward(client: orchard.Client, task: Task, answer: Any) -> Reward:
        if task.id != "mixed":
            return await check_reward(client, task, answer)
        async with client.sandbox() as sb:
            solved = (await sb.exec(answer)).exit_code == 0
        return Reward(value=float(solved), solved=solved)

    assert orchard.rollout.settle_after(4, 0.5) == 2
    results = await orchard.rollout.run(
        local_client, tasks, agent=agent, reward=reward, n=4, concurrency=1, adaptive=True, progress=False
    )
    groups = results.groups
    for tid in ("always", "never"):
        kinds = [r["kind"] for r in groups[tid]]
        assert kinds.count("ok") == 2
        assert kinds.count("skipped") == 2
        assert all(r["reason"].startswith("group settled: 2 of 2") for r in groups[tid] if r["kind"] == "skipped")
    # The four skipped attempts went to the mixed group; the budget (3 x 4) is never exceeded.
    assert [r["attempt"] for r in groups["mixed"]] == list(range(8))
    assert results.pass_rate["mixed"] == 0.5
    assert sum(1 for r in results.records if r["kind"] != "skipped") == 12
    assert no_sandboxes(local_root)


async def test_bad_input_fails_before_any_sandbox(
    local_client: orchard.Client, local_root: Path, tmp_path: Path
) -> None:
    tasks = make_tasks("always")
    common: dict[str, Any] = {"agent": seeded_agent, "reward": check_reward, "progress": False}
    with pytest.raises(ConfigError, match="unique"):
        await orchard.rollout.run(local_client, tasks * 2, **common)
    with pytest.raises(ConfigError, match="Task"):
        await orchard.rollout.run(local_client, [{"id": "x"}], **common)  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="n=0"):
        await orchard.rollout.run(local_client, tasks, n=0, **common)
    with pytest.raises(ConfigError, match="adaptive=2"):
        await orchard.rollout.run(local_client, tasks, adaptive=2, **common)
    with pytest.raises(ConfigError, match="timeout"):
        await orchard.rollout.run(local_client, tasks, timeout=0, **common)
    with pytest.raises(ConfigError, match="invalid sandbox option"):
        await orchard.rollout.run(local_client, tasks, sandbox={"cpus": 2}, **common)
    assert no_sandboxes(local_root)

    # An out= directory: held by one run at a time; a resume must keep n.
    out = tmp_path / "run"
    await orchard.rollout.run(local_client, tasks, n=1, out=out, **common)
    with pytest.raises(ConfigError, match="n=1"):
        await orchard.rollout.run(local_client, tasks, n=2, out=out, **common)
    from orchard.rollout._store import Store

    held = Store(out)
    try:
        with pytest.raises(ConfigError, match="in use by another run"):
            await orchard.rollout.run(local_client, tasks, n=1, out=out, **common)
    finally:
        held.close()


async def test_a_partial_last_line_is_dropped_on_resume(local_client: orchard.Client, tmp_path: Path) -> None:
    out = tmp_path / "run"
    common: dict[str, Any] = {"agent": seeded_agent, "reward": check_reward, "progress": False, "out": out, "n": 1}
    await orchard.rollout.run(local_client, make_tasks("always"), **common)
    with open(out / "results.jsonl", "a") as f:
        f.write('{"v": 1, "task": "never", "attempt": 0, "ki')  # a process killed mid-write
    rerun = await orchard.rollout.run(local_client, make_tasks("always", "never"), **common)
    assert rerun.counts["ok"] == 2
    # The partial line is gone and the new record is a line of its own: every line parses.
    assert [(r["task"], r["attempt"]) for r in lines(out)] == [("always", 0), ("never", 0)]


TOYS = Path(__file__).parent.parent / "examples" / "tasks" / "swe-mini.jsonl"


async def test_toy_tasks_start_through_task_sandbox_and_grade_by_swe_reward(
    local_client: orchard.Client, local_root: Path
) -> None:
    """The toy SWE tasks on the local backend: each attempt's repository is the task's local_dir, committed."""
    toys = orchard.tasks.load(TOYS)
    policy = orchard.tasks.ScriptedPolicy(p_right=0.5, seed=0)
    results = await orchard.rollout.run(
        local_client, toys, agent=policy, reward=orchard.tasks.swe_reward, n=2, concurrency=8, progress=False
    )
    assert results.counts["ok"] == 12
    assert results.pass_rate == {t.id: sum(policy.chooses_right(t, a) for a in range(2)) / 2 for t in toys}
    assert 0 < results.overall < 1  # type: ignore[operator]
    for r in results.records:
        assert r["answer"].startswith("diff --git")  # the sandbox's git diff against the committed local_dir
        assert r["solved"] == all(s == "PASSED" for s in r["tests"].values())

    # A SWE-bench task without local_dir cannot run on the local backend: refused before any sandbox starts.
    bare = dataclasses.replace(toys[0], local_dir=None)
    with pytest.raises(TaskError, match="needs local_dir"):
        await orchard.rollout.run(local_client, [bare], agent=policy, reward=orchard.tasks.swe_reward, progress=False)
    assert no_sandboxes(local_root)
