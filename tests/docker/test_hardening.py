"""Docker sandboxes hold against the code inside: capabilities, privileges, pids, networks, runtime.

Each attack here worked on the docker backend before it was hardened (issue 11).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import socket
import subprocess
import textwrap
from collections.abc import AsyncIterator, Iterator

import pytest
from docker_support import SWE, SandboxFactory, engine, inspect

import orchard
from orchard._backends import DockerConfig
from orchard._backends.docker import ensure_network
from orchard._backends.docker_engine import Engine
from orchard.errors import SandboxStartError

pytestmark = pytest.mark.docker

#: Linux capability numbers (include/uapi/linux/capability.h).
CAP_NAMES = (
    "CHOWN DAC_OVERRIDE DAC_READ_SEARCH FOWNER FSETID KILL SETGID SETUID SETPCAP LINUX_IMMUTABLE "
    "NET_BIND_SERVICE NET_BROADCAST NET_ADMIN NET_RAW IPC_LOCK IPC_OWNER SYS_MODULE SYS_RAWIO SYS_CHROOT "
    "SYS_PTRACE SYS_PACCT SYS_ADMIN SYS_BOOT SYS_NICE SYS_RESOURCE SYS_TIME SYS_TTY_CONFIG MKNOD LEASE "
    "AUDIT_WRITE AUDIT_CONTROL SETFCAP MAC_OVERRIDE MAC_ADMIN SYSLOG WAKE_ALARM BLOCK_SUSPEND AUDIT_READ "
    "PERFMON BPF CHECKPOINT_RESTORE"
).split()
#: What a root task needs (documented on DockerConfig.cap_add): files, users, signals, low ports.
DOCUMENTED_CAPS = {"CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID", "NET_BIND_SERVICE"}


def status_field(status: str, name: str) -> str:
    """One field of /proc/<pid>/status."""
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key == name:
            return value.strip()
    raise AssertionError(f"{name} not in {status!r}")


def capabilities(mask: str) -> set[str]:
    """The capability names in a hexadecimal mask such as CapEff's."""
    bits = int(mask, 16)
    return {name for i, name in enumerate(CAP_NAMES) if bits >> i & 1}


@pytest.fixture
async def custom() -> AsyncIterator[list[orchard.Client]]:
    """Clients on the docker backend with a non-default DockerConfig; closed (their sandboxes removed) after."""
    made: list[orchard.Client] = []
    try:
        yield made
    finally:
        for client in made:
            await client.aclose()


def client_with(custom: list[orchard.Client], **options: object) -> orchard.Client:
    """A Client whose DockerConfig has these options."""
    client = orchard.Client(DockerConfig(**options))  # type: ignore[arg-type]
    custom.append(client)
    return client


async def test_root_has_only_the_documented_capabilities(sandbox: SandboxFactory) -> None:
    sb = await sandbox(SWE)
    status = (await sb.exec(["cat", "/proc/self/status"])).stdout
    effective = capabilities(status_field(status, "CapEff"))
    assert effective == DOCUMENTED_CAPS
    assert capabilities(status_field(status, "CapBnd")) == DOCUMENTED_CAPS
    assert not effective & {"MKNOD", "NET_RAW", "SYS_ADMIN", "SYS_CHROOT", "SETFCAP", "AUDIT_WRITE"}
    r = await sb.exec(["mknod", "/tmp/null", "c", "1", "3"])
    assert r.exit_code != 0
    assert "Operation not permitted" in r.stderr
    # Raw sockets (ICMP/ARP spoofing on the bridge) need NET_RAW.
    r = await sb.exec(["python3", "-c", "import socket; socket.socket(socket.AF_INET, socket.SOCK_RAW, 1)"])
    assert "PermissionError" in r.stderr


#: What code in a sandbox would send its executor (PID 1) to end the sandbox and pass its attempt for an infra fault.
SIGNALS = "TERM INT HUP QUIT USR1 USR2 ALRM KILL STOP"


