"""ExecutorClient, in this process, against scripted executors on 127.0.0.1.

Each test starts its own HTTP server (aiohttp.web, or a raw asyncio one
where aiohttp would not misbehave enough) that answers with scripted
replies: good ones, errors in the executor's schema, replies over the caps,
bodies that are not the schema, silence. The assertions are what a caller
and the executor can see: the typed exception, its message, ``reason`` and
``sandbox_id``; and what reached the server (route, query, headers, token,
body, how many tries). Deadlines are a few tenths of a second, so that the
module stays fast enough for mutation testing (``mutation.toml``'s rpc).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web
from multidict import CIMultiDict

from orchard import _tls, errors
from orchard._rpc import ExecutorClient, _Flight, _Source, with_stdin
from orchard_executor.protocol import (
    FRAME_HEADER,
    JSON,
    MAX_FRAME,
    MSGPACK,
    WITH_STDIN,
    DataFrame,
    EndFrame,
    Error,
    ErrorEvent,
    ExecRequest,
    ExecResult,
    ExitEvent,
    FileStat,
    HeartbeatEvent,
    Info,
    OutputEvent,
    encode,
    frame,
)

#: A mutant that spins the event loop is stopped by the test's own timeout, not the suite's 120 s.
pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

SID = "sb-unit"
TOKEN = "tok-123"
#: The client's deadlines here: short, so that a test waits tenths of a second.
READ = 0.3
LIVE = 0.2
#: Far above those deadlines: reaching it means the client hung.
BOUND = 5.0
INFO = Info(
    version="1",
    api="v1",
    pid=42,
    uptime=1.5,
    load=(0.0, 0.0, 0.0),
    idle_timeout=None,
    running_processes=0,
    sessions=0,
    cwd="/w",
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class Seen:
    """One request as the fake executor received it."""

    method: str
    path: str
    query: dict[str, str]
    headers: CIMultiDict[str]
    body: bytes | None


@dataclass
class Fake:
    """A scripted executor: ``reply`` answers every request but ``/healthz``, which ``health`` answers."""

    reply: Handler | None = None
    health: Handler | None = None
    seen: list[Seen] = field(default_factory=list)
    probes: int = 0
    #: What the backend's diagnose returns, and how many times it was asked.
    diagnosis: errors.OrchardError | None = None
    diagnosed: int = 0
    url: str = ""
    #: Read each request's body before ``reply`` runs (and record it in ``seen``).
    read_body: bool = True

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/healthz":
            self.probes += 1
            if self.health is not None:
                return await self.health(request)
            return web.Response(text="ok")
        body: bytes | None = None
        if self.read_body:
            try:
                body = await request.read()
            except Exception:
                body = None
        self.seen.append(Seen(request.method, request.path, dict(request.query), CIMultiDict(request.headers), body))
        assert self.reply is not None, f"unexpected {request.method} {request.path}"
        return await self.reply(request)

    async def diagnose(self) -> errors.OrchardError | None:
        self.diagnosed += 1
        return self.diagnosis


def msgpack(obj: object, status: int = 200) -> web.Response:
    return web.Response(body=encode(obj), status=status, content_type=MSGPACK)


def replying(*responses: Callable[[web.Request], Awaitable[web.StreamResponse]] | web.StreamResponse) -> Handler:
    """A handler that gives these replies in turn (the last one again and again)."""
    left = list(responses)

    async def handler(request: web.Request) -> web.StreamResponse:
        r = left.pop(0) if len(left) > 1 else left[0]
        if isinstance(r, web.StreamResponse):
            # A response object serves once: build a fresh copy of a plain one.
            assert isinstance(r, web.Response)
            return web.Response(body=r.body, status=r.status, headers=r.headers)
        return await r(request)

    return handler


async def drop(request: web.Request) -> web.StreamResponse:
    """Close the connection without a reply: an executor killed, a connection reset."""
    assert request.transport is not None
    request.transport.abort()
    await asyncio.sleep(BOUND)
    raise AssertionError("unreachable")


async def silent(request: web.Request) -> web.StreamResponse:
    await asyncio.sleep(BOUND * 2)
    raise AssertionError("the client should have given up")


def after(delay: float, response: web.Response) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(delay)
        return web.Response(body=response.body, status=response.status, headers=response.headers)

    return handler


def streamed(*chunks: bytes, content_type: str = MSGPACK, status: int = 200, length: int | None = None) -> Handler:
    """A reply written in these chunks (chunked unless ``length``), then held open and silent."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(status=status)
        resp.content_type = content_type
        if length is not None:
            resp.content_length = length
        await resp.prepare(request)
        for chunk in chunks:
            await resp.write(chunk)
        await asyncio.sleep(BOUND * 2)
        return resp

    return handler


