"""Handles on the docker backend: attach from a real subprocess, who deletes, typed failures."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from docker_support import BUSYBOX, SWE, WORKDIR, inspect

import orchard
from handles_support import attach_in_child, token_of
from orchard import _handle
from orchard.errors import AuthError, InvalidHandle, ProtocolError, SandboxLost

pytestmark = pytest.mark.docker


def _reencoded(handle: str, **changes: Any) -> str:
    return _handle.encode(msgspec.structs.replace(_handle.parse(handle), **changes))


async def test_attach_from_another_process_runs_there_and_the_creator_still_deletes(docker_ready: str) -> None:
    async with orchard.Client("docker") as creator:
        sb = await creator.create(SWE, workdir=WORKDIR)
        await sb.write_file("note.txt", "from the creator\n")
        handle = sb.handle()
        assert handle.backend == "docker"
        assert token_of(handle) not in repr(handle)

        child = await attach_in_child(handle, "docker", {})
        assert child["exit_code"] == 0, child
        assert child["stdout"] == "from the creator\n"
        # The child's client closed without removing the container: it is still the creator's.
        assert await sb.read_file("child.txt") == b"from-child\n"
        assert inspect(sb.id) is not None
    assert inspect(sb.id) is None
    child = await attach_in_child(handle, "docker", {})
    assert child["error"] == "SandboxLost", child


async def test_an_owner_deletes_the_container_when_it_closes(docker_ready: str) -> None:
    async with orchard.Client("docker") as creator:
        sb = await creator.create(SWE, workdir=WORKDIR)
        await sb.write_file("note.txt", "x\n")
        child = await attach_in_child(sb.handle(), "docker", {}, owner=True)
        assert child["exit_code"] == 0, child
        assert inspect(sb.id) is None
        with pytest.raises(SandboxLost):
            await sb.exec("true")


async def test_a_wrong_token_a_wrong_certificate_and_a_deleted_sandbox_fail_typed(docker_ready: str) -> None:
    # Executors on the network (a unix socket's impostor: tests/docker/test_docker_unix.py).
    tcp = orchard.DockerConfig(transport="tcp")
    async with orchard.Client(tcp) as creator, orchard.Client(tcp) as other:
        sb = await creator.create(SWE, workdir=WORKDIR)
        handle = sb.handle()
        with pytest.raises(AuthError):
            await other.attach(_reencoded(handle, token="x" * 43))
        # Whatever presents another certificate at that address is not its executor: the token is not sent.
        with pytest.raises(ProtocolError, match="not its executor"):
            await other.attach(_reencoded(handle, fingerprint=secrets.token_bytes(32)))
        with pytest.raises(InvalidHandle, match="Client\\('docker'"):
            async with orchard.Client(orchard.LocalConfig(isolation="bwrap")) as local:
                await local.attach(handle)
        assert (await sb.exec("true")).exit_code == 0
        await sb.aclose()
        with pytest.raises(SandboxLost):
            await other.attach(handle)


@pytest.fixture
def foreign_container() -> Iterator[str]:
    """A container on the engine that is not an Orchard sandbox (testcontainers starts and removes it)."""
    from testcontainers.core.config import testcontainers_config
    from testcontainers.core.container import DockerContainer

    testcontainers_config.ryuk_disabled = True  # its reaper's image is in no registry here; the block removes it
    name = f"not-orchard-{secrets.token_hex(4)}"
    with DockerContainer(BUSYBOX).with_name(name).with_command(["sleep", "300"]):
        info = inspect(name)
        assert info is not None, name
        assert info["State"]["Running"]
        yield name
    assert inspect(name) is None  # removed with its block


async def test_a_handle_naming_another_container_deletes_nothing(docker_ready: str, foreign_container: str) -> None:
    # A handle edited to name some other container of the engine, attached with owner=True,
    # must not let the attaching client remove that container.
    async with orchard.Client("docker") as creator, orchard.Client("docker") as other:
        sb = await creator.create(SWE, workdir=WORKDIR)
        forged = _reencoded(sb.handle(), sandbox_id=foreign_container)
        # (Attached with owner=True, it would be removed when ``other`` closes.)
        with pytest.raises(InvalidHandle, match="not an Orchard sandbox"):
            await other.attach(forged, owner=True)
    assert inspect(foreign_container) is not None
