"""The rollout runner: tasks x n attempts, each in a fresh sandbox, graded, streamed to ``out=``."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import datetime
import os
import random
import time
import traceback
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .._backends import LocalConfig
from .._spec import make_spec
from ..errors import (
    BrowserCrashed,
    ClusterUnavailable,
    ConfigError,
    NoDisplay,
    OrchardError,
    SandboxClosed,
    SandboxLost,
    SandboxStartError,
    SandboxTimeout,
    TaskError,
)
from ..tasks._sandbox import task_sandbox
from ..tasks._types import Reward, Task
from . import _plan
from ._results import Results
from ._store import SCHEMA_VERSION, Store

if TYPE_CHECKING:
    from .._client import Client
    from .._sandbox import Sandbox
    from ._progress import Progress

#: ``agent(sandbox, task, *, attempt) -> answer``.
Agent = Callable[..., Awaitable[Any]]
#: ``reward(client, task, answer) -> Reward``.
RewardFn = Callable[[Any, Task, Any], Awaitable[Reward]]

#: The errors of the sandbox layer that mean infrastructure, not the agent: retried, never a zero reward.
INFRA_ERRORS: tuple[type[OrchardError], ...] = (
    SandboxStartError,
    SandboxTimeout,
    SandboxLost,
    SandboxClosed,
    # The cluster's API server did not answer for a while (restarting, etcd down).
    ClusterUnavailable,
    # GUI environments: the browser or the X server in the sandbox died.
    BrowserCrashed,
    NoDisplay,
)
#: Seconds before the first retry after an infrastructure failure, doubled for each next one, with jitter
#: (half of it to all of it): retries spread over the seconds a restart or a drain lasts instead of
#: spending every try at once, and many attempts do not come back at the same moment.
RETRY_DELAY = 2.0
#: Kinds whose outcome counts in pass rates (an agent error counts as unsolved).
COUNTED = ("ok", "agent_error")
#: Options of ``client.create`` that are not ``SandboxSpec`` fields.
_CREATE_OPTIONS = ("trace", "model")


def infra_cause(exc: BaseException) -> OrchardError | None:
    """The infrastructure error behind ``exc`` (itself, its cause or context, or inside a group), if any."""
    todo: list[BaseException] = [exc]
    seen: set[int] = set()
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, INFRA_ERRORS):
            return e
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
    return None


def _new_record(task_id: str, attempt: int) -> dict[str, Any]:
    return {
        "v": SCHEMA_VERSION,
        "task": task_id,
        "attempt": attempt,
        "kind": None,
        "reward": None,
        "solved": None,
        "reason": None,
        "tests": {},
        "log_tail": "",
        "answer": None,
        "tries": 0,
        "infra": [],
        "error": None,
        "traceback": None,
        "sandbox_id": None,
        "durations": {},
        "started_at": None,
        "ended_at": None,
        "trace": None,
        "calls": None,
    }


def _failure(phase: str, exc: OrchardError, sandbox_id: str | None) -> dict[str, Any]:
    return {
        "phase": phase,
        "error": type(exc).__name__,
        "message": str(exc),
        "reason": getattr(exc, "reason", None),
        "sandbox_id": exc.sandbox_id or sandbox_id,
    }


def _describe_error(exc: BaseException) -> tuple[str, str]:
    return f"{type(exc).__name__}: {exc}", "".join(traceback.format_exception(exc))


def _stop_if_cancelled() -> None:
    """Raise ``CancelledError`` if this attempt's task was cancelled (its run was) and the cancellation got lost.

    Python 3.11's ``asyncio.wait_for`` (the local backend's start waits for the executor with it) returns the
    result and drops the cancellation when what it waits for ends in the step the cancellation comes: the
    attempt would go on to its agent, which may run for hours, and the cancelled run would wait for it.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class _Run:
    def __init__(
        self,
        client: Client,
        tasks: Sequence[Task],
        *,
        agent: Agent,
        reward: RewardFn,
        plan: _plan.Plan,
        concurrency: int,
        retries: int,
        timeout: float,
        spec: dict[str, Any],
        store: Store | None,
        records: dict[tuple[str, int], dict[str, Any]],
        progress: Progress | None,
    ) -> None:
        self.client = client
        self.tasks = {t.id: t for t in tasks}
        self.agent = agent
        self.reward = reward
        self.plan = plan
        self.concurrency = concurrency
        self.retries = retries
        self.timeout = timeout
        self.spec = spec
        self.store = store
        self.records = records
        self.progress = progress
        #: The ``ModelGateway`` of ``sandbox={"model": ...}``: each attempt's record gets its sandbox's calls.
        self.gateway = spec.get("model")
        self.active = 0
        self.kinds: collections.Counter[str] = collections.Counter()
        self.solved = 0
        for record in records.values():
            self._count(record)
        self._wake = asyncio.Event()

    async def go(self) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                while True:
                    self._record_skips()
                    if self.active < self.concurrency and (nxt := self.plan.start()) is not None:
                        self.active += 1
                        tg.create_task(self._one(*nxt))
                        continue
                    if self.active == 0:
                        break
                    self._wake.clear()
                    await self._wake.wait()
        except BaseExceptionGroup as group:
            # A fatal error of one attempt (the Client closed, a bad sandbox option) ended the run: raise it as is.
            errors = [e for e in group.exceptions if not isinstance(e, asyncio.CancelledError)]
            if len(errors) == 1:
                raise errors[0] from None
            raise

    def _record_skips(self) -> None:
        for task_id, attempt, why in self.plan.take_skips():
            record = _new_record(task_id, attempt)
            now = time.time()
            record.update(kind="skipped", reason=why, started_at=now, ended_at=now)
            self._emit(record)

    def _emit(self, record: dict[str, Any]) -> None:
        self.records[(record["task"], record["attempt"])] = record
        self._count(record)
        if self.store is not None:
            self.store.append(record)
        self._update_progress()

    def _count(self, record: dict[str, Any]) -> None:
        self.kinds[record["kind"]] += 1
        self.solved += record["kind"] == "ok" and bool(record.get("solved"))

    def _update_progress(self, *, force: bool = False) -> None:
        if self.progress is not None:
            self.progress.update(self.kinds, self.solved, self.plan.extras, self.active, force=force)

    async def _one(self, task_id: str, attempt: int) -> None:
        try:
            record = await self._attempt(self.tasks[task_id], attempt)
        finally:
            self.active -= 1
            self._wake.set()
        self.plan.finish(task_id, attempt, record["solved"] if record["kind"] in COUNTED else None)
        self._emit(record)

    async def _attempt(self, task: Task, attempt: int) -> dict[str, Any]:
        record = _new_record(task.id, attempt)
        record["started_at"] = time.time()
        answer: Any = None
        answered = False
        tries = 0
        while tries <= self.retries:
            if tries:
                delay = RETRY_DELAY * 2 ** (tries - 1)
                await asyncio.sleep(random.uniform(delay / 2, delay))
            _stop_if_cancelled()
            tries += 1
            record["tries"] = tries
            if not answered:
                failure = await self._run_agent(task, attempt, record)
                if failure is not None:
                    record["infra"].append(failure)
                    continue
                if record["kind"] == "agent_error":
                    break
                answer, answered = record["answer"], True
                _stop_if_cancelled()
            failure = await self._run_reward(task, answer, record)
            if failure is not None:
                record["infra"].append(failure)
                continue
            break
        else:
            last = record["infra"][-1]
            record.update(
                kind="infra_error",
                reward=None,
                solved=None,
                error=f"{last['error']}: {last['message']}" + (f" (after {tries} tries)" if tries > 1 else ""),
            )
        record["ended_at"] = time.time()
        return record

    async def _run_agent(self, task: Task, attempt: int, record: dict[str, Any]) -> dict[str, Any] | None:
        """One try of the sandbox part: start, setup, agent. Returns the infrastructure failure, if one.

        The sandbox comes from ``orchard.tasks.task_sandbox``: the task's image and workdir, its ``local_dir``
        on the local backend, its setup commands.
        """
        spec = dict(self.spec)
        if self.store is not None and "trace" not in spec:
            spec["trace"] = record["trace"] = self.store.trace_path(task.id, attempt)
        durations = record["durations"] = {}
        sb: Sandbox | None = None
        failure: dict[str, Any] | None = None
        t0 = time.monotonic()
        try:
            async with task_sandbox(self.client, task, **spec) as sb:
                ready = time.monotonic() - t0
                # The sandbox's own start (to its executor ready); the rest is setup (local_dir, commands).
                durations["start"] = min(max(sb.timings.values(), default=ready), ready)
                durations["setup"] = ready - durations["start"]
                record["sandbox_id"] = sb.id
                _stop_if_cancelled()
                failure = await self._in_sandbox(sb, task, attempt, record)
        except OrchardError as exc:
            if sb is not None:
                raise  # not from the start or the setup (those end before the sandbox is handed over)
            durations["start"] = time.monotonic() - t0
            return self._not_ready(exc)
        if self.gateway is not None:
            # The sandbox's model calls, those that ended: the agent awaited its harness, so all of them unless it
            # left one running (cancelled when the key was revoked at close, and recorded a moment later). The
            # record keeps the calls of the try that answered; a failed try's are only counted.
            calls = self.gateway.calls(sb)
            if failure is None:
                record["calls"] = calls
            else:
                failure["calls"] = len(calls)
        return failure

    def _not_ready(self, exc: OrchardError) -> dict[str, Any]:
        """The infrastructure failure of a sandbox that did not get ready for the agent, or raise what is fatal."""
        if isinstance(exc, TaskError):
            # A setup command (or the local_dir commit) failed: the task's environment, maybe a download.
            return {
                "phase": "setup",
                "error": type(exc).__name__,
                "message": str(exc),
                "reason": "setup",
                "sandbox_id": exc.sandbox_id,
            }
        if isinstance(exc, SandboxClosed) and not self._client_open():
            raise exc  # the Client is closed: no attempt can run
        if isinstance(exc, SandboxStartError | SandboxTimeout):
            return _failure("start", exc, None)
        if isinstance(exc, INFRA_ERRORS):
            return _failure("setup", exc, None)  # lost while its setup ran
        if isinstance(exc, ConfigError):
            raise exc  # a sandbox option the backend refuses: no retry fixes it
        return {  # the upload of local_dir or a setup command could not run
            "phase": "setup",
            "error": type(exc).__name__,
            "message": str(exc),
            "reason": "setup",
            "sandbox_id": exc.sandbox_id,
        }

    async def _in_sandbox(self, sb: Sandbox, task: Task, attempt: int, record: dict[str, Any]) -> dict[str, Any] | None:
        """The agent in a ready sandbox. Returns the infrastructure failure, if one."""
        durations = record["durations"]
        t1 = time.monotonic()
        try:
            async with asyncio.timeout(self.timeout) as deadline:
                answer = await self.agent(sb, task, attempt=attempt)
        except Exception as exc:
            durations["agent"] = time.monotonic() - t1
            if not deadline.expired() and (cause := infra_cause(exc)) is not None:
                return _failure("agent", cause, sb.id)
            error, trace = _describe_error(exc)
            if deadline.expired():
                error = f"the agent did not return within timeout={self.timeout:g}s"
            record.update(kind="agent_error", reward=0.0, solved=False, error=error, traceback=trace)
            return None
        durations["agent"] = time.monotonic() - t1
        record["answer"] = answer
        return None

    async def _run_reward(self, task: Task, answer: Any, record: dict[str, Any]) -> dict[str, Any] | None:
        """One try of grading. Returns the infrastructure failure, if one."""
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(self.timeout) as deadline:
                reward = await self.reward(self.client, task, answer)
        except Exception as exc:
            record["durations"]["reward"] = time.monotonic() - t0
            if not deadline.expired() and (cause := infra_cause(exc)) is not None:
                if isinstance(cause, SandboxClosed) and not self._client_open():
                    raise
                return _failure("reward", cause, None)
            error, trace = _describe_error(exc)
            if deadline.expired():
                error = f"the reward did not return within timeout={self.timeout:g}s"
            record.update(kind="reward_error", error=error, traceback=trace)
            return None
        record["durations"]["reward"] = time.monotonic() - t0
        if not isinstance(reward, Reward):
            record.update(kind="reward_error", error=f"the reward function returned {reward!r}, not an orchard Reward")
            return None
        grade = {f.name: getattr(reward, f.name) for f in dataclasses.fields(reward)}
        value = grade.pop("value")
        record.update(grade, kind="ok", reward=float(value), tests=dict(grade.get("tests") or {}))
        return None

    def _client_open(self) -> bool:
        return not getattr(self.client, "_closed", False)


