"""orchard.rollout on Kubernetes with faults injected for real during the run.

Generic tasks x n, graded by ``orchard.tasks.check_reward`` in a pod of its
own. In the faulted run, the first try of some attempts loses its pod while
the agent runs: deleted through the Kubernetes API, evicted through the
Eviction API (policy/v1, pods/eviction, with the test's admin kubeconfig: the
client's Role has no such right), or its executor killed from inside. Those
attempts are retried in new pods and their tries say why; the run finishes,
no pod is left, and every reward equals the fault-free run's of the same seed.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio.client.api_client import ApiClient

import orchard
import orchard.rollout
from orchard.tasks import Task, check_reward
from support import executor_host_pids

pytestmark = pytest.mark.k8s

BUSYBOX = "orchard-test/busybox:latest"
#: Each task's chance that the seeded agent answers right.
CHANCE = {"always": 1.0, "half": 0.5, "never": 0.0}
N = 4


def make_tasks() -> list[Task]:
    return [
        Task(
            id=name,
            image=BUSYBOX,
            instruction="what is 6 x 7? answer in answer.txt",
            workdir="/tmp",
            setup=("echo 'what is 6 x 7' > question.txt",),
            check='test "$(cat)" = 42',  # the answer, on stdin
        )
        for name in CHANCE
    ]


def right(task: Task, attempt: int) -> bool:
    return random.Random(f"{task.id}:{attempt}").random() < CHANCE[task.id]


async def seeded_agent(sb: orchard.Sandbox, task: Task, *, attempt: int) -> str:
    """Reads the question (setup ran), writes an answer right or wrong by the seed, returns it."""
    assert (await sb.read_file("question.txt")).startswith(b"what is")
    answer = "42" if right(task, attempt) else "41"
    assert (await sb.exec(f"echo {answer} > answer.txt")).exit_code == 0
    return (await sb.read_file("answer.txt")).decode().strip()


async def managed_pods(api: ApiClient, namespace: str) -> list[str]:
    listing = await k8s.CoreV1Api(api).list_namespaced_pod(
        namespace, label_selector="app.kubernetes.io/managed-by=orchard"
    )
    return [p.metadata.name for p in listing.items]


@pytest.mark.timeout(600)  # two runs of 24 pods each; the start of a pod takes 3 s here unloaded, 30 s under load
async def test_pods_deleted_evicted_and_killed_mid_run_are_retried_and_rewards_unchanged(
    kubeconfig: str, k8s_api: ApiClient, k8s_namespace: str
) -> None:
    core = k8s.CoreV1Api(k8s_api)
    tasks = make_tasks()

    async def delete(sb: orchard.Sandbox) -> None:
        await core.delete_namespaced_pod(sb.id, k8s_namespace, grace_period_seconds=0)

    async def evict(sb: orchard.Sandbox) -> None:
        eviction = k8s.V1Eviction(metadata=k8s.V1ObjectMeta(name=sb.id, namespace=k8s_namespace))
        await core.create_namespaced_pod_eviction(sb.id, k8s_namespace, eviction)

    async def kill_executor(sb: orchard.Sandbox) -> None:
        # The executor is the pod's PID 1, which code in the sandbox cannot signal: killed from the host.
        pod = await core.read_namespaced_pod(sb.id, k8s_namespace)
        [digest] = [e.value for e in pod.spec.containers[0].env if e.name == "ORCHARD_EXECUTOR_TOKEN_SHA256"]
        for pid in executor_host_pids(digest):
            os.kill(pid, signal.SIGKILL)

    faults: dict[tuple[str, int], Callable[[orchard.Sandbox], Awaitable[None]]] = {
        ("always", 0): delete,
        ("half", 1): delete,
        ("never", 2): delete,
        ("half", 0): evict,
        ("always", 3): kill_executor,
    }
    struck: list[tuple[str, int]] = []

    async def faulty_agent(sb: orchard.Sandbox, task: Task, *, attempt: int) -> str:
        key = (task.id, attempt)
        if key in faults and key not in struck:
            struck.append(key)
            running = asyncio.ensure_future(sb.exec("sleep 60", timeout=90))
            await asyncio.sleep(0.5)
            await faults[key](sb)
            await running  # raises SandboxLost: the pod is gone
            for _ in range(300):  # (if the exec ended first) the next call finds the sandbox lost
                await sb.exec("true")
                await asyncio.sleep(0.1)
        return await seeded_agent(sb, task, attempt=attempt)

    async with orchard.Client(orchard.KubernetesConfig(namespace=k8s_namespace, kubeconfig=kubeconfig)) as client:
        common: dict[str, Any] = {"reward": check_reward, "n": N, "concurrency": 12, "retries": 2, "progress": False}
        t0 = time.monotonic()
        clean = await orchard.rollout.run(client, tasks, agent=seeded_agent, **common)
        t1 = time.monotonic()
        faulted = await orchard.rollout.run(client, tasks, agent=faulty_agent, **common)
        t2 = time.monotonic()
    print(f"fault-free run {t1 - t0:.1f} s, faulted run {t2 - t1:.1f} s ({len(tasks)} tasks x {N})")

    assert sorted(struck) == sorted(faults)
    assert clean.counts["ok"] == faulted.counts["ok"] == len(tasks) * N
    assert clean.pass_rate == {t.id: sum(right(t, a) for a in range(N)) / N for t in tasks}
    assert [(r["task"], r["attempt"], r["reward"], r["solved"]) for r in faulted.records] == [
        (r["task"], r["attempt"], r["reward"], r["solved"]) for r in clean.records
    ]
    # The executor killed: its last reply may say it is stopping before the pod's status does ("unreachable").
    reasons = {
        "delete": ("Deleted", "Error", "Completed"),
        "evict": ("Evicted",),
        "kill_executor": ("Completed", "Error", "Deleted", "unreachable"),
    }
    for r in faulted.records:
        key = (r["task"], r["attempt"])
        if key not in faults:
            assert (r["tries"], r["infra"]) == (1, []), r
            continue
        assert r["tries"] == 2, r
        [failure] = r["infra"]
        assert (failure["phase"], failure["error"]) == ("agent", "SandboxLost"), failure
        assert failure["reason"] in reasons[faults[key].__name__], (key, failure)
        assert failure["sandbox_id"] != r["sandbox_id"]  # the retry ran in a new pod
    for r in clean.records:
        assert (r["tries"], r["infra"]) == (1, [])

    # No pod is left: orchard deleted every one (lost ones included) before run returned.
    deadline = time.monotonic() + 60
    while (left := await managed_pods(k8s_api, k8s_namespace)) and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    assert left == []
