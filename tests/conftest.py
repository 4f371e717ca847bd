"""Shared fixtures.

``client`` is parametrized by backend: the generic Sandbox tests
(``test_sandbox_*.py``, ``test_executor_http.py``) take it and run unchanged
on every backend listed in ``BACKENDS``: plain ``pytest`` runs them on both
local tiers, unisolated and under bubblewrap, as ``scripts/test`` does, and
``ORCHARD_TEST_BACKENDS=local`` chooses the first alone. A tier that cannot
run here FAILS with the reason (``bwrap_ready``), as docker's and k8s's do:
never a smaller run. Backend-specific checks (host pids, directories) live in
their own modules and use ``local_client``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

import orchard

#: Backends the generic tests run on (support.py); other backends add themselves to ``client`` below.
# In support.py, so that test modules import them from there: another conftest can own the name "conftest".
from gateway_support import Upstream, upstream  # noqa: E402
from support import BACKENDS, unisolated_ok  # noqa: E402, F401

SANDBOXES = pytest.StashKey[list[orchard.Sandbox]]()

SandboxFactory = Callable[..., Awaitable[orchard.Sandbox]]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report = yield
    created = item.stash.get(SANDBOXES, [])
    if report.failed and created:  # type: ignore[attr-defined]
        lines = [f"{sb.id} image={sb.image!r}" for sb in created]
        report.sections.append(("orchard sandboxes", "\n".join(lines)))  # type: ignore[attr-defined]
    return report  # type: ignore[no-any-return]


@pytest.fixture
def local_root(tmp_path: Path) -> Path:
    """Where the local backend puts its sandbox directories for this test."""
    return tmp_path / "sandboxes"


@pytest.fixture
async def local_client(local_root: Path) -> AsyncIterator[orchard.Client]:
    """A Client on the local backend (unisolated), its sandboxes under ``local_root``."""
    with unisolated_ok():
        client = await orchard.Client(orchard.LocalConfig(root=str(local_root), isolation="none")).__aenter__()
    async with client:
        yield client


@pytest.fixture
async def unretrieved() -> list[str]:
    """What the test's event loop reports as unhandled ("Task exception was never retrieved"), to assert none."""
    reported: list[str] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, context: reported.append(context["message"]))
    return reported


@pytest.fixture(scope="session")
def bwrap_ready() -> None:
    """Bubblewrap isolates sandboxes here; the local-bwrap tier FAILS (never skips) otherwise."""
    from orchard._backends.local import find_isolation

    try:
        find_isolation("bwrap")
    except orchard.errors.ConfigError as exc:
        pytest.fail(
            f"the local-bwrap tier cannot run: {exc}. scripts/test installs bubblewrap and slirp4netns; "
            "ORCHARD_TEST_BACKENDS=local runs the unisolated tier alone",
            pytrace=False,
        )


@pytest.fixture(params=BACKENDS)
async def client(request: pytest.FixtureRequest, local_root: Path) -> AsyncIterator[orchard.Client]:
    """A Client on each backend the generic tests run on."""
    if request.param == "local":
        config = orchard.LocalConfig(root=str(local_root), isolation="none")
    elif request.param == "local-bwrap":
        request.getfixturevalue("bwrap_ready")
        config = orchard.LocalConfig(root=str(local_root), isolation="bwrap")
    else:
        raise NotImplementedError(f"no client fixture for backend {request.param!r}")
    with unisolated_ok():
        client = await orchard.Client(config).__aenter__()
    async with client:
        yield client


@pytest.fixture
def generic_image() -> tuple[str, dict[str, Any]]:
    """The image (and spec) that ``"local"``, the generic tests' image, means on this backend.

    Container backends override it with a task image and an empty working
    directory, which is what the generic tests expect to start in.
    """
    return "local", {}


@pytest.fixture
async def sandbox(
    client: orchard.Client, request: pytest.FixtureRequest, generic_image: tuple[str, dict[str, Any]]
) -> AsyncIterator[SandboxFactory]:
    """A factory of sandboxes: ``sb = await sandbox(**spec)``; all are deleted after the test."""
    created: list[orchard.Sandbox] = []
    request.node.stash[SANDBOXES] = created

    async def make(image: str = "local", **spec: Any) -> orchard.Sandbox:
        if image == "local":
            image, defaults = generic_image
            spec = defaults | spec
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


@pytest.fixture
async def sb(sandbox: SandboxFactory) -> orchard.Sandbox:
    """One sandbox with the default spec."""
    return await sandbox()


@pytest.fixture
async def quick_client(local_root: Path) -> AsyncIterator[orchard.Client]:
    """A local Client with short deadlines: 2 s to answer, a probe after 1 s of silence."""
    config = orchard.LocalConfig(root=str(local_root), isolation="none")
    async with orchard.Client(config, read_timeout=2.0, liveness_timeout=1.0) as client:
        yield client


@pytest.fixture
async def up() -> AsyncIterator[Upstream]:
    """The scripted model upstream of the gateway tests (tests/gateway_support.py)."""
    async with upstream() as u:
        yield u


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """A client session with a deadline (modules with an ``http`` of their own override it)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        yield s
