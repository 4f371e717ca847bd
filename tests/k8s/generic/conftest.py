"""The generic Sandbox tests on the kubernetes backend, in real pods of the SWE-style image.

``client`` and ``sandbox`` override the generic fixtures of tests/conftest.py,
so the modules imported by ``test_generic_*.py`` run unchanged, once through
the pod IP and once through the API server's port-forward.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

import orchard

SWE = "orchard-test/swe:latest"
#: An empty working directory, as the generic tests expect (the image's /testbed holds its repository).
WORKDIR = "/work"

SandboxFactory = Callable[..., Awaitable[orchard.Sandbox]]


@pytest.fixture(params=["direct", "port-forward"])
async def client(request: pytest.FixtureRequest, kubeconfig: str, k8s_namespace: str) -> AsyncIterator[orchard.Client]:
    """A Client on the kubernetes backend, in a fresh namespace."""
    config = orchard.KubernetesConfig(namespace=k8s_namespace, kubeconfig=kubeconfig, transport=request.param)
    async with orchard.Client(config) as c:
        yield c


@pytest.fixture
async def sandbox(client: orchard.Client) -> AsyncIterator[SandboxFactory]:
    """A factory of pods (``"local"``, the generic tests' image, means the SWE-style image)."""
    created: list[orchard.Sandbox] = []

    async def make(image: str = "local", **spec: Any) -> orchard.Sandbox:
        if image == "local":
            image = SWE
            spec.setdefault("workdir", WORKDIR)
        sb = await client.create(image, **spec)
        created.append(sb)
        return sb

    try:
        yield make
    finally:
        results = await asyncio.gather(*(sb.aclose() for sb in created), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
