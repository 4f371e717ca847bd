"""The executor's HTTP surface seen from outside: auth, /healthz, JSON, request-id idempotency.

Raw requests go to the sandbox's executor URL, read from the client's private
``_rpc`` (a test may look inside; the public API gains nothing for it).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import msgspec
import pytest

import orchard
from orchard_executor.protocol import JSON, MSGPACK, Error, ExecRequest, ExecResult, SessionExecRequest, decode, encode
from support import eventually, executor_opener, raw_http

pytestmark = pytest.mark.executor


def url(sb: orchard.Sandbox, path: str) -> str:
    return sb._rpc._base + path


@pytest.fixture
async def http(sb: orchard.Sandbox) -> aiohttp.ClientSession:
    async with raw_http(sb) as session:
        yield session  # type: ignore[misc]


BAD_AUTH = [
    {},
    {"Authorization": "Bearer wrong-token"},
    {"Authorization": "Basic dXNlcjpwYXNz"},
    {"Authorization": "Bearer "},
]


async def test_requests_without_the_right_token_get_401(sb: orchard.Sandbox, http: aiohttp.ClientSession) -> None:
    token = sb._rpc._headers["Authorization"].removeprefix("Bearer ")
    one_short = {"Authorization": f"Bearer {token[:-1]}"}
    for headers in [*BAD_AUTH, one_short]:
        for method, path in [("GET", "/v1/info"), ("POST", "/v1/exec"), ("GET", "/v1/files?path=/etc/passwd")]:
            body = encode(ExecRequest(cmd=["touch", "pwned"])) if method == "POST" else None
            all_headers = headers | {"Content-Type": MSGPACK}
            async with http.request(method, url(sb, path), headers=all_headers, data=body) as resp:
                assert resp.status == 401, (headers, path)
                error = decode(await resp.read(), Error, resp.content_type)
                assert "Server" not in resp.headers
            assert error.code == "unauthorized"
            assert "token" in error.message
    assert not await sb.exists("pwned")


async def test_401_body_is_json_when_asked(sb: orchard.Sandbox, http: aiohttp.ClientSession) -> None:
    async with http.get(url(sb, "/v1/info"), headers={"Accept": JSON}) as resp:
        assert resp.status == 401
        assert resp.content_type == JSON
        assert decode(await resp.read(), Error, JSON).code == "unauthorized"


async def test_healthz_needs_no_token_and_reveals_nothing(sb: orchard.Sandbox, http: aiohttp.ClientSession) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        async with http.get(url(sb, "/healthz"), headers=headers) as resp:
            assert resp.status == 200
            assert await resp.read() == b"ok"
            assert "Server" not in resp.headers
            assert set(resp.headers) <= {"Content-Type", "Content-Length", "Date"}


async def test_the_real_token_works_on_a_raw_request(sb: orchard.Sandbox, http: aiohttp.ClientSession) -> None:
    async with http.get(url(sb, "/v1/info"), headers=sb._rpc._headers) as resp:
        assert resp.status == 200
        assert resp.content_type == MSGPACK


async def test_json_bodies_are_accepted_for_debugging(sb: orchard.Sandbox, http: aiohttp.ClientSession) -> None:
    headers = {"Authorization": sb._rpc._headers["Authorization"], "Content-Type": JSON}
    body = b'{"cmd": ["printf", "%s", "curl me"]}'
    async with http.post(url(sb, "/v1/exec"), data=body, headers=headers) as resp:
        assert resp.status == 200
        assert resp.content_type == JSON
        result = decode(await resp.read(), ExecResult, JSON)
    assert result.stdout == "curl me"


async def test_a_malformed_body_is_a_400_with_an_error(sb: orchard.Sandbox, http: aiohttp.ClientSession) -> None:
    headers = {"Authorization": sb._rpc._headers["Authorization"], "Content-Type": MSGPACK}
    for body in (b"\xc1 not msgpack", msgspec.msgpack.encode({"cmd": 42})):
        async with http.post(url(sb, "/v1/exec"), data=body, headers=headers) as resp:
            assert resp.status == 400
            assert decode(await resp.read(), Error).code == "bad_request"


async def test_unknown_routes_are_404(sb: orchard.Sandbox, http: aiohttp.ClientSession) -> None:
    async with http.get(url(sb, "/v1/nope"), headers=sb._rpc._headers) as resp:
        assert resp.status == 404


# Request-id idempotency, through the client's own ExecutorClient.

APPEND = "echo run >> runs.log; cat /proc/sys/kernel/random/uuid"


async def run_lines(sb: orchard.Sandbox, name: str = "runs.log") -> int:
    return len((await sb.read_file(name)).splitlines())


async def test_a_repeated_request_id_runs_once_and_returns_the_first_result(sb: orchard.Sandbox) -> None:
    req = ExecRequest(cmd=APPEND, request_id=uuid.uuid4().hex)
    first = await sb._rpc.call("POST", "/v1/exec", ExecResult, req)
    second = await sb._rpc.call("POST", "/v1/exec", ExecResult, req)
    assert first.ok
    assert second == first  # the same random uuid: the first run's output, replayed
    assert await run_lines(sb) == 1


async def test_different_request_ids_run_again(sb: orchard.Sandbox) -> None:
    results = [
        await sb._rpc.call("POST", "/v1/exec", ExecResult, ExecRequest(cmd=APPEND, request_id=uuid.uuid4().hex))
        for _ in range(2)
    ]
    assert results[0].stdout != results[1].stdout
    assert await run_lines(sb) == 2
    # Without a request id there is no deduplication either.
    for _ in range(2):
        await sb._rpc.call("POST", "/v1/exec", ExecResult, ExecRequest(cmd=APPEND))
    assert await run_lines(sb) == 4


async def test_duplicates_sent_while_the_first_runs_wait_for_its_result(sb: orchard.Sandbox) -> None:
    cmd = "echo run >> runs.log; while [ ! -e go ]; do sleep 0.02; done; cat /proc/sys/kernel/random/uuid"
    req = ExecRequest(cmd=cmd, request_id=uuid.uuid4().hex, timeout=60)
    first = asyncio.create_task(sb._rpc.call("POST", "/v1/exec", ExecResult, req))
    await eventually(lambda: sb.exists("runs.log"), what="the first run started")
    duplicates = [asyncio.create_task(sb._rpc.call("POST", "/v1/exec", ExecResult, req)) for _ in range(5)]
    # Give the duplicates time to reach the executor while the first still waits for "go".
    await asyncio.sleep(0.5)
    assert not first.done()
    await sb.write_file("go", "")
    results = await asyncio.gather(first, *duplicates)
    assert results[0].ok
    assert results[0].stdout
    assert all(r == results[0] for r in results)
    assert await run_lines(sb) == 1


async def test_session_commands_are_deduplicated_too(sb: orchard.Sandbox) -> None:
    sh = await sb.shell()
    req = SessionExecRequest(command="N=$((${N:-0} + 1)); echo $N >> n.log; echo $N", request_id=uuid.uuid4().hex)
    path = f"/v1/sessions/{sh.id}/exec"
    a = await sb._rpc.call("POST", path, ExecResult, req)
    b = await sb._rpc.call("POST", path, ExecResult, req)
    assert a == b
    assert a.stdout == "1\n"
    assert await run_lines(sb, "n.log") == 1
    assert (await sh.exec("echo $N")).stdout == "1\n"


class ResponseLosingProxy:
    """A loopback TCP proxy that breaks its first connection.

    By default it breaks when the reply starts: the executor has done the work
    and answered, but the client never hears it, exactly the case a retry with
    the same request id must survive. With ``cut_when`` it breaks as soon as
    that check turns true instead (say, while the command still runs).
    """

    def __init__(self, sb: orchard.Sandbox, cut_when: Callable[[], Awaitable[bool]] | None = None) -> None:
        self._open = executor_opener(sb)
        self._cut_when = cut_when
        self.connections = 0
        self.lost_replies = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        lose = self.connections == 1
        up_r, up_w = await self._open()

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, is_reply: bool) -> None:
            try:
                while data := await src.read(65536):
                    if is_reply and lose:
                        self.lost_replies += 1
                        return
                    dst.write(data)
                    await dst.drain()
            except ConnectionError:
                pass
            finally:
                for w in (client_w, up_w):
                    w.close()

        async def cut() -> None:
            assert self._cut_when is not None
            await eventually(self._cut_when, what="the moment to break the connection")
            self.lost_replies += 1
            for w in (client_w, up_w):
                w.close()

        if lose and self._cut_when is not None:
            lose = False
            cutter = asyncio.create_task(cut())
            await asyncio.gather(pump(client_r, up_w, False), pump(up_r, client_w, True))
            await cutter
        else:
            await asyncio.gather(pump(client_r, up_w, False), pump(up_r, client_w, True))


@contextlib.asynccontextmanager
async def through(sb: orchard.Sandbox, proxied_url: str) -> AsyncIterator[None]:
    """Send the sandbox client's requests to ``proxied_url`` (over TCP, whatever the sandbox's own transport)."""
    direct, session = sb._rpc._base, sb._rpc._session
    async with aiohttp.ClientSession() as tcp:
        sb._rpc._base, sb._rpc._session = proxied_url, tcp
        try:
            yield
        finally:
            sb._rpc._base, sb._rpc._session = direct, session


async def test_a_lost_reply_is_retried_and_the_command_runs_once(sb: orchard.Sandbox) -> None:
    proxy = ResponseLosingProxy(sb)
    async with proxy as proxied_url, through(sb, proxied_url):
        result = await sb.exec(APPEND)
    assert proxy.lost_replies == 1
    assert proxy.connections == 2
    assert result.ok
    assert result.stdout.strip()
    assert await run_lines(sb) == 1  # the retry got the first run's result; nothing ran twice


async def test_a_connection_lost_mid_command_is_retried_and_the_command_runs_once(sb: orchard.Sandbox) -> None:
    proxy = ResponseLosingProxy(sb, cut_when=lambda: sb.exists("started"))
    async with proxy as proxied_url, through(sb, proxied_url):
        result = await sb.exec("echo run >> runs.log; touch started; sleep 0.5; echo done")
    assert proxy.lost_replies == 1
    assert result.stdout == "done\n"
    assert await run_lines(sb) == 1


async def test_rekey_swaps_the_token_and_only_the_token_holder_may(
    sb: orchard.Sandbox, http: aiohttp.ClientSession
) -> None:
    """A pooled sandbox's claimer re-keys it: the pool's token stops working, the claimer's works."""
    import hashlib

    old = dict(sb._rpc._headers)
    new_token = "claimer-" + uuid.uuid4().hex
    body = msgspec.json.encode({"token_sha256": hashlib.sha256(new_token.encode()).hexdigest()})
    headers = {"Content-Type": JSON, "Accept": JSON}
    for bad in BAD_AUTH:  # without the current token nothing changes
        async with http.post(url(sb, "/v1/rekey"), headers=headers | bad, data=body) as resp:
            assert resp.status == 401
    for digest in ("00" * 31, "zz" * 32, ""):  # not a SHA-256: refused, and the old token still works
        wrong = msgspec.json.encode({"token_sha256": digest})
        async with http.post(url(sb, "/v1/rekey"), headers=old | headers, data=wrong) as resp:
            assert resp.status == 400
            assert decode(await resp.read(), Error, resp.content_type).code == "bad_request"
    async with http.get(url(sb, "/v1/info"), headers=old) as resp:
        assert resp.status == 200
    async with http.post(url(sb, "/v1/rekey"), headers=old | headers, data=body) as resp:
        assert resp.status == 204
    async with http.get(url(sb, "/v1/info"), headers=old) as resp:
        assert resp.status == 401
    async with http.post(url(sb, "/v1/rekey"), headers=old | headers, data=body) as resp:
        assert resp.status == 401  # the old token cannot re-key a second time
    async with http.get(url(sb, "/v1/info"), headers={"Authorization": f"Bearer {new_token}"}) as resp:
        assert resp.status == 200
