"""The executor stays responsive and bounded whatever a sandbox or a peer sends (issue 11).

Each test is an attack that broke the executor before: a stream that fails
after its reply started, a path swapped for a FIFO, a STOPped executor,
daemons that outlive their sandbox, inputs the OS cannot take.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import resource
import secrets
import signal
import socket
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

import orchard
from orchard.errors import ExecutorError, InvalidRequest, SandboxLost, SandboxTimeout
from orchard_executor.protocol import (
    FRAME_HEADER,
    JSON,
    MSGPACK,
    Error,
    ExecRequest,
    ExecResult,
    decode,
    encode,
)
from orchard_executor.runner import OutputBuffer
from support import eventually, host_pid_alive, open_executor, raw_http, read_pid

pytestmark = pytest.mark.executor


def url(sb: orchard.Sandbox, path: str) -> str:
    return sb._rpc._base + path


def auth(sb: orchard.Sandbox) -> dict[str, str]:
    return {"Authorization": sb._rpc._headers["Authorization"]}


@pytest.fixture
async def http(sb: orchard.Sandbox) -> Any:
    async with raw_http(sb) as session:
        yield session


# Streams that fail after their reply started, and quiet or frozen streams.


async def test_a_tar_download_that_fails_midway_ends_with_a_typed_error(sb: orchard.Sandbox) -> None:
    # A sparse 256 MiB file, cut to nothing once the archive is under way:
    # tarfile then finds less data than it announced and fails mid-stream.
    await sb.exec("mkdir big && truncate -s 256M big/f")
    chunks = sb.download_tar("big")

    async def consume() -> None:
        await anext(chunks)
        assert (await sb.exec("truncate -s 0 big/f")).ok
        async for _ in chunks:
            pass

    with pytest.raises(ExecutorError):
        await asyncio.wait_for(consume(), 60)
    assert (await sb.exec("true")).ok


async def test_a_file_read_and_a_tar_download_still_yield_raw_bytes(sb: orchard.Sandbox) -> None:
    data = os.urandom(700_000)
    await sb.write_file("f.bin", data)
    assert b"".join([c async for c in sb.stream_file("f.bin")]) == data
    tar = b"".join([c async for c in sb.download_tar("f.bin")])
    assert data in tar
    assert len(tar) % 512 == 0


async def raw_frames(sb: orchard.Sandbox, http: aiohttp.ClientSession, body: dict[str, Any]) -> list[dict[str, Any]]:
    headers = auth(sb) | {"Content-Type": MSGPACK}
    events = []
    async with http.post(url(sb, "/v1/exec/stream"), data=msgspec.msgpack.encode(body), headers=headers) as resp:
        assert resp.status == 200
        while True:
            try:
                header = await resp.content.readexactly(FRAME_HEADER.size)
            except asyncio.IncompleteReadError:
                return events
            (size,) = FRAME_HEADER.unpack(header)
            events.append(msgspec.msgpack.decode(await resp.content.readexactly(size)))


async def test_a_quiet_stream_carries_heartbeats(sb: orchard.Sandbox, http: aiohttp.ClientSession) -> None:
    events = await raw_frames(sb, http, {"cmd": "sleep 2.5; echo done"})
    kinds = [e["type"] for e in events]
    assert "heartbeat" in kinds
    assert kinds[-1] == "exit"
    # The client hides them: the events it yields are output and exit only.
    seen = [type(e).__name__ async for e in sb.exec_stream("sleep 2.5; echo done")]
    assert seen == ["OutputEvent", "ExitEvent"]


async def test_a_quiet_stream_outlives_the_idle_deadline(sb: orchard.Sandbox) -> None:
    sb._rpc.stream_idle_timeout = 3.0
    events = [e async for e in sb.exec_stream("sleep 5; echo done")]
    assert events[-1].result.exit_code == 0  # type: ignore[union-attr]


async def stopped(sb: orchard.Sandbox) -> int:
    pid = (await sb.info()).pid
    assert host_pid_alive(pid)
    os.kill(pid, signal.SIGSTOP)
    return pid


async def test_a_stopped_executor_is_a_typed_timeout_on_streams(local_client: orchard.Client) -> None:
    async with local_client.sandbox() as sb:
        await sb.write_file("f", b"x" * 10_000_000)
        sb._rpc.stream_idle_timeout = 3.0
        stream = sb.exec_stream("echo start; sleep 60")
        first = await anext(stream)
        assert first.data == b"start\n"  # type: ignore[union-attr]
        pid = await stopped(sb)
        try:
            with pytest.raises((SandboxTimeout, SandboxLost)):
                await asyncio.wait_for(anext(stream), 30)
            with pytest.raises((SandboxTimeout, SandboxLost)):
                await asyncio.wait_for(sb.read_file("f"), 30)
        finally:
            os.kill(pid, signal.SIGCONT)
        await stream.aclose()
        assert (await sb.exec("true")).ok


# No blocking: FIFOs where a file is expected.

SWAPPER = """
import os, sys
os.chdir(sys.argv[1])
open("regular", "w").write("content")
os.mkfifo("fifo")
while True:
    for src in ("regular", "fifo"):
        os.link(src, "next")
        os.rename("next", "target")
