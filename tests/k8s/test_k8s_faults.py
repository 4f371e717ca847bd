"""The kubernetes backend under faults fired at the real dev cluster (``hack/devcluster/faults.py``).

Each test fires one fault mid-run: the API server or etcd crashing and coming
back, the kubelet or containerd restarting, the network between this host and
the pods cut (with and without its connections reset), a node drained or
reclaimed. What must hold: running sandboxes ride out what does not touch
them, everything else is a typed error within seconds, a command runs once,
no file written is lost, and nothing is left behind. The cluster is whole
again after each test (the fixture heals it and waits for it).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio.client.api_client import ApiClient

import orchard
from orchard._backends import kubernetes as k8s_backend
from orchard.errors import ClusterUnavailable, SandboxLost, SandboxStartError, SandboxTimeout
from orchard.rollout._runner import infra_cause

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(300)]

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "hack" / "devcluster"))
import faults  # noqa: E402 - the dev cluster's fault harness, a script beside devcluster.py

BUSYBOX = "orchard-test/busybox:latest"


@pytest.fixture
def cluster(kubeconfig: str) -> Iterator[ModuleType]:
    """The fault harness; after the test, every fault undone and every component serving again."""
    if os.geteuid() != 0:
        pytest.fail("firing faults at the dev cluster needs root (iptables, signals, containerd)", pytrace=False)
    if not faults.dc.healthy():
        pytest.fail(f"the dev cluster is not healthy before the test: {faults.dc.status.__doc__}", pytrace=False)
    try:
        yield faults
    finally:
        faults.heal()
        faults.dc.wait_for("the dev cluster healthy again", faults.dc.healthy, 120, interval=0.5)
        faults.settle()


def config(kubeconfig: str, namespace: str, **extra: Any) -> orchard.KubernetesConfig:
    return orchard.KubernetesConfig(namespace=namespace, kubeconfig=kubeconfig, **extra)


@pytest.fixture
async def kclient(kubeconfig: str, k8s_namespace: str) -> AsyncIterator[orchard.Client]:
    # A long liveness timeout: what ends a request early below is the watch, not the watchdog.
    async with orchard.Client(config(kubeconfig, k8s_namespace, lease_seconds=15), liveness_timeout=60) as c:
        yield c


class Traffic:
    """Execs and file writes against a sandbox in a loop, until stopped; every outcome kept."""

    def __init__(self, sb: orchard.Sandbox) -> None:
        self.sb = sb
        self.ok = 0
        #: When the last call succeeded (monotonic).
        self.last_ok = 0.0
        self.errors: list[BaseException] = []
        self.files: dict[str, str] = {}
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            data = os.urandom(4096)
            try:
                await self.sb.write_file(f"/tmp/traffic/{n}", data)
                self.files[f"/tmp/traffic/{n}"] = hashlib.sha256(data).hexdigest()
                assert (await self.sb.exec(f"echo {n}")).stdout == f"{n}\n"
                self.ok += 1
                self.last_ok = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - every failure is an outcome to report
                self.errors.append(exc)
            await asyncio.sleep(0.1)

    async def stop(self) -> None:
        self._stop.set()
        await self._task

    async def lost_files(self) -> list[str]:
        """Files whose write returned but whose content is not there now."""
        return [
            path
            for path, digest in self.files.items()
            if hashlib.sha256(await self.sb.read_file(path)).hexdigest() != digest
        ]


async def lease_renewed(api: ApiClient, namespace: str) -> float:
    """Seconds since the namespace's one session Lease was last renewed."""
    leases = (await k8s.CoordinationV1Api(api).list_namespaced_lease(namespace)).items
    [lease] = [item for item in leases if item.metadata.name.startswith("orchard-session-")]
    return (time.time() - lease.spec.renew_time.timestamp()) if lease.spec.renew_time else float("inf")


async def lost_through_the_watch(cluster: ModuleType, sb: orchard.Sandbox, namespace: str) -> SandboxLost:
    """Delete the sandbox's pod while its executor cannot be reached; what a call then raises, and how soon.

    With the host cut from the pods, only the watch can tell the call what happened: the
    executor's silence alone would take the Client's liveness_timeout (60 s here).
    """
    with cluster.partitioned():
        pending = asyncio.create_task(sb.exec("echo never"))
        await asyncio.sleep(0.5)
        await asyncio.to_thread(cluster.delete, namespace, sb.id)
        t0 = time.monotonic()
        with pytest.raises(SandboxLost) as info:
            await pending
        assert time.monotonic() - t0 < 20, "the pod's deletion did not end the call before the watchdog would"
    return info.value


