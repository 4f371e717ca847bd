"""The docker backend's unix transport (the default): the executor on a socket in a bind-mounted
host directory, no TLS, and no network at all for a sandbox with ``network=False``."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from docker_support import BUSYBOX, NONROOT, SWE, inspect

import orchard
from handles_support import a_swapped_socket_never_gets_the_token
from orchard import DockerConfig
from orchard._backends.docker import collect_garbage, owner_label
from orchard.errors import ConfigError

pytestmark = pytest.mark.docker


def sockets_of(client: orchard.Client) -> str:
    """The client's directory of socket directories."""
    directory = client._backend._sockets  # type: ignore[union-attr]
    assert directory is not None
    return str(directory)


async def test_the_executor_is_on_a_unix_socket_and_a_closed_sandbox_has_no_network(
    tmp_path: Path, docker_ready: str
) -> None:
    async with orchard.Client(DockerConfig(socket_dir=str(tmp_path))) as client:
        sb = await client.create(BUSYBOX)
        info = inspect(sb.id)
        assert info is not None
        assert info["HostConfig"]["NetworkMode"] == "none"
        assert info["Config"]["Cmd"][0] == "--unix=/.orchard-socket/executor.sock"
        assert not info["Config"].get("ExposedPorts")
        (bind,) = [m for m in info["Mounts"] if m["Type"] == "bind"]
        directory = sockets_of(client)
        assert bind["Source"] == os.path.join(directory, sb.id)
        assert bind["Destination"] == "/.orchard-socket"
        # Only this user reaches the sockets; the image's user (any uid) can make its own in its directory.
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        assert os.path.dirname(directory) == str(tmp_path)
        # No TLS and no certificate: the handle holds the socket by its inode.
        assert sb._rpc._base == "http://sandbox"
        assert sb._rpc._session.connector.path.startswith("/proc/self/fd/")  # type: ignore[union-attr]
        fields = orchard._handle.parse(sb.handle())
        assert fields.socket == os.path.join(directory, sb.id, "executor.sock")
        assert fields.inode is not None
        assert fields.fingerprint is None
        # Its only interface is the loopback.
        r = await sb.exec("cat /proc/net/dev")
        interfaces = {line.split(":")[0].strip() for line in r.stdout.splitlines()[2:]}
        assert interfaces == {"lo"}, r.stdout
        assert (await sb.exec("echo hi")).stdout == "hi\n"
        await sb.aclose()
        assert not os.path.exists(os.path.join(directory, sb.id))
    # The client's directory goes with it.
    assert not os.path.exists(directory)


async def test_a_sandbox_with_network_joins_the_egress_network_and_keeps_its_socket(
    client: orchard.Client,
) -> None:
    async with client.sandbox(BUSYBOX, network=True) as sb:
        info = inspect(sb.id)
        assert info is not None
        assert list(info["NetworkSettings"]["Networks"]) == ["orchard-egress"]
        assert info["Config"]["Cmd"][0].startswith("--unix=")
        assert sb._rpc._base == "http://sandbox"
        assert (await sb.exec("echo hi")).stdout == "hi\n"


async def test_a_non_root_image_makes_its_socket_and_is_reached(client: orchard.Client) -> None:
    # The image's user has nowhere to write (tests/docker/test_failures.py) but its socket directory.
    async with client.sandbox(NONROOT, env={"TMPDIR": "/.orchard-socket"}) as sb:
        socket = orchard._handle.parse(sb.handle()).socket
        assert socket is not None
        st = os.stat(socket, follow_symlinks=False)
        assert st.st_uid != 0  # made by the image's user, and open to this client's
        assert stat.S_IMODE(st.st_mode) == 0o666
        assert "executor.sock" in [e.name for e in await sb.list_dir("/.orchard-socket")]