"""


async def test_a_path_swapped_for_a_fifo_never_freezes_the_executor(local_client: orchard.Client) -> None:
    async with local_client.sandbox() as sb:
        await sb.mkdir("swap")
        swapper = await sb.start_process([sys.executable, "-c", SWAPPER, "swap"])
        await eventually(lambda: sb.exists("swap/target"), what="the swapper started")
        outcomes: set[str] = set()
        for _ in range(300):
            try:
                data = await asyncio.wait_for(sb.read_file("swap/target"), 20)
            except InvalidRequest:
                outcomes.add("refused")
            else:
                assert data == b"content"
                outcomes.add("read")
        assert outcomes == {"read", "refused"}
        await swapper.kill()


async def test_a_background_output_file_swapped_for_a_fifo_is_refused(
    local_client: orchard.Client, local_root: Path
) -> None:
    async with local_client.sandbox() as sb:
        p = await sb.start_process("echo hi; sleep 60")
        [out] = list(local_root.rglob(f"{p.id}.stdout"))
        out.unlink()
        os.mkfifo(out)
        with pytest.raises(ExecutorError):
            await asyncio.wait_for(p.read(), 20)
        assert (await sb.exec("echo ok")).stdout == "ok\n"


# Nothing outlives the executor.

DAEMONS = (
    "sleep 300 >/dev/null 2>&1 & echo $! > bg.pid; "
    "(setsid sh -c 'sleep 301 >/dev/null 2>&1 & echo $! > daemon.pid' &); true"
)


async def test_background_and_daemonized_processes_die_with_the_sandbox(local_client: orchard.Client) -> None:
    async with local_client.sandbox() as sb:
        assert (await sb.exec(DAEMONS)).ok
        pids = [await read_pid(sb, "bg.pid"), await read_pid(sb, "daemon.pid")]
        assert all(host_pid_alive(pid) for pid in pids)
    assert [pid for pid in pids if host_pid_alive(pid)] == []


async def test_daemons_die_when_the_executor_exits_idle(local_client: orchard.Client) -> None:
    async with local_client.sandbox(idle_timeout=2) as sb:
        executor = (await sb.info()).pid
        assert (await sb.exec(DAEMONS)).ok
        pids = [await read_pid(sb, "bg.pid"), await read_pid(sb, "daemon.pid")]
        await eventually(lambda: not host_pid_alive(executor), what="the idle executor exited")
        assert [pid for pid in pids if host_pid_alive(pid)] == []


# Inputs the OS cannot take: a typed 400, never a 500.

EXEC = "/v1/exec"
BAD_BODIES: list[tuple[str, dict[str, Any]]] = [
    (EXEC, {"cmd": ["echo", "a\0b"]}),
    (EXEC, {"cmd": "echo a\0b"}),
    (EXEC, {"cmd": ["true"], "shell": "/bin/sh\0"}),
    (EXEC, {"cmd": ["true"], "cwd": "/tmp\0x"}),
    (EXEC, {"cmd": ["true"], "env": {"A=B": "x"}}),
    (EXEC, {"cmd": ["true"], "env": {"": "x"}}),
    (EXEC, {"cmd": ["true"], "env": {"A\0": "x"}}),
    (EXEC, {"cmd": ["true"], "env": {"A": "x\0y"}}),
    (EXEC, {"cmd": ["true"], "timeout": float("nan")}),
    (EXEC, {"cmd": ["true"], "timeout": float("inf")}),
    (EXEC, {"cmd": ["true"], "timeout": -1.0}),
    (EXEC, {"cmd": ["true"], "max_output": -1}),
    ("/v1/exec/stream", {"cmd": ["echo", "a\0b"]}),
    ("/v1/exec/stream", {"cmd": ["true"], "timeout": float("nan")}),
    ("/v1/processes", {"cmd": ["echo", "a\0b"]}),
    ("/v1/processes", {"cmd": ["true"], "env": {"A=B": "x"}}),
    ("/v1/files/mkdir", {"path": "d", "mode": -1}),
    ("/v1/files/mkdir", {"path": "d", "mode": 0o10000}),
    ("/v1/files/mkdir", {"path": "d", "mode": 0o4755}),
    ("/v1/files/mkdir", {"path": "d\0e"}),
    ("/v1/files/remove", {"path": "d\0e"}),
    ("/v1/sessions", {"shell": "bash\0"}),
    ("/v1/sessions", {"env": {"A=B": "x"}}),
    ("/v1/sessions", {"cwd": "/\0"}),
]


async def status_and_error(resp: aiohttp.ClientResponse) -> tuple[int, str | None]:
    body = await resp.read()
    try:
        return resp.status, decode(body, Error, resp.content_type).code
    except (msgspec.DecodeError, msgspec.ValidationError):
        return resp.status, None


async def test_bodies_the_os_cannot_take_are_typed_400s(sb: orchard.Sandbox, http: aiohttp.ClientSession) -> None:
    headers = auth(sb) | {"Content-Type": MSGPACK}
    wrong = []
    for path, body in BAD_BODIES:
        async with http.post(url(sb, path), data=msgspec.msgpack.encode(body), headers=headers) as resp:
            got = await status_and_error(resp)
        if got != (400, "bad_request"):
            wrong.append((path, body, got))
    assert wrong == []
    assert not await sb.exists("d")


async def test_numbers_the_os_cannot_take_are_typed_400s(sb: orchard.Sandbox, http: aiohttp.ClientSession) -> None:
    headers = auth(sb) | {"Content-Type": MSGPACK}
    p = await sb.start_process("echo hi; sleep 60")
    sh = await sb.shell()
    huge = "1" * 5000
    requests: list[tuple[str, str, bytes | None]] = [
        ("PUT", "/v1/files?path=m&mode=-1", b"x"),
        ("PUT", "/v1/files?path=m&mode=4096", b"x"),
        ("PUT", f"/v1/files?path=m&mode={0o4755}", b"x"),
        ("PUT", f"/v1/files?path=m&mode={huge}", b"x"),
        ("PUT", f"/v1/files?path=m&mode={2**70}", b"x"),
        ("PUT", "/v1/files?path=m%00n", b"x"),
        ("GET", "/v1/files?path=m%00n", None),
        ("GET", "/v1/files/stat?path=m%00n", None),
        ("GET", "/v1/files/list?path=m%00n", None),
        ("GET", "/v1/files/tar?path=m%00n", None),
        ("PUT", "/v1/files/tar?path=m%00n", b""),
        ("GET", f"/v1/processes/{p.id}/output?limit=-1", None),
        ("GET", f"/v1/processes/{p.id}/output?offset=-1", None),
        ("GET", f"/v1/processes/{p.id}/output?offset={2**70}", None),
        ("GET", f"/v1/processes/{p.id}/output?limit={huge}", None),
        ("POST", f"/v1/processes/{p.id}/signal", encode({"signal": -1})),
        ("POST", f"/v1/processes/{p.id}/signal", encode({"signal": 0})),
        ("POST", f"/v1/processes/{p.id}/signal", b'{"signal": 1180591620717411303424}'),
        ("POST", f"/v1/processes/{p.id}/wait", encode({"timeout": float("nan")})),
        ("POST", f"/v1/processes/{p.id}/wait", encode({"timeout": -1.0})),
        ("POST", f"/v1/sessions/{sh.id}/exec", encode({"command": "echo a\0b"})),
        ("POST", f"/v1/sessions/{sh.id}/exec", encode({"command": "true", "timeout": float("inf")})),
    ]
    wrong = []
    for method, path, body in requests:
        h = headers | {"Content-Type": JSON} if body and body.startswith(b"{") else headers
        async with http.request(method, url(sb, path), data=body, headers=h) as resp:
            got = await status_and_error(resp)
        if got != (400, "bad_request"):
            wrong.append((method, path, got))
    assert wrong == []
    assert not await sb.exists("m")
    # A limit larger than the executor's read cap is clamped, not refused.
    async with http.get(url(sb, f"/v1/processes/{p.id}/output?limit={2**40}"), headers=headers) as resp:
        assert resp.status == 200
    assert (await p.status()).running


async def test_setid_modes_need_the_explicit_flag(sb: orchard.Sandbox, http: aiohttp.ClientSession) -> None:
    headers = auth(sb) | {"Content-Type": MSGPACK}
    async with http.put(url(sb, f"/v1/files?path=s&mode={0o4755}&setid=1"), data=b"x", headers=headers) as resp:
        assert resp.status == 200
    assert (await sb.stat("s")).mode == 0o4755
    sticky = await sb.mkdir("t", mode=0o1777)
    assert sticky.mode == 0o1777


async def test_a_non_utf8_bearer_header_is_a_401(sb: orchard.Sandbox) -> None:
    for value in (b"Bearer \xff\xfe\x80", "Bearer é".encode("latin-1"), b"Bearer \xed\xa0\x80"):
        reader, writer = await open_executor(sb)
        writer.write(b"GET /v1/info HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: " + value + b"\r\n\r\n")
        await writer.drain()
        reply = await asyncio.wait_for(reader.read(), 20)
        writer.close()
        assert reply.startswith(b"HTTP/1.1 401"), (value, reply[:200])


async def test_a_structured_body_over_64_mib_is_a_400(sb: orchard.Sandbox, http: aiohttp.ClientSession) -> None:
    body = encode({"cmd": ["true"], "stdin": b"x" * (65 * 1024 * 1024)})
    async with http.post(url(sb, EXEC), data=body, headers=auth(sb) | {"Content-Type": MSGPACK}) as resp:
        assert await status_and_error(resp) == (400, "bad_request")
    assert (await sb.exec("true")).ok


# Bounded memory and disk.


def test_the_output_ring_holds_exactly_its_cap() -> None:
    cap = 16 * 1024 * 1024
    chunk = os.urandom(256 * 1024)
    tracemalloc.start()
    try:
        buf = OutputBuffer(cap)
        for _ in range(8 * cap // len(chunk)):
            buf.feed(chunk)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert buf.truncated
    assert buf.total == 8 * cap
    value = buf.getvalue()
    assert len(value) == cap
    assert value[-len(chunk) :] == chunk
    assert peak < cap + 4 * len(chunk), peak


# The fd-exhaustion flood: a real executor process at 64 file descriptors.


def clock_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


async def test_an_idle_connection_flood_at_the_fd_limit(tmp_path: Path) -> None:
    token = secrets.token_hex(16)
    ready_r, ready_w = os.pipe()
    log_path = tmp_path / "executor.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "orchard_executor", "--host=127.0.0.1", "--port=0", f"--workdir={tmp_path}"]
            + [f"--token-sha256={hashlib.sha256(token.encode()).hexdigest()}", f"--ready-fd={ready_w}"],
            pass_fds=(ready_w,),
            stdin=subprocess.DEVNULL,
            stderr=log,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64)),
        )
    os.close(ready_w)
    idle: list[socket.socket] = []
    try:
        with os.fdopen(ready_r, "rb") as ready:
            line = await asyncio.wait_for(asyncio.to_thread(ready.readline), 30)
        port = json.loads(line)["port"]
        for _ in range(300):  # unauthenticated, never sending a byte, held open
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            idle.append(s)
        await asyncio.sleep(1)
        before = clock_ticks(proc.pid)
        headers = {"Authorization": f"Bearer {token}", "Content-Type": MSGPACK}
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            for _ in range(3):
                body = encode(ExecRequest(cmd=["echo", "ok"]))
                async with http.post(f"http://127.0.0.1:{port}/v1/exec", data=body, headers=headers) as resp:
                    assert resp.status == 200
                    assert decode(await resp.read(), ExecResult).stdout == "ok\n"
            await asyncio.sleep(3)
            async with http.get(f"http://127.0.0.1:{port}/healthz") as resp:
                assert resp.status == 200
        spent = (clock_ticks(proc.pid) - before) / os.sysconf("SC_CLK_TCK")
        assert proc.poll() is None
    finally:
        for s in idle:
            s.close()
        proc.terminate()
        proc.wait(30)
    assert log_path.stat().st_size < 64 * 1024, log_path.read_bytes()[:2000]
    assert spent < 3.0, f"the executor was busy for {spent:.2f}s of CPU while flooded"


async def test_a_path_too_long_for_the_os_is_a_typed_400(sb: orchard.Sandbox) -> None:
    # Found by the fuzz test in a checkout whose longer working directory pushed the path over PATH_MAX.
    long = "x" * 5000
    with pytest.raises(InvalidRequest):
        await sb.stat(long)
    with pytest.raises(InvalidRequest):
        async for _ in sb.download_tar(long):
            pass
