"""Fixtures for tests against a real Kubernetes (``-m k8s``).

The cluster is the dev cluster from ``hack/devcluster/devcluster up`` (or any
cluster ``$KUBECONFIG`` names). When it cannot be reached the tests FAIL with
the reason; they never skip, so a broken cluster cannot pass CI.

Fixtures:

* ``kubeconfig`` (session): path of a kubeconfig whose cluster answered.
* ``k8s_api``: a ``kubernetes_asyncio`` ``ApiClient`` for that cluster.
* ``k8s_namespace``: a fresh namespace (its default service account exists),
  deleted with everything in it after the test.
* ``kubectl``: argv prefix running kubectl against that cluster.
* ``service_account_kubeconfig``: makes a kubeconfig whose user is a service
  account of ``k8s_namespace`` (a fresh token), to test what its Role allows.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import yaml
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.api_client import ApiClient

DEVCLUSTER_KUBECONFIG = Path("/var/lib/orchard-devcluster/kubeconfig")
DEVCLUSTER_CACHE = Path(os.environ.get("ORCHARD_K8S_CACHE", "/var/cache/orchard/k8s"))
TEST_LABEL = "orchard.test/pytest"

HELP = "bring the dev cluster up with `hack/devcluster/devcluster up` (or point $KUBECONFIG at a cluster)"


def _kubeconfig_path() -> Path:
    env = os.environ.get("KUBECONFIG")
    if env:
        return Path(env.split(os.pathsep)[0])
    return DEVCLUSTER_KUBECONFIG


async def _load(path: Path) -> client.Configuration:
    cfg = client.Configuration()
    await config.load_kube_config(config_file=str(path), client_configuration=cfg)
    return cfg


async def _probe(path: Path) -> str:
    cfg = await _load(path)
    async with ApiClient(configuration=cfg) as api:
        version = await asyncio.wait_for(client.VersionApi(api).get_code(), 10)
        nodes = await asyncio.wait_for(client.CoreV1Api(api).list_node(), 10)
    ready = [
        n.metadata.name
        for n in nodes.items
        if any(c.type == "Ready" and c.status == "True" for c in n.status.conditions or [])
    ]
    if not ready:
        raise RuntimeError(f"no Ready node among {[n.metadata.name for n in nodes.items]}")
    return f"{version.git_version}, Ready nodes {ready}"


@pytest.fixture(scope="session")
def kubeconfig() -> str:
    """Path of a kubeconfig for a reachable cluster with a Ready node; fails (never skips) otherwise."""
    path = _kubeconfig_path()
    if not path.exists():
        pytest.fail(f"no kubeconfig at {path}: {HELP}", pytrace=False)
    try:
        asyncio.run(_probe(path))
    except Exception as e:  # noqa: BLE001 - any reason the cluster is unusable fails the test with it
        pytest.fail(f"Kubernetes cluster of {path} unreachable: {type(e).__name__}: {e}\n{HELP}", pytrace=False)
    return str(path)


@pytest.fixture
async def k8s_api(kubeconfig: str) -> AsyncIterator[ApiClient]:
    """An ApiClient for the test cluster, on this test's event loop."""
    cfg = await _load(Path(kubeconfig))
    async with ApiClient(configuration=cfg) as api:
        yield api


@pytest.fixture
async def k8s_namespace(k8s_api: ApiClient, request: pytest.FixtureRequest) -> AsyncIterator[str]:
    """A fresh namespace, ready for pods; deleted (with its pods) after the test."""
    core = client.CoreV1Api(k8s_api)
    name = f"orchard-test-{secrets.token_hex(4)}"
    body = client.V1Namespace(
        metadata=client.V1ObjectMeta(
            name=name, labels={TEST_LABEL: "1"}, annotations={"orchard.test/node": request.node.nodeid[:250]}
        )
    )
    await core.create_namespace(body)
    try:
        # The ServiceAccount admission plugin rejects pods until the namespace's default SA exists.
        deadline = time.monotonic() + 30
        while True:
            sas = await core.list_namespaced_service_account(name, field_selector="metadata.name=default")
            if sas.items:
                break
            if time.monotonic() > deadline:
                pytest.fail(f"default service account of namespace {name} never appeared (kube-controller-manager?)")
            await asyncio.sleep(0.1)
        yield name
    finally:
        await core.delete_namespace(name, grace_period_seconds=0, propagation_policy="Background")


def _kubectl_binary() -> str:
    found = os.environ.get("KUBECTL") or shutil.which("kubectl")
    if found:
        return found
    cached = sorted(DEVCLUSTER_CACHE.glob("v*/bin/kubectl"))
    if cached:
        return str(cached[-1])
    pytest.fail(f"no kubectl on PATH nor in {DEVCLUSTER_CACHE}: {HELP}", pytrace=False)


@pytest.fixture(scope="session")
def kubectl(kubeconfig: str) -> list[str]:
    """argv prefix for kubectl against the test cluster."""
    return [_kubectl_binary(), f"--kubeconfig={kubeconfig}"]


@pytest.fixture
def service_account_kubeconfig(
    kubeconfig: str, k8s_namespace: str, k8s_api: ApiClient, tmp_path: Path
) -> Callable[[str], Awaitable[str]]:
    """``await make(account)``: the path of a kubeconfig for the test cluster as that service account."""

    async def make(account: str) -> str:
        request = client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[]))
        core = client.CoreV1Api(k8s_api)
        token = (await core.create_namespaced_service_account_token(account, k8s_namespace, request)).status.token
        cluster = yaml.safe_load(Path(kubeconfig).read_text())["clusters"][0]
        path = tmp_path / f"{account}.kubeconfig"
        path.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [cluster],
                    "users": [{"name": account, "user": {"token": token}}],
                    "contexts": [{"name": account, "context": {"cluster": cluster["name"], "user": account}}],
                    "current-context": account,
                }
            )
        )
        return str(path)

    return make
