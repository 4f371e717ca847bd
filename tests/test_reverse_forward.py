"""Sandbox.reverse_forward: a port inside the sandbox that leads to a server in the test process, on every backend.

The server (aiohttp, ``target`` below) listens on the test host's loopback,
which the sandbox cannot reach by itself; the clients (tests/reverse_client.py,
stdlib only) run inside the sandbox and reach it only through the port that
``reverse_forward`` opens there.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import pickle
import signal
import socket
import sys
import textwrap
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

import orchard
from orchard import errors
from orchard_executor import ports
from support import WAIT, eventually, raw_http

pytestmark = pytest.mark.executor

CLIENT = os.path.join(os.path.dirname(__file__), "reverse_client.py")
#: Events each streamed response sends; all but the first only once every stream has acknowledged its first.
EVENTS = 5


@dataclasses.dataclass
class Target:
    """The server on the client's side, and what it has seen."""

    url: str
    streams: int = 1
    acks: int = 0
    holds: int = 0
    all_acked: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    release: asyncio.Queue[None] = dataclasses.field(default_factory=asyncio.Queue)


@pytest.fixture
async def target() -> AsyncIterator[Target]:
    app = web.Application()
    state = Target(url="")

    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hello from the client side")

    async def sse(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: 0\n\n")
        await state.all_acked.wait()
        for i in range(1, EVENTS):
            await resp.write(f"data: {i}\n\n".encode())
        return resp

    async def ack(request: web.Request) -> web.Response:
        state.acks += 1
        if state.acks >= state.streams:
            state.all_acked.set()
        return web.Response(text="ok")

    async def hold(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(b"held\n")
        state.holds += 1
        await state.release.get()
        return resp

    async def ws(request: web.Request) -> web.WebSocketResponse:
        sock = web.WebSocketResponse()
        await sock.prepare(request)
        async for msg in sock:
            await sock.send_str(msg.data.upper())
        return sock

    app.router.add_get("/hello", hello)
    app.router.add_get("/sse", sse)
    app.router.add_get("/ack", ack)
    app.router.add_get("/hold", hold)
    app.router.add_get("/ws", ws)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    state.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield state
    finally:
        await runner.cleanup()


@pytest.fixture
async def sb_client(sb: orchard.Sandbox) -> orchard.Sandbox:
    """The sandbox, with reverse_client.py in its working directory."""
    await sb.write_file("reverse_client.py", open(CLIENT, "rb").read())
    return sb


async def inside(sb: orchard.Sandbox, *args: object) -> str:
    """Run reverse_client.py in the sandbox; its stdout."""
    r = await sb.exec(["python3", "reverse_client.py", *map(str, args)], timeout=WAIT * 2)
    assert r.exit_code == 0, r.stderr
    return r.stdout


def refused_port() -> int:
    """A port on this host's loopback that nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_request_from_inside_reaches_the_client_side(sb_client: orchard.Sandbox, target: Target) -> None:
    async with sb_client.reverse_forward(0, target.url) as port:
        assert 1 <= port <= 65535
        for _ in range(3):
            assert await inside(sb_client, "get", port, "/hello") == "hello from the client side"
    # The same port again, by number, and the target as host:port.
    async with sb_client.reverse_forward(port, target.url.removeprefix("http://")) as again:
        assert again == port
        assert await inside(sb_client, "get", port, "/hello") == "hello from the client side"


async def test_a_hundred_concurrent_streams_pass_through_as_they_are_sent(
    sb_client: orchard.Sandbox, target: Target
) -> None:
    target.streams = 100
    async with sb_client.reverse_forward(0, target.url) as port:
        # Each stream's later events are sent only once all 100 streams have acknowledged their first event:
        # a tunnel that buffered, or carried fewer at once, would never finish.
        out = json.loads(await inside(sb_client, "sse", port, 100))
    expected = "".join(f"data: {i}\n\n" for i in range(1, EVENTS))
    assert out == {str(i): ["200", "data: 0\n", expected] for i in range(100)}
    assert target.acks == 100


async def test_a_websocket_passes_through(sb_client: orchard.Sandbox, target: Target) -> None:
    async with sb_client.reverse_forward(0, target.url) as port:
        out = await inside(sb_client, "ws", port, "hello", "orchard", "z" * 1000, "y" * 60_000)
    assert out.splitlines() == ["101", "HELLO", "ORCHARD", "Z" * 1000, "Y" * 60_000]


async def test_a_target_that_refuses_closes_the_connection_inside_at_once(sb_client: orchard.Sandbox) -> None:
    async with sb_client.reverse_forward(0, f"127.0.0.1:{refused_port()}") as port:
        # A reset, not a hang (the client's socket would time out after 60 s and say "timeout").
        assert await inside(sb_client, "recv", port) == "reset\n"
        assert await inside(sb_client, "recv", port) == "reset\n"


async def test_the_block_exit_closes_the_port_and_its_connections(sb_client: orchard.Sandbox, target: Target) -> None:
    async with sb_client.reverse_forward(0, target.url) as port:
        await sb_client.start_process(["python3", "reverse_client.py", "hold", str(port)])
        await eventually(lambda: sb_client.exists("holding"), what="the held request to begin")
    await eventually(lambda: sb_client.exists("hold.out"), what="the held connection to end")
    assert await sb_client.read_file("hold.out") == b"reset"
    assert await inside(sb_client, "probe", port) == "refused\n"


async def test_a_port_in_use_is_a_typed_error(sb_client: orchard.Sandbox, target: Target) -> None:
    async with sb_client.reverse_forward(0, target.url) as port:
        with pytest.raises(errors.InvalidRequest, match="in use") as caught:
            async with sb_client.reverse_forward(port, target.url):
                pytest.fail("entered")
        assert caught.value.sandbox_id == sb_client.id
        assert "remote_port" in str(caught.value)
        # The first one still works.
        assert await inside(sb_client, "get", port, "/hello") == "hello from the client side"


async def test_bad_ports_and_targets_are_refused(sb: orchard.Sandbox, target: Target) -> None:
    for port in [-1, 65536, 10**9, True, "80"]:
        with pytest.raises(errors.ConfigError, match="remote_port"):
            async with sb.reverse_forward(port, target.url):  # type: ignore[arg-type]
                pytest.fail("entered")
    for url in ["127.0.0.1", "http://127.0.0.1:8000/v1", "http://u@127.0.0.1:8000", "http://127.0.0.1:99999", ""]:
        with pytest.raises(errors.ConfigError, match="local_url"):
            async with sb.reverse_forward(0, url):
                pytest.fail("entered")


async def test_the_executor_refuses_bad_ports_plain_requests_and_unknown_connections(sb: orchard.Sandbox) -> None:
    token = sb._rpc._headers["Authorization"]
    base = sb._rpc._base
    async with raw_http(sb) as session:
        for port in ["65536", "-1", "abc", "８０"]:
            async with session.get(f"{base}/v1/ports/{port}/listen", headers={"Authorization": token}) as resp:
                assert resp.status == 400, port
        async with session.get(f"{base}/v1/ports/0/listen", headers={"Authorization": token}) as resp:
            assert resp.status == 400  # not a websocket upgrade: nothing is bound
        with pytest.raises(aiohttp.WSServerHandshakeError) as caught:
            await session.ws_connect(
                f"{base}/v1/ports/0/listen", headers={"Authorization": "Bearer x"}, ssl=sb._rpc._ssl
            )
        assert caught.value.status == 401
    with pytest.raises(errors.PortClosed):
        await sb._rpc.websocket("/v1/ports/8000/accept/" + "0" * 32, max_msg_size=1 << 20)


async def test_listeners_are_capped(sb: orchard.Sandbox, target: Target) -> None:
    async with contextlib.AsyncExitStack() as stack:
        for _ in range(ports.MAX_LISTENERS):
            await stack.enter_async_context(sb.reverse_forward(0, target.url))
        with pytest.raises(errors.ExecutorError) as caught:
            async with sb.reverse_forward(0, target.url):
                pytest.fail("entered")
        assert caught.value.code == "too_many_tunnels"
        assert (await sb.exec(["echo", "still here"], timeout=WAIT)).stdout == "still here\n"
    async with sb.reverse_forward(0, target.url):
        pass  # each closed listener made room


async def test_connections_beyond_the_cap_wait_until_one_ends(sb_client: orchard.Sandbox, target: Target) -> None:
    extra = 2
    async with sb_client.reverse_forward(0, target.url) as port:
        many = asyncio.ensure_future(inside(sb_client, "many", port, ports.MAX_REVERSE + extra))
        await eventually(lambda: target.holds >= ports.MAX_REVERSE, what="the capped connections to arrive")
        await asyncio.sleep(1)  # room for any connection beyond the cap to arrive, which it must not
        assert target.holds == ports.MAX_REVERSE
        for _ in range(extra):
            target.release.put_nowait(None)
        await eventually(lambda: target.holds == ports.MAX_REVERSE + extra, what="the waiting connections to arrive")
        for _ in range(ports.MAX_REVERSE):
            target.release.put_nowait(None)
        assert await many == "['eof']\n"


async def message(control: aiohttp.ClientWebSocketResponse, timeout: float) -> dict[str, object]:
    """The next control message, decoded."""
    msg = await control.receive(timeout=timeout)
    assert msg.type == aiohttp.WSMsgType.TEXT, msg
    decoded: dict[str, object] = json.loads(msg.data)
    return decoded


async def test_unclaimed_connections_are_bounded_and_reset_after_the_claim_deadline(sb_client: orchard.Sandbox) -> None:
    # A client that reads the announcements but claims none.
    control = await sb_client._rpc.websocket("/v1/ports/0/listen", max_msg_size=1 << 20)
    try:
        port = (await message(control, WAIT))["port"]
        n = ports.MAX_UNCLAIMED + 1
        script = textwrap.dedent(
            f"""
            import socket
            from reverse_client import ending
            conns = [socket.create_connection(("127.0.0.1", {port}), timeout=60) for _ in range({n})]
            print(sorted({{ending(c.makefile("rb")) for c in conns}}))
            """
        )
        waiting = asyncio.ensure_future(sb_client.exec(["python3", "-c", script], timeout=WAIT * 2))
        announced = [await message(control, WAIT) for _ in range(ports.MAX_UNCLAIMED)]
        assert {a["type"] for a in announced} == {"accepted"}
        # The last one waits in the backlog, unannounced, until the first are reset at their deadline.
        with pytest.raises(TimeoutError):
            await control.receive(timeout=1)
        assert (await message(control, ports.CLAIM_TIMEOUT + WAIT))["type"] == "accepted"
        r = await waiting
        assert r.stdout == "['reset']\n", r.stderr
    finally:
        await control.close()


CHILD = textwrap.dedent(
    """
    import asyncio, pickle, sys, warnings
    import orchard

    async def main():
        config, handle, url = pickle.loads(sys.stdin.buffer.read())
        warnings.simplefilter("ignore")
        async with orchard.Client(config) as client:
            sb = await client.attach(handle)
            async with sb.reverse_forward(0, url) as port:
                print(port, flush=True)
                await asyncio.Event().wait()

    asyncio.run(main())
    """
)


async def test_a_killed_client_s_port_is_closed_by_the_executor(
    client: orchard.Client, sb_client: orchard.Sandbox, target: Target
) -> None:
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert child.stdin is not None
        assert child.stdout is not None
        child.stdin.write(pickle.dumps((client.config, str(sb_client.handle()), target.url)))
        child.stdin.close()
        port = int(await asyncio.wait_for(child.stdout.readline(), WAIT))
        assert await inside(sb_client, "get", port, "/hello") == "hello from the client side"
        await sb_client.start_process(["python3", "reverse_client.py", "hold", str(port)])
        await eventually(lambda: sb_client.exists("holding"), what="the held request to begin")
        child.send_signal(signal.SIGKILL)
        await child.wait()
        await eventually(lambda: sb_client.exists("hold.out"), what="the held connection to end")
        assert await sb_client.read_file("hold.out") == b"reset"
        assert await inside(sb_client, "probe", port) == "refused\n"
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()


async def test_the_port_closes_when_the_sandbox_does(sb_client: orchard.Sandbox, target: Target) -> None:
    async with sb_client.reverse_forward(0, target.url) as port:
        assert await inside(sb_client, "get", port, "/hello") == "hello from the client side"
        await sb_client.aclose()
    # The block exits without error although the sandbox is gone.
