"""The example notebooks that need Kubernetes run top to bottom in a fresh kernel (see tests/test_notebooks.py).

The notebook finds the cluster as a user's does: ``$KUBECONFIG`` (the test
cluster's) and ``$ORCHARD_NAMESPACE`` (a fresh namespace), set here and
inherited by the kernel process.
"""

from __future__ import annotations

import asyncio

import pytest
from kubernetes_asyncio.client.api_client import ApiClient
from test_k8s_backend import wait_no_pods

from test_notebooks import KUBERNETES, check_notebook

pytestmark = pytest.mark.k8s


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", KUBERNETES)
async def test_kubernetes_notebook_runs(
    name: str, kubeconfig: str, k8s_namespace: str, k8s_api: ApiClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", kubeconfig)
    monkeypatch.setenv("ORCHARD_NAMESPACE", k8s_namespace)
    ran = await asyncio.to_thread(check_notebook, name)
    # It ran in the namespace it was given (the kernel inherited the environment), and left no pod there.
    assert f"namespace: {k8s_namespace} " in "".join(o.get("text", "") for o in ran.cells[1].outputs)
    await wait_no_pods(k8s_api, k8s_namespace)
