"""Sandbox.forward: a local URL for a server inside the sandbox, through the executor, on every backend.

The servers (tests/forward_server.py, stdlib only) run inside the sandbox,
started with ``start_process``; the client reaches them only through the
URL that ``forward`` gives.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from collections.abc import AsyncIterator

import aiohttp
import pytest

import orchard
from orchard import errors
from orchard_executor import ports
from support import WAIT, eventually, listening, raw_http

pytestmark = pytest.mark.executor

SERVER = os.path.join(os.path.dirname(__file__), "forward_server.py")
FREE_PORT = "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"


async def start_servers(sb: orchard.Sandbox) -> tuple[int, int]:
    """Start forward_server.py in the sandbox; its HTTP and raw TCP ports once both listen."""
    await sb.write_file("forward_server.py", open(SERVER, "rb").read())
    await sb.start_process(["python3", "forward_server.py"])
    await eventually(lambda: sb.exists("ports"), what="the servers to listen")
    http, raw = (await sb.read_file("ports")).split()
    return int(http), int(raw)


async def free_port(sb: orchard.Sandbox) -> int:
    """A port nothing listens on inside the sandbox."""
    r = await sb.exec(["python3", "-c", FREE_PORT], timeout=WAIT)
    assert r.exit_code == 0, r.stderr
    return int(r.stdout)


@pytest.fixture
async def servers(sb: orchard.Sandbox) -> tuple[int, int]:
    return await start_servers(sb)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT)) as session:
        yield session


async def test_http_requests_and_large_bodies_pass_through(
    sb: orchard.Sandbox, servers: tuple[int, int], http: aiohttp.ClientSession
) -> None:
    async with sb.forward(servers[0]) as url:
        assert url.startswith("http://127.0.0.1:")
        for _ in range(3):  # several requests, on one kept-alive local connection
            async with http.get(f"{url}/hello") as resp:
                assert resp.status == 200
                assert await resp.read() == b"hello from the sandbox"
        body = os.urandom(8 * 1024 * 1024)
        async with http.post(f"{url}/echo", data=body) as resp:
            assert hashlib.sha256(await resp.read()).digest() == hashlib.sha256(body).digest()
        # Separate local connections at once: each one is its own tunnel.
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as fresh:

            async def get() -> bytes:
                async with fresh.get(f"{url}/hello") as resp:
                    return await resp.read()

            assert await asyncio.gather(*(get() for _ in range(8))) == [b"hello from the sandbox"] * 8


async def test_a_streaming_response_arrives_as_it_is_sent(
    sb: orchard.Sandbox, servers: tuple[int, int], http: aiohttp.ClientSession
) -> None:
    async with sb.forward(servers[0]) as url, http.get(f"{url}/stream") as resp:
        # The server sends its second chunk only once "go" exists: a buffered tunnel would never deliver the first.
        assert await resp.content.readline() == b"first\n"
        await sb.write_file("go", b"")
        assert await resp.content.readline() == b"second\n"
        assert await resp.content.read() == b""


async def test_a_websocket_passes_through(
    sb: orchard.Sandbox, servers: tuple[int, int], http: aiohttp.ClientSession
) -> None:
    async with sb.forward(servers[0]) as url, http.ws_connect(f"{url.replace('http:', 'ws:')}/ws") as ws:
        for word in ["hello", "orchard", "z" * 1000, "y" * 70_000]:
            await ws.send_str(word)
            assert await ws.receive_str() == word.upper()
        blob = os.urandom(300 * 1024)
        await ws.send_bytes(blob)
        assert await ws.receive_bytes() == blob


async def test_a_half_close_passes_through_and_the_reply_follows(sb: orchard.Sandbox, servers: tuple[int, int]) -> None:
    async with sb.forward(servers[1]) as url:
        reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
        writer.write(b"x" * 100_000)
        writer.write_eof()  # the server answers only after EOF
        assert await reader.read() == b"100000"
        writer.close()


async def test_forward_to_a_port_with_no_listener_is_a_typed_error_at_entry(sb: orchard.Sandbox) -> None:
    port = await free_port(sb)
    with pytest.raises(errors.PortClosed) as caught:
        async with sb.forward(port):
            pytest.fail("entered")
    assert isinstance(caught.value, ConnectionRefusedError)
    assert f"port {port}" in str(caught.value)
    assert caught.value.sandbox_id == sb.id
    assert "wait=" in str(caught.value)


async def test_without_the_check_a_connection_to_a_closed_port_is_reset(
    sb: orchard.Sandbox, http: aiohttp.ClientSession
) -> None:
    port = await free_port(sb)
    async with sb.forward(port, check=False) as url:
        with pytest.raises(aiohttp.ClientConnectionError):
            await http.get(f"{url}/hello")


async def test_wait_lets_a_server_that_is_still_starting_come_up(
    sb: orchard.Sandbox, http: aiohttp.ClientSession
) -> None:
    port = await free_port(sb)
    await sb.write_file("forward_server.py", open(SERVER, "rb").read())
    # The server starts only once "go" appears, which happens after forward() has begun to wait.
    await sb.start_process(f"while [ ! -e go ]; do sleep 0.05; done; exec python3 forward_server.py {port}")
    with pytest.raises(errors.PortClosed):
        async with sb.forward(port):
            pytest.fail("entered")

    async def fetch() -> bytes:
        async with sb.forward(port, wait=WAIT) as url, http.get(f"{url}/hello") as resp:
            return await resp.read()

    fetched = asyncio.ensure_future(fetch())
    await sb.write_file("go", b"")
    assert await fetched == b"hello from the sandbox"


async def test_bad_ports_are_refused(sb: orchard.Sandbox) -> None:
    for port in [0, -1, 65536, 10**9]:
        with pytest.raises(errors.ConfigError, match="port"):
            async with sb.forward(port):
                pytest.fail("entered")


async def test_the_executor_refuses_bad_ports_and_plain_requests_and_wrong_tokens(
    sb: orchard.Sandbox, servers: tuple[int, int]
) -> None:
    token = sb._rpc._headers["Authorization"]
    base = sb._rpc._base
    async with raw_http(sb) as session:
        for port in ["0", "65536", "-1", "abc", "1e3", "８０", "99999999999999999999"]:
            async with session.get(f"{base}/v1/ports/{port}/connect", headers={"Authorization": token}) as resp:
                assert resp.status == 400, port
        # Not a websocket upgrade: nothing is connected.
        async with session.get(f"{base}/v1/ports/{servers[0]}/connect", headers={"Authorization": token}) as resp:
            assert resp.status == 400
        for headers in [{}, {"Authorization": "Bearer wrong"}]:
            with pytest.raises(aiohttp.WSServerHandshakeError) as caught:
                await session.ws_connect(f"{base}/v1/ports/{servers[0]}/connect", headers=headers, ssl=sb._rpc._ssl)
            assert caught.value.status == 401
        # The same through the client: typed.
        ws = await sb._rpc.websocket(f"/v1/ports/{servers[1]}/connect", max_msg_size=1 << 20)
        await ws.close()
        with pytest.raises(errors.InvalidRequest):
            await sb._rpc.websocket("/v1/ports/0/connect", max_msg_size=1 << 20)


async def logged(sb: orchard.Sandbox, name: str, n: int) -> bool:
    """Whether the raw server has written ``n`` lines to its log ``name``."""
    return await sb.exists(name) and len((await sb.read_file(name)).splitlines()) >= n


async def received(sb: orchard.Sandbox, count: bytes) -> bool:
    """Whether the raw server's connection has received ``count`` bytes."""
    return await sb.exists("received") and await sb.read_file("received") == count


