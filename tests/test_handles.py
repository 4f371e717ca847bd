"""Handles on the local backend: ``sb.handle()`` in one process, ``client.attach(handle)`` in another.

The attaching side runs in a real subprocess where the claim is about
processes; the handle reaches it on stdin (never argv, which ``ps`` shows).
"""

from __future__ import annotations

import asyncio
import base64
import json
import pickle
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

import orchard
from handles_support import a_swapped_socket_never_gets_the_token, attach_in_child, token_of
from orchard import _handle
from orchard.errors import (
    AuthError,
    ConfigError,
    InvalidHandle,
    SandboxClosed,
    SandboxLost,
    SandboxTimeout,
)
from support import unisolated_ok

pytestmark = pytest.mark.executor


@pytest.fixture(params=["none", "bwrap"])
def isolation(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def creator(local_root: Path, isolation: str) -> AsyncIterator[orchard.Client]:
    with unisolated_ok():
        client = await orchard.Client(orchard.LocalConfig(root=str(local_root), isolation=isolation)).__aenter__()
    async with client:
        yield client


@pytest.fixture
async def attacher(isolation: str) -> AsyncIterator[orchard.Client]:
    """Another Client in this process (where a subprocess proves nothing more)."""
    with unisolated_ok():
        client = await orchard.Client(orchard.LocalConfig(isolation=isolation)).__aenter__()
    async with client:
        yield client


async def test_a_handle_is_a_str_whose_repr_hides_the_token(creator: orchard.Client) -> None:
    async with creator.sandbox() as sb:
        handle = sb.handle()
        token = token_of(handle)
    assert isinstance(handle, orchard.Handle)
    assert isinstance(handle, str)
    assert handle.startswith("orchard1:")
    assert len(handle) < 400
    assert (handle.backend, handle.sandbox_id) == ("local", sb.id)
    for shown in (repr(handle), repr([handle]), repr({"h": handle}), repr(_handle.parse(handle))):
        assert token not in shown
        assert sb.id in shown
    # It travels as a plain string: pickle, JSON, an environment variable.
    assert pickle.loads(pickle.dumps(handle)) == handle
    assert json.loads(json.dumps(handle)) == handle
    assert token_of(str(handle)) == token


async def test_attach_from_another_process_runs_there_and_the_creator_still_deletes(
    local_root: Path, isolation: str
) -> None:
    with unisolated_ok():
        client = await orchard.Client(orchard.LocalConfig(root=str(local_root), isolation=isolation)).__aenter__()
    async with client:
        sb = await client.create()
        await sb.write_file("note.txt", "from the creator\n")
        handle = sb.handle()

        child = await attach_in_child(handle, "local", {"isolation": isolation})
        assert child["exit_code"] == 0, child
        assert child["stdout"] == "from the creator\n"
        assert child["id"] == sb.id
        assert token_of(handle) not in child["repr"]
        # The child's client closed without deleting the sandbox: it is still the creator's.
        assert await sb.read_file("child.txt") == b"from-child\n"
        assert (await sb.exec("true")).exit_code == 0
        assert any(local_root.iterdir())
    # The creator's client deleted it at exit: its directory is gone, and the handle is dead.
    assert not any(local_root.iterdir())
    child = await attach_in_child(handle, "local", {"isolation": isolation})
    assert child["error"] == "SandboxLost", child
    assert token_of(handle) not in child["message"]


async def test_closing_an_attached_sandbox_or_its_client_lets_go_without_deleting(
    creator: orchard.Client, attacher: orchard.Client
) -> None:
    async with creator.sandbox() as sb:
        sb2 = await attacher.attach(sb.handle())
        assert (await sb2.exec("echo hi")).stdout == "hi\n"
        await sb2.aclose()
        sb3 = await attacher.attach(sb.handle())
        await attacher.aclose()
        with pytest.raises(SandboxClosed):
            await sb3.exec("true")
        assert (await sb.exec("echo still")).stdout == "still\n"


async def test_letting_go_of_an_attached_sandbox_ends_its_stream_in_flight(
    creator: orchard.Client, attacher: orchard.Client
) -> None:
    async with creator.sandbox() as sb:
        sb2 = await attacher.attach(sb.handle())
        stream = sb2.exec_stream("while true; do echo tick; sleep 0.1; done")
        await anext(stream)

        async def drain() -> None:
            async for _ in stream:
                pass

        await sb2.aclose()
        # It streamed on (nothing deletes a sandbox that is not this client's), or under bubblewrap,
        # whose sandboxes have a session of their own, ended with aiohttp's RuntimeError("Connection closed.").
        with pytest.raises(SandboxClosed, match="closed while this call was in flight"):
            await asyncio.wait_for(drain(), 5)


async def test_an_attached_sandbox_is_traced_from_its_attach_to_its_letting_go(
    creator: orchard.Client, attacher: orchard.Client, tmp_path: Path
) -> None:
    trace = tmp_path / "attached.jsonl"
    async with creator.sandbox() as sb:
        sb2 = await attacher.attach(sb.handle(), trace=str(trace))
        await sb2.exec("echo traced")
        await sb.exec("echo by the creator, not traced here")
        await sb2.aclose()
        with pytest.raises(InvalidHandle):
            await attacher.attach("orchard1:not-a-handle", trace=str(trace))
    found = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [r["type"] for r in found] == ["sandbox_attach", "exec", "sandbox_close", "sandbox_attach"]
    attached, ran, closed, refused = found
    assert attached["sandbox"] == ran["sandbox"] == closed["sandbox"] == sb.id
    assert attached["owner"] is False
    assert attached["error"] is None
    assert ran["cmd"] == "echo traced"
    assert ran["stdout_head"] == "traced\n"
    assert refused["error"]["type"] == "InvalidHandle"
    assert refused["sandbox"] is None
    assert token_of(sb.handle()) not in trace.read_text()


async def test_owner_true_on_a_local_sandbox_is_a_config_error(
    creator: orchard.Client, attacher: orchard.Client
) -> None:
    async with creator.sandbox() as sb:
        with pytest.raises(ConfigError, match="owner=True"):
            await attacher.attach(sb.handle(), owner=True)
        assert (await sb.exec("true")).exit_code == 0


async def test_attaching_in_the_creating_client_is_a_config_error(creator: orchard.Client) -> None:
    async with creator.sandbox() as sb:
        with pytest.raises(ConfigError, match="already open"):
            await creator.attach(sb.handle())


def _reencoded(handle: str, **changes: Any) -> str:
    return _handle.encode(msgspec.structs.replace(_handle.parse(handle), **changes))


async def test_malformed_handles_are_invalid_handle_errors_that_never_show_the_token(
    creator: orchard.Client, attacher: orchard.Client
) -> None:
    async with creator.sandbox() as sb:
        good = str(sb.handle())
        token = token_of(good)
        body = good.removeprefix("orchard1:")
        raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        bad: list[Any] = [
            "",
            "hello",
            good.encode(),
            None,
            "orchard2:" + body,
            "orchard1:",
            "orchard1:" + body[:-7],  # truncated in transit
            "orchard1:" + body + "!",
            "orchard1:" + body[:20] + "*" + body[21:],
            "orchard1:" + base64.urlsafe_b64encode(b"\x93\x01\x02\x03").decode(),
            "orchard1:" + base64.urlsafe_b64encode(raw[:-3]).decode(),
            "orchard1:" + "A" * 5000,
            _reencoded(good, backend="kubernetes"),  # a socket on kubernetes, no namespace, port or fingerprint
            _reencoded(good, backend="docker", url="http://127.0.0.1:1", socket=None),  # on a network, no fingerprint
            _reencoded(good, backend="ec2"),
            _reencoded(good, token=""),
            _reencoded(good, sandbox_id="../../images/x"),  # an id the backend puts in an API path
            _reencoded(good, sandbox_id="sb x"),
            _reencoded(good, url="file:///etc/passwd", socket=None),
            _reencoded(good, url="https://127.0.0.1:1", socket=None, fingerprint=None),
        ]
        for handle in bad:
            with pytest.raises(InvalidHandle) as info:
                await attacher.attach(handle)
            assert token not in str(info.value)
        # A well-formed handle of another backend: it names the Client to use.
        docker = _reencoded(good, backend="docker", url="https://127.0.0.1:1", socket=None, fingerprint=b"x" * 32)
        with pytest.raises(InvalidHandle, match="Client\\('docker'"):
            await attacher.attach(docker)
        assert (await sb.exec("true")).exit_code == 0


async def test_a_wrong_token_is_an_auth_error(creator: orchard.Client, attacher: orchard.Client) -> None:
    async with creator.sandbox() as sb:
        forged = _reencoded(sb.handle(), token="x" * 43)
        with pytest.raises(AuthError):
            await attacher.attach(forged)
        assert (await sb.exec("true")).exit_code == 0


async def test_a_deleted_sandbox_is_sandbox_lost(creator: orchard.Client, attacher: orchard.Client) -> None:
    sb = await creator.create()
    handle = sb.handle()
    await sb.aclose()
    with pytest.raises(SandboxLost):
        await attacher.attach(handle)


@pytest.fixture
def silent_listener() -> Iterator[int]:
    """A loopback port that accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    try:
        yield server.getsockname()[1]
    finally:
        server.close()


async def test_an_executor_that_never_answers_is_a_timeout_not_a_hang(
    creator: orchard.Client, attacher: orchard.Client, silent_listener: int
) -> None:
    async with creator.sandbox() as sb:
        frozen = _reencoded(sb.handle(), url=f"http://127.0.0.1:{silent_listener}", socket=None, inode=None)
    with pytest.raises(SandboxTimeout, match="timeout=1s"):
        await attacher.attach(frozen, timeout=1)


async def test_a_socket_the_sandbox_swapped_in_never_gets_the_token(local_root: Path) -> None:
    # An isolated sandbox can write its socket's directory: it replaces the executor's socket
    # with its own, waiting for whoever attaches next to send the token.
    async with (
        orchard.Client(orchard.LocalConfig(root=str(local_root), isolation="bwrap")) as creator,
        orchard.Client(orchard.LocalConfig(isolation="bwrap")) as attacher,
        creator.sandbox() as sb,
    ):
        await a_swapped_socket_never_gets_the_token(sb, attacher, "/.orchard/executor.sock")
