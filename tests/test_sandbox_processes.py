"""Background processes: start, status, output from an offset, stdin, signals, wait, kill, list."""

from __future__ import annotations

import signal

import pytest

import orchard
from orchard import errors
from support import WAIT, eventually, sandbox_pid_alive

pytestmark = pytest.mark.executor


async def test_status_and_output_of_a_finished_process(sb: orchard.Sandbox) -> None:
    p = await sb.start_process("printf hello; printf ' world'; printf 'err\\000' >&2; exit 3")
    assert p.id
    assert p.pid > 0
    st = await p.wait(timeout=WAIT)
    assert not st.running
    assert st.exit_code == 3
    assert st.signal is None
    assert not st.timed_out
    assert (st.stdout_size, st.stderr_size) == (11, 4)
    assert st.duration is not None
    assert st.duration > 0
    assert await p.output() == b"hello world"
    assert await p.output("stderr") == b"err\x00"
    assert (await p.status()) == st


async def test_reading_from_an_offset_continues_with_next_offset(sb: orchard.Sandbox) -> None:
    p = await sb.start_process(["printf", "0123456789abcdef"])
    await p.wait(timeout=WAIT)
    first = await p.read(offset=0, limit=5)
    assert (first.data, first.offset, first.next_offset, first.eof) == (b"01234", 0, 5, False)
    rest = await p.read(offset=first.next_offset, limit=100)
    assert (rest.data, rest.offset, rest.next_offset, rest.eof) == (b"56789abcdef", 5, 16, True)
    past = await p.read(offset=rest.next_offset)
    assert (past.data, past.next_offset, past.eof) == (b"", 16, True)
    middle = await p.read(offset=10, limit=3)
    assert middle.data == b"abc"


async def test_output_of_a_running_process_grows_and_is_not_eof(sb: orchard.Sandbox) -> None:
    p = await sb.start_process("printf first; while [ ! -e go ]; do sleep 0.02; done; printf second")
    chunk = await p.read()

    async def first_arrived() -> bool:
        nonlocal chunk
        chunk = await p.read()
        return chunk.data == b"first"

    await eventually(first_arrived, what="first output of a running process")
    assert not chunk.eof
    assert (await p.status()).running
    await sb.write_file("go", "")
    st = await p.wait(timeout=WAIT)
    assert st.exit_code == 0
    rest = await p.read(offset=chunk.next_offset)
    assert rest.data == b"second"
    assert rest.eof


async def test_writing_stdin(sb: orchard.Sandbox) -> None:
    p = await sb.start_process(["cat"])
    await p.write_stdin("abc")
    await p.write_stdin(b"\x00\xff")
    await eventually(lambda: _output_is(p, b"abc\x00\xff"), what="cat echoed stdin")
    assert (await p.status()).running  # stdin still open: cat still waits
    await p.write_stdin(b"", close=True)
    st = await p.wait(timeout=WAIT)
    assert st.exit_code == 0
    assert await p.output() == b"abc\x00\xff"
    with pytest.raises(errors.InvalidRequest, match="closed"):
        await p.write_stdin("too late")


async def test_stdin_given_at_start(sb: orchard.Sandbox) -> None:
    p = await sb.start_process(["cat"], stdin="preset\n")
    await p.write_stdin("more\n", close=True)
    assert (await p.wait(timeout=WAIT)).exit_code == 0
    assert await p.output() == b"preset\nmore\n"


async def test_sigterm_ends_it_and_status_shows_the_signal(sb: orchard.Sandbox) -> None:
    p = await sb.start_process("sleep 300")
    st = await p.signal(signal.SIGTERM)
    assert st.id == p.id
    st = await p.wait(timeout=WAIT)
    assert not st.running
    assert st.signal == signal.SIGTERM
    assert st.exit_code is None
    assert not await sandbox_pid_alive(sb, p.pid)


async def test_a_signal_reaches_the_whole_group(sb: orchard.Sandbox) -> None:
    p = await sb.start_process("sleep 300 & echo $! > child.pid; wait")
    await eventually(lambda: sb.exists("child.pid"))
    child = int((await sb.read_file("child.pid")).split()[0])
    await p.signal(signal.SIGKILL)
    assert (await p.wait(timeout=WAIT)).signal == signal.SIGKILL
    await eventually(lambda: _dead(sb, child), what="the process group's other member killed")


async def test_wait_with_a_timeout_returns_while_it_runs(sb: orchard.Sandbox) -> None:
    p = await sb.start_process(["sleep", "300"])
    st = await p.wait(timeout=0.2)
    assert st.running
    assert st.exit_code is None
    assert st.signal is None
    assert st.duration is None
    await p.kill()


