"""The token and what a sandbox reads and writes cross the Docker bridge only inside TLS, to the pinned executor.

Before (issue 11) the bearer token and every command and file went over the
bridge in clear: anyone sniffing it took over the sandbox.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator

import pytest
from docker_support import SWE, SandboxFactory

import orchard
from orchard.errors import ProtocolError
from support import captured_tcp, to_executor

pytestmark = pytest.mark.docker


@pytest.fixture
async def client(docker_ready: str) -> AsyncIterator[orchard.Client]:
    """Executors on the network (transport tcp), whose traffic these tests examine."""
    async with orchard.Client(orchard.DockerConfig(transport="tcp")) as client:
        yield client


async def test_the_token_and_the_data_cross_the_bridge_only_encrypted(sandbox: SandboxFactory) -> None:
    secret = secrets.token_hex(16).encode()
    with captured_tcp() as segments:
        sb = await sandbox(SWE)
        assert (await sb.exec(["echo", secret.decode()])).stdout == secret.decode() + "\n"
        await sb.write_file("/tmp/secret", secret)
        assert await sb.read_file("/tmp/secret") == secret
        await asyncio.sleep(0.5)  # the capture thread catches up
    token = sb._rpc._headers["Authorization"].removeprefix("Bearer ").encode()
    sent = to_executor(segments, sb)
    # The capture saw the client's requests, ...
    assert len(sent) >= 4, f"only {len(sent)} segments to the executor captured"
    # ... yet neither the token nor the data appears anywhere on any interface: TLS records only.
    assert not [s for s in segments if token in s.payload], "the bearer token crossed the network in clear"
    assert not [s for s in segments if secret in s.payload], "a command's data crossed the network in clear"
    assert sent[0].payload[:1] == b"\x16", sent[0].payload[:64]  # a TLS handshake record


async def test_an_impostor_at_the_executors_address_is_refused(sandbox: SandboxFactory) -> None:
    victim, impostor = await sandbox(SWE), await sandbox(SWE)
    # The impostor answers at the victim's address (as if it had taken over the IP): a real
    # executor with a certificate of its own, not the one the client pinned for the victim.
    victim._rpc._base = impostor._rpc._base
    with pytest.raises(ProtocolError, match="not its executor"):
        await victim.exec(["true"])
    assert (await impostor.exec(["true"])).ok
