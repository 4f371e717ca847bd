"""The generic Sandbox tests on the kubernetes backend, in real pods of the SWE-style image.

``client`` and ``generic_image`` override the generic fixtures of tests/conftest.py,
so the modules imported by ``test_generic_*.py`` run unchanged, once through
the pod IP and once through the API server's port-forward.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

import orchard

SWE = "orchard-test/swe:latest"
#: An empty working directory, as the generic tests expect (the image's /testbed holds its repository).
WORKDIR = "/work"


@pytest.fixture(params=["direct", "port-forward"])
async def client(request: pytest.FixtureRequest, kubeconfig: str, k8s_namespace: str) -> AsyncIterator[orchard.Client]:
    """A Client on the kubernetes backend, in a fresh namespace."""
    config = orchard.KubernetesConfig(namespace=k8s_namespace, kubeconfig=kubeconfig, transport=request.param)
    async with orchard.Client(config) as c:
        yield c


@pytest.fixture
def generic_image() -> tuple[str, dict[str, Any]]:
    """The generic tests run in the SWE-style image, in an empty working directory."""
    return SWE, {"workdir": WORKDIR}
