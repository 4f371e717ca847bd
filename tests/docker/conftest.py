"""Fixtures for the docker backend's tests: a real Docker engine, real containers.

``scripts/docker-setup.sh`` installs and starts the engine and builds every
image used here. Tests marked ``docker`` FAIL (never skip) when the engine or
an image is missing: a green run must mean the containers really ran.

``client`` and ``sandbox`` override the generic fixtures of tests/conftest.py,
so the generic Sandbox tests imported by ``test_generic_*.py`` run unchanged on
the docker backend, in the SWE-style Debian image.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from docker_support import IMAGES, INJECTOR, SOCKET, SWE, TOOLS, WORKDIR, engine, executor_source_hash

import orchard


@pytest.fixture(scope="session")
def docker_ready() -> str:
    """The engine's version, once it is known to answer and to hold every test image."""
    try:
        status, version = engine("GET", "/version")
    except OSError as exc:
        pytest.fail(f"no Docker engine at {SOCKET} ({exc}): run scripts/docker-setup.sh first", pytrace=False)
    if status != 200:
        pytest.fail(f"the Docker engine answered {status}: {version}", pytrace=False)
    missing = [image for image in IMAGES if engine("GET", f"/images/{image}/json")[0] != 200]
    if missing:
        pytest.fail(f"images missing: {', '.join(missing)}: run scripts/docker-setup.sh", pytrace=False)
    labels = engine("GET", f"/images/{INJECTOR}/json")[1]["Config"]["Labels"] or {}
    if labels.get("orchard.executor.source") != executor_source_hash():
        pytest.fail(
            f"{INJECTOR} was built from other executor sources than this tree's: run scripts/docker-setup.sh",
            pytrace=False,
        )
    return str(version["Version"])


@pytest.fixture(scope="module")
def tools_image(docker_ready: str) -> None:
    """The harness tools image (tools=[...]) is on the engine."""
    if engine("GET", f"/images/{TOOLS}/json")[0] != 200:
        pytest.fail(f"{TOOLS} is missing: run scripts/docker-setup.sh", pytrace=False)


@pytest.fixture(autouse=True)
def _require_docker(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("docker") is not None:
        request.getfixturevalue("docker_ready")


@pytest.fixture
async def client(docker_ready: str) -> AsyncIterator[orchard.Client]:
    """A Client on the docker backend."""
    async with orchard.Client("docker") as c:
        yield c


@pytest.fixture
def generic_image() -> tuple[str, dict[str, Any]]:
    """The generic tests run in the SWE-style Debian image, in an empty working directory."""
    # The task image's own directory, /testbed, holds its repository.
    return SWE, {"workdir": WORKDIR}