@pytest.mark.parametrize("component", ["kube-apiserver", "etcd"])
async def test_the_control_plane_crashing_leaves_sandboxes_running_and_the_watch_resumes(
    kclient: orchard.Client, k8s_api: ApiClient, k8s_namespace: str, cluster: ModuleType, component: str
) -> None:
    async with kclient.sandbox(BUSYBOX) as a, kclient.sandbox(BUSYBOX) as b:
        traffic = Traffic(a)
        outage = asyncio.create_task(asyncio.to_thread(cluster.restart, component, down=4, kill=True))
        await asyncio.sleep(1)
        # A start during the outage: its API calls are retried until the control plane is back.
        async with kclient.sandbox(BUSYBOX) as c:
            assert (await c.exec("echo started")).stdout == "started\n"
        await outage
        # The watch is back, or soon: a pod deleted now, maybe before it reconnected (then it finds the pod
        # gone from a new list, its resource version being older than the new API server keeps), ends its
        # sandbox's calls at once.
        lost = await lost_through_the_watch(cluster, b, k8s_namespace)
        assert lost.reason == "Deleted"
        await traffic.stop()
        # The executors are reached directly: the control plane's outage cost no call.
        assert traffic.errors == []
        assert traffic.ok > 10
        assert await traffic.lost_files() == []
        # The session's Lease outlived the outage and is renewed again (every lease_seconds/3 = 5 s).
        deadline = time.monotonic() + 30
        while await lease_renewed(k8s_api, k8s_namespace) > 6 and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        assert await lease_renewed(k8s_api, k8s_namespace) <= 6


async def test_a_pod_deleted_while_the_watch_was_away_is_found_by_listing_again(
    kclient: orchard.Client, k8s_namespace: str, cluster: ModuleType
) -> None:
    async with kclient.sandbox(BUSYBOX) as sb:
        # Deleted while the API server is down, and etcd's history compacted past it: the watch, back from
        # an older resource version, is refused (410 Gone) and must list again to learn of it.
        await asyncio.to_thread(
            cluster.restart, "kube-apiserver", kill=True, meanwhile=lambda: cluster.forget_pod(k8s_namespace, sb.id)
        )
        with cluster.partitioned():  # the executor may still run until the kubelet ends it: not reachable
            t0 = time.monotonic()
            with pytest.raises(SandboxLost) as info:
                await sb.exec("echo never")
            assert time.monotonic() - t0 < 30, "only the executor's silence ended the call, not the watch"
        assert info.value.reason == "Deleted"


