"""The shm tests of tests/test_sandbox_shm.py, in real pods (an emptyDir of medium Memory at /dev/shm)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

import orchard
from test_sandbox_shm import *  # noqa: F403

pytestmark = [pytest.mark.k8s]


@pytest.fixture
async def client(kubeconfig: str, k8s_namespace: str) -> AsyncIterator[orchard.Client]:
    """A Client on the kubernetes backend (the transport does not matter to a volume)."""
    config = orchard.KubernetesConfig(namespace=k8s_namespace, kubeconfig=kubeconfig)
    async with orchard.Client(config) as c:
        yield c


@pytest.fixture
def generic_image() -> tuple[str, dict[str, Any]]:
    """The SWE-style Debian image, which has coreutils' stat and dd."""
    return "orchard-test/swe:latest", {"workdir": "/work"}