async def drained(reader: asyncio.StreamReader) -> bytes:
    """Everything read until the connection ends, by EOF or by a reset."""
    data = b""
    with contextlib.suppress(ConnectionError):
        while chunk := await reader.read(65536):
            data += chunk
    return data


async def connected_with_bytes_sent(
    sb: orchard.Sandbox, url: str
) -> tuple[int, asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection through the forwarded port that has delivered 3 bytes to the counting server."""
    port = int(url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"abc")
    await writer.drain()
    await eventually(lambda: received(sb, b"3"), what="the bytes to arrive")
    return port, reader, writer


async def test_the_tunnel_closes_when_the_block_exits(sb: orchard.Sandbox, servers: tuple[int, int]) -> None:
    async with sb.forward(servers[1]) as url:
        port, reader, writer = await connected_with_bytes_sent(sb, url)
    # The server in the sandbox saw its connection end (it counts what it got), and the local one ended too.
    await eventually(lambda: logged(sb, "closed.log", 2), what="the server's connection to close")
    # forward()'s check at entry was the first connection.
    assert (await sb.read_file("closed.log")).split() == [b"0", b"3"]
    assert await drained(reader) == b""
    writer.close()
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", port)


async def test_the_tunnel_closes_when_the_sandbox_does(sb: orchard.Sandbox, servers: tuple[int, int]) -> None:
    async with sb.forward(servers[1]) as url:
        port, reader, writer = await connected_with_bytes_sent(sb, url)
        await sb.aclose()
        assert await drained(reader) == b""
        writer.close()
        # New connections are reset at once, not left hanging.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await drained(reader) == b""
        writer.close()


async def test_tunnels_are_capped_and_the_api_stays_reachable(sb: orchard.Sandbox, servers: tuple[int, int]) -> None:
    path = f"/v1/ports/{servers[1]}/connect"
    held = []
    try:
        for _ in range(ports.MAX_TUNNELS):
            held.append(await sb._rpc.websocket(path, max_msg_size=1 << 20))
        with pytest.raises(errors.ExecutorError) as caught:
            await sb._rpc.websocket(path, max_msg_size=1 << 20)
        assert caught.value.code == "too_many_tunnels"
        # Tunnels never crowd out the API itself.
        assert (await sb.exec(["echo", "still here"], timeout=WAIT)).stdout == "still here\n"
        await held.pop().close()
        await eventually(lambda: logged(sb, "closed.log", 1), what="the closed tunnel's connection to end")
        held.append(await sb._rpc.websocket(path, max_msg_size=1 << 20))
    finally:
        await asyncio.gather(*(ws.close() for ws in held))


async def test_the_local_end_listens_on_loopback_only(sb: orchard.Sandbox, servers: tuple[int, int]) -> None:
    async with sb.forward(servers[0]) as url:
        port = int(url.rsplit(":", 1)[1])
        # 127.0.0.1 as /proc/net/tcp writes it (in the host's byte order): no wildcard, no other interface, no IPv6.
        assert listening(port) == ["0100007F"]
    assert listening(port) == []  # and closed with the block
