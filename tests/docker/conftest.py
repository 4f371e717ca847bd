"""Fixtures for the docker backend's tests: a real Docker engine, real containers.

``scripts/docker-setup.sh`` installs and starts the engine and builds every
image used here. Tests marked ``docker`` FAIL (never skip) when the engine or
an image is missing: a green run must mean the containers really ran.

``client`` and ``sandbox`` override the generic fixtures of tests/conftest.py,
so the generic Sandbox tests imported by ``test_generic_*.py`` run unchanged on
the docker backend, in the SWE-style Debian image.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from docker_support import IMAGES, INJECTOR, SOCKET, SWE, WORKDIR, SandboxFactory, engine, executor_source_hash

import orchard

CREATED = pytest.StashKey[list[orchard.Sandbox]]()


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


@pytest.fixture(autouse=True)
def _require_docker(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("docker") is not None:
        request.getfixturevalue("docker_ready")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report = yield
    created = item.stash.get(CREATED, [])
    if report.failed and created:  # type: ignore[attr-defined]
        lines = [f"container {sb.id} image={sb.image!r}" for sb in created]
        report.sections.append(("orchard docker sandboxes", "\n".join(lines)))  # type: ignore[attr-defined]
    return report  # type: ignore[no-any-return]


@pytest.fixture
async def client(docker_ready: str) -> AsyncIterator[orchard.Client]:
    """A Client on the docker backend."""
    async with orchard.Client("docker") as c:
        yield c


@pytest.fixture
async def sandbox(client: orchard.Client, request: pytest.FixtureRequest) -> AsyncIterator[SandboxFactory]:
    """A factory of sandboxes (``"local"``, the generic tests' image, means the SWE-style Debian image).

    Every sandbox it made is removed after the test.
    """
    created: list[orchard.Sandbox] = []
    request.node.stash[CREATED] = created

    async def make(image: str = "local", **spec: Any) -> orchard.Sandbox:
        if image == "local":
            # A generic test: it expects to start in an empty working directory, as the
            # local backend gives it (the task image's own, /testbed, holds its repository).
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
