"""A bounded fuzz of the executor API: every route, random and mutated bodies, headers and numbers.

The real application (``create_app``) is served on loopback by aiohttp's
test server, in this process. Whatever arrives, the executor answers with
something other than a 500, keeps answering /healthz and an authenticated
exec, and its memory stays bounded. Deterministic (``derandomize``) and
bounded (``max_examples``) for CI. Values are drawn so that nothing can name
a path outside the test's directory or run anything but harmless commands:
the process runs as root.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp.test_utils import TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchard_executor.app import Settings, create_app
from orchard_executor.protocol import FRAME_HEADER, WITH_STDIN

pytestmark = pytest.mark.executor

TOKEN = "fuzz-token"
COMMANDS = [["true"], ["echo", "x"], "echo hi", ["sleep", "0.1"], ["/nonexistent"], []]
# No "/" and no ".": a drawn name never leaves the working directory.
NAME = st.text(alphabet="abcXYZ019_- =\x00é", max_size=40)
NUMBER = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -1, 2**63, 2**64, 0o7777, 0o10000, 0o4755, math.nan, math.inf]),
)
SCALAR = st.one_of(st.none(), st.booleans(), NUMBER, NAME, st.binary(max_size=64))
VALUE = st.recursive(
    SCALAR, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(NAME, inner, max_size=4), max_leaves=8
)

BODIES: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    "exec": st.fixed_dictionaries(
        {"cmd": st.sampled_from(COMMANDS)},
        optional={
            "cwd": NAME,
            "env": st.dictionaries(NAME, NAME, max_size=3),
            "stdin": st.binary(max_size=64),
            "timeout": NUMBER,
            "max_output": NUMBER,
            "shell": st.sampled_from(["/bin/sh", "sh\x00", "", "/nonexistent"]),
            "request_id": NAME,
        },
    ),
    "stdin": st.fixed_dictionaries({}, optional={"data": st.binary(max_size=64), "close": st.booleans()}),
    "signal": st.fixed_dictionaries({"signal": NUMBER}),
    "wait": st.fixed_dictionaries({}, optional={"timeout": st.sampled_from([0, 0.01, -1, math.nan, math.inf])}),
    "session": st.fixed_dictionaries(
        {},
        optional={
            "cwd": NAME,
            "env": st.dictionaries(NAME, NAME, max_size=3),
            "shell": st.sampled_from(["bash", "", "x\x00"]),
        },
    ),
    "session_exec": st.fixed_dictionaries(
        {"command": st.sampled_from(["true", "echo hi", "cd x\x00"])},
        optional={"timeout": NUMBER, "max_output": NUMBER, "stdin": st.binary(max_size=16)},
    ),
    "mkdir": st.fixed_dictionaries(
        {"path": NAME}, optional={"parents": SCALAR, "mode": NUMBER, "exist_ok": SCALAR, "setid": SCALAR}
    ),
    "remove": st.fixed_dictionaries({"path": NAME}, optional={"recursive": SCALAR, "missing_ok": SCALAR}),
}

# (method, route, body kind); {id} is a drawn id or one that exists.
ROUTES = [
    ("GET", "/v1/info", None),
    ("POST", "/v1/exec", "exec"),
    ("POST", "/v1/exec/stream", "exec"),
    ("POST", "/v1/processes", "exec"),
    ("GET", "/v1/processes", None),
    ("GET", "/v1/processes/{id}", None),
    ("GET", "/v1/processes/{id}/output", None),
    ("POST", "/v1/processes/{id}/stdin", "stdin"),
    ("POST", "/v1/processes/{id}/signal", "signal"),
    ("POST", "/v1/processes/{id}/wait", "wait"),
    ("DELETE", "/v1/processes/{id}", None),
    ("POST", "/v1/sessions", "session"),
    ("POST", "/v1/sessions/{id}/exec", "session_exec"),
    ("DELETE", "/v1/sessions/{id}", None),
    ("PUT", "/v1/files", "raw"),
    ("GET", "/v1/files", None),
    ("GET", "/v1/files/stat", None),
    ("GET", "/v1/files/list", None),
    ("POST", "/v1/files/mkdir", "mkdir"),
    ("POST", "/v1/files/remove", "remove"),
    ("PUT", "/v1/files/tar", "raw"),
    ("GET", "/v1/files/tar", None),
    # Without a websocket upgrade (or with a bad port) it is refused before connecting anywhere.
    ("GET", "/v1/ports/{id}/connect", None),
]
QUERY = st.dictionaries(
    st.sampled_from(["path", "mode", "parents", "setid", "offset", "limit", "stream", "max_bytes", "max_members"]),
    st.one_of(NAME, NUMBER.map(str), st.sampled_from(["1" * 5000, "0x1ff", "-0", "stdout", "stderr"])),
    max_size=4,
)


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, str, dict[str, str], dict[str, str], bytes]:
    method, route, kind = draw(st.sampled_from(ROUTES))
    route = route.replace("{id}", draw(st.sampled_from(["{known}", "nope", "0" * 16, "%00", "a" * 300])))
    query = draw(QUERY)
    content_type = draw(st.sampled_from(["application/msgpack", "application/json", "text/plain", "", WITH_STDIN]))
    shape = draw(st.sampled_from(["valid", "mutated", "random", "empty"]))
    if kind in BODIES and shape in ("valid", "mutated"):
        body_obj = draw(BODIES[kind])
        if shape == "mutated" and body_obj:
            key = draw(st.sampled_from(sorted(body_obj)))
            if key not in ("cmd", "command", "path"):  # never anything but the harmless commands and names
                body_obj[key] = draw(VALUE)
        if content_type == "application/json":
            try:
                body = json.dumps(body_obj, default=lambda b: b.hex(), allow_nan=True).encode()
            except (TypeError, ValueError):
                body = b"{"
        else:
            try:
                body = msgspec.msgpack.encode(body_obj)
            except OverflowError:  # msgpack has no ints past 64 bits: send them as JSON text instead
                body = json.dumps(body_obj, default=lambda b: b.hex()).encode()
            if content_type == WITH_STDIN:  # the struct as one frame, then the streamed stdin
                body = FRAME_HEADER.pack(len(body)) + body + draw(st.binary(max_size=256))
    elif shape == "random":
        body = draw(st.binary(max_size=256))
    else:
        body = b""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    auth = draw(st.sampled_from(["good", "good", "good", "none", "bad", "latin"]))
    if auth == "none":
        headers = {}
    elif auth == "bad":
        headers = {"Authorization": draw(st.sampled_from(["Bearer", "Bearer  x", "Basic x", "bearer " + TOKEN]))}
    elif auth == "latin":
        headers = {"Authorization": "Bearer \xe9\xff"}
    if content_type:
        headers["Content-Type"] = content_type
    headers["Accept"] = draw(st.sampled_from(["application/msgpack", "application/json", "*/*"]))
    return method, route, {k: v for k, v in query.items()}, headers, body


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_fuzz_every_route(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    app = create_app(
        Settings(
            token_sha256=hashlib.sha256(TOKEN.encode()).hexdigest(),
            workdir=str(work),
            state_dir=str(tmp_path / "state"),
        )
    )
    loop = asyncio.new_event_loop()
    server = TestServer(app, host="127.0.0.1", loop=loop)
    loop.run_until_complete(server.start_server())
    session = loop.run_until_complete(_session())
    base = f"http://127.0.0.1:{server.port}"
    good = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/msgpack"}
    known = loop.run_until_complete(_start_process(session, base, good))
    statuses: dict[int, int] = {}
    failures: list[tuple[Any, ...]] = []

    async def send(method: str, route: str, query: dict[str, str], headers: dict[str, str], body: bytes) -> int:
        timeout = aiohttp.ClientTimeout(total=30)
        async with session.request(
            method, base + route.replace("{known}", known), params=query, headers=headers, data=body, timeout=timeout
        ) as resp:
            await resp.read()
            return resp.status

    @settings(
        max_examples=1500,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(req=requests())
    def fuzz(req: tuple[str, str, dict[str, str], dict[str, str], bytes]) -> None:
        status = loop.run_until_complete(send(*req))
        statuses[status] = statuses.get(status, 0) + 1
        if status >= 500:
            failures.append((status, *req))

    try:
        start_rss = rss()
        fuzz()
        assert failures == [], failures[:10]
        # Still answering, and a real command still runs.
        assert loop.run_until_complete(send("GET", "/healthz", {}, {}, b"")) == 200
        body = msgspec.msgpack.encode({"cmd": ["echo", "alive"]})
        assert loop.run_until_complete(send("POST", "/v1/exec", {}, good, body)) == 200
        assert rss() - start_rss < 256 * 1024 * 1024
        assert statuses.get(200, 0) > 20, statuses
        assert statuses.get(400, 0) > 20, statuses
    finally:
        loop.run_until_complete(session.close())
        loop.run_until_complete(server.close())
        loop.close()


async def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession()


async def _start_process(session: aiohttp.ClientSession, base: str, headers: dict[str, str]) -> str:
    body = msgspec.msgpack.encode({"cmd": ["sleep", "30"]})
    async with session.post(base + "/v1/processes", data=body, headers=headers) as resp:
        assert resp.status == 200
        status: dict[str, Any] = msgspec.msgpack.decode(await resp.read())
        return str(status["id"])
