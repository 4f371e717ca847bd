"""The docker backend's own promises: one container per sandbox from the task image, limits, labels, cleanup."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from docker_support import BUSYBOX, NOSHELL, SWE, SandboxFactory, containers, engine, events, inspect

import orchard
from orchard._backends import DockerConfig
from orchard._backends.docker import collect_garbage, list_sandboxes, owner_label
from orchard.errors import SandboxLost
from support import eventually

pytestmark = pytest.mark.docker


async def test_one_container_per_sandbox_from_the_task_image_and_removed_on_exit(client: orchard.Client) -> None:
    async with client.sandbox(SWE) as a, client.sandbox(SWE) as b:
        ia, ib = inspect(a.id), inspect(b.id)
        assert ia is not None
        assert ib is not None
        assert ia["Id"] != ib["Id"]
        assert ia["Config"]["Image"] == SWE
        assert ia["State"]["Running"]
        # The task image's command is replaced by the launcher, which runs the injected runtime.
        assert ia["Config"]["Entrypoint"][0] == "/.orchard/runtime/lib/ld.so"
        assert ia["Config"]["Cmd"][0] == "--unix=/.orchard-socket/executor.sock"
        # The task image's own setting stays: the repository is the working directory.
        assert (await a.info()).cwd == "/testbed"
        assert "calc.py" in [e.name for e in await a.list_dir(".")]
    assert inspect(a.id) is None
    assert inspect(b.id) is None


async def test_the_runtime_volume_is_shared_read_only_and_filled_once(docker_ready: str) -> None:
    since = int(time.time()) - 1
    async with orchard.Client("docker") as one, orchard.Client("docker") as two:
        a = await one.create(BUSYBOX)
        b = await two.create(SWE)
        mounts = [[m for m in inspect(sb.id)["Mounts"] if m["Type"] == "volume"] for sb in (a, b)]  # type: ignore[index]
        assert mounts[0] == mounts[1]
        (mount,) = mounts[0]
        assert (mount["Type"], mount["Destination"], mount["RW"]) == ("volume", "/.orchard", False)
        assert mount["Name"].startswith("orchard-runtime-")
        r = await a.exec(["touch", "/.orchard/runtime/x"])
        assert r.exit_code != 0
        assert "Read-only" in r.stderr
    # Two clients, two sandboxes: the installer ran at most once (once per process), and is gone.
    found = events(since, int(time.time()) + 1, label=["orchard.dev/role=installer"], event=["create"])
    mine = [e for e in found if e["Actor"]["Attributes"].get("orchard.dev/owner") == owner_label()]
    assert len(mine) <= 1, mine
    left = [c for c in containers("orchard.dev/role=installer") if c["Labels"]["orchard.dev/owner"] == owner_label()]
    assert left == []


async def test_labels_and_the_executor_reached_on_orchards_bridge(docker_ready: str) -> None:
    async with orchard.Client(DockerConfig(transport="tcp")) as client:
        sb = await client.create(BUSYBOX, labels={"team": "rl"}, annotations={"run": "7"})
        await _labels_and_bridge(sb, client)


async def _labels_and_bridge(sb: orchard.Sandbox, client: orchard.Client) -> None:
    info = inspect(sb.id)
    assert info is not None
    labels = info["Config"]["Labels"]
    assert labels["team"] == "rl"
    assert labels["run"] == "7"
    assert labels["orchard.dev/role"] == "sandbox"
    assert labels["orchard.dev/sandbox"] == sb.id
    assert labels["orchard.dev/session"] == client.session_id
    assert labels["orchard.dev/owner"].split("/")[1] == str(os.getpid())
    assert labels["orchard.dev/image"] == BUSYBOX
    # Nothing is published on the host: the executor is reached at the container's address
    # on Orchard's internal network, whose bridge is an interface of this host.
    assert not info["NetworkSettings"]["Ports"]
    ((name, endpoint),) = info["NetworkSettings"]["Networks"].items()
    assert name == "orchard-internal"
    assert sb._rpc._base == f"https://{endpoint['IPAddress']}:8750"
    status, network = engine("GET", "/networks/orchard-internal")
    assert status == 200, network
    assert network["Internal"] is True
    assert network["Options"]["com.docker.network.bridge.enable_icc"] == "false"


async def test_a_network_of_ones_own_publishes_the_port_on_loopback_only(docker_ready: str) -> None:
    name = f"orchard-test-{os.getpid()}"
    status, created = engine("POST", "/networks/create", {"Name": name, "Labels": {"orchard.dev/test": "1"}})
    assert status == 201, created
    try:
        async with orchard.Client(DockerConfig(network=name)) as client, client.sandbox(BUSYBOX) as sb:
            info = inspect(sb.id)
            assert info is not None
            assert list(info["NetworkSettings"]["Networks"]) == [name]
            bindings = info["NetworkSettings"]["Ports"]["8750/tcp"]
            assert {b["HostIp"] for b in bindings} == {"127.0.0.1"}
            assert sb._rpc._base == f"https://127.0.0.1:{bindings[0]['HostPort']}"
            assert (await sb.exec(["true"])).ok
    finally:
        assert engine("DELETE", f"/networks/{created['Id']}")[0] == 204


async def test_only_the_token_hash_reaches_the_container(sandbox: SandboxFactory) -> None:
    sb = await sandbox(BUSYBOX)
    token = sb._rpc._headers["Authorization"].removeprefix("Bearer ")
    info = inspect(sb.id)
    assert info is not None
    config = repr(info["Config"]) + repr(info["HostConfig"])
    assert token not in config
    assert f"--token-sha256={hashlib.sha256(token.encode()).hexdigest()}" in info["Config"]["Cmd"]
    assert token not in (await sb.exec(["cat", "/proc/1/cmdline"])).stdout
    assert token not in (await sb.exec(["cat", "/proc/1/environ"])).stdout


async def test_cpu_and_memory_limits_are_enforced_by_the_container(sandbox: SandboxFactory) -> None:
    sb = await sandbox(SWE, cpu="500m", memory="256Mi")
    host = inspect(sb.id)["HostConfig"]  # type: ignore[index]
    assert host["NanoCpus"] == 500_000_000
    assert host["Memory"] == 256 * 1024 * 1024
    assert host["MemorySwap"] == 256 * 1024 * 1024
    r = await sb.exec("cat /sys/fs/cgroup/memory.max 2>/dev/null || cat /sys/fs/cgroup/memory/memory.limit_in_bytes")
    assert int(r.stdout) == 256 * 1024 * 1024
    r = await sb.exec(
        "cat /sys/fs/cgroup/cpu.max 2>/dev/null || cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us /sys/fs/cgroup/cpu/cpu.cfs_period_us"
    )
    quota, period = (int(x) for x in r.stdout.split())
    assert quota / period == 0.5


async def test_env_and_workdir(sandbox: SandboxFactory) -> None:
    sb = await sandbox(SWE, env={"TASK": "overridden", "EXTRA": "a b"}, workdir="/scratch/job")
    assert (await sb.info()).cwd == "/scratch/job"
    r = await sb.exec('printf "%s|%s|%s" "$TASK" "$EXTRA" "$PWD"')
    assert r.stdout == "overridden|a b|/scratch/job"
    assert (await sb.exec(["git", "-C", "/testbed", "log", "--oneline"])).stdout.endswith("the task, as given\n")


async def test_a_swe_style_task_runs_its_tests_fixes_and_passes(sandbox: SandboxFactory) -> None:
    sb = await sandbox(SWE)
    r = await sb.exec("python3 -m unittest -q", timeout=60)
    assert r.exit_code == 1
    shell = await sb.shell()
    await shell.exec("cd /testbed && export FIXED=1")
    await sb.write_file("calc.py", (await sb.read_file("calc.py")).replace(b"a - b", b"a + b"))
    r = await shell.exec('python3 -m unittest -q && echo "$FIXED $PWD"', timeout=60)
    assert r.ok, r.stderr
    assert r.stdout == "1 /testbed\n"
    assert "calc.py" in (await sb.exec(["git", "status", "--short"])).stdout


async def test_closing_the_client_removes_every_container(docker_ready: str) -> None:
    async with orchard.Client("docker") as client:
        sandboxes = await asyncio.gather(*(client.create(BUSYBOX) for _ in range(3)))
        assert all(inspect(sb.id) is not None for sb in sandboxes)
    assert [inspect(sb.id) for sb in sandboxes] == [None, None, None]
    assert containers(f"orchard.dev/session={client.session_id}") == []


async def test_closing_the_client_during_a_create_fails_it_and_removes_its_container(docker_ready: str) -> None:
    client = orchard.Client("docker")
    creating = asyncio.create_task(client.create(SWE))
    session = f"orchard.dev/session={client.session_id}"

    async def created() -> bool:
        return bool(await asyncio.to_thread(containers, session))

    await eventually(created, what="the sandbox's container exists")
    await client.aclose()
    # It was aiohttp's RuntimeError("Session is closed"), and the container was left behind.
    with pytest.raises(orchard.errors.SandboxClosed, match="closed while the sandbox started"):
        await asyncio.wait_for(creating, 30)
    assert containers(session) == []


async def test_ttl_ends_the_sandbox_with_the_reason(sandbox: SandboxFactory) -> None:
    sb = await sandbox(BUSYBOX, ttl=2)
    assert (await sb.exec(["true"])).ok
    with pytest.raises(SandboxLost) as info:
        await sb.exec(["sleep", "60"])
    assert info.value.reason == "ttl"


async def test_idle_timeout_stops_the_executor_and_the_container(sandbox: SandboxFactory) -> None:
    sb = await sandbox(BUSYBOX, idle_timeout=1)
    await eventually(lambda: not inspect(sb.id)["State"]["Running"], what="the idle container stopped")  # type: ignore[index]
    with pytest.raises(SandboxLost) as info:
        await sb.exec(["true"])
    assert info.value.reason == "exited(0)"
    assert "idle" in str(info.value)


ORPHAN_MAKER = textwrap.dedent(
    """
    import asyncio, os, sys, orchard

    async def main():
        client = orchard.Client("docker")
        sb = await client.create(sys.argv[1])
        print(sb.id, flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


async def test_gc_removes_the_containers_of_a_client_that_died(docker_ready: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", ORPHAN_MAKER, BUSYBOX], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 120)
        orphan = line.strip()
        assert orphan.startswith("sb-"), line
        config = DockerConfig()
        rows = {row["name"]: row for row in await list_sandboxes(config)}
        assert rows[orphan]["gc"] == ""  # its client is alive: gc keeps it
        assert (orphan, "orphaned") not in await collect_garbage(config, dry_run=True)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert inspect(orphan) is not None  # a killed client cannot clean up
    rows = {row["name"]: row for row in await list_sandboxes(config)}
    assert rows[orphan]["gc"] == "orphaned"
    assert (orphan, "orphaned") in await collect_garbage(config, dry_run=True)
    assert inspect(orphan) is not None  # a dry run removes nothing
    assert (orphan, "orphaned") in await collect_garbage(config)
    assert inspect(orphan) is None


async def test_gc_keeps_live_sandboxes_and_removes_finished_ones(sandbox: SandboxFactory) -> None:
    live = await sandbox(BUSYBOX)
    done = await sandbox(BUSYBOX, idle_timeout=1)
    await eventually(lambda: not inspect(done.id)["State"]["Running"], what="the idle container stopped")  # type: ignore[index]
    removed = dict(await collect_garbage(DockerConfig()))
    assert removed.get(done.id) == "finished"
    assert live.id not in removed
    assert (await live.exec(["true"])).ok


async def test_sandboxes_start_and_work_concurrently(docker_ready: str) -> None:
    images = [BUSYBOX, SWE, NOSHELL] * 4
    async with orchard.Client("docker", max_concurrent_starts=6) as client:

        async def one(i: int, image: str) -> str:
            async with client.sandbox(image, env={"N": str(i)}) as sb:
                await sb.write_file(f"/tmp/{i}.txt", str(i))
                r = await sb.exec(["cat", f"/tmp/{i}.txt"])
                assert r.stdout == str(i)
                assert f"N={i}" in (await sb.exec(["env"])).stdout
                return sb.id

        ids = await asyncio.gather(*(one(i, image) for i, image in enumerate(images)))
    assert len(set(ids)) == len(images)
    assert [inspect(i) for i in ids] == [None] * len(images)
