"""The ``orchard`` command against the dev cluster as a newcomer meets it: a missing namespace, a Role that
lacks a right, a missing image; ``ls``'s formats. Each runs the real command in a subprocess."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Awaitable, Callable

import pytest
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio.client.api_client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

import orchard
from support import orchard_cli

pytestmark = pytest.mark.k8s

BUSYBOX = "orchard-test/busybox:latest"
PSA = "pod-security.kubernetes.io"


def cluster(kubeconfig: str, namespace: str) -> tuple[str, ...]:
    return ("--namespace", namespace, "--kubeconfig", kubeconfig)


async def test_setup_of_a_missing_namespace_says_so_and_creates_it_when_asked(
    kubeconfig: str, k8s_api: ApiClient
) -> None:
    core = k8s.CoreV1Api(k8s_api)
    name = f"orchard-test-{secrets.token_hex(4)}"
    run = orchard_cli("k8s", "setup", *cluster(kubeconfig, name))
    assert (run.returncode, run.stdout) == (1, "")
    assert run.stderr == (
        f'orchard k8s setup: namespace "{name}" not found: create it (kubectl create namespace {name}), '
        "or pass --create-namespace (create_namespace=True)\n"
    )
    with pytest.raises(ApiException) as missing:
        await core.read_namespace(name)
    assert missing.value.status == 404
    try:
        run = orchard_cli("k8s", "setup", "--create-namespace", *cluster(kubeconfig, name))
        assert run.returncode == 0, run.stderr
        assert run.stdout.splitlines()[0] == f"Namespace/{name} written in {name}"
        labels = (await core.read_namespace(name)).metadata.labels
        assert labels[f"{PSA}/enforce"] == "baseline"
        role = await k8s.RbacAuthorizationV1Api(k8s_api).read_namespaced_role("orchard-client", name)
        assert role.rules
    finally:
        await core.delete_namespace(name, grace_period_seconds=0, propagation_policy="Background")


def test_ls_and_gc_of_a_missing_namespace_say_so(kubeconfig: str) -> None:
    name = f"orchard-test-{secrets.token_hex(4)}"
    for command in (["ls"], ["gc", "--dry-run"]):
        run = orchard_cli(*command, "-n", name, "--kubeconfig", kubeconfig)
        assert (run.returncode, run.stdout) == (1, ""), command
        assert run.stderr == (
            f'orchard {command[0]}: namespace "{name}" not found: create it (kubectl create namespace {name}, '
            "or orchard k8s setup --create-namespace), or pass an existing one\n"
        )


async def test_ls_lists_a_running_sandbox_as_json_names_and_a_table(kubeconfig: str, k8s_namespace: str) -> None:
    empty = orchard_cli("ls", "-n", k8s_namespace, "--kubeconfig", kubeconfig)
    assert (empty.returncode, empty.stdout, empty.stderr) == (0, "", f"no sandboxes in namespace {k8s_namespace}\n")
    config = orchard.KubernetesConfig(namespace=k8s_namespace, kubeconfig=kubeconfig)
    async with orchard.sandbox(BUSYBOX, backend=config) as sb:
        # Blocking this loop while ls runs is fine: a few seconds are well inside the Lease's 60.
        run = orchard_cli("ls", "-n", k8s_namespace, "--kubeconfig", kubeconfig, "--json")
        assert run.returncode == 0, run.stderr
        (row,) = json.loads(run.stdout)
        assert (row["name"], row["image"], row["phase"], row["gc"]) == (sb.id, BUSYBOX, "Running", "")
        quiet = orchard_cli("ls", "-n", k8s_namespace, "--kubeconfig", kubeconfig, "-q")
        assert quiet.stdout == f"{sb.id}\n"
        table = orchard_cli("ls", "-n", k8s_namespace, "--kubeconfig", kubeconfig).stdout.splitlines()
        assert table[0].split() == ["NAME", "SESSION", "PHASE", "IMAGE", "CREATED", "GC"]
        assert table[1].split()[:4] == [sb.id, row["session"], "Running", BUSYBOX]


async def _limited(k8s_api: ApiClient, namespace: str, rules: list[k8s.V1PolicyRule]) -> None:
    """A service account ``limited``, bound to a Role of ``rules`` only."""
    meta = k8s.V1ObjectMeta(name="limited")
    await k8s.CoreV1Api(k8s_api).create_namespaced_service_account(namespace, k8s.V1ServiceAccount(metadata=meta))
    rbac = k8s.RbacAuthorizationV1Api(k8s_api)
    await rbac.create_namespaced_role(namespace, k8s.V1Role(metadata=meta, rules=rules))
    await rbac.create_namespaced_role_binding(
        namespace,
        k8s.V1RoleBinding(
            metadata=meta,
            role_ref=k8s.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="Role", name="limited"),
            subjects=[k8s.RbacV1Subject(kind="ServiceAccount", name="limited", namespace=namespace)],
        ),
    )


async def test_a_role_without_pods_create_is_named_with_the_fix(
    k8s_namespace: str, k8s_api: ApiClient, service_account_kubeconfig: Callable[[str], Awaitable[str]]
) -> None:
    # Everything a client needs but creating pods: its Lease is taken, then the first create is refused.
    rules = [
        k8s.V1PolicyRule(api_groups=["coordination.k8s.io"], resources=["leases"], verbs=["*"]),
        k8s.V1PolicyRule(api_groups=[""], resources=["pods"], verbs=["get", "list", "watch", "delete", "patch"]),
    ]
    await _limited(k8s_api, k8s_namespace, rules)
    limited = await service_account_kubeconfig("limited")
    user = f"system:serviceaccount:{k8s_namespace}:limited"
    run = orchard_cli("demo", "--backend", "kubernetes", *cluster(limited, k8s_namespace), "-n", "4", "-q")
    assert (run.returncode, run.stdout) == (1, "")
    (line,) = run.stderr.splitlines()
    assert line.startswith("orchard demo: sandbox sb-")
    assert line.endswith(
        f': the API server refused the pod: 403 Forbidden: pods is forbidden: User "{user}" cannot create '
        f'resource "pods" in API group "" in the namespace "{k8s_namespace}"; a cluster admin grants a client '
        f"its rights with orchard k8s setup -n {k8s_namespace} --service-account NAME (the client Role, bound "
        "to NAME)"
    )
    # Listing needs only pods and Leases (and not reading the namespace, which this Role may not: ls of an
    # empty namespace then cannot tell it from a missing one, and lists nothing).
    run = orchard_cli("ls", "-n", k8s_namespace, "--kubeconfig", limited)
    assert (run.returncode, run.stderr) == (0, f"no sandboxes in namespace {k8s_namespace}\n")
    # Unbound, the account may do nothing: ls names the right it lacks.
    await k8s.RbacAuthorizationV1Api(k8s_api).delete_namespaced_role_binding("limited", k8s_namespace)
    run = orchard_cli("ls", "-n", k8s_namespace, "--kubeconfig", limited)
    assert (run.returncode, run.stdout) == (1, "")
    assert run.stderr == (
        f"orchard ls: the API server denied this client the right to list pods and Leases in namespace "
        f'\'{k8s_namespace}\': pods is forbidden: User "{user}" cannot list resource "pods" in API group '
        f'"" in the namespace "{k8s_namespace}"; a cluster admin grants a client its rights with orchard k8s '
        f"setup -n {k8s_namespace} --service-account NAME (the client Role, bound to NAME)\n"
    )


def test_a_missing_image_fails_the_demo_once_with_the_kubelets_reason(kubeconfig: str, k8s_namespace: str) -> None:
    image = f"orchard-test/missing-{secrets.token_hex(3)}:1"
    t0 = time.monotonic()
    run = orchard_cli(
        "demo", "--backend", "kubernetes", *cluster(kubeconfig, k8s_namespace), "--image", image, "-n", "4", "-q"
    )
    took = time.monotonic() - t0
    assert (run.returncode, run.stdout) == (1, "")
    (line,) = run.stderr.splitlines()
    assert line.startswith("orchard demo: ")
    assert "ErrImagePull" in line or "ImagePullBackOff" in line, line
    assert image in line
    assert line.endswith(
        "; load the image into the nodes' container runtime (the dev cluster's up imports the images "
        "scripts/docker-setup.sh builds) or push it to a registry the nodes reach"
    )
    print(f"a missing image failed the demo in {took:.1f} s")
