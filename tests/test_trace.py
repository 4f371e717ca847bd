"""Traces: ``trace=`` records every request to a sandbox, one JSON line each, as it happens."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import aiohttp
import pytest

import orchard
import orchard.sync
from orchard import errors
from support import WAIT, agen, unisolated_ok

pytestmark = pytest.mark.executor

SECRET = "s3cr3t-env-value-that-must-not-appear"


def records(path: Path) -> list[dict[str, Any]]:
    """Every line of a trace file, each a whole JSON object of schema version 1."""
    text = path.read_text()
    assert text.endswith("\n")
    lines = [json.loads(line) for line in text.splitlines()]
    for r in lines:
        assert r["v"] == 1
        assert r["start"] <= r["end"]
        assert r["duration"] >= 0
    return lines


def one(found: list[dict[str, Any]], kind: str, **match: Any) -> dict[str, Any]:
    hits = [r for r in found if r["type"] == kind and all(r.get(k) == v for k, v in match.items())]
    assert len(hits) == 1, (kind, match, [r["type"] for r in found])
    return hits[0]


def no_sandbox_started(local_root: Path, client: orchard.Client) -> bool:
    return not client._live and (not local_root.exists() or not any(local_root.iterdir()))


@pytest.mark.parametrize(
    "where",
    ["missing-dir/trace.jsonl", "a-directory", "a-file/trace.jsonl", "/proc/version"],
)
async def test_an_unwritable_trace_fails_before_any_sandbox_starts(
    local_client: orchard.Client, local_root: Path, tmp_path: Path, where: str
) -> None:
    (tmp_path / "a-directory").mkdir()
    (tmp_path / "a-file").write_text("x")
    path = where if where.startswith("/") else str(tmp_path / where)
    with pytest.raises(errors.TraceError, match="trace=") as info:
        await local_client.create(trace=path)
    assert isinstance(info.value, OSError)
    assert info.value.path == path
    assert path in str(info.value)
    assert no_sandbox_started(local_root, local_client)


async def test_a_trace_that_is_neither_path_nor_function_is_a_config_error(
    local_client: orchard.Client, local_root: Path
) -> None:
    async def coroutine_function(record: dict[str, Any]) -> None:
        pass

    for bad in (42, b"/tmp/x.jsonl", coroutine_function):
        with pytest.raises(errors.ConfigError, match="trace="):
            await local_client.create(trace=bad)
    assert no_sandbox_started(local_root, local_client)


async def test_a_run_produces_the_documented_records(client: orchard.Client, tmp_path: Path) -> None:
    path = tmp_path / "traj.jsonl"
    payload = os.urandom(300_000)
    chunks = [payload[:100_000], payload[100_000:]]
    local = tmp_path / "up.bin"
    local.write_bytes(b"uploaded")
    async with client.sandbox(trace=path, env={"BASE": SECRET}) as sb:
        sb_id = sb.id
        token = sb._rpc._headers["Authorization"].removeprefix("Bearer ")
        await sb.mkdir("work")
        r = await sb.exec(
            "printf %s \"${#X}\"; head -c 10000 /dev/zero | tr '\\0' a; echo err >&2; exit 3",
            cwd="work",
            env={"X": SECRET, "Y": "1"},
            stdin=b"in",
        )
        assert r.exit_code == 3
        await sb.exec(["sleep", "5"], timeout=0.2)
        with pytest.raises(errors.CommandNotFound):
            await sb.exec(["no-such-program-here"])
        events = [ev async for ev in sb.exec_stream("echo one; echo two >&2")]
        assert isinstance(events[-1], orchard.ExitEvent)
        await sb.write_file("small.txt", "hello")
        await sb.write_file("big.bin", agen(chunks))
        assert await sb.read_file("big.bin") == payload
        streamed = b"".join([c async for c in sb.stream_file("small.txt")])
        assert streamed == b"hello"
        with pytest.raises(errors.PathNotFound):
            await sb.read_file("missing.txt")
        await sb.upload(local, "up.bin")
        await sb.download("up.bin", tmp_path / "down.bin")
        assert await sb.exists("up.bin")
        p = await sb.start_process(["sh", "-c", "read line; echo got $line; sleep 30"], env={"Z": SECRET})
        await p.write_stdin("x\n")
        await p.signal(signal.SIGTERM)
        status = await p.wait(timeout=WAIT)
        assert status.signal == signal.SIGTERM
        await p.kill()
        async with await sb.shell(env={"S": SECRET}) as sh:
            await sh.exec("cd work && export Q=1")
            assert (await sh.exec("echo $Q")).stdout == "1\n"
    found = records(path)
    text = path.read_text()
    assert SECRET not in text
    assert token not in text
    assert {r["sandbox"] for r in found} == {sb_id}
    assert found[0]["type"] == "sandbox_create"
    assert found[0]["env_keys"] == ["BASE"]
    assert found[-1]["type"] == "sandbox_close"
    assert all(r["error"] is None for r in found[:-1] if r["type"] not in ("exec", "file_read"))

    ex = one(found, "exec", exit_code=3)
    assert ex["cmd"].startswith("printf")
    assert (ex["cwd"], ex["env_keys"], ex["stdin_bytes"]) == ("work", ["X", "Y"], 2)
    assert (ex["signal"], ex["timed_out"], ex["error"]) == (None, False, None)
    assert (ex["stdout_total"], ex["stderr_total"]) == (len(str(len(SECRET))) + 10000, 4)
    assert ex["stdout_head"] == str(len(SECRET)) + "a" * (2048 - len(str(len(SECRET))))
    assert ex["stdout_tail"] == "a" * 2048
    assert (ex["stderr_head"], ex["stderr_tail"]) == ("err\n", "")
    assert ex["end"] - ex["start"] == pytest.approx(ex["duration"], abs=0.01)
    timed = one(found, "exec", cmd=["sleep", "5"])
    assert timed["timed_out"] is True
    assert timed["timeout"] == 0.2
    failed = one(found, "exec", cmd=["no-such-program-here"])
    assert failed["error"]["type"] == "CommandNotFound"
    assert "no-such-program-here" in failed["error"]["message"]
    assert "exit_code" not in failed  # a call that failed has no outcome fields

    st = one(found, "exec_stream")
    assert (st["exit_code"], st["stdout_total"], st["stderr_total"]) == (0, 4, 4)
    assert (st["stdout_head"], st["stderr_head"]) == ("one\n", "two\n")

    small = one(found, "file_write", path="small.txt")
    assert (small["bytes"], small["sha256"]) == (5, hashlib.sha256(b"hello").hexdigest())
    big = one(found, "file_write", path="big.bin")
    assert (big["bytes"], big["sha256"]) == (len(payload), hashlib.sha256(payload).hexdigest())
    read = one(found, "file_read", path="big.bin")
    assert (read["bytes"], read["sha256"]) == (len(payload), hashlib.sha256(payload).hexdigest())
    st_read = one(found, "file_read", path="small.txt")
    assert (st_read["bytes"], st_read["sha256"]) == (5, hashlib.sha256(b"hello").hexdigest())
    assert st_read["closed_early"] is False
    missing = one(found, "file_read", path="missing.txt")
    assert missing["error"]["type"] == "PathNotFound"
    up = one(found, "upload")
    assert (up["local_path"], up["path"], up["file_type"], up["size"]) == (str(local), "up.bin", "file", 8)
    down = one(found, "download")
    assert (down["path"], down["local_path"]) == ("up.bin", str(tmp_path / "down.bin"))
    assert one(found, "exists")["result"] is True
    # One record per call: the stat, write and read an upload or download makes are inside it.
    assert not [r for r in found if r["type"] == "stat"]
    assert not [r for r in found if r.get("path") == "up.bin" and r["type"] in ("file_write", "file_read")]

    start = one(found, "process_start")
    assert (start["process"], start["pid"], start["env_keys"]) == (p.id, p.pid, ["Z"])
    assert one(found, "process_stdin")["bytes"] == 2
    assert one(found, "process_signal")["sent_signal"] == signal.SIGTERM
    wait = one(found, "process_wait")
    assert (wait["process"], wait["running"], wait["signal"], wait["timeout"]) == (p.id, False, signal.SIGTERM, WAIT)
    assert one(found, "process_kill")["process"] == p.id

    opened = one(found, "shell_open")
    assert opened["env_keys"] == ["S"]
    execs = [r for r in found if r["type"] == "shell_exec"]
    assert [r["command"] for r in execs] == ["cd work && export Q=1", "echo $Q"]
    assert execs[1]["stdout_head"] == "1\n"
    assert {r["session"] for r in execs} == {opened["session"]}
    assert one(found, "shell_close")["session"] == opened["session"]
    # In the order the calls ended: the file is written as it goes.
    kinds = [r["type"] for r in found]
    assert kinds.index("process_start") < kinds.index("process_wait") < kinds.index("shell_open")
    assert [r["end"] for r in found] == sorted(r["end"] for r in found)


async def test_a_function_gets_each_record_as_it_happens(local_client: orchard.Client) -> None:
    got: list[dict[str, Any]] = []
    async with local_client.sandbox(trace=got.append) as sb:
        assert [r["type"] for r in got] == ["sandbox_create"]
        await sb.exec("echo hi")
        assert [r["type"] for r in got] == ["sandbox_create", "exec"]
        assert got[-1]["stdout_head"] == "hi\n"
    assert [r["type"] for r in got] == ["sandbox_create", "exec", "sandbox_close"]
    assert all(r["v"] == 1 and r["sandbox"] == sb.id for r in got)


async def test_a_failed_start_is_recorded(local_client: orchard.Client, tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    with pytest.raises(errors.ConfigError):
        await local_client.create(trace=path, ttl=-1)
    (create,) = records(path)
    assert create["type"] == "sandbox_create"
    assert create["error"]["type"] == "ConfigError"


async def test_a_trace_function_that_raises_leaves_no_sandbox(local_client: orchard.Client, local_root: Path) -> None:
    def broken(record: dict[str, Any]) -> None:
        raise RuntimeError("trace sink broke")

    with pytest.raises(RuntimeError, match="trace sink broke"):
        await local_client.create(trace=broken)
    assert no_sandbox_started(local_root, local_client)


async def test_a_trace_whose_first_record_fails_leaves_no_sandbox(
    local_client: orchard.Client, local_root: Path
) -> None:
    # /dev/full opens for writing and then refuses every write (ENOSPC), like a disk filling up.
    with pytest.raises(errors.TraceError, match="/dev/full") as info:
        await local_client.create(trace="/dev/full")
    assert isinstance(info.value.__cause__, OSError)
    assert no_sandbox_started(local_root, local_client)


async def test_a_trace_function_that_raises_mid_run_fails_that_call(local_client: orchard.Client) -> None:
    got: list[dict[str, Any]] = []

    def sink(record: dict[str, Any]) -> None:
        if record.get("cmd") == "echo broken":
            raise RuntimeError("trace sink broke")
        got.append(record)

    async with local_client.sandbox(trace=sink) as sb:
        with pytest.raises(RuntimeError, match="trace sink broke"):
            await sb.exec("echo broken")
        assert (await sb.exec("echo after")).stdout == "after\n"
    assert [r["type"] for r in got] == ["sandbox_create", "exec", "sandbox_close"]


async def test_streams_left_early_and_binary_output(local_client: orchard.Client, tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    async with local_client.sandbox(trace=path) as sb:
        await sb.write_file("big", b"x" * 3_000_000)
        async for _ in sb.stream_file("big"):
            break
        async for ev in sb.exec_stream("echo first; sleep 30"):
            assert isinstance(ev, orchard.OutputEvent)
            break
        await sb.exec(["printf", "\\377ok"])
    assert path.stat().st_mode & 0o777 == 0o600
    found = records(path)
    partial = one(found, "file_read", path="big")
    assert (partial["closed_early"], partial["error"]) == (True, None)
    assert 0 < partial["bytes"] < 3_000_000
    left = one(found, "exec_stream")
    assert (left["stdout_head"], left["closed_early"], left["error"]) == ("first\n", True, None)
    assert "exit_code" not in left  # it never ended: the loop left first, killing it
    assert one(found, "exec", cmd=["printf", "\\377ok"])["stdout_head"] == "\ufffdok"


async def test_merged_output_is_recorded(local_client: orchard.Client) -> None:
    got: list[dict[str, Any]] = []
    async with local_client.sandbox(trace=got.append) as sb:
        r = await sb.exec("echo out; echo err >&2", merge_output=True)
        assert r.output == "out\nerr\n"
        [ev async for ev in sb.exec_stream("echo a; echo b >&2", merge_output=True)]
    ex, st = got[1], got[2]
    assert (ex["type"], ex["merge_output"], ex["output_head"], ex["output_total"]) == ("exec", True, "out\nerr\n", 8)
    assert (ex["stdout_total"], ex["stderr_total"]) == (0, 0)
    assert (st["type"], st["merge_output"], st["output_head"], st["stderr_total"]) == ("exec_stream", True, "a\nb\n", 0)


async def test_a_cancelled_call_is_recorded(local_client: orchard.Client) -> None:
    got: list[dict[str, Any]] = []
    async with local_client.sandbox(trace=got.append) as sb:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(sb.exec("sleep 30"), 0.5)
        assert got[-1]["type"] == "exec"
        assert got[-1]["error"]["type"] == "CancelledError"


def test_through_the_sync_facade(local_root: Path, tmp_path: Path) -> None:
    path = tmp_path / "sync.jsonl"
    config = orchard.LocalConfig(root=str(local_root), isolation="none")
    with unisolated_ok(), orchard.sync.Client(config) as client, client.sandbox(trace=path) as sb:
        assert sb.exec("echo hi").stdout == "hi\n"
        assert [type(ev).__name__ for ev in sb.exec_stream(["echo", "s"])] == ["OutputEvent", "ExitEvent"]
    found = records(path)
    assert [r["type"] for r in found] == ["sandbox_create", "exec", "exec_stream", "sandbox_close"]
    assert (found[1]["stdout_head"], found[2]["stdout_head"]) == ("hi\n", "s\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_forward_is_recorded_when_its_block_exits(local_client: orchard.Client) -> None:
    got: list[dict[str, Any]] = []
    port, closed = free_port(), free_port()
    async with local_client.sandbox(trace=got.append) as sb:
        await sb.start_process(["python3", "-m", "http.server", str(port), "--bind", "127.0.0.1"])
        async with sb.forward(port, wait=WAIT) as url, aiohttp.ClientSession() as http:
            async with http.get(url) as resp:
                assert resp.status == 200
            assert [r["type"] for r in got][-1] == "process_start"  # not yet: the block is open
        with pytest.raises(errors.PortClosed):
            async with sb.forward(closed):
                pass
        with pytest.raises(KeyError):
            async with sb.forward(port):
                raise KeyError("the caller's own")
    ok, refused, raised = (r for r in got if r["type"] == "forward")
    assert (ok["port"], ok["url"], ok["error"]) == (port, url, None)
    assert (refused["port"], refused["error"]["type"]) == (closed, "PortClosed")
    assert (raised["port"], raised["error"]) == (port, None)


async def test_records_of_two_sandboxes_share_one_file(local_client: orchard.Client, tmp_path: Path) -> None:
    path = tmp_path / "shared.jsonl"
    async with local_client.sandbox(trace=path) as a, local_client.sandbox(trace=str(path)) as b:
        await asyncio.gather(*(sb.exec(f"echo {i}") for i in range(20) for sb in (a, b)))
    found = records(path)
    assert sorted(r["sandbox"] for r in found if r["type"] == "exec") == sorted([a.id] * 20 + [b.id] * 20)


CHILD = textwrap.dedent(
    """
    import asyncio, sys, warnings
    import orchard

    async def main(root, path):
        warnings.simplefilter("ignore")
        config = orchard.LocalConfig(root=root, isolation="none")
        async with orchard.Client(config) as client, client.sandbox(trace=path) as sb:
            i = 0
            while True:
                await sb.exec(["echo", str(i)])
                print(i, flush=True)
                i += 1

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


async def test_a_sigkilled_clients_trace_is_complete_up_to_the_kill(local_root: Path, tmp_path: Path) -> None:
    path = tmp_path / "killed.jsonl"
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD, str(local_root), str(path), stdout=subprocess.PIPE
    )
    assert child.stdout is not None
    try:
        for _ in range(30):
            await asyncio.wait_for(child.stdout.readline(), WAIT)
    finally:
        child.send_signal(signal.SIGKILL)
    rest = (await asyncio.wait_for(child.stdout.read(), WAIT)).split()
    assert await child.wait() == -signal.SIGKILL
    done = 29 + len(rest)  # the last exec the child saw returned
    found = records(path)  # every line whole, the last one too
    assert found[0]["type"] == "sandbox_create"
    execs = found[1:]
    assert all(r["type"] == "exec" for r in execs)
    # Each call's record is on disk before the call returns: none lost, none torn.
    assert [r["stdout_head"] for r in execs] == [f"{i}\n" for i in range(len(execs))]
    assert len(execs) >= done + 1