def frames_reply(*chunks: bytes, status: int = 200) -> Handler:
    """A framed reply: these bytes, then the end of the body (the connection ends the stream)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(status=status)
        resp.content_type = "application/x-orchard-frames"
        await resp.prepare(request)
        for chunk in chunks:
            await resp.write(chunk)
        await resp.write_eof()
        return resp

    return handler


@pytest.fixture
async def server() -> AsyncIterator[Fake]:
    fake = Fake()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fake.handle)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    fake.url = f"http://127.0.0.1:{port}"
    try:
        yield fake
    finally:
        await runner.cleanup()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.fixture
def rpc(server: Fake, session: aiohttp.ClientSession) -> ExecutorClient:
    """A client of ``server``, its base URL given with a trailing slash."""
    return ExecutorClient(
        session,
        server.url + "/",
        TOKEN,
        sandbox_id=SID,
        diagnose=server.diagnose,
        read_timeout=READ,
        liveness_timeout=LIVE,
    )


async def bounded(aw: Awaitable[Any]) -> Any:
    """``aw``, or a plain TimeoutError (never an Orchard one) if the client hangs."""
    return await asyncio.wait_for(aw, BOUND)


async def collect(it: AsyncIterator[Any], into: list[Any] | None = None) -> list[Any]:
    """What ``it`` yields; also appended to ``into`` as it comes, to be seen when ``it`` then raises."""
    got = [] if into is None else into
    async for x in it:
        got.append(x)
    return got


async def chunks_of(*chunks: bytes, error: Exception | None = None) -> AsyncIterator[bytes]:
    for c in chunks:
        yield c
    if error is not None:
        raise error


def timed_out(url: str) -> str:
    """The message of a request whose reply did not begin within read_timeout (aiohttp's sock_read)."""
    return (
        f"sandbox {SID}: the executor at {url} did not answer in time (Timeout on reading data from socket); "
        f"a request may take read_timeout={READ:g}s, plus the command's timeout if it has one (a Client option)"
    )


def error_body(code: str, message: str, path: str | None = None) -> bytes:
    return encode(Error(code=code, message=message, path=path))  # type: ignore[arg-type]


# Requests as sent


async def test_a_call_sends_the_token_and_msgpack_headers_to_its_route_and_decodes_the_reply(
    server: Fake, rpc: ExecutorClient
) -> None:
    server.reply = replying(msgpack(INFO))
    got = await bounded(rpc.call("GET", "/v1/info", Info, params={"path": "a b", "n": "1"}))
    assert got == INFO
    [seen] = server.seen
    assert (seen.method, seen.path, seen.query, seen.body) == ("GET", "/v1/info", {"path": "a b", "n": "1"}, b"")
    assert seen.headers["Authorization"] == f"Bearer {TOKEN}"
    assert seen.headers.getall("Content-Type") == [MSGPACK]
    assert seen.headers["Accept"] == MSGPACK


async def test_a_call_sends_its_body_as_msgpack(server: Fake, rpc: ExecutorClient) -> None:
    server.reply = replying(msgpack(ExecResult(exit_code=0, stdout_bytes=b"hi\n")))
    req = ExecRequest(cmd=["echo", "hi"], request_id="rid-1")
    got = await bounded(rpc.call("POST", "/v1/exec", ExecResult, req))
    assert (got.exit_code, got.stdout) == (0, "hi\n")
    [seen] = server.seen
    assert (seen.method, seen.path) == ("POST", "/v1/exec")
    assert seen.body == encode(req)
    assert msgspec.msgpack.decode(seen.body, type=ExecRequest) == req


def test_an_https_executor_needs_a_fingerprint(session: aiohttp.ClientSession) -> None:
    async def diagnose() -> None:
        return None

    with pytest.raises(
        ValueError, match="^https://10.0.0.1:1/: an https executor needs the fingerprint of its certificate$"
    ):
        ExecutorClient(session, "https://10.0.0.1:1/", TOKEN, sandbox_id=SID, diagnose=diagnose)
    # With one it is accepted; plain http needs none.
    ExecutorClient(session, "https://10.0.0.1:1", TOKEN, sandbox_id=SID, diagnose=diagnose, fingerprint=bytes(32))
    ExecutorClient(session, "http://10.0.0.1:1", TOKEN, sandbox_id=SID, diagnose=diagnose)


# Error replies


@pytest.mark.parametrize(
    ("status", "code", "cls"),
    [
        (400, "bad_request", errors.InvalidRequest),
        (401, "unauthorized", errors.AuthError),
        (404, "file_not_found", errors.PathNotFound),
        (409, "file_exists", errors.PathExists),
        (404, "process_not_found", errors.ProcessNotFound),
        (429, "too_many_tunnels", errors.ExecutorError),
        (500, "internal", errors.ExecutorError),
    ],
)
async def test_an_error_reply_raises_its_typed_error(
    server: Fake, rpc: ExecutorClient, status: int, code: str, cls: type[errors.ExecutorError]
) -> None:
    server.reply = replying(
        web.Response(body=error_body(code, "it went wrong", "/w/x"), status=status, content_type=MSGPACK)
    )
    with pytest.raises(errors.ExecutorError) as info:
        await bounded(rpc.call("GET", "/v1/files/stat", FileStat, params={"path": "x"}))
    assert type(info.value) is cls
    assert str(info.value) == "it went wrong"
    assert (info.value.code, info.value.path, info.value.sandbox_id) == (code, "/w/x", SID)
    assert server.diagnosed == 0


async def test_an_error_reply_in_json_is_read_as_json(server: Fake, rpc: ExecutorClient) -> None:
    body = msgspec.json.encode(Error(code="permission_denied", message="no"))
    server.reply = replying(web.Response(body=body, status=403, content_type=JSON))
    with pytest.raises(errors.PermissionDenied, match="^no$") as info:
        await bounded(rpc.call("GET", "/v1/info", Info))
    assert (info.value.code, info.value.path) == ("permission_denied", None)


async def test_an_undecodable_error_reply_is_an_internal_error_quoting_its_first_200_bytes(
    server: Fake, rpc: ExecutorClient
) -> None:
    body = b"<html>" + b"a" * 194 + b"TAIL" * 30
    server.reply = replying(web.Response(body=body, status=502, content_type="text/html"))
    with pytest.raises(errors.ExecutorError) as info:
        await bounded(rpc.call("GET", "/v1/info", Info))
    assert type(info.value) is errors.ExecutorError
    assert str(info.value) == f"sandbox {SID}: HTTP 502 from the executor: {body[:200]!r}"
    assert (info.value.code, info.value.sandbox_id) == ("internal", SID)


async def test_a_stopping_executor_is_a_lost_sandbox_unless_the_backend_knows_why(
    server: Fake, rpc: ExecutorClient
) -> None:
    server.reply = replying(msgpack(Error(code="stopping", message="going away"), status=503))
    with pytest.raises(errors.SandboxLost) as info:
        await bounded(rpc.call("GET", "/v1/info", Info))
    assert str(info.value) == (
        f"sandbox {SID}: the executor at {server.url} is unreachable: ConnectionResetError('going away')"
    )
    assert (info.value.reason, info.value.sandbox_id) == ("unreachable", SID)
    assert server.diagnosed == 1
    assert len(server.seen) == 1  # not retried
    server.diagnosis = errors.SandboxLost("evicted", reason="Evicted")
    with pytest.raises(errors.SandboxLost, match="^evicted$") as info:
        await bounded(rpc.call("GET", "/v1/info", Info))
    assert info.value.reason == "Evicted"


async def test_an_error_reply_of_64_kib_is_read_and_one_over_it_is_refused(server: Fake, rpc: ExecutorClient) -> None:
    limit = 64 * 1024
    short = error_body("no_space", "")
    exact = error_body("no_space", "x" * (limit - len(short) - 2))  # the str header grows by 2 bytes
    assert len(exact) == limit
    server.reply = replying(web.Response(body=exact, status=507, content_type=MSGPACK))
    with pytest.raises(errors.NoSpace):
        await bounded(rpc.call("GET", "/v1/info", Info))
    over = error_body("no_space", "x" * (limit - len(short) - 1))
    server.reply = replying(web.Response(body=over, status=507, content_type=MSGPACK))
    with pytest.raises(errors.ProtocolError) as info:
        await bounded(rpc.call("GET", "/v1/info", Info))
    assert str(info.value) == (
        f"sandbox {SID}: the executor's reply to GET /v1/info is too large ({limit + 1} bytes, the limit is {limit})"
    )
    assert info.value.sandbox_id == SID


async def test_a_chunked_error_reply_over_64_kib_is_refused(server: Fake, rpc: ExecutorClient) -> None:
    server.reply = streamed(bytes(40 * 1024), bytes(40 * 1024), status=500)
    with pytest.raises(errors.ProtocolError, match=r"is too large \(over 65536 bytes\)$"):
        await bounded(rpc.call("GET", "/v1/info", Info))


# Replies that are not the schema, or too large


async def test_a_reply_of_another_content_type_is_a_protocol_error(server: Fake, rpc: ExecutorClient) -> None:
    server.reply = replying(web.Response(body=encode(INFO), content_type="text/html"))
    with pytest.raises(errors.ProtocolError) as info:
        await bounded(rpc.call("GET", "/v1/info", Info))
    assert str(info.value) == (
        f"sandbox {SID}: the executor's reply to GET /v1/info has content type 'text/html', not application/msgpack"
    )
    assert info.value.sandbox_id == SID


@pytest.mark.parametrize("body", [b"\xc1\xc1 not msgpack", encode({"surprise": [1, 2, 3]})])
async def test_a_reply_that_is_not_the_schema_is_a_protocol_error(
    server: Fake, rpc: ExecutorClient, body: bytes
) -> None:
    server.reply = replying(web.Response(body=body, content_type=MSGPACK))
    with pytest.raises(errors.ProtocolError) as info:
        await bounded(rpc.call("POST", "/v1/exec", Info, ExecRequest(cmd="true")))
    assert str(info.value).startswith(f"sandbox {SID}: the executor's reply to POST /v1/exec is not a valid Info: ")
    assert info.value.sandbox_id == SID
    assert len(server.seen) == 1


async def test_a_reply_up_to_its_limit_is_read_and_one_byte_over_is_refused(server: Fake, rpc: ExecutorClient) -> None:
    body = encode(INFO)
    server.reply = replying(web.Response(body=body, content_type=MSGPACK))
    assert await bounded(rpc.call("GET", "/v1/info", Info, limit=len(body))) == INFO
    with pytest.raises(errors.ProtocolError) as info:
        await bounded(rpc.call("GET", "/v1/info", Info, limit=len(body) - 1))
    assert str(info.value) == (
        f"sandbox {SID}: the executor's reply to GET /v1/info is too large "
        f"({len(body)} bytes, the limit is {len(body) - 1})"
    )


async def test_a_chunked_reply_up_to_its_limit_is_read_and_one_byte_over_is_refused(
    server: Fake, rpc: ExecutorClient
) -> None:
    body = encode(INFO)
    server.reply = frames_reply(body[:10], body[10:], status=200)

    async def msgpack_chunked(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.content_type = MSGPACK
        await resp.prepare(request)
        await resp.write(body[:10])
        await asyncio.sleep(0.01)
        await resp.write(body[10:])
        await resp.write_eof()
        return resp

    server.reply = msgpack_chunked
    assert await bounded(rpc.call("GET", "/v1/info", Info, limit=len(body))) == INFO
    with pytest.raises(errors.ProtocolError) as info:
        await bounded(rpc.call("GET", "/v1/info", Info, limit=len(body) - 1))
    assert str(info.value) == (
        f"sandbox {SID}: the executor's reply to GET /v1/info is too large (over {len(body) - 1} bytes)"
    )


async def test_a_reply_begun_and_never_finished_times_out_after_read_timeout(server: Fake, rpc: ExecutorClient) -> None:
    server.reply = streamed(b"\x00" * 10, length=1000)
    loop = asyncio.get_running_loop()
    start = loop.time()
    # A command timeout of 5 s: only the body's own deadline, read_timeout, can end it this soon.
    with pytest.raises(errors.SandboxTimeout) as info:
        await bounded(rpc.call("POST", "/v1/exec", ExecResult, ExecRequest(cmd="true"), timeout=5.0))
    assert loop.time() - start < 4.0  # read_timeout (0.3 s), not the 5 s command timeout; loose for a loaded machine
    assert str(info.value) == (
        f"sandbox {SID}: the executor began a reply to POST /v1/exec but did not finish it within "
        f"read_timeout={READ:g}s (a Client option)"
    )
    assert info.value.sandbox_id == SID


# Deadlines


async def test_a_request_unanswered_within_read_timeout_times_out(server: Fake, rpc: ExecutorClient) -> None:
    server.reply = silent
    with pytest.raises(errors.SandboxTimeout) as info:
        await bounded(rpc.call("GET", "/v1/info", Info))
    assert str(info.value) == timed_out(server.url)
    assert info.value.sandbox_id == SID
    assert (len(server.seen), server.diagnosed) == (1, 1)  # a deadline that passed is not retried
    server.diagnosis = errors.SandboxLost("oom", reason="OOMKilled")
    with pytest.raises(errors.SandboxLost, match="^oom$"):
        await bounded(rpc.call("GET", "/v1/info", Info))


async def test_a_commands_timeout_extends_the_reply_deadline(server: Fake, rpc: ExecutorClient) -> None:
    server.reply = after(READ + 0.15, msgpack(INFO))
    assert await bounded(rpc.call("GET", "/v1/info", Info, timeout=0.3)) == INFO
    # By default a call runs no command: read_timeout alone.
    with pytest.raises(errors.SandboxTimeout, match="did not answer in time"):
        await bounded(rpc.call("GET", "/v1/info", Info))


async def test_a_request_without_a_deadline_waits_while_the_executor_answers_its_probes(
    server: Fake, rpc: ExecutorClient
) -> None:
    server.reply = after(READ + 2 * LIVE + 0.2, msgpack(INFO))
    assert await bounded(rpc.call("GET", "/v1/info", Info, timeout=None)) == INFO
    assert server.probes >= 2
    assert server.diagnosed == 0


# Retries


async def test_a_broken_connection_is_retried_with_the_same_body_and_request_id(
    server: Fake, rpc: ExecutorClient
) -> None:
    server.reply = replying(drop, msgpack(ExecResult(exit_code=0)))
    req = ExecRequest(cmd="true", request_id="rid-retry")
    assert (await bounded(rpc.call("POST", "/v1/exec", ExecResult, req))).exit_code == 0
    assert [s.path for s in server.seen] == ["/v1/exec", "/v1/exec"]
    assert server.seen[0].body == server.seen[1].body == encode(req)
    assert server.seen[1].headers["Authorization"] == f"Bearer {TOKEN}"


async def test_a_call_is_tried_four_times_in_all_then_is_a_lost_sandbox(server: Fake, rpc: ExecutorClient) -> None:
    # POST: aiohttp itself resends an idempotent request once on a reused connection.
    server.reply = replying(drop, drop, drop, msgpack(INFO))
    assert await bounded(rpc.call("POST", "/v1/info", Info)) == INFO
    assert len(server.seen) == 4
    server.seen.clear()
    server.reply = drop
    with pytest.raises(errors.SandboxLost) as info:
        await bounded(rpc.call("POST", "/v1/info", Info))
    assert len(server.seen) == 4
    assert str(info.value) == (
        f"sandbox {SID}: the executor at {server.url} is unreachable: ServerDisconnectedError('Server disconnected')"
    )
    assert (info.value.reason, info.value.sandbox_id) == ("unreachable", SID)
    assert isinstance(info.value.__cause__, aiohttp.ClientConnectionError)
    assert server.diagnosed == 1


async def test_a_call_that_may_not_be_retried_is_sent_once(server: Fake, rpc: ExecutorClient) -> None:
    server.reply = drop
    with pytest.raises(errors.SandboxLost, match="is unreachable") as info:
        await bounded(rpc.call("POST", "/v1/exec", ExecResult, ExecRequest(cmd="true"), retry=False))
    assert len(server.seen) == 1
    assert info.value.reason == "unreachable"
    server.diagnosis = errors.SandboxLost("deleted", reason="Deleted")
    with pytest.raises(errors.SandboxLost, match="^deleted$"):
        await bounded(rpc.call("POST", "/v1/exec", ExecResult, ExecRequest(cmd="true"), retry=False))
    assert len(server.seen) == 2


async def test_a_retried_call_that_times_out_is_a_timeout(server: Fake, rpc: ExecutorClient) -> None:
    server.reply = replying(drop, silent)
    with pytest.raises(errors.SandboxTimeout) as info:
        await bounded(rpc.call("POST", "/v1/info", Info))
    assert str(info.value) == timed_out(server.url)
    assert len(server.seen) == 2


async def test_an_unreachable_executor_is_a_lost_sandbox(session: aiohttp.ClientSession) -> None:
    # A port that was just free: nothing listens there.
    srv = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    srv.close()
    await srv.wait_closed()

    async def diagnose() -> None:
        return None

    rpc = ExecutorClient(
        session, f"http://127.0.0.1:{port}", TOKEN, sandbox_id=SID, diagnose=diagnose, read_timeout=READ
    )
    with pytest.raises(
        errors.SandboxLost, match=f"^sandbox {SID}: the executor at http://127.0.0.1:{port} is unreachable: "
    ):
        await bounded(rpc.call("GET", "/v1/info", Info))


# TLS: an impostor


@pytest.fixture
async def tls_server() -> AsyncIterator[tuple[str, _tls.Identity, list[int]]]:
    """A TLS server with its own certificate, counting the connections it accepts."""
    identity = _tls.make_identity("impostor")
    with tempfile.TemporaryDirectory() as d:
        pem = Path(d) / "id.pem"
        pem.write_text(identity.pem)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(pem)
    accepted = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted[0] += 1
        try:
            await reader.read(65536)
        finally:
            writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=ctx)
    try:
        yield f"https://127.0.0.1:{srv.sockets[0].getsockname()[1]}", identity, accepted
    finally:
        srv.close()


async def test_a_server_with_another_certificate_is_not_the_executor_and_is_not_retried(
    tls_server: tuple[str, _tls.Identity, list[int]], session: aiohttp.ClientSession
) -> None:
    url, identity, accepted = tls_server
    pinned = _tls.make_identity("sandbox").fingerprint
    diagnosed = []

    async def diagnose() -> None:
        diagnosed.append(1)

    rpc = ExecutorClient(session, url, TOKEN, sandbox_id=SID, diagnose=diagnose, fingerprint=pinned, read_timeout=READ)
    with pytest.raises(errors.ProtocolError) as info:
        await bounded(rpc.call("GET", "/v1/info", Info))
    assert str(info.value) == (
        f"sandbox {SID}: whatever answers at {url} is not its executor: it presented a TLS certificate with "
        f"SHA-256 {identity.fingerprint.hex()}, not the one made for the sandbox ({pinned.hex()})"
    )
    assert info.value.sandbox_id == SID
    await asyncio.sleep(0.05)
    assert accepted[0] == 1
    assert diagnosed == []


# Raw bodies: send


async def test_send_posts_raw_bytes_with_its_content_type_and_retries_them(server: Fake, rpc: ExecutorClient) -> None:
    stat = FileStat(path="/w/f", name="f", type="file", size=3, mode=0o644, mtime=1.0)
    server.reply = replying(drop, msgpack(stat))
    # POST: aiohttp itself resends an idempotent request (PUT) once on a broken connection.
    got = await bounded(
        rpc.send("POST", "/v1/files", FileStat, b"abc", params={"path": "f"}, content_type="application/octet-stream")
    )
    assert got == stat
    assert len(server.seen) == 2
    for seen in server.seen:
        assert (seen.method, seen.path, seen.query, seen.body) == ("POST", "/v1/files", {"path": "f"}, b"abc")
        assert seen.headers.getall("Content-Type") == ["application/octet-stream"]
        assert seen.headers["Authorization"] == f"Bearer {TOKEN}"
        assert seen.headers["Accept"] == MSGPACK


async def test_send_streams_an_async_body_and_does_not_retry_it(server: Fake, rpc: ExecutorClient) -> None:
    stat = FileStat(path="/w/f", name="f", type="file", size=6, mode=0o644, mtime=1.0)
    server.reply = replying(msgpack(stat))
    got = await bounded(
        rpc.send("PUT", "/v1/files", FileStat, chunks_of(b"abc", b"", b"def"), params={}, content_type="x/y")
    )
    assert got == stat
    assert server.seen[0].body == b"abcdef"
    assert server.seen[0].headers.getall("Content-Type") == ["x/y"]
    server.seen.clear()
    server.reply = drop
    with pytest.raises(errors.SandboxLost, match="unreachable"):
        await bounded(rpc.send("PUT", "/v1/files", FileStat, chunks_of(b"abc"), params={}, content_type="x/y"))
    assert len(server.seen) == 1


async def test_send_raises_the_exception_of_a_failing_body_as_itself(server: Fake, rpc: ExecutorClient) -> None:
    server.reply = replying(msgpack(FileStat(path="/w/f", name="f", type="file", size=6, mode=0o644, mtime=1.0)))
    broken = OSError("the source file went away")
    with pytest.raises(OSError, match="^the source file went away$") as info:
        await bounded(
            rpc.send("PUT", "/v1/files", FileStat, chunks_of(b"abc", error=broken), params={}, content_type="x/y")
        )
    assert info.value is broken
    assert server.diagnosed == 0


async def test_send_applies_the_reply_deadline_and_limit(server: Fake, rpc: ExecutorClient) -> None:
    body = encode(INFO)
    server.reply = replying(web.Response(body=body, content_type=MSGPACK))
    with pytest.raises(errors.ProtocolError, match=f"limit is {len(body) - 1}"):
        await bounded(rpc.send("PUT", "/v1/x", Info, b"", params={}, content_type="x/y", limit=len(body) - 1))
    server.reply = after(READ + 0.15, msgpack(INFO))
    assert await bounded(rpc.send("PUT", "/v1/x", Info, b"", params={}, content_type="x/y", timeout=0.3)) == INFO
    with pytest.raises(errors.SandboxTimeout, match="did not answer in time"):
        await bounded(rpc.send("PUT", "/v1/x", Info, b"", params={}, content_type="x/y"))


async def test_send_with_no_body_sends_an_empty_one_and_does_not_retry_it(server: Fake, rpc: ExecutorClient) -> None:
    server.reply = replying(msgpack(INFO))
    assert await bounded(rpc.send("POST", "/v1/x", Info, None, params={"a": "1"}, content_type="x/y")) == INFO
    assert [(s.body, s.query) for s in server.seen] == [(b"", {"a": "1"})]
    server.reply = drop
    with pytest.raises(errors.SandboxLost, match="unreachable"):
        await bounded(rpc.send("POST", "/v1/x", Info, None, params={}, content_type="x/y"))
    assert len(server.seen) == 2


# Byte streams: receive


def framed(*events: object) -> bytes:
    return b"".join(frame(e) for e in events)


async def test_receive_yields_the_data_frames_until_the_end_frame(server: Fake, rpc: ExecutorClient) -> None:
    server.reply = frames_reply(
        framed(DataFrame(data=b"ab"), HeartbeatEvent(), DataFrame(data=b"cd")),
        framed(EndFrame(), DataFrame(data=b"after the end")),
    )
    got = await bounded(collect(rpc.receive("/v1/files", {"path": "f"})))
    assert got == [b"ab", b"cd"]
    assert (rpc._flights, rpc._streams) == (set(), set())  # nothing kept of a stream that ended
    [seen] = server.seen
    assert (seen.method, seen.path, seen.query) == ("GET", "/v1/files", {"path": "f"})
    assert seen.headers["Authorization"] == f"Bearer {TOKEN}"
    assert seen.headers["Accept"] == MSGPACK


async def test_receive_of_a_stream_without_its_end_frame_is_a_lost_sandbox(server: Fake, rpc: ExecutorClient) -> None:
    server.reply = frames_reply(framed(DataFrame(data=b"ab")))
    got: list[bytes] = []
    with pytest.raises(errors.SandboxLost) as info:
        await bounded(collect(rpc.receive("/v1/files", {"path": "f"}), into=got))
    assert got == [b"ab"]
    assert str(info.value) == f"sandbox {SID}: the stream from /v1/files ended before its last frame"
    assert (info.value.reason, info.value.sandbox_id) == ("stream", SID)
    assert server.diagnosed == 0


async def test_receive_of_a_stream_cut_inside_a_frame_is_an_unreachable_sandbox(
    server: Fake, rpc: ExecutorClient
) -> None:
    cuts = {
        framed(DataFrame(data=b"ab"))[:-1]: "IncompleteReadError('19 bytes read on a total of 20 expected bytes')",
        FRAME_HEADER.pack(5)[:2]: "IncompleteReadError('2 bytes read on a total of 4 expected bytes')",
    }
    for cut, why in cuts.items():
        server.reply = frames_reply(cut)
        with pytest.raises(errors.SandboxLost) as info:
            await bounded(collect(rpc.receive("/v1/files", {"path": "f"})))
        assert (info.value.reason, info.value.sandbox_id) == ("unreachable", SID)
        assert str(info.value) == f"sandbox {SID}: the executor at {server.url} is unreachable: {why}"


async def test_receive_raises_the_typed_error_of_an_error_frame(server: Fake, rpc: ExecutorClient) -> None:
    error = Error(code="is_a_directory", message="a directory", path="/w/d")
    server.reply = frames_reply(framed(DataFrame(data=b"ab"), ErrorEvent(error=error), EndFrame()))
    got: list[bytes] = []
    with pytest.raises(errors.IsADirectory, match="^a directory$") as info:
        await bounded(collect(rpc.receive("/v1/files", {"path": "d"}), into=got))
    assert got == [b"ab"]
    assert (info.value.code, info.value.path, info.value.sandbox_id) == ("is_a_directory", "/w/d", SID)


async def test_receive_raises_the_typed_error_of_an_error_reply(server: Fake, rpc: ExecutorClient) -> None:
    server.reply = replying(
        web.Response(body=error_body("file_not_found", "gone", "/w/f"), status=404, content_type=MSGPACK)
    )
    with pytest.raises(errors.PathNotFound, match="^gone$") as info:
        await bounded(collect(rpc.receive("/v1/files", {"path": "f"})))
    assert (info.value.path, info.value.sandbox_id) == ("/w/f", SID)
    server.reply = replying(web.Response(body=error_body("bad_request", "bad path"), status=400, content_type=MSGPACK))
    with pytest.raises(errors.InvalidRequest, match="^bad path$"):
        await bounded(collect(rpc.receive("/v1/files", {"path": "f"})))
    server.reply = replying(msgpack(Error(code="stopping", message="bye"), status=503))
    with pytest.raises(errors.SandboxLost, match=r"unreachable: ConnectionResetError\('bye'\)"):
        await bounded(collect(rpc.receive("/v1/files", {"path": "f"})))


async def test_receive_refuses_a_frame_over_the_limit_and_an_undecodable_one(server: Fake, rpc: ExecutorClient) -> None:
    server.reply = frames_reply(FRAME_HEADER.pack(MAX_FRAME + 1) + b"\x00" * 100)
    with pytest.raises(errors.ProtocolError) as info:
        await bounded(collect(rpc.receive("/v1/files", {"path": "f"})))
    assert str(info.value) == (
        f"sandbox {SID}: the executor's reply to GET /v1/files has a frame of {MAX_FRAME + 1} bytes "
        f"(the limit is {MAX_FRAME})"
    )
    assert info.value.sandbox_id == SID
    server.reply = frames_reply(FRAME_HEADER.pack(3) + b"\xc1\xc1\xc1" + framed(EndFrame()))
    with pytest.raises(errors.ProtocolError) as info:
        await bounded(collect(rpc.receive("/v1/files", {"path": "f"})))
    assert str(info.value).startswith(
        f"sandbox {SID}: the executor's reply to GET /v1/files has an undecodable frame: "
    )


async def test_receive_reads_a_frame_of_exactly_the_limit(server: Fake, rpc: ExecutorClient) -> None:
    # Its header is accepted, and the stream then ends inside it: a cut stream, not a refused frame.
    server.reply = frames_reply(FRAME_HEADER.pack(MAX_FRAME))
    with pytest.raises(errors.SandboxLost, match="unreachable"):
        await bounded(collect(rpc.receive("/v1/files", {"path": "f"})))


async def test_a_silent_stream_times_out_after_stream_idle_timeout(server: Fake, rpc: ExecutorClient) -> None:
    rpc.stream_idle_timeout = 0.3
    server.reply = streamed(framed(DataFrame(data=b"ab")), content_type="application/x-orchard-frames")
    got: list[bytes] = []
    with pytest.raises(errors.SandboxTimeout) as info:
        await bounded(collect(rpc.receive("/v1/files", {"path": "f"}), into=got))
    assert got == [b"ab"]
    assert str(info.value) == (
        f"sandbox {SID}: the executor sent nothing on a stream for stream_idle_timeout=0.3s, not even a heartbeat: "
        "it is frozen or unreachable"
    )
    assert info.value.sandbox_id == SID
    server.reply = streamed(framed(ExitEvent(result=ExecResult(exit_code=0)))[:0], content_type="x/frames")
    with pytest.raises(errors.SandboxTimeout, match="stream_idle_timeout=0.3s"):
        await bounded(collect(rpc.frames("/v1/exec/stream", ExecRequest(cmd="true"), None)))


async def test_a_stream_kept_alive_by_heartbeats_does_not_time_out(server: Fake, rpc: ExecutorClient) -> None:
    rpc.stream_idle_timeout = 0.3

    async def beating(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.content_type = "application/x-orchard-frames"
        await resp.prepare(request)
        for _ in range(6):
            await resp.write(framed(HeartbeatEvent()))
            await asyncio.sleep(0.1)
        await resp.write(framed(DataFrame(data=b"late"), EndFrame()))
        await resp.write_eof()
        return resp

    server.reply = beating
    assert await bounded(collect(rpc.receive("/v1/files", {"path": "f"}))) == [b"late"]


# Event streams: frames


async def test_frames_posts_the_request_and_yields_output_and_exit_without_heartbeats(
    server: Fake, rpc: ExecutorClient
) -> None:
    out = OutputEvent(stream="stdout", data=b"hi\n")
    exit_ = ExitEvent(result=ExecResult(exit_code=3))
    server.reply = frames_reply(framed(HeartbeatEvent(), out, HeartbeatEvent(), exit_))
    req = ExecRequest(cmd=["echo", "hi"])
    got = await bounded(collect(rpc.frames("/v1/exec/stream", req, None)))
    assert got == [out, exit_]
    [seen] = server.seen
    assert (seen.method, seen.path, seen.body) == ("POST", "/v1/exec/stream", encode(req))
    assert seen.headers["Content-Type"] == MSGPACK
    assert seen.headers["Authorization"] == f"Bearer {TOKEN}"


async def test_frames_raises_the_typed_error_of_an_error_frame_or_reply(server: Fake, rpc: ExecutorClient) -> None:
    out = OutputEvent(stream="stderr", data=b"x")
    server.reply = frames_reply(framed(out, ErrorEvent(error=Error(code="no_space", message="full", path="/w"))))
    got: list[object] = []
    with pytest.raises(errors.NoSpace, match="^full$") as info:
        await bounded(collect(rpc.frames("/v1/exec/stream", ExecRequest(cmd="true"), None), into=got))
    assert got == [out]
    assert (info.value.code, info.value.path, info.value.sandbox_id) == ("no_space", "/w", SID)
    server.reply = replying(
        web.Response(body=error_body("command_not_found", "nope"), status=400, content_type=MSGPACK)
    )
    with pytest.raises(errors.CommandNotFound, match="^nope$"):
        await bounded(collect(rpc.frames("/v1/exec/stream", ExecRequest(cmd="nope"), None)))


async def test_frames_of_a_cut_stream_is_an_unreachable_sandbox(server: Fake, rpc: ExecutorClient) -> None:
    server.reply = frames_reply(FRAME_HEADER.pack(5)[:2])
    with pytest.raises(errors.SandboxLost) as info:
        await bounded(collect(rpc.frames("/v1/exec/stream", ExecRequest(cmd="true"), None)))
    assert info.value.reason == "unreachable"
    assert str(info.value) == (
        f"sandbox {SID}: the executor at {server.url} is unreachable: "
        "IncompleteReadError('2 bytes read on a total of 4 expected bytes')"
    )
    server.reply = frames_reply(FRAME_HEADER.pack(1) + b"\xc1")
    with pytest.raises(errors.ProtocolError, match="POST /v1/exec/stream has an undecodable frame"):
        await bounded(collect(rpc.frames("/v1/exec/stream", ExecRequest(cmd="true"), None)))


async def test_frames_with_stdin_sends_the_request_framed_then_the_stdin(server: Fake, rpc: ExecutorClient) -> None:
    exit_ = ExitEvent(result=ExecResult(exit_code=0))
    server.reply = frames_reply(framed(exit_))
    req = ExecRequest(cmd="cat")
    got = await bounded(collect(rpc.frames("/v1/exec/stream", req, None, stdin=chunks_of(b"one ", b"", b"two"))))
    assert got == [exit_]
    [seen] = server.seen
    assert seen.headers.getall("Content-Type") == [WITH_STDIN]
    assert seen.headers["Authorization"] == f"Bearer {TOKEN}"
    assert seen.headers["Accept"] == MSGPACK
    assert seen.body == frame(req) + b"one two"


async def test_frames_raises_the_exception_of_a_failing_stdin_as_itself(server: Fake, rpc: ExecutorClient) -> None:
    broken = ValueError("stdin broke")
    exit_ = ExitEvent(result=ExecResult(exit_code=0))

    async def slow_stdin() -> AsyncIterator[bytes]:
        yield b"first"
        await asyncio.sleep(0.2)
        raise broken

    async def streaming(request: web.Request) -> web.StreamResponse:
        # Answers at once, before the body is read: the stdin fails while the reply streams in.
        resp = web.StreamResponse()
        resp.content_type = "application/x-orchard-frames"
        await resp.prepare(request)
        await resp.write(framed(OutputEvent(stream="stdout", data=b"x")))
        try:
            await request.read()
        except Exception:
            pass
        await asyncio.sleep(BOUND)
        await resp.write(framed(exit_))
        return resp

    async def record(request: web.Request) -> web.StreamResponse:
        return await streaming(request)

    server.reply = record
    server.read_body = False
    got: list[object] = []
    with pytest.raises(ValueError, match="^stdin broke$") as info:
        await bounded(
            collect(rpc.frames("/v1/exec/stream", ExecRequest(cmd="cat"), None, stdin=slow_stdin()), into=got)
        )
    assert info.value is broken
    assert got == [OutputEvent(stream="stdout", data=b"x")]
    assert server.diagnosed == 0

    # Failing before any reply, and with a complete reply after the failure.
    server.read_body = True
    server.reply = frames_reply(framed(exit_))
    with pytest.raises(ValueError, match="^stdin broke$") as info:
        await bounded(
            collect(rpc.frames("/v1/exec/stream", ExecRequest(cmd="cat"), None, stdin=chunks_of(b"a", error=broken)))
        )
    assert info.value is broken
    assert server.diagnosed == 0


# Websockets


async def test_a_websocket_carries_only_the_token(server: Fake, rpc: ExecutorClient) -> None:
    async def echo(request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for msg in ws:
            await ws.send_bytes(msg.data)
        return ws

    server.reply = echo
    ws = await bounded(rpc.websocket("/v1/ports/80/connect", max_msg_size=1000))
    try:
        await ws.send_bytes(b"ping")
        assert (await bounded(ws.receive_bytes())) == b"ping"
        await ws.send_bytes(b"x" * 2000)
        msg = await bounded(ws.receive())
        assert msg.type is aiohttp.WSMsgType.ERROR  # the echo is over max_msg_size
    finally:
        await ws.close()
    [seen] = server.seen
    assert (seen.method, seen.path) == ("GET", "/v1/ports/80/connect")
    assert seen.headers["Authorization"] == f"Bearer {TOKEN}"
    assert "Content-Type" not in seen.headers
    assert seen.headers["Accept"] == "*/*"  # aiohttp's, not the msgpack one


@pytest.mark.parametrize(
    ("status", "code", "cls"),
    [
        (400, "bad_request", errors.InvalidRequest),
        (401, "unauthorized", errors.AuthError),
        (429, "too_many_tunnels", errors.ExecutorError),
        (502, "port_closed", errors.PortClosed),
        (418, "internal", errors.ExecutorError),
    ],
)
async def test_a_refused_websocket_is_typed_by_its_status(
    server: Fake, rpc: ExecutorClient, status: int, code: str, cls: type[errors.ExecutorError]
) -> None:
    server.reply = replying(web.Response(status=status))
    with pytest.raises(errors.ExecutorError) as info:
        await bounded(rpc.websocket("/v1/ports/80/connect", max_msg_size=1000))
    assert type(info.value) is cls
    assert str(info.value) == f"sandbox {SID}: the executor refused /v1/ports/80/connect with HTTP {status} ({code})"
    assert (info.value.code, info.value.path, info.value.sandbox_id) == (code, None, SID)


async def test_a_websocket_refused_by_a_stopping_executor_is_a_lost_sandbox(server: Fake, rpc: ExecutorClient) -> None:
    server.reply = replying(web.Response(status=503))
    with pytest.raises(errors.SandboxLost) as info:
        await bounded(rpc.websocket("/v1/ports/80/connect", max_msg_size=1000))
    assert str(info.value) == (
        f"sandbox {SID}: the executor at {server.url} is unreachable: ConnectionResetError('the executor is stopping')"
    )
    assert info.value.reason == "unreachable"


async def test_a_websocket_unanswered_within_read_timeout_times_out(server: Fake, rpc: ExecutorClient) -> None:
    server.reply = silent
    with pytest.raises(errors.SandboxTimeout) as info:
        await bounded(rpc.websocket("/v1/ports/80/connect", max_msg_size=1000))
    assert str(info.value) == (
        f"sandbox {SID}: the executor at {server.url} did not answer in time (); a request may take "
        f"read_timeout={READ:g}s, plus the command's timeout if it has one (a Client option)"
    )
    server.reply = drop
    with pytest.raises(errors.SandboxLost) as lost:
        await bounded(rpc.websocket("/v1/ports/80/connect", max_msg_size=1000))
    assert str(lost.value) == (
        f"sandbox {SID}: the executor at {server.url} is unreachable: ServerDisconnectedError('Server disconnected')"
    )


# Closing, ending


async def test_a_closed_client_refuses_every_request(server: Fake, rpc: ExecutorClient) -> None:
    server.reply = replying(msgpack(INFO))
    rpc.close("bye")
    assert rpc.closed
    message = f"^sandbox {SID} is closed$"
    with pytest.raises(errors.SandboxClosed, match=message) as info:
        await rpc.call("GET", "/v1/info", Info)
    assert info.value.sandbox_id == SID
    with pytest.raises(errors.SandboxClosed, match=message):
        await rpc.send("PUT", "/v1/files", FileStat, b"", params={}, content_type="x/y")
    with pytest.raises(errors.SandboxClosed, match=message):
        await collect(rpc.receive("/v1/files", {}))
    with pytest.raises(errors.SandboxClosed, match=message):
        await collect(rpc.frames("/v1/exec/stream", ExecRequest(cmd="true"), None))
    with pytest.raises(errors.SandboxClosed, match=message):
        await rpc.websocket("/v1/ports/1/connect", max_msg_size=10)
    assert server.seen == []


async def test_a_client_whose_session_closed_refuses_requests(server: Fake, rpc: ExecutorClient) -> None:
    await rpc._session.close()
    with pytest.raises(errors.SandboxClosed, match=f"^sandbox {SID} is closed$"):
        await rpc.call("GET", "/v1/info", Info)
    with pytest.raises(errors.SandboxClosed):
        await collect(rpc.frames("/v1/exec/stream", ExecRequest(cmd="true"), None))


async def test_close_fails_the_requests_and_streams_in_flight_with_sandbox_closed(
    server: Fake, rpc: ExecutorClient
) -> None:
    async def stream_then_hold(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.content_type = "application/x-orchard-frames"
        await resp.prepare(request)
        if request.path == "/v1/files":
            await resp.write(framed(DataFrame(data=b"ab")))
        else:
            await resp.write(framed(OutputEvent(stream="stdout", data=b"ab")))
        await asyncio.sleep(BOUND * 2)
        return resp

    async def route(request: web.Request) -> web.StreamResponse:
        if request.path in ("/v1/files", "/v1/exec/stream"):
            return await stream_then_hold(request)
        return await silent(request)

    server.reply = route
    received: list[object] = []

    async def read(it: AsyncIterator[Any]) -> None:
        async for x in it:
            received.append(x)

    tasks = [
        asyncio.create_task(rpc.call("POST", "/v1/exec", ExecResult, ExecRequest(cmd="sleep 9"), timeout=None)),
        asyncio.create_task(rpc.call("GET", "/v1/info", Info, timeout=5.0)),
        asyncio.create_task(read(rpc.receive("/v1/files", {"path": "f"}))),
        asyncio.create_task(read(rpc.frames("/v1/exec/stream", ExecRequest(cmd="sleep 9"), None))),
    ]
    while len(received) < 2 or len(server.seen) < 4:
        await asyncio.sleep(0.01)
    rpc.close("it was closed")
    for task in tasks:
        with pytest.raises(errors.SandboxClosed) as info:
            await bounded(task)
        assert str(info.value) == f"sandbox {SID}: it was closed"
        assert info.value.sandbox_id == SID
        assert task.cancelling() == 0
    assert server.diagnosed == 0
    assert (rpc._flights, rpc._streams) == (set(), set())  # nothing kept of requests that ended


async def test_ended_fails_requests_in_flight_and_later_ones_with_the_first_reason(
    server: Fake, rpc: ExecutorClient
) -> None:
    server.reply = silent
    task = asyncio.create_task(rpc.call("GET", "/v1/info", Info, timeout=5.0))
    while not server.seen:
        await asyncio.sleep(0.01)
    made: list[str] = []

    def deleted() -> errors.OrchardError:
        made.append("deleted")
        return errors.SandboxLost("deleted", reason="Deleted", sandbox_id=SID)

    rpc.ended(deleted)
    rpc.ended(lambda: errors.SandboxLost("evicted", reason="Evicted"))
    with pytest.raises(errors.SandboxLost, match="^deleted$") as info:
        await bounded(task)
    assert info.value.reason == "Deleted"
    for later in (
        rpc.call("GET", "/v1/info", Info),
        collect(rpc.receive("/v1/files", {})),
        rpc.websocket("/v1/ports/1/connect", max_msg_size=10),
    ):
        with pytest.raises(errors.SandboxLost, match="^deleted$"):
            await bounded(later)
    assert made == ["deleted"] * 4
    assert not rpc.closed
    assert len(server.seen) == 1


async def test_a_request_cancelled_by_its_caller_as_the_sandbox_closes_stays_cancelled(
    server: Fake, rpc: ExecutorClient
) -> None:
    server.reply = silent
    task = asyncio.create_task(rpc.call("GET", "/v1/info", Info, timeout=5.0))
    while not server.seen:
        await asyncio.sleep(0.01)
    task.cancel()
    rpc.close("closed")
    with pytest.raises(asyncio.CancelledError):
        await bounded(task)


async def test_a_request_made_while_its_task_is_cancelling_still_fails_with_sandbox_closed(
    server: Fake, rpc: ExecutorClient
) -> None:
    server.reply = silent
    started = asyncio.Event()

    async def cleanup_after_a_cancel() -> object:
        try:
            await asyncio.sleep(BOUND)
        except asyncio.CancelledError:
            pass  # cleans up, still cancelling, with a request
        started.set()
        return await rpc.call("GET", "/v1/info", Info, timeout=5.0)

    task = asyncio.create_task(cleanup_after_a_cancel())
    await asyncio.sleep(0)
    task.cancel()
    await started.wait()
    while not server.seen:
        await asyncio.sleep(0.01)
    rpc.close("closed meanwhile")
    with pytest.raises(errors.SandboxClosed, match="closed meanwhile"):
        await bounded(task)


async def test_a_request_failed_while_a_cancel_is_swallowed_below_it_leaves_its_task_uncancelled() -> None:
    """``_Flight``: the cancel that fails a request, swallowed by code below (Python 3.11's ``wait_for`` can),
    is taken back: the task must not stay cancelling, or the next check of it (a rollout's) ends it silently."""
    flights: set[_Flight] = set()
    waiting = asyncio.Event()

    async def request() -> None:
        task = asyncio.current_task()
        assert task is not None
        with _Flight(flights, task, 0.0):
            waiting.set()
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass  # swallowed below the flight
            raise errors.SandboxLost("what the request found itself", reason="Deleted")

    task = asyncio.create_task(request())
    await waiting.wait()
    [flight] = flights
    flight.fail(errors.SandboxLost("the watch saw the pod end", reason="Deleted"))
    flight.fail(errors.SandboxLost("a second reason", reason="Evicted"))
    with pytest.raises(errors.SandboxLost, match="found itself"):
        await task
    assert task.cancelling() == 0
    assert flights == set()


async def test_a_diagnosis_that_closes_the_sandbox_does_not_fail_its_own_request(
    server: Fake, rpc: ExecutorClient
) -> None:
    server.reply = silent
    closed_by_diagnose: list[bool] = []

    async def diagnose() -> None:
        rpc.close("closed by the backend")
        closed_by_diagnose.append(True)
        await asyncio.sleep(0.01)

    rpc._diagnose = diagnose
    with pytest.raises(errors.SandboxTimeout, match="did not answer in time"):
        await bounded(rpc.call("GET", "/v1/info", Info))
    assert closed_by_diagnose == [True]


# The liveness watchdog


async def test_a_request_without_a_deadline_fails_once_the_executor_stops_answering_probes(
    server: Fake, rpc: ExecutorClient
) -> None:
    server.reply = silent
    server.health = silent
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(errors.SandboxTimeout) as info:
        await bounded(rpc.call("POST", "/v1/exec", ExecResult, ExecRequest(cmd="sleep 9"), timeout=None))
    took = loop.time() - start
    assert 2 * LIVE - 0.05 < took < 2 * LIVE + 3  # two liveness periods, well before BOUND; loose for a loaded machine
    assert str(info.value) == (
        f"sandbox {SID}: the executor at {server.url} stopped answering: a request waited {LIVE:g}s and /healthz "
        f"then got no answer within liveness_timeout={LIVE:g}s (a Client option); it is frozen, overloaded or cut "
        "off by the network"
    )
    assert info.value.sandbox_id == SID
    assert server.diagnosed == 1
    assert server.probes == 1


async def test_a_failed_probe_reports_what_the_backend_found(server: Fake, rpc: ExecutorClient) -> None:
    server.reply = silent
    server.health = drop
    server.diagnosis = errors.SandboxLost("oom killed", reason="OOMKilled")
    tasks = [
        asyncio.create_task(rpc.call("GET", "/v1/info", Info, timeout=None)),
        asyncio.create_task(rpc.call("GET", "/v1/info", Info, timeout=None)),
    ]
    for task in tasks:
        with pytest.raises(errors.SandboxLost, match="^oom killed$"):
            await bounded(task)
    assert server.probes > 1  # a refused probe is retried within its deadline
    assert server.diagnosed == 1


async def test_a_probe_answered_after_a_refusal_keeps_the_request_waiting(server: Fake, rpc: ExecutorClient) -> None:
    server.reply = after(3 * LIVE + 0.1, msgpack(INFO))
    server.health = replying(drop, web.Response(status=500))
    assert await bounded(rpc.call("GET", "/v1/info", Info, timeout=None)) == INFO
    assert server.probes >= 3
    assert server.diagnosed == 0


async def test_a_closed_session_fails_the_waiting_requests_at_the_probe(server: Fake, rpc: ExecutorClient) -> None:
    server.reply = silent
    loop = asyncio.get_running_loop()
    start = loop.time()
    task = asyncio.create_task(rpc.call("GET", "/v1/info", Info, timeout=None))
    while not server.seen:
        await asyncio.sleep(0.01)
    # The Client's session closed while the request waits on a connection of its own.
    closed = aiohttp.ClientSession()
    await closed.close()
    rpc._session = closed
    with pytest.raises(errors.SandboxClosed) as info:
        await bounded(task)
    # At the first probe, and without the watchdog spinning the loop after it (it once did, until the test's timeout).
    assert loop.time() - start < LIVE + 3  # loose for a loaded machine
    assert str(info.value) == f"sandbox {SID}: its HTTP session was closed"
    assert info.value.sandbox_id == SID
    assert (server.probes, server.diagnosed) == (0, 0)


# The helpers


async def test_with_stdin_frames_the_request_then_yields_the_non_empty_chunks() -> None:
    req = ExecRequest(cmd="cat")
    got = await collect(with_stdin(req, chunks_of(b"a", b"", b"bc", b"")))
    assert got == [frame(req), b"a", b"bc"]


async def test_a_source_passes_its_chunks_and_keeps_the_error_it_raised() -> None:
    source = _Source(chunks_of(b"a", b"b"))
    assert (source.error, source.on_error) == (None, None)
    assert await collect(source.__aiter__()) == [b"a", b"b"]
    assert source.error is None
    broken = OSError("broken")
    calls: list[str] = []
    source = _Source(chunks_of(b"a", error=broken))
    source.on_error = lambda: calls.append("closed")
    got: list[bytes] = []
    with pytest.raises(OSError, match="^broken$") as info:
        await bounded(collect(source.__aiter__(), into=got))
    assert info.value is broken
    assert (got, source.error, calls) == ([b"a"], broken, ["closed"])
    source = _Source(chunks_of(error=broken))
    with pytest.raises(OSError, match="^broken$"):
        await collect(source.__aiter__())
    assert source.error is broken


async def test_replies_to_other_requests_prove_the_executor_alive_and_no_probe_is_made(
    server: Fake, rpc: ExecutorClient
) -> None:
    async def route(request: web.Request) -> web.StreamResponse:
        if request.path == "/v1/slow":
            await asyncio.sleep(4 * LIVE)
        return msgpack(INFO)

    server.reply = route
    server.health = silent  # a probe would fail the slow request
    slow = asyncio.create_task(rpc.call("GET", "/v1/slow", Info, timeout=None))
    while not slow.done():
        assert await bounded(rpc.call("GET", "/v1/info", Info)) == INFO
        await asyncio.sleep(LIVE / 4)
    assert await slow == INFO
    assert server.probes == 0
    # And with no other traffic, the watchdog still fails a request the executor stopped answering.
    server.reply = silent
    with pytest.raises(errors.SandboxTimeout, match="stopped answering"):
        await bounded(rpc.call("GET", "/v1/info", Info, timeout=None))


async def test_frames_of_a_stream_prove_the_executor_alive_and_no_probe_is_made(
    server: Fake, rpc: ExecutorClient
) -> None:
    async def route(request: web.Request) -> web.StreamResponse:
        if request.path == "/v1/slow":
            await asyncio.sleep(4 * LIVE)
            return msgpack(INFO)
        resp = web.StreamResponse()
        resp.content_type = "application/x-orchard-frames"
        await resp.prepare(request)
        for _ in range(round(6 * LIVE / 0.05)):
            await resp.write(framed(HeartbeatEvent()))
            await asyncio.sleep(0.05)
        await resp.write(framed(EndFrame()))
        await resp.write_eof()
        return resp

    server.reply = route
    server.health = silent
    stream = asyncio.create_task(collect(rpc.receive("/v1/files", {"path": "f"})))
    while not server.seen:
        await asyncio.sleep(0.01)
    assert await bounded(rpc.call("GET", "/v1/slow", Info, timeout=None)) == INFO
    assert await bounded(stream) == []
    assert server.probes == 0


async def test_a_websocket_answers_the_executors_pings_by_itself(server: Fake, rpc: ExecutorClient) -> None:
    async def pinging(request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse(autoping=False)
        await ws.prepare(request)
        await ws.ping(b"are you there")
        msg = await ws.receive()
        await ws.send_str(f"{msg.type.name} {bytes(msg.data)!r}")
        await ws.close()
        return ws

    server.reply = pinging
    ws = await bounded(rpc.websocket("/v1/ports/80/connect", max_msg_size=1000))
    try:
        assert await bounded(ws.receive_str()) == "PONG b'are you there'"
    finally:
        await ws.close()


@pytest.mark.parametrize("kind", ["receive", "frames"])
async def test_a_stream_left_by_its_reader_after_the_sandbox_closed_ends_quietly(
    server: Fake, rpc: ExecutorClient, kind: str
) -> None:
    stream: Any  # an async generator: aclose() is what a reader that leaves calls
    if kind == "receive":
        server.reply = streamed(framed(DataFrame(data=b"ab")), content_type="x/frames")
        stream = rpc.receive("/v1/files", {"path": "f"})
    else:
        server.reply = streamed(framed(OutputEvent(stream="stdout", data=b"ab")), content_type="x/frames")
        stream = rpc.frames("/v1/exec/stream", ExecRequest(cmd="true"), None)
    assert await bounded(anext(stream)) in (b"ab", OutputEvent(stream="stdout", data=b"ab"))
    rpc.close("closed while read")
    await bounded(stream.aclose())  # the reader left: no error for it
    assert rpc._streams == set()


# TLS: the pinned executor


@pytest.fixture
async def tls_fake(session: aiohttp.ClientSession) -> AsyncIterator[tuple[Fake, ExecutorClient]]:
    """A scripted executor over TLS with its own certificate, and a client that pins it."""
    identity = _tls.make_identity("sandbox")
    with tempfile.TemporaryDirectory() as d:
        pem = Path(d) / "id.pem"
        pem.write_text(identity.pem)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(pem)
    fake = Fake()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fake.handle)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx)
    await site.start()
    fake.url = f"https://127.0.0.1:{runner.addresses[0][1]}"
    rpc = ExecutorClient(
        session,
        fake.url,
        TOKEN,
        sandbox_id=SID,
        diagnose=fake.diagnose,
        fingerprint=identity.fingerprint,
        read_timeout=READ,
        liveness_timeout=LIVE,
    )
    try:
        yield fake, rpc
    finally:
        await runner.cleanup()


async def test_every_kind_of_request_reaches_a_pinned_tls_executor(tls_fake: tuple[Fake, ExecutorClient]) -> None:
    server, rpc = tls_fake
    exit_ = ExitEvent(result=ExecResult(exit_code=0))

    async def route(request: web.Request) -> web.StreamResponse:
        if request.path == "/v1/files" and request.method == "GET":
            return await frames_reply(framed(DataFrame(data=b"ab"), EndFrame()))(request)
        if request.path == "/v1/exec/stream":
            return await frames_reply(framed(exit_))(request)
        if request.path == "/v1/ports/1/connect":
            ws = web.WebSocketResponse()
            await ws.prepare(request)
            await ws.close()
            return ws
        if request.path == "/v1/slow":
            await asyncio.sleep(3 * LIVE)
        return msgpack(INFO)

    server.reply = route
    assert await bounded(rpc.call("GET", "/v1/info", Info)) == INFO
    assert await bounded(rpc.send("PUT", "/v1/x", Info, b"abc", params={}, content_type="x/y")) == INFO
    assert await bounded(rpc.send("PUT", "/v1/x", Info, chunks_of(b"abc"), params={}, content_type="x/y")) == INFO
    assert await bounded(collect(rpc.receive("/v1/files", {"path": "f"}))) == [b"ab"]
    req = ExecRequest(cmd="true")
    assert await bounded(collect(rpc.frames("/v1/exec/stream", req, None))) == [exit_]
    assert await bounded(collect(rpc.frames("/v1/exec/stream", req, None, stdin=chunks_of(b"in")))) == [exit_]
    ws = await bounded(rpc.websocket("/v1/ports/1/connect", max_msg_size=100))
    await ws.close()
    # A request without a deadline, waiting while the probes reach /healthz over TLS.
    assert await bounded(rpc.call("GET", "/v1/slow", Info, timeout=None)) == INFO
    assert server.probes >= 1
    assert server.diagnosed == 0


# A connection never accepted


@pytest.fixture
def unaccepted() -> Iterator[str]:
    """A URL on 127.0.0.1 whose connections hang: a listening socket's backlog, full and never accepted."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(8):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        fillers.append(s)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        for s in fillers:
            s.close()
        listener.close()


async def test_a_connection_never_accepted_times_out_after_the_connect_timeout(
    unaccepted: str, session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("orchard._rpc._CONNECT_TIMEOUT", 0.3)

    async def diagnose() -> None:
        return None

    rpc = ExecutorClient(session, unaccepted, TOKEN, sandbox_id=SID, diagnose=diagnose, read_timeout=READ)
    for timeout in (0.0, 5.0, None):
        with pytest.raises(errors.SandboxTimeout, match="did not answer in time"):
            await bounded(rpc.call("GET", "/v1/info", Info, timeout=timeout))
    rpc.stream_idle_timeout = 5.0
    with pytest.raises(errors.SandboxTimeout, match="stream_idle_timeout"):
        await bounded(collect(rpc.receive("/v1/files", {"path": "f"})))


async def test_a_base_url_with_a_path_keeps_it(server: Fake, session: aiohttp.ClientSession) -> None:
    rpc = ExecutorClient(session, server.url + "/proxiedX//", TOKEN, sandbox_id=SID, diagnose=server.diagnose)
    assert rpc.closed is False
    server.reply = replying(msgpack(INFO))
    assert await bounded(rpc.call("GET", "/v1/info", Info)) == INFO
    assert [s.path for s in server.seen] == ["/proxiedX/v1/info"]