async def test_kill_ends_and_forgets_it(sb: orchard.Sandbox) -> None:
    p = await sb.start_process("sleep 300 & echo $! > k.pid; wait")
    await eventually(lambda: sb.exists("k.pid"))
    child = int((await sb.read_file("k.pid")).split()[0])
    await p.kill()
    await eventually(lambda: _dead(sb, p.pid), what="killed process gone")
    await eventually(lambda: _dead(sb, child), what="killed process's child gone")
    with pytest.raises(errors.ProcessNotFound) as info:
        await p.status()
    assert isinstance(info.value, LookupError)
    with pytest.raises(errors.ProcessNotFound):
        await p.read()
    assert p.id not in [s.id for s in await sb.processes()]


async def test_list(sb: orchard.Sandbox) -> None:
    assert await sb.processes() == []
    a = await sb.start_process(["sleep", "300"])
    b = await sb.start_process(["true"])
    await b.wait(timeout=WAIT)
    listed = {s.id: s for s in await sb.processes()}
    assert set(listed) == {a.id, b.id}
    assert listed[a.id].running
    assert listed[a.id].pid == a.pid
    assert not listed[b.id].running
    assert listed[b.id].exit_code == 0
    await a.kill()
    assert [s.id for s in await sb.processes()] == [b.id]


async def test_a_process_timeout_kills_it(sb: orchard.Sandbox) -> None:
    p = await sb.start_process("echo started; sleep 300", timeout=1)
    st = await p.wait(timeout=WAIT)
    assert st.timed_out
    assert st.signal == signal.SIGKILL
    assert await p.output() == b"started\n"


async def test_output_beyond_max_output_is_drained_dropped_and_counted(sb: orchard.Sandbox) -> None:
    cap = 64 * 1024
    total = 8 * 1024 * 1024 + 3
    # Far more than a pipe holds: a process whose output is not drained past the cap would block.
    p = await sb.start_process(f"head -c {total} /dev/zero; printf err >&2", max_output=cap)
    st = await p.wait(timeout=WAIT)
    assert (st.running, st.exit_code, st.timed_out) == (False, 0, False)
    assert (st.stdout_size, st.stdout_total, st.stdout_truncated) == (cap, total, True)
    assert (st.stderr_size, st.stderr_total, st.stderr_truncated) == (3, 3, False)
    assert await p.output() == bytes(cap)
    assert await p.output("stderr") == b"err"
    end = await p.read(offset=cap)
    assert (end.data, end.next_offset, end.eof) == (b"", cap, True)


async def test_output_within_the_default_cap_is_kept_whole(sb: orchard.Sandbox) -> None:
    p = await sb.start_process(["head", "-c", "300000", "/dev/zero"])
    st = await p.wait(timeout=WAIT)
    assert (st.stdout_size, st.stdout_total, st.stdout_truncated) == (300000, 300000, False)
    assert await p.output() == bytes(300000)


async def test_a_bad_process_max_output_is_an_invalid_request(sb: orchard.Sandbox) -> None:
    with pytest.raises(errors.InvalidRequest, match="max_output"):
        await sb.start_process(["true"], max_output=10**12)


async def test_cwd_and_env(sb: orchard.Sandbox) -> None:
    await sb.mkdir("w")
    p = await sb.start_process('pwd; printf "%s" "$X"', cwd="w", env={"X": "ex"})
    await p.wait(timeout=WAIT)
    out = (await p.output()).split(b"\n")
    assert out[0].endswith(b"/w")
    assert out[1] == b"ex"


async def test_errors(sb: orchard.Sandbox) -> None:
    with pytest.raises(errors.CommandNotFound):
        await sb.start_process(["no-such-program-xyz"])
    with pytest.raises(errors.PathNotFound):
        await sb.start_process(["true"], cwd="missing")
    p = await sb.start_process(["sleep", "300"])
    with pytest.raises(errors.InvalidRequest, match="signal"):
        await p.signal(999)
    with pytest.raises(errors.InvalidRequest, match="stream"):
        await p.read("stdin")  # type: ignore[arg-type]
    assert (await p.status()).running
    await p.kill()


async def _output_is(p: orchard.Process, expected: bytes) -> bool:
    return await p.output() == expected


async def _dead(sb: orchard.Sandbox, pid: int) -> bool:
    return not await sandbox_pid_alive(sb, pid)