async def test_a_start_while_the_api_server_stays_down_is_a_typed_error(
    kubeconfig: str, k8s_namespace: str, cluster: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(k8s_backend, "API_RETRY_SECONDS", 3.0)
    async with orchard.Client(config(kubeconfig, k8s_namespace)) as c:
        async with c.sandbox(BUSYBOX) as sb:
            outage = asyncio.create_task(asyncio.to_thread(cluster.restart, "kube-apiserver", down=12, kill=True))
            await asyncio.sleep(1)
            t0 = time.monotonic()
            with pytest.raises(ClusterUnavailable, match="did not answer") as info:
                await c.create(BUSYBOX)
            # Typed, and long before start_timeout (120 s): the 3 s of retries, their last backoff, the attempts.
            assert time.monotonic() - t0 < 30
            assert infra_cause(info.value) is info.value  # a rollout retries it, never blames the agent
            # Meanwhile the running sandbox works, and closes once the API server is back.
            assert (await sb.exec("echo alive")).stdout == "alive\n"
            await outage


@pytest.mark.parametrize("component", ["kubelet", "containerd"])
async def test_sandboxes_ride_out_a_node_agent_restart(
    kclient: orchard.Client, cluster: ModuleType, component: str
) -> None:
    async with kclient.sandbox(BUSYBOX) as sb:
        traffic = Traffic(sb)
        await asyncio.to_thread(cluster.restart, component, down=3)
        await asyncio.sleep(1)
        await traffic.stop()
        assert traffic.errors == []
        assert traffic.ok > 10
        assert await traffic.lost_files() == []
        # The node takes new pods again.
        async with kclient.sandbox(BUSYBOX) as new:
            assert (await new.exec("echo new")).stdout == "new\n"


async def test_a_partition_fails_calls_by_their_deadline_and_loses_nothing(
    kubeconfig: str, k8s_namespace: str, cluster: ModuleType
) -> None:
    async with orchard.Client(config(kubeconfig, k8s_namespace), liveness_timeout=3, read_timeout=5) as c:
        async with c.sandbox(BUSYBOX) as sb:
            await sb.write_file("/tmp/before", b"kept")
            with cluster.partitioned():
                for call in (sb.exec("echo cut"), sb.write_file("/tmp/during", b"x")):
                    t0 = time.monotonic()
                    with pytest.raises(SandboxTimeout, match="liveness_timeout=3s"):
                        await call
                    assert time.monotonic() - t0 < 20
            # Healed: the same sandbox answers, and what was written before is there.
            assert (await sb.exec("echo healed")).stdout == "healed\n"
            assert await sb.read_file("/tmp/before") == b"kept"


async def test_an_exec_whose_connection_breaks_is_retried_and_runs_once(
    kclient: orchard.Client, cluster: ModuleType
) -> None:
    async with kclient.sandbox(BUSYBOX) as sb:
        run = asyncio.create_task(sb.exec("echo x >> /tmp/runs; sleep 3; wc -l < /tmp/runs"))
        await asyncio.sleep(1)
        # Its connection reset under it, and no new one possible for a second and a half.
        await asyncio.to_thread(cluster.partition, 1.5, reset_connections=True)
        result = await run
        # The retry carried the same request id: the executor answered it with the first run's result.
        assert (result.exit_code, result.stdout.strip()) == (0, "1")
        assert (await sb.exec("wc -l < /tmp/runs")).stdout.strip() == "1"


async def test_a_pod_deleted_during_a_partition_ends_its_calls_through_the_watch(
    kclient: orchard.Client, k8s_namespace: str, cluster: ModuleType
) -> None:
    async with kclient.sandbox(BUSYBOX) as sb:
        lost = await lost_through_the_watch(cluster, sb, k8s_namespace)
        assert lost.reason == "Deleted"
        # Every later call fails at once with the same reason.
        with pytest.raises(SandboxLost, match="Deleted"):
            await sb.exec("echo after")


async def test_a_drain_evicts_sandboxes_and_refuses_starts_until_the_node_is_back(
    kclient: orchard.Client, cluster: ModuleType
) -> None:
    async with kclient.sandbox(BUSYBOX) as a, kclient.sandbox(BUSYBOX) as b:
        running = [asyncio.create_task(sb.exec("sleep 60")) for sb in (a, b)]
        await asyncio.sleep(0.5)
        drain = asyncio.create_task(asyncio.to_thread(cluster.drain, 6))
        for task in running:
            with pytest.raises(SandboxLost) as info:
                await task
            assert info.value.reason == "Evicted"
        # Cordoned, the only node: a start fails at once with the scheduler's reason (no node to wait for)...
        with pytest.raises(SandboxStartError) as refused:
            await kclient.create(BUSYBOX)
        assert refused.value.reason == "Unschedulable"
        assert sorted(await drain) == sorted([a.id, b.id])
    # ...and succeeds once the node is uncordoned.
    async with kclient.sandbox(BUSYBOX) as c:
        assert (await c.exec("echo back")).stdout == "back\n"


async def test_a_reclaimed_node_ends_its_sandboxes_and_leaves_nothing(
    kclient: orchard.Client, k8s_api: ApiClient, k8s_namespace: str, cluster: ModuleType
) -> None:
    async with kclient.sandbox(BUSYBOX) as a, kclient.sandbox(BUSYBOX) as b:
        traffic = [Traffic(a), Traffic(b)]
        await asyncio.sleep(1)
        gone = await asyncio.to_thread(cluster.reclaim, cluster.dc.NODE_NAME)
        reclaimed = time.monotonic()
        assert sorted(gone) == sorted([a.id, b.id])
        for sb in (a, b):
            with pytest.raises(SandboxLost):
                await sb.exec("echo gone")
        for t in traffic:
            await t.stop()
            assert 0 < t.last_ok < reclaimed
            assert all(isinstance(e, SandboxLost) for e in t.errors), t.errors
    pods = await k8s.CoreV1Api(k8s_api).list_namespaced_pod(k8s_namespace)
    assert pods.items == []