async def test_tcp_keeps_tls_on_orchards_internal_network(docker_ready: str) -> None:
    async with orchard.Client(DockerConfig(transport="tcp")) as client, client.sandbox(BUSYBOX) as sb:
        info = inspect(sb.id)
        assert info is not None
        assert list(info["NetworkSettings"]["Networks"]) == ["orchard-internal"]
        assert sb._rpc._base.startswith("https://")
        assert not [m for m in info["Mounts"] if m["Type"] == "bind"]
        assert orchard._handle.parse(sb.handle()).fingerprint is not None
        assert (await sb.exec("echo hi")).stdout == "hi\n"


def test_unix_needs_an_engine_on_this_machine() -> None:
    from orchard._backends.docker import transport

    with pytest.raises(ConfigError, match="transport='tcp'"):
        transport(DockerConfig(transport="unix"), "tcp://10.0.0.1:2375")
    assert transport(DockerConfig(), "tcp://10.0.0.1:2375") == "tcp"
    assert transport(DockerConfig(), "unix:///var/run/docker.sock") == "unix"
    assert transport(DockerConfig(network="mine"), "unix:///var/run/docker.sock") == "tcp"
    assert transport(DockerConfig(transport="tcp"), "unix:///var/run/docker.sock") == "tcp"


async def test_a_socket_the_sandbox_swapped_in_never_gets_the_token(client: orchard.Client) -> None:
    # The sandbox can write its socket's directory: it replaces the executor's socket with its own,
    # waiting for whoever attaches next to send the token.
    async with orchard.Client("docker") as attacher, client.sandbox(SWE) as sb:
        await a_swapped_socket_never_gets_the_token(sb, attacher, "/.orchard-socket/executor.sock")


async def test_what_a_sandbox_leaves_in_its_socket_directory_goes_and_links_are_not_followed(
    tmp_path: Path, client: orchard.Client
) -> None:
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep").write_text("mine")
    sb = await client.create(BUSYBOX)
    directory = os.path.join(sockets_of(client), sb.id)
    r = await sb.exec(
        f"cd /.orchard-socket && ln -s {precious} link && ln -s {precious}/keep file-link && "
        "mkdir -p locked/deep && echo x > locked/deep/f && chmod 0 locked/deep locked && "
        "dd if=/dev/zero of=big bs=1M count=4 2>/dev/null && ls"
    )
    assert r.exit_code == 0, r.stderr
    assert os.path.islink(os.path.join(directory, "link"))
    await sb.aclose()
    assert not os.path.lexists(directory)
    assert (precious / "keep").read_text() == "mine"


async def test_orchard_gc_removes_the_socket_directories_of_a_dead_client(tmp_path: Path, docker_ready: str) -> None:
    # A client killed with a sandbox running leaves its socket directory behind.
    script = textwrap.dedent(
        f"""
        import asyncio, os, orchard
        async def main():
            client = orchard.Client(orchard.DockerConfig(socket_dir={str(tmp_path)!r}))
            await client.__aenter__()
            sb = await client.create({BUSYBOX!r})
            await sb.exec("dd if=/dev/zero of=/.orchard-socket/junk bs=1k count=8")
            print(sb.id, flush=True)
            os._exit(0)
        asyncio.run(main())
        """
    )
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    sandbox_id = child.stdout.strip()
    (left,) = os.listdir(tmp_path)
    assert os.path.exists(tmp_path / left / sandbox_id / "junk")
    mine = tmp_path / f"{owner_label().split('/', 1)[1].replace('/', '-')}-x"  # a live owner's (this process)
    mine.mkdir()
    removed = await collect_garbage(DockerConfig(socket_dir=str(tmp_path)))
    assert (left, "orphaned socket directory") in removed
    assert (sandbox_id, "orphaned") in removed
    assert os.listdir(tmp_path) == [mine.name]
    assert inspect(sandbox_id) is None


async def test_a_socket_directory_others_may_write_is_refused(tmp_path: Path, docker_ready: str) -> None:
    tmp_path.chmod(0o777)
    async with orchard.Client(DockerConfig(socket_dir=str(tmp_path))) as client:
        with pytest.raises(ConfigError, match="not this user's own directory"):
            await client.create(BUSYBOX)
    assert os.listdir(tmp_path) == []
