"""``orchard doctor --backend kubernetes``, run as the real command against the dev cluster.

A healthy namespace (set up by ``orchard k8s setup``), a namespace that does not
exist, a trial image that no node has, a service account without the client Role's permissions, and the API
server killed (``hack/devcluster/faults.py``) or stopped while doctor runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio.client.api_client import ApiClient

import orchard
from orchard._backends.kubernetes import setup

pytestmark = pytest.mark.k8s

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "hack" / "devcluster"))
import faults  # type: ignore[import-not-found]  # noqa: E402 - the dev cluster's fault harness, a script beside devcluster.py

#: Held around a fault, so that no other run on this cluster's host has its API server killed under it.
CLUSTER_LOCK = "/tmp/orchard-cluster.lock"
API_CHECKS = ("namespace", "rbac", "injector-image", "trial-image", "image-volumes", "network-policies", "sandbox")


def doctor(kubeconfig: str, namespace: str, *args: str) -> tuple[int, dict[str, Any], float]:
    """Exit status, JSON report and seconds taken of ``orchard doctor --backend kubernetes --json ARGS``."""
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "orchard", "doctor", "--backend", "kubernetes", "--json"]
        + ["--kubeconfig", kubeconfig, "-n", namespace, *args],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert "Traceback" not in r.stderr, r.stderr
    return r.returncode, json.loads(r.stdout), time.monotonic() - t0


def by_name(report: dict[str, Any]) -> dict[str, dict[str, str]]:
    return {c["check"]: c for c in report["checks"]}


async def test_a_healthy_namespace_passes_and_runs_a_sandbox_at_the_pod_ip(kubeconfig: str, k8s_namespace: str) -> None:
    await setup(orchard.KubernetesConfig(namespace=k8s_namespace, kubeconfig=kubeconfig))
    rc, report, _ = await asyncio.to_thread(doctor, kubeconfig, k8s_namespace)
    checks = by_name(report)
    assert rc == 0, report
    assert {n: c["status"] for n, c in checks.items()} == {
        "kubeconfig": "pass",
        "api-server": "pass",
        "namespace": "pass",
        "rbac": "pass",
        "injector-image": "pass",
        "trial-image": "pass",
        "image-volumes": "pass",
        # Whether the plugin enforces them is not told by the API: never a pass.
        "network-policies": "warn",
        "sandbox": "pass",
    }
    assert checks["namespace"]["detail"] == f"namespace {k8s_namespace!r} exists (Pod Security enforce=baseline)"
    assert checks["rbac"]["detail"].startswith(f"all 14 permissions of the orchard-client Role in {k8s_namespace}")
    assert checks["network-policies"]["detail"].endswith("cannot be told from the API: unknown")
    assert re.fullmatch(
        r"started in \d+ ms, the runtime from an image volume, reached directly at the pod IP; "
        r"'echo orchard doctor' answered in \d+ ms",
        checks["sandbox"]["detail"],
    )


def test_a_missing_namespace_fails_and_what_needs_it_is_skipped(kubeconfig: str) -> None:
    namespace = f"orchard-doctor-missing-{secrets.token_hex(4)}"
    rc, report, _ = doctor(kubeconfig, namespace)
    checks = by_name(report)
    assert rc == 1
    assert checks["namespace"] == {
        "backend": "kubernetes",
        "check": "namespace",
        "status": "fail",
        "detail": f"namespace {namespace!r} does not exist",
        "fix": f"kubectl create namespace {namespace}, or a cluster admin runs `orchard k8s setup -n {namespace} "
        "--create-namespace` (also labels it for Pod Security and writes the client Role and NetworkPolicies)",
    }
    assert checks["rbac"]["status"] == "pass"  # the admin's: a review needs no namespace
    for name in ("image-volumes", "network-policies", "sandbox"):
        assert (checks[name]["status"], checks[name]["detail"]) == ("skip", "not run: the namespace check failed")


async def test_a_missing_trial_image_is_a_warning_and_its_sandbox_fails_naming_the_fix(
    kubeconfig: str, k8s_namespace: str
) -> None:
    image = "orchard-test/no-such-image:1"
    rc, report, _ = await asyncio.to_thread(doctor, kubeconfig, k8s_namespace, "--image", image)
    checks = by_name(report)
    assert rc == 1
    fix = "--image IMAGE for an image the nodes have or can pull"
    # A registry might serve it: not on a node is not yet a failure, the start that cannot pull it is.
    assert checks["trial-image"] == {
        "backend": "kubernetes",
        "check": "trial-image",
        "status": "warn",
        "detail": f"{image} is on no node: a pod pulls it where it is missing (IfNotPresent), from a registry that "
        "must serve it",
        "fix": fix,
    }
    sandbox = checks["sandbox"]
    assert (sandbox["status"], sandbox["fix"]) == ("fail", fix)
    assert re.match(r"SandboxStartError: sandbox sb-\S+ failed to start: ErrImagePull: ", sandbox["detail"]), sandbox


async def test_a_service_account_without_the_role_is_told_what_it_lacks(
    k8s_api: ApiClient, k8s_namespace: str, service_account_kubeconfig: Callable[[str], Awaitable[str]]
) -> None:
    sa = "doctor-probe"
    meta = k8s.V1ObjectMeta(name=sa)
    await k8s.CoreV1Api(k8s_api).create_namespaced_service_account(k8s_namespace, k8s.V1ServiceAccount(metadata=meta))
    rbac = k8s.RbacAuthorizationV1Api(k8s_api)
    read_pods = k8s.V1PolicyRule(api_groups=[""], resources=["pods"], verbs=["get", "list", "watch"])
    await rbac.create_namespaced_role(k8s_namespace, k8s.V1Role(metadata=meta, rules=[read_pods]))
    binding = k8s.V1RoleBinding(
        metadata=meta,
        role_ref=k8s.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="Role", name=sa),
        subjects=[k8s.RbacV1Subject(kind="ServiceAccount", name=sa, namespace=k8s_namespace)],
    )
    await rbac.create_namespaced_role_binding(k8s_namespace, binding)
    as_sa = await service_account_kubeconfig(sa)

    rc, report, _ = await asyncio.to_thread(doctor, as_sa, k8s_namespace)
    checks = by_name(report)
    assert rc == 1
    missing = [
        "create pods", "delete pods", "patch pods", "create pods/portforward", "get pods/portforward",
        "create leases", "delete leases", "get leases", "list leases", "patch leases", "update leases",
    ]  # fmt: skip
    assert checks["rbac"] == {
        "backend": "kubernetes",
        "check": "rbac",
        "status": "fail",
        "detail": f"11 of the orchard-client Role's 14 permissions missing in {k8s_namespace} as "
        f"system:serviceaccount:{k8s_namespace}:{sa}: {', '.join(missing)}",
        "fix": f"a cluster admin runs `orchard k8s setup -n {k8s_namespace} --service-account {sa}`",
    }
    # What it may not read is a warning saying so, not a pass and not a failure of the cluster.
    for name in ("namespace", "injector-image", "trial-image", "image-volumes", "network-policies"):
        assert checks[name]["status"] == "warn", checks[name]
    assert checks["sandbox"] == {
        "backend": "kubernetes",
        "check": "sandbox",
        "status": "skip",
        "detail": "not run: the rbac check failed",
        "fix": "",
    }


@contextlib.contextmanager
def cluster_lock(timeout: float = 600) -> Iterator[None]:
    """``flock /tmp/orchard-cluster.lock``: other runs on this host keep their API server while we take it down."""
    with open(CLUSTER_LOCK, "a") as lock:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.fail(f"{CLUSTER_LOCK} still held by another run after {timeout:g} s", pytrace=False)
                time.sleep(1)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextlib.contextmanager
def silent_api_server() -> Iterator[None]:
    """The API server stopped (SIGSTOP): its port still accepts connections, and nothing answers them."""
    pid = faults.dc.pid_of("kube-apiserver")
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


@pytest.mark.timeout(900)  # the lock may be held by another run for minutes
@pytest.mark.parametrize(
    ("fault", "why"),
    [("killed", "cannot connect ("), ("silent", "no answer within 5 s")],
    ids=["killed", "silent"],
)
def test_the_api_server_down_fails_its_check_within_seconds(kubeconfig: str, fault: str, why: str) -> None:
    if os.geteuid() != 0:
        pytest.fail("taking the dev cluster's API server down needs root", pytrace=False)
    runs: list[tuple[int, dict[str, Any], float]] = []
    with cluster_lock():
        assert faults.dc.healthy(), "the dev cluster is not healthy before the test"
        try:
            if fault == "killed":
                faults.restart(
                    "kube-apiserver", kill=True, meanwhile=lambda: runs.append(doctor(kubeconfig, "default"))
                )
            else:
                with silent_api_server():
                    runs.append(doctor(kubeconfig, "default"))
        finally:
            faults.heal()
            faults.dc.wait_for("the dev cluster healthy again", faults.dc.healthy, 120, interval=0.5)
            faults.settle()
        assert faults.dc.healthy()
    ((rc, report, took),) = runs
    checks = by_name(report)
    assert rc == 1
    assert took < 15  # not the library's 30 s of retries
    assert checks["kubeconfig"]["status"] == "pass"
    api = checks["api-server"]
    assert api["status"] == "fail"
    assert api["detail"].startswith(f"https://127.0.0.1:6443 did not answer: {why}"), api
    assert api["fix"] == "check the cluster is up and its address reachable from here: kubectl cluster-info"
    for name in API_CHECKS:
        assert (checks[name]["status"], checks[name]["detail"]) == ("skip", "not run: the api-server check failed")
