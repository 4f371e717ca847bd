"""Failures surface quickly as typed errors with the reason, never as a timeout much later."""

from __future__ import annotations

import asyncio
import time

import pytest
from docker_support import BUSYBOX, NONROOT, SWE, SandboxFactory, containers, engine, inspect

import orchard
from orchard._backends import DockerConfig
from orchard.errors import OrchardError, SandboxLost, SandboxStartError, SandboxTimeout

pytestmark = pytest.mark.docker

#: Well under any timeout a test would otherwise hit: "quickly" means seconds.
QUICK = 20.0


async def start_error(client: orchard.Client, image: str, **spec: object) -> SandboxStartError:
    t0 = time.monotonic()
    with pytest.raises(SandboxStartError) as info:
        await client.create(image, start_timeout=120, **spec)
    assert time.monotonic() - t0 < QUICK, "the failure was not reported quickly"
    assert not isinstance(info.value, SandboxTimeout)
    return info.value


async def test_a_missing_image_with_pulls_off(client: orchard.Client) -> None:
    error = await start_error(client, "orchard-test/no-such-image:1", image_pull_policy="Never")
    assert error.reason == "ErrImageNeverPull"
    assert "orchard-test/no-such-image:1" in str(error)
    assert "image_pull_policy" in str(error)
    assert error.sandbox_id is not None
    assert containers(f"orchard.dev/sandbox={error.sandbox_id}") == []


async def test_a_missing_image_whose_pull_fails(client: orchard.Client) -> None:
    # A registry on a loopback port nobody listens on: the pull fails at once, and only locally.
    error = await start_error(client, "127.0.0.1:9/orchard/missing:1")
    assert error.reason == "ErrImagePull"
    assert "pulling it failed" in str(error)


async def test_a_missing_injector_image(docker_ready: str) -> None:
    async with orchard.Client(DockerConfig(injector_image="orchard-executor:no-such-tag")) as client:
        error = await start_error(client, BUSYBOX)
    assert error.reason == "InjectorImageNotFound"
    assert "Dockerfile.executor" in str(error)


async def test_no_docker_engine(docker_ready: str) -> None:
    async with orchard.Client(DockerConfig(host="unix:///nonexistent/docker.sock")) as client:
        error = await start_error(client, BUSYBOX)
    assert error.reason == "DockerUnavailable"
    assert "DOCKER_HOST" in str(error)


async def test_a_container_that_dies_at_start_reports_the_executor_output(client: orchard.Client) -> None:
    # An unprivileged user with nowhere to write: the executor cannot make its state directory.
    error = await start_error(client, NONROOT)
    assert error.reason == "exited(1)"
    assert "No usable temporary directory" in str(error)
    assert containers(f"orchard.dev/sandbox={error.sandbox_id}") == []


async def test_oom_at_start(client: orchard.Client) -> None:
    error = await start_error(client, BUSYBOX, memory="12Mi")
    assert error.reason == "OOMKilled"
    assert containers(f"orchard.dev/sandbox={error.sandbox_id}") == []


async def test_start_timeout(client: orchard.Client) -> None:
    with pytest.raises(SandboxTimeout, match="start_timeout") as info:
        await client.create(BUSYBOX, start_timeout=0.05)
    await asyncio.sleep(0.5)
    assert containers(f"orchard.dev/sandbox={info.value.sandbox_id}") == []
    assert isinstance(info.value, TimeoutError)


async def lost_during(sb: orchard.Sandbox, cmd: list[str] | str, act: object) -> SandboxLost:
    """Run ``cmd``, do ``act`` to the container while it runs, and return the error the exec raised."""
    task = asyncio.create_task(sb.exec(cmd, timeout=300))
    await asyncio.sleep(1.0)
    assert not task.done()
    t0 = time.monotonic()
    act()  # type: ignore[operator]
    with pytest.raises(SandboxLost) as info:
        await task
    assert time.monotonic() - t0 < QUICK, "the loss was not reported quickly"
    assert isinstance(info.value, ConnectionError)
    assert info.value.sandbox_id == sb.id
    return info.value


async def test_a_container_removed_under_a_running_exec(sandbox: SandboxFactory) -> None:
    sb = await sandbox(BUSYBOX)
    error = await lost_during(sb, ["sleep", "300"], lambda: engine("DELETE", f"/containers/{sb.id}?force=1"))
    assert error.reason == "removed"
    assert "removed" in str(error)


async def test_a_container_killed_under_a_running_exec(sandbox: SandboxFactory) -> None:
    sb = await sandbox(BUSYBOX)
    error = await lost_during(sb, ["sleep", "300"], lambda: engine("POST", f"/containers/{sb.id}/kill"))
    assert error.reason == "exited(137)"
    # Every later call says the same, at once.
    with pytest.raises(SandboxLost, match="exited"):
        await sb.read_file("/etc/hostname")


async def test_an_oom_kill_of_the_sandbox(sandbox: SandboxFactory) -> None:
    sb = await sandbox(SWE, memory="128Mi")
    # Make the executor (PID 1) the kernel's first choice, then exceed the limit.
    hog = "echo 1000 > /proc/1/oom_score_adj && exec python3 -c 'b = bytearray(1 << 30); print(len(b))'"
    task = asyncio.create_task(sb.exec(hog, timeout=300))
    t0 = time.monotonic()
    with pytest.raises(SandboxLost) as info:
        await task
    assert time.monotonic() - t0 < QUICK
    assert info.value.reason == "OOMKilled"
    state = inspect(sb.id)["State"]  # type: ignore[index]
    assert state["OOMKilled"]


async def test_a_command_oom_killed_alone_leaves_the_sandbox_alive(sandbox: SandboxFactory) -> None:
    sb = await sandbox(SWE, memory="128Mi")
    r = await sb.exec(["python3", "-c", "b = bytearray(1 << 30)"], timeout=300)
    assert r.signal == 9
    assert (await sb.exec(["true"])).ok


async def test_errors_are_orchard_errors(client: orchard.Client) -> None:
    with pytest.raises(OrchardError):
        await client.create("orchard-test/no-such-image:1", image_pull_policy="Never")