async def test_code_in_the_sandbox_cannot_signal_its_executor(sandbox: SandboxFactory) -> None:
    sb = await sandbox(SWE)
    r = await sb.exec(f"for s in {SIGNALS}; do kill -$s 1; done; sleep 1; echo alive")
    assert r.stdout == "alive\n"
    assert (await sb.exec(["true"])).exit_code == 0
    assert (await sb.info()).pid == 1


async def test_no_new_privileges_a_setuid_binary_gains_nothing(sandbox: SandboxFactory) -> None:
    sb = await sandbox(SWE)
    status = (await sb.exec(["cat", "/proc/self/status"])).stdout
    assert status_field(status, "NoNewPrivs") == "1"
    # A setuid-root program run by an unprivileged user would run as root (euid 0).
    r = await sb.exec(
        "cp /usr/bin/id /tmp/suid-id && chmod u+s /tmp/suid-id && "
        "setpriv --reuid=nobody --regid=nogroup --clear-groups /tmp/suid-id -u"
    )
    assert r.ok, r.stderr
    assert r.stdout == "65534\n"


ROOT_TASK = textwrap.dedent(
    """
    set -eu
    useradd -m alice
    echo hi > /tmp/f && chown alice:alice /tmp/f && stat -c %U /tmp/f
    su alice -c 'id -un; echo secret > ~/s; chmod 600 ~/s'
    cat /home/alice/s
    chmod 644 /home/alice/s
    setpriv --reuid=alice --regid=alice --init-groups id -un
    su alice -c 'sleep 60 >/dev/null 2>&1 & echo $! > /tmp/pid'
    kill "$(cat /tmp/pid)" && echo killed
    mkdir -p /tmp/pkg/DEBIAN /tmp/pkg/usr/share/orchard-hello
    printf 'Package: orchard-hello\\nVersion: 1.0\\nArchitecture: all\\nMaintainer: t <t@localhost>\\nDescription: t\\n' \\
        > /tmp/pkg/DEBIAN/control
    echo hello > /tmp/pkg/usr/share/orchard-hello/hello
    dpkg-deb --build --root-owner-group /tmp/pkg /tmp/orchard-hello.deb >/dev/null
    apt-get install -y -q /tmp/orchard-hello.deb >/dev/null 2>&1
    dpkg-query -W -f '${Status}\\n' orchard-hello
    cat /usr/share/orchard-hello/hello
    git -C /testbed -c user.name=t -c user.email=t@localhost commit -q --allow-empty -m root && echo committed
    """
)


async def test_a_root_task_still_manages_users_files_and_packages(sandbox: SandboxFactory) -> None:
    sb = await sandbox(SWE)
    r = await sb.exec(ROOT_TASK, timeout=60)
    assert r.ok, r.stderr
    assert r.stdout.split("\n") == [
        "alice",
        "alice",
        "secret",
        "alice",
        "killed",
        "install ok installed",
        "hello",
        "committed",
        "",
    ]


async def test_cap_add_adds_a_capability(custom: list[orchard.Client]) -> None:
    client = client_with(custom, cap_add=["SYS_PTRACE", "cap_net_raw"])
    sb = await client.create(SWE)
    status = (await sb.exec(["cat", "/proc/self/status"])).stdout
    assert capabilities(status_field(status, "CapEff")) == DOCUMENTED_CAPS | {"SYS_PTRACE", "NET_RAW"}


async def test_a_bad_capability_is_a_typed_error_naming_the_option(custom: list[orchard.Client]) -> None:
    client = client_with(custom, cap_add=["NO_SUCH_CAP"])
    with pytest.raises(SandboxStartError) as info:
        await client.create(SWE)
    assert "cap_add" in str(info.value)


