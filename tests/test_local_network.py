"""``network=True`` on isolated local sandboxes: slirp4netns, never the host's loopback.

The only traffic these tests send goes to servers they start themselves: on
an address of an interface (a bridge with no ports) each test creates on the host (and removes),
or on the host's 127.0.0.1. Requires root (to make the interface),
bubblewrap, setpriv and slirp4netns (the CI image has them).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import orchard
from orchard import errors
from support import eventually, host_pid_alive, host_processes

pytestmark = pytest.mark.executor

FETCH = """
import sys, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=5) as reply:
        print("BODY", reply.read().decode())
except Exception as exc:
    print("failed", type(exc).__name__, exc)
"""


@dataclass
class Server:
    """A tiny HTTP server that answers every request with its own token and counts connections."""

    host: str
    port: int = 0
    token: str = field(default_factory=lambda: secrets.token_hex(8))
    connections: int = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await reader.readuntil(b"\r\n\r\n")
            body = self.token.encode()
            writer.write(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def serve(host: str) -> tuple[Server, asyncio.Server]:
    server = Server(host)
    listener = await asyncio.start_server(server.handle, host, 0)
    server.port = listener.sockets[0].getsockname()[1]
    return server, listener


@pytest.fixture
def dummy_address() -> Iterator[str]:
    """An address on an interface made for this test on the host: where the sandbox may go.

    A bridge with no ports, a stand-in for a dummy interface (not every kernel has the dummy driver):
    its address is the host's own, and no packet leaves the machine.
    """
    name = f"orch{secrets.token_hex(4)}"
    address = f"10.213.{secrets.randbelow(250) + 1}.1"
    subprocess.run(["ip", "link", "add", name, "type", "bridge"], check=True)
    try:
        subprocess.run(["ip", "addr", "add", f"{address}/24", "dev", name], check=True)
        subprocess.run(["ip", "link", "set", name, "up"], check=True)
        yield address
    finally:
        subprocess.run(["ip", "link", "del", name], check=False)


@pytest.fixture
async def outside(dummy_address: str) -> AsyncIterator[Server]:
    server, listener = await serve(dummy_address)
    async with listener:
        yield server


@pytest.fixture
async def bwrap_client(local_root: Path) -> AsyncIterator[orchard.Client]:
    async with orchard.Client(orchard.LocalConfig(root=str(local_root), isolation="bwrap")) as client:
        yield client


async def fetch(sb: orchard.Sandbox, url: str) -> str:
    r = await sb.exec(["python3", "-c", FETCH, url], timeout=60)
    assert r.exit_code == 0, r.stderr
    return r.stdout.strip()


def helpers_of(pid: int) -> list[int]:
    """Live slirp4netns processes whose parent is ``pid``."""
    return [p for p, ppid, argv in host_processes() if ppid == pid and argv[0].endswith(b"slirp4netns")]


async def test_network_reaches_a_host_interface_and_the_executor_stays_on_its_socket(
    bwrap_client: orchard.Client, outside: Server
) -> None:
    async with bwrap_client.sandbox(network=True) as sb:
        assert await fetch(sb, outside.url) == f"BODY {outside.token}"
        # The executor listens on its unix socket only: no TCP listener in the sandbox's namespace.
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            r = await sb.exec(["cat", table])
            states = [line.split()[3] for line in r.stdout.splitlines()[1:]]
            assert "0A" not in states, r.stdout
        # Names resolve through slirp4netns's forwarder; certificates are readable for TLS.
        assert (await sb.exec(["cat", "/etc/resolv.conf"])).stdout.split() == ["nameserver", "10.0.2.3"]
        r = await sb.exec("ls /etc/ssl/certs | grep -c pem")
        assert int(r.stdout) > 0, r.stderr
    assert outside.connections == 1


async def test_network_does_not_reach_the_hosts_loopback(bwrap_client: orchard.Client, outside: Server) -> None:
    server, listener = await serve("127.0.0.1")
    async with listener, bwrap_client.sandbox(network=True) as sb:
        # slirp4netns's gateway (10.0.2.2) would be the host's loopback without --disable-host-loopback.
        for url in (server.url, f"http://10.0.2.2:{server.port}/"):
            assert (await fetch(sb, url)).startswith("failed"), url
        # The network works: the refusals above are the loopback's, not a dead network's.
        assert await fetch(sb, outside.url) == f"BODY {outside.token}"
    assert server.connections == 0


async def test_no_network_reaches_nothing(bwrap_client: orchard.Client, outside: Server) -> None:
    async with bwrap_client.sandbox() as sb:
        assert (await fetch(sb, outside.url)).startswith("failed")
        r = await sb.exec(["cat", "/proc/net/dev"])
        assert [line.split(":")[0].strip() for line in r.stdout.splitlines()[2:]] == ["lo"], r.stdout
    assert outside.connections == 0
    assert helpers_of(os.getpid()) == []


async def test_the_network_helper_ends_with_the_sandbox(bwrap_client: orchard.Client, outside: Server) -> None:
    async with bwrap_client.sandbox(network=True) as sb:
        assert await fetch(sb, outside.url) == f"BODY {outside.token}"
        helpers = helpers_of(os.getpid())
        assert len(helpers) == 1, helpers
    # Closing the sandbox waits for the helper: it is gone when aclose returns.
    assert not host_pid_alive(helpers[0])


CLIENT = """
import asyncio, os, sys
import orchard

async def main():
    client = orchard.Client(orchard.LocalConfig(root=sys.argv[1], isolation="bwrap"))
    await client.create(network=True)
    print("READY", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_the_network_helper_ends_with_a_killed_client(local_root: Path, outside: Server) -> None:
    client = await asyncio.create_subprocess_exec(
        sys.executable, "-c", textwrap.dedent(CLIENT), str(local_root), stdout=asyncio.subprocess.PIPE
    )
    try:
        assert client.stdout is not None
        line = await asyncio.wait_for(client.stdout.readline(), 120)
        assert line == b"READY\n", line
        helpers = helpers_of(client.pid)
        assert len(helpers) == 1, helpers
    finally:
        with contextlib.suppress(ProcessLookupError):
            client.send_signal(signal.SIGKILL)
        await client.wait()
    await eventually(lambda: not host_pid_alive(helpers[0]), what="slirp4netns ends with its client")


async def test_network_without_slirp4netns_is_a_clear_error(
    bwrap_client: orchard.Client, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(errors.ConfigError, match=r"apt-get install slirp4netns"):
        await bwrap_client.create(network=True)
    assert list((tmp_path / "sandboxes").glob("*")) == []