def _describe_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The sandbox options as run.json keeps them: env names without their values (secrets), the gateway's upstream."""
    out = dict(spec)
    if isinstance(out.get("env"), Mapping):
        out["env"] = sorted(out["env"])
    gateway = out.get("model")
    if gateway is not None:
        out["model"] = {"upstream": getattr(gateway, "upstream", None), "model": getattr(gateway, "model", None)}
    return out


def _threshold(adaptive: bool | float) -> float | None:
    if adaptive is True:
        return _plan.DEFAULT_THRESHOLD
    if adaptive is False:
        return None
    if isinstance(adaptive, float | int) and 0 < adaptive < 1:
        return float(adaptive)
    raise ConfigError(f"adaptive={adaptive!r}: give True, False, or a threshold between 0 and 1")


def _check_int(name: str, value: object, least: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ConfigError(f"{name}={value!r} must be an integer of at least {least}")
    return value


def _params(
    tasks: Sequence[Task],
    *,
    n: int,
    threshold: float | None,
    settle: int | None,
    concurrency: int,
    retries: int,
    timeout: float,
    spec: Mapping[str, Any],
    client: Client,
    agent: Agent,
    reward: RewardFn,
) -> dict[str, Any]:
    return {
        "v": SCHEMA_VERSION,
        "n": n,
        "adaptive": threshold is not None,
        "threshold": threshold,
        "settle_after": settle,
        "concurrency": concurrency,
        "retries": retries,
        "timeout": timeout,
        "backend": type(client.config).__name__,
        "agent": getattr(agent, "__qualname__", repr(agent)),
        "reward": getattr(reward, "__qualname__", repr(reward)),
        "sandbox": _describe_spec(spec),
        "tasks": [{"id": t.id, "image": t.image, "instruction": t.instruction, "workdir": t.workdir} for t in tasks],
    }


async def run(
    client: Client,
    tasks: Sequence[Task],
    *,
    agent: Agent,
    reward: RewardFn,
    n: int = 1,
    concurrency: int = 16,
    adaptive: bool | float = False,
    out: str | os.PathLike[str] | None = None,
    retries: int = 2,
    timeout: float = 3600.0,
    sandbox: Mapping[str, Any] | None = None,
    progress: bool = True,
) -> Results:
    """Run every task ``n`` times, each attempt in a fresh sandbox, and grade each answer.

    Args:
        client: an open ``orchard.Client``; every sandbox is started by it.
        tasks: ``orchard.tasks.Task`` objects, their ids unique.
        agent: ``async agent(sandbox, task, *, attempt) -> answer``; the answer is
            what ``reward`` grades (a patch, any JSON-able value; a dict with
            ``"messages"`` is what ``Results.to_chat`` exports).
        reward: ``async reward(client, task, answer) -> orchard.tasks.Reward``
            (``orchard.tasks.swe_reward``); it starts its own sandbox if it needs one.
        n: attempts per task (a GRPO group).
        concurrency: attempts in flight at most, each holding one sandbox at a time
            (its own while the agent runs, the reward's while it grades).
        adaptive: stop a group once its first outcomes agree and give its budget
            to mixed groups (docs/rollout.md: the rule). True is a threshold of
            0.5 on the chance the group would have been mixed; a float sets it.
        out: a directory for results.jsonl (one record per attempt, appended as
            each ends), run.json and the sandbox traces; running again with the
            same ``out`` resumes, running only the attempts not yet finished.
        retries: tries after an infrastructure failure (a sandbox that does not
            start, is lost, or whose executor stops answering) before the attempt
            is recorded as ``infra_error`` (never as reward 0); the first after
            1-2 s, each next one after twice as long.
        timeout: seconds for each setup command, the agent and the reward; past
            it the agent's (or reward's) try fails.
        sandbox: options of ``client.sandbox`` for every attempt (``SandboxSpec``
            fields, ``trace``, ``model``); ``task.workdir`` overrides ``workdir``.
        progress: show a progress bar (tqdm).

    Returns:
        The ``Results``: every attempt's record of this run and, on resume, the earlier ones.

    Raises:
        ConfigError: a bad argument, a bad sandbox option, or ``out`` held by another run
            or holding a run of another ``n`` or ``adaptive``.
    """
    if isinstance(tasks, Task) or not all(isinstance(t, Task) for t in tasks):
        raise ConfigError("tasks must be a sequence of orchard.tasks.Task")
    tasks = list(tasks)
    ids = [t.id for t in tasks]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise ConfigError(f"task ids must be unique; repeated: {dup[:5]}")
    if not callable(agent) or not callable(reward):
        raise ConfigError("agent= and reward= must be async functions")
    n = _check_int("n", n, 1)
    concurrency = _check_int("concurrency", concurrency, 1)
    retries = _check_int("retries", retries, 0)
    if not isinstance(timeout, int | float) or not 0 < timeout < float("inf"):
        raise ConfigError(f"timeout={timeout!r} must be a positive number of seconds")
    threshold = _threshold(adaptive)
    settle = _plan.settle_after(n, threshold) if threshold is not None else None
    spec = dict(sandbox or {})
    plain = {k: v for k, v in spec.items() if k not in _CREATE_OPTIONS}
    for image, workdir in {(t.image, t.workdir) for t in tasks}:
        make_spec(image, plain if workdir is None else {**plain, "workdir": workdir})  # a bad option fails here
    if isinstance(client.config, LocalConfig):
        for t in tasks:
            if t.instance is not None and t.local_dir is None:  # task_sandbox refuses it: say so before any start
                raise TaskError(
                    f"task {t.id}: the local backend has no images, so a SWE-bench task needs local_dir "
                    "(a directory holding its repository); or use the docker or kubernetes backend",
                    field="local_dir",
                    task_id=t.id,
                )

    params = _params(
        tasks,
        n=n,
        threshold=threshold,
        settle=settle,
        concurrency=concurrency,
        retries=retries,
        timeout=timeout,
        spec=spec,
        client=client,
        agent=agent,
        reward=reward,
    )
    store = Store(out) if out is not None else None
    bar: Progress | None = None
    records: dict[tuple[str, int], dict[str, Any]] = {}
    try:
        plan = _plan.Plan(ids, n, settle)
        now = datetime.datetime.now(datetime.UTC).isoformat()
        if store is not None:
            earlier = store.params()
            if earlier is not None:
                for key in ("n", "adaptive", "threshold"):
                    if earlier.get(key) != params[key]:
                        raise ConfigError(
                            f"out={os.fspath(store.dir)!r} holds a run with {key}={earlier.get(key)!r}, and this run "
                            f"has {key}={params[key]!r}: give the same, or another out="
                        )
                known = {t["id"] for t in params["tasks"]}
                params["tasks"] = [t for t in earlier.get("tasks", []) if t.get("id") not in known] + params["tasks"]
                params["runs"] = [*earlier.get("runs", []), now]
            else:
                params["runs"] = [now]
            for record in store.records():
                if record["task"] in plan.groups:
                    plan.restore(record["task"], record["attempt"], record["kind"], record.get("solved"))
                    if record["kind"] in (*COUNTED, "skipped"):
                        records[(record["task"], record["attempt"])] = record
            plan.restored()
            store.write_params(params)
        if progress:
            from ._progress import Progress

            bar = Progress(plan.budget)
        runner = _Run(
            client,
            tasks,
            agent=agent,
            reward=reward,
            plan=plan,
            concurrency=concurrency,
            retries=retries,
            timeout=timeout,
            spec=spec,
            store=store,
            records=records,
            progress=bar,
        )
        runner._update_progress(force=True)
        try:
            await runner.go()
        finally:
            runner._update_progress(force=True)
    finally:
        if bar is not None:
            bar.close()
        if store is not None:
            store.close()
    order = {tid: i for i, tid in enumerate(ids)}
    ordered = sorted(records.values(), key=lambda r: (order[r["task"]], r["attempt"]))
    return Results(ordered, tasks=params["tasks"], params=params)