async def test_default_limits_pids_nofile_and_memory(sandbox: SandboxFactory) -> None:
    sb = await sandbox(SWE)
    host = inspect(sb.id)["HostConfig"]  # type: ignore[index]
    config = DockerConfig()
    assert host["PidsLimit"] == config.pids_limit
    assert config.pids_limit is not None
    assert config.pids_limit > 0
    r = await sb.exec("cat /sys/fs/cgroup/pids.max 2>/dev/null || cat /sys/fs/cgroup/pids/pids.max")
    assert int(r.stdout) == config.pids_limit
    r = await sb.exec("ulimit -Sn; ulimit -Hn")
    assert r.stdout.split() == [str(config.nofile)] * 2
    assert host["Memory"] == host["MemorySwap"] > 0


FORK_LOOP = textwrap.dedent(
    """
    import os, signal
    kids = []
    try:
        for _ in range(500):
            pid = os.fork()
            if pid == 0:
                signal.pause()
                os._exit(0)
            kids.append(pid)
        print("no limit", len(kids))
    except BlockingIOError as exc:
        print("EAGAIN" if exc.errno == 11 else exc, len(kids) < 64)
    finally:
        for pid in kids:
            os.kill(pid, signal.SIGKILL)
        for pid in kids:
            os.waitpid(pid, 0)
    """
)


async def test_the_pids_limit_holds(custom: list[orchard.Client]) -> None:
    client = client_with(custom, pids_limit=64)
    sb = await client.create(SWE)
    r = await sb.exec(["python3", "-c", FORK_LOOP], timeout=60)
    assert r.stdout == "EAGAIN True\n", r.stderr
    # Cleaned up: the sandbox forks again.
    assert (await sb.exec(["true"])).ok


def container_address(sandbox_id: str) -> tuple[str, str]:
    """(IP address, gateway) of a sandbox container on its one network."""
    networks = inspect(sandbox_id)["NetworkSettings"]["Networks"]  # type: ignore[index]
    ((name, net),) = networks.items()
    assert net["IPAddress"], (name, net)
    return net["IPAddress"], net["Gateway"]


CONNECT = textwrap.dedent(
    """
    import socket, sys
    try:
        socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close()
        print("connected")
    except OSError as exc:
        print("failed", type(exc).__name__)
    """
)


async def connects(sb: orchard.Sandbox, host: str, port: int) -> bool:
    """Whether a TCP connection from inside the sandbox to host:port succeeds."""
    r = await sb.exec(["python3", "-c", CONNECT, host, str(port)], timeout=30)
    assert r.stdout.startswith(("connected", "failed")), r.stderr
    return r.stdout.startswith("connected")


@pytest.mark.parametrize("network", [False, True])
async def test_a_sandbox_cannot_reach_another_sandboxs_executor(custom: list[orchard.Client], network: bool) -> None:
    # On a network: with network=True, or on transport tcp (with the default unix transport, a
    # network=False sandbox has no network: tests/docker/test_docker_unix.py).
    client = client_with(custom, transport="tcp")
    a, b = await asyncio.gather(client.create(SWE, network=network), client.create(SWE, network=network))
    b_ip, _ = container_address(b.id)
    a_ip, _ = container_address(a.id)
    assert not await connects(a, b_ip, 8750)
    assert not await connects(b, a_ip, 8750)
    # Each executor still answers its own client.
    assert (await a.exec(["true"])).ok
    assert (await b.exec(["true"])).ok


@contextlib.contextmanager
def listener(address: str) -> Iterator[tuple[socket.socket, int]]:
    """A TCP listener of this host on one address (a port chosen by the kernel)."""
    with socket.socket() as server:
        server.bind((address, 0))
        server.listen()
        server.setblocking(False)
        yield server, server.getsockname()[1]


def accepted(server: socket.socket) -> bool:
    """Whether a connection has reached the listener."""
    try:
        conn, _ = server.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


