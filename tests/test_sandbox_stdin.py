"""Streamed stdin: exec and exec_stream take an async iterable or a local file, sent as the request body."""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

import orchard
from orchard import ExitEvent, OutputEvent, errors
from orchard_executor.protocol import FRAME_HEADER, MAX_BODY, WITH_STDIN, Error, decode
from support import WAIT, eventually, raw_http, read_pid, sandbox_pid_alive

pytestmark = pytest.mark.executor

MiB = 1024 * 1024


class Generated:
    """``total`` pseudo-random bytes, made chunk by chunk and hashed as they go: never held whole."""

    def __init__(self, total: int, seed: int = 7) -> None:
        self.total = total
        self.sent = 0
        self._rng = random.Random(seed)
        self._hash = hashlib.sha256()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while self.sent < self.total:
            chunk = self._rng.randbytes(min(MiB, self.total - self.sent))
            self._hash.update(chunk)
            self.sent += len(chunk)
            yield chunk

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


async def endless() -> AsyncIterator[bytes]:
    block = b"y" * MiB
    while True:
        yield block
        await asyncio.sleep(0)


class SourceBroke(Exception):
    pass


async def breaks_after(total: int) -> AsyncIterator[bytes]:
    for _ in range(total // MiB):
        yield b"z" * MiB
        await asyncio.sleep(0)
    raise SourceBroke("the stdin source broke mid-way")


async def test_a_100_mib_streamed_stdin_arrives_exactly(sb: orchard.Sandbox) -> None:
    data = Generated(100 * MiB + 12345)
    r = await sb.exec(["sha256sum"], stdin=data, timeout=WAIT * 5)
    assert r.ok, r.stderr
    assert data.sent == data.total
    assert r.stdout.split()[0] == data.hexdigest()


async def test_a_100_mib_streamed_stdin_reaches_a_streaming_exec(sb: orchard.Sandbox) -> None:
    data = Generated(100 * MiB + 1, seed=8)
    out = b""
    end = None
    async for ev in sb.exec_stream(["wc", "-c"], stdin=data, timeout=WAIT * 5):
        if isinstance(ev, OutputEvent):
            out += ev.data
        else:
            end = ev
    assert isinstance(end, ExitEvent)
    assert end.result.exit_code == 0
    assert int(out) == 100 * MiB + 1


async def test_stdin_from_a_local_file(sb: orchard.Sandbox, tmp_path: Path) -> None:
    local = tmp_path / "input.bin"
    content = random.Random(3).randbytes(3 * MiB + 7)
    local.write_bytes(content)
    r = await sb.exec(["sha256sum"], stdin=local)
    assert r.stdout.split()[0] == hashlib.sha256(content).hexdigest()
    with pytest.raises(FileNotFoundError):
        await sb.exec(["cat"], stdin=tmp_path / "missing")


async def test_bytes_over_the_structured_body_limit_are_streamed(sb: orchard.Sandbox) -> None:
    data = random.Random(4).randbytes(MAX_BODY + MiB)
    r = await sb.exec(["sha256sum"], stdin=data, timeout=WAIT * 5)
    assert r.stdout.split()[0] == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("cmd", [["true"], ["head", "-c", "10"], "sleep 0.2 & exit 3"])
async def test_a_command_that_leaves_its_stdin_unread_does_not_hang(sb: orchard.Sandbox, cmd: Any) -> None:
    r = await sb.exec(cmd, stdin=endless())
    assert r.exit_code == (3 if isinstance(cmd, str) else 0)
    if cmd[0] == "head":
        assert r.stdout_bytes == b"y" * 10
    events = [ev async for ev in sb.exec_stream(cmd, stdin=endless())]
    assert isinstance(events[-1], ExitEvent)
    assert events[-1].result.exit_code == (3 if isinstance(cmd, str) else 0)
    assert (await sb.exec("echo alive")).stdout == "alive\n"


async def test_a_broken_stdin_source_raises_its_error_and_kills_the_command(sb: orchard.Sandbox) -> None:
    # The command would record that it ran to the end: a cut stdin must not pass for a whole one.
    cmd = "echo $$ > pid; cat > got; touch finished"
    with pytest.raises(SourceBroke):
        await sb.exec(cmd, stdin=breaks_after(4 * MiB), timeout=WAIT)
    pid = await read_pid(sb, "pid")
    await eventually(lambda: _dead(sb, pid), what="the command of the broken stdin killed")
    assert not await sb.exists("finished")

    await sb.remove("pid")
    with pytest.raises(SourceBroke):
        async for _ in sb.exec_stream(cmd, stdin=breaks_after(4 * MiB), timeout=WAIT):
            pass
    pid = await read_pid(sb, "pid")
    await eventually(lambda: _dead(sb, pid), what="the streaming command of the broken stdin killed")
    assert not await sb.exists("finished")
    assert (await sb.exec("echo alive")).stdout == "alive\n"


async def test_small_stdin_still_goes_in_the_request(sb: orchard.Sandbox) -> None:
    r = await sb.exec(["cat"], stdin="small")
    assert r.stdout == "small"
    events = [ev async for ev in sb.exec_stream(["cat"], stdin=b"s\x00b")]
    assert b"".join(ev.data for ev in events if isinstance(ev, OutputEvent)) == b"s\x00b"


def _framed(obj: object, stdin: bytes = b"") -> bytes:
    body = msgspec.msgpack.encode(obj)
    return FRAME_HEADER.pack(len(body)) + body + stdin


@pytest.mark.parametrize("route", ["/v1/exec", "/v1/exec/stream"])
async def test_a_bad_streamed_request_is_a_typed_400(sb: orchard.Sandbox, route: str) -> None:
    bad = [
        b"",  # no struct at all
        b"\x00\x00",  # a cut length
        FRAME_HEADER.pack(MAX_BODY + 1) + b"\x80",  # a struct over the limit
        FRAME_HEADER.pack(100) + b"\x80",  # a struct cut short
        FRAME_HEADER.pack(3) + b"junkstdin",  # not msgpack
        _framed({"cmd": 5}),  # not an ExecRequest
        _framed({"cmd": ["echo", "a\x00b"]}, b"in"),  # what the OS cannot take
        _framed({"cmd": ["cat"], "stdin": b"twice"}, b"in"),  # stdin in the struct and the body
        _framed({"cmd": ["cat"], "request_id": "r1"}, b"in"),  # a stream cannot be replayed for a retry
    ]
    headers = {"Authorization": sb._rpc._headers["Authorization"], "Content-Type": WITH_STDIN}
    async with raw_http(sb) as http:
        for body in bad:
            async with http.post(sb._rpc._base + route, data=body, headers=headers) as resp:
                raw = await resp.read()
                assert resp.status == 400, (body[:40], resp.status, raw[:200])
                assert decode(raw, Error, resp.content_type).code == "bad_request"
        async with http.post(sb._rpc._base + route, data=_framed({"cmd": ["cat"]}, b"fine"), headers=headers) as resp:
            assert resp.status == 200
            assert b"fine" in await resp.read()


async def test_a_streamed_stdin_into_a_missing_command_is_typed(sb: orchard.Sandbox) -> None:
    with pytest.raises(errors.CommandNotFound):
        await sb.exec(["no-such-program-xyz"], stdin=endless())


async def _dead(sb: orchard.Sandbox, pid: int) -> bool:
    return not await sandbox_pid_alive(sb, pid)
