"""Sandbox.exec_stream: output as it is produced, then the exit."""

from __future__ import annotations

import signal

import pytest

import orchard
from orchard import ExitEvent, OutputEvent, errors
from support import WAIT, eventually, read_pid, sandbox_pid_alive

pytestmark = pytest.mark.executor


async def collect(events: object) -> tuple[dict[str, bytes], list[OutputEvent | ExitEvent]]:
    out = {"stdout": b"", "stderr": b""}
    seen: list[OutputEvent | ExitEvent] = []
    async for ev in events:  # type: ignore[attr-defined]
        seen.append(ev)
        if isinstance(ev, OutputEvent):
            out[ev.stream] += ev.data
    return out, seen


async def test_the_first_chunk_arrives_while_the_command_still_runs(sb: orchard.Sandbox) -> None:
    # The command cannot end before the test creates "go", which it does only
    # once the first chunk has arrived: so that chunk came while it ran.
    cmd = "echo first; while [ ! -e go ]; do sleep 0.02; done; echo second"
    events: list[OutputEvent | ExitEvent] = []
    async for ev in sb.exec_stream(cmd, timeout=WAIT):
        events.append(ev)
        if isinstance(ev, OutputEvent) and ev.data == b"first\n":
            assert not await sb.exists("go")
            await sb.write_file("go", "")
    outputs = [ev for ev in events if isinstance(ev, OutputEvent)]
    assert b"".join(ev.data for ev in outputs) == b"first\nsecond\n"
    assert outputs[0].data == b"first\n"
    end = events[-1]
    assert isinstance(end, ExitEvent)
    assert end.result.exit_code == 0
    assert not end.result.timed_out
    assert sum(isinstance(ev, ExitEvent) for ev in events) == 1


async def test_streams_are_separate_and_the_exit_event_counts_bytes(sb: orchard.Sandbox) -> None:
    out, seen = await collect(sb.exec_stream("printf 'a\\377\\000'; printf EE >&2; printf b; exit 5"))
    assert out == {"stdout": b"a\xff\x00b", "stderr": b"EE"}
    end = seen[-1]
    assert isinstance(end, ExitEvent)
    assert end.result.exit_code == 5
    assert (end.result.stdout_total, end.result.stderr_total) == (4, 2)
    # The output came as events, not again in the result.
    assert end.result.stdout_bytes == b""
    assert end.result.stderr_bytes == b""


async def test_a_large_stream_arrives_whole_and_in_order(sb: orchard.Sandbox) -> None:
    expected = "".join(f"{i}\n" for i in range(1, 1_000_001)).encode()
    out, seen = await collect(sb.exec_stream(["seq", "1", "1000000"]))
    assert out["stdout"] == expected
    assert len(seen) > 2  # many chunks, not one buffered blob
    end = seen[-1]
    assert isinstance(end, ExitEvent)
    assert end.result.stdout_total == len(expected)


async def test_argv_cwd_env_and_stdin(sb: orchard.Sandbox) -> None:
    await sb.mkdir("d")
    out, seen = await collect(
        sb.exec_stream(["sh", "-c", 'pwd; printf "%s\\n" "$V"; cat'], cwd="d", env={"V": "vee"}, stdin=b"in\x00put")
    )
    lines = out["stdout"].split(b"\n")
    assert lines[0].endswith(b"/d")
    assert lines[1] == b"vee"
    assert lines[2] == b"in\x00put"


async def test_a_stream_timeout_kills_and_reports(sb: orchard.Sandbox) -> None:
    out, seen = await collect(sb.exec_stream("echo partial; sleep 300 & echo $! > s.pid; wait", timeout=1))
    assert out["stdout"] == b"partial\n"
    end = seen[-1]
    assert isinstance(end, ExitEvent)
    assert end.result.timed_out
    assert end.result.signal == signal.SIGKILL
    pid = await read_pid(sb, "s.pid")
    await eventually(lambda: _dead(sb, pid), what="timed-out stream's grandchild killed")


async def test_breaking_out_early_kills_the_command(sb: orchard.Sandbox) -> None:
    # Silent after its first line: only the client going away can end it.
    async for ev in sb.exec_stream("sleep 300 & echo $! > early.pid; echo started; wait"):
        assert isinstance(ev, OutputEvent)
        assert ev.data == b"started\n"
        break
    pid = await read_pid(sb, "early.pid")
    await eventually(lambda: _dead(sb, pid), what=f"command {pid} of an abandoned stream killed")
    assert (await sb.exec(["true"])).ok


async def test_breaking_out_of_a_chatty_command_kills_it(sb: orchard.Sandbox) -> None:
    async for _ in sb.exec_stream("echo $$ > chatty.pid; while :; do echo spam; done"):
        break
    pid = await read_pid(sb, "chatty.pid")
    await eventually(lambda: _dead(sb, pid), what=f"chatty command {pid} killed")


async def test_stream_errors_are_typed(sb: orchard.Sandbox) -> None:
    with pytest.raises(errors.CommandNotFound):
        async for _ in sb.exec_stream(["no-such-program-xyz"]):
            pass
    with pytest.raises(errors.PathNotFound):
        async for _ in sb.exec_stream(["true"], cwd="missing-dir"):
            pass


async def _dead(sb: orchard.Sandbox, pid: int) -> bool:
    return not await sandbox_pid_alive(sb, pid)