def _addresses(interface: str) -> list[dict[str, str]]:
    """The IPv4 addresses of a host interface, as ``ip -j`` lists them."""
    out = subprocess.run(["ip", "-j", "-4", "addr", "show", interface], capture_output=True, text=True, check=True)
    return [a for link in json.loads(out.stdout) for a in link.get("addr_info", [])]


@pytest.mark.parametrize("transport", ["unix", "tcp"])
async def test_network_false_has_no_egress_not_even_to_this_host(custom: list[orchard.Client], transport: str) -> None:
    sb = await client_with(custom, transport=transport).create(SWE)  # network=False is the spec's default
    if transport == "tcp":
        _, gateway = container_address(sb.id)
        assert gateway, "the sandbox's network has no gateway"
    else:
        # No network at all: not even the address at which Docker's default bridge reaches this host.
        assert list(inspect(sb.id)["NetworkSettings"]["Networks"]) == ["none"]  # type: ignore[index]
        status, bridge = engine("GET", "/networks/bridge")
        assert status == 200, bridge
        ipam = bridge["IPAM"]["Config"][0]
        # An engine that found docker0 already up lists no Gateway; the bridge's address is then its
        # subnet's first host, as the engine assigns it.
        gateway = ipam.get("Gateway") or str(next(ipaddress.ip_network(ipam["Subnet"]).hosts()))
        assert any(a.get("local") == gateway for a in _addresses(bridge["Options"]["com.docker.network.bridge.name"]))
    with listener(gateway) as (server, port):
        assert not await connects(sb, gateway, port)
        assert not accepted(server)
    assert inspect(sb.id)["HostConfig"]["PortBindings"] in ({}, None)  # type: ignore[index]


async def test_network_true_reaches_out(sandbox: SandboxFactory) -> None:
    sb = await sandbox(SWE, network=True)
    _, gateway = container_address(sb.id)
    with listener(gateway) as (server, port):
        assert await connects(sb, gateway, port)
        assert accepted(server)


async def test_an_unknown_runtime_is_a_typed_error_naming_the_option(custom: list[orchard.Client]) -> None:
    client = client_with(custom, runtime="no-such-runtime")
    with pytest.raises(SandboxStartError) as info:
        await client.create(SWE, start_timeout=30)
    assert "runtime" in str(info.value)
    assert "no-such-runtime" in str(info.value)
    assert info.value.reason == "UnknownRuntime"
    # A runtime the engine has is used.
    sb = await client_with(custom, runtime="runc").create(SWE)
    assert inspect(sb.id)["HostConfig"]["Runtime"] == "runc"  # type: ignore[index]


@pytest.mark.parametrize("round_", range(3))
async def test_networks_are_made_once_when_clients_race_and_checked_when_found(docker_ready: str, round_: int) -> None:
    # Eight clients at once: under load the engine refused one before the winner was listed (a CI run's
    # NetworkError "networks have same bridge name"), which a refused client now waits out.
    name, bridge = f"orchard-race-{os.getpid()}-{round_}", f"orch-race{os.getpid() % 100000}{round_}"
    engines = [Engine(None) for _ in range(8)]
    try:
        ids = await asyncio.gather(*(ensure_network(e, name, bridge, egress=False) for e in engines))
        assert len(set(ids)) == 1
        (network,) = await engines[0].networks(name)
        assert network.id == ids[0]
        assert network.internal
        assert (network.options or {})["com.docker.network.bridge.enable_icc"] == "false"
        assert await ensure_network(engines[0], name, bridge, egress=False) == ids[0]
        # Found with other settings (here: internal where egress is asked): refused, by name.
        with pytest.raises(SandboxStartError) as info:
            await ensure_network(engines[0], name, bridge, egress=True)
        assert info.value.reason == "NetworkMismatch"
        assert name in str(info.value)
    finally:
        for network in await engines[0].networks(name):
            await engines[0].request("DELETE", f"/networks/{network.id}")
        for e in engines:
            await e.close()
