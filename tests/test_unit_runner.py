"""OutputBuffer (head + tail capture) and argv building: pure logic."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import os
import random
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from orchard_executor import runner
from orchard_executor.errors import ExecutorError
from orchard_executor.protocol import ExecRequest
from orchard_executor.runner import (
    TRACKED,
    OutputBuffer,
    build_argv,
    descendants,
    kill_tree,
    parents,
    run,
    spawn_error,
    start,
    write_all,
)

pytestmark = pytest.mark.unit


def expected(data: bytes, cap: int) -> bytes:
    """What a head+tail capture of ``data`` under ``cap`` must keep."""
    if len(data) <= cap:
        return data
    head, tail = cap - cap // 2, cap // 2
    return data[:head] + (data[len(data) - tail :] if tail else b"")


def feed_all(buf: OutputBuffer, data: bytes, sizes: list[int]) -> None:
    pos = 0
    for n in sizes:
        buf.feed(data[pos : pos + n])
        pos += n
    buf.feed(data[pos:])


def test_output_under_the_cap_is_kept_whole() -> None:
    buf = OutputBuffer(100)
    buf.feed(b"hello ")
    buf.feed(b"world")
    assert buf.getvalue() == b"hello world"
    assert buf.total == 11
    assert not buf.truncated


def test_output_exactly_at_the_cap_is_not_truncated() -> None:
    data = bytes(range(256)) * 4
    buf = OutputBuffer(len(data))
    buf.feed(data)
    assert buf.getvalue() == data
    assert not buf.truncated


def test_one_byte_over_the_cap_drops_the_middle() -> None:
    data = b"abcdefghijk"  # 11 bytes, cap 10: head "abcde", tail "ghijk"
    buf = OutputBuffer(10)
    buf.feed(data)
    assert buf.truncated
    assert buf.total == 11
    assert buf.getvalue() == b"abcdeghijk"


def test_odd_cap_gives_the_extra_byte_to_the_head() -> None:
    data = bytes(range(100))
    buf = OutputBuffer(7)
    buf.feed(data)
    assert buf.getvalue() == data[:4] + data[-3:]


def test_zero_cap_keeps_nothing_but_counts_everything() -> None:
    buf = OutputBuffer(0)
    buf.feed(b"x" * 1000)
    assert buf.getvalue() == b""
    assert buf.total == 1000
    assert buf.truncated


def test_cap_of_one_keeps_only_the_first_byte() -> None:
    buf = OutputBuffer(1)
    for b in (b"ab", b"cd"):
        buf.feed(b)
    assert buf.getvalue() == b"a"
    assert buf.truncated


def test_empty_feeds_change_nothing() -> None:
    buf = OutputBuffer(4)
    buf.feed(b"")
    assert buf.getvalue() == b""
    assert buf.total == 0
    assert not buf.truncated


@pytest.mark.parametrize("cap", [1, 2, 3, 10, 64, 1000, 4097])
@pytest.mark.parametrize("seed", range(5))
def test_head_and_tail_match_a_reference_for_any_chunking(cap: int, seed: int) -> None:
    rng = random.Random(seed * 1000 + cap)
    data = rng.randbytes(rng.randrange(0, cap * 5 + 10))
    sizes = [rng.randrange(0, max(2, cap)) for _ in range(rng.randrange(0, 50))]
    buf = OutputBuffer(cap)
    feed_all(buf, data, sizes)
    assert buf.total == len(data)
    assert buf.truncated == (len(data) > cap)
    assert buf.getvalue() == expected(data, cap)


def test_memory_stays_within_the_cap() -> None:
    cap = 1000
    buf = OutputBuffer(cap)
    peak = 0
    for i in range(10_000):
        buf.feed(bytes([i % 256]) * 97)
        peak = max(peak, len(buf._head) + len(buf._ring or b""))
    assert buf.total == 970_000
    assert peak <= cap
    assert len(buf.getvalue()) == cap


def test_getvalue_is_repeatable_and_feeding_continues_after_it() -> None:
    buf = OutputBuffer(6)
    buf.feed(b"abcdefgh")
    assert buf.getvalue() == buf.getvalue() == b"abcfgh"
    buf.feed(b"ij")
    assert buf.getvalue() == b"abchij"


def test_build_argv_runs_a_string_through_the_shell() -> None:
    assert build_argv("echo $HOME", "/bin/sh") == ["/bin/sh", "-c", "echo $HOME"]
    assert build_argv("x", "bash") == ["bash", "-c", "x"]


def test_build_argv_keeps_a_list_as_is() -> None:
    argv = ["printf", "%s", "a b"]
    built = build_argv(argv, "/bin/sh")
    assert built == argv
    assert built is not argv


def test_build_argv_rejects_an_empty_list() -> None:
    with pytest.raises(ExecutorError) as info:
        build_argv([], "/bin/sh")
    with pytest.raises(ExecutorError):
        build_argv([], None, login=True)
    assert info.value.error.code == "bad_request"
    assert info.value.status == 400


def test_build_argv_defaults_to_sh_without_login() -> None:
    assert build_argv("x", None) == ["/bin/sh", "-c", "x"]


def test_build_argv_login_prefers_bash_on_the_path_and_falls_back_to_sh(tmp_path: Path) -> None:
    with_bash, without = tmp_path / "with", tmp_path / "without"
    with_bash.mkdir()
    without.mkdir()
    bash = with_bash / "bash"
    bash.write_text("")
    bash.chmod(0o755)
    assert build_argv("x", None, login=True, path=str(with_bash)) == [str(bash), "-l", "-c", "x"]
    assert build_argv("x", None, login=True, path=str(without)) == ["/bin/sh", "-l", "-c", "x"]
    # A named shell is used as named.
    assert build_argv("x", "zsh", login=True, path=str(with_bash)) == ["zsh", "-l", "-c", "x"]


def test_build_argv_login_passes_a_list_as_positional_parameters() -> None:
    built = build_argv(["printf", "%s", "a b", "$X"], "/bin/sh", login=True)
    assert built == ["/bin/sh", "-l", "-c", 'exec "$@"', "/bin/sh", "printf", "%s", "a b", "$X"]


def spawned(argv: list[str], cwd: str) -> ExecutorError:
    """What spawn_error makes of the OSError that really starting ``argv`` in ``cwd`` raises."""
    with pytest.raises(OSError) as info:  # noqa: PT011 - which OSError is what spawn_error sorts out
        subprocess.Popen(argv, cwd=cwd)
    return spawn_error(info.value, argv, cwd)


def test_spawn_error_names_the_missing_program_and_hints_at_a_missing_shell(tmp_path: Path) -> None:
    cwd = str(tmp_path)
    cases = [
        (["no-such-program-xyz", "arg"], ""),
        (["/no/such/shell", "-c", "true"], " (a string cmd needs a shell; pass an argv list instead)"),
        (
            ["/no/such/shell", "-l", "-c", 'exec "$@"', "/no/such/shell", "true"],
            " (login=True needs a shell, bash or /bin/sh, in the sandbox)",
        ),
        (["/no/such/shell", "-l", "-c", "true"], " (login=True needs a shell, bash or /bin/sh, in the sandbox)"),
    ]
    for argv, hint in cases:
        error = spawned(argv, cwd).error
        assert (error.code, error.message, error.path) == (
            "command_not_found",
            f"{argv[0]!r} was not found in the sandbox{hint}",
            argv[0],
        )


def test_spawn_error_names_a_missing_working_directory_first(tmp_path: Path) -> None:
    missing = str(tmp_path / "gone")
    error = spawned(["no-such-program-xyz"], missing).error
    assert (error.code, error.message, error.path) == (
        "file_not_found",
        f"working directory {missing!r} does not exist",
        missing,
    )


def test_spawn_error_for_a_file_that_cannot_be_executed(tmp_path: Path) -> None:
    (tmp_path / "script.sh").write_text("#!/bin/sh\necho hi\n")
    (tmp_path / "empty").write_bytes(b"")
    os.chmod(tmp_path / "empty", 0o755)
    error = spawned(["./script.sh", "arg"], str(tmp_path)).error
    assert (error.code, error.message, error.path) == (
        "permission_denied",
        "cannot execute './script.sh': Permission denied",
        "./script.sh",
    )
    error = spawned(["./empty", "arg"], str(tmp_path)).error
    assert (error.code, error.message, error.path) == (
        "bad_request",
        "cannot execute './empty': [Errno 8] Exec format error: './empty'",
        "./empty",
    )


def _gone(pid: int) -> bool:
    """Whether ``pid`` has exited (no such process, or a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return True
    return stat[stat.rfind(b")") + 2 :].split()[0] in (b"Z", b"X")


def _wait_gone(pids: list[int]) -> list[int]:
    """The pids of ``pids`` still alive after a generous wait (none, for a kill that worked)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(_gone(p) for p in pids):
        time.sleep(0.02)
    return [p for p in pids if not _gone(p)]


@pytest.fixture
def tree() -> Iterator[tuple[subprocess.Popen[bytes], list[int]]]:
    """A shell in a session of its own, a child of it, and a grandchild that left the session: their pids."""
    script = 'sleep 300 & echo $!; setsid sh -c "sleep 300 & echo \\$!; wait" & echo $!; wait'
    shell = subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE, start_new_session=True)
    assert shell.stdout is not None
    pids = [int(shell.stdout.readline()) for _ in range(3)]
    yield shell, pids
    for pid in [shell.pid, *pids]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    shell.wait()
    shell.stdout.close()


def test_parents_reads_each_process_parent_even_through_a_name_with_parentheses(tmp_path: Path) -> None:
    # The kernel takes the command name from the path executed: here "x) 1 2 (y", which a
    # parser splitting at the first ')' would read the wrong fields of.
    odd = tmp_path / "x) 1 2 (y"
    odd.symlink_to(shutil.which("sleep") or "/bin/sleep")
    child = subprocess.Popen([str(odd), "300"])
    try:
        found = parents()
        assert found[child.pid] == os.getpid()
        assert found[os.getpid()] == os.getppid()
    finally:
        child.kill()
        child.wait()


def test_descendants_finds_children_and_grandchildren_outside_the_group(
    tree: tuple[subprocess.Popen[bytes], list[int]],
) -> None:
    shell, (child, setsid_shell, grandchild) = tree
    assert sorted(descendants(shell.pid)) == sorted([child, setsid_shell, grandchild])
    assert descendants(grandchild) == []


def test_kill_tree_kills_the_group_and_descendants_that_left_it(
    tree: tuple[subprocess.Popen[bytes], list[int]],
) -> None:
    shell, pids = tree
    kill_tree(shell.pid)
    assert shell.wait() == -signal.SIGKILL
    assert _wait_gone(pids) == []


def test_kill_tree_sends_the_signal_asked_for(tree: tuple[subprocess.Popen[bytes], list[int]]) -> None:
    shell, pids = tree
    kill_tree(shell.pid, signal.SIGTERM)
    assert shell.wait() == -signal.SIGTERM
    assert _wait_gone(pids) == []


def test_kill_tree_of_a_process_that_is_gone_is_not_an_error() -> None:
    done = subprocess.Popen(["true"], start_new_session=True)
    done.wait()
    kill_tree(done.pid)


async def test_run_captures_each_stream_the_exit_code_and_stdin(tmp_path: Path) -> None:
    request = ExecRequest(cmd="cat; printf err >&2; exit 3", stdin=b"in\x00put", env={"X": "1"}, max_output=None)
    result = await run(request, cwd=str(tmp_path), env={"PATH": os.defpath})
    assert (result.exit_code, result.signal, result.timed_out) == (3, None, False)
    assert (result.stdout_bytes, result.stderr_bytes, result.output_bytes) == (b"in\x00put", b"err", b"")
    assert (result.stdout_total, result.stderr_total, result.output_total) == (6, 3, 0)
    assert (result.stdout_truncated, result.stderr_truncated, result.output_truncated) == (False, False, False)
    assert result.duration > 0


async def test_run_merges_the_streams_in_order_and_caps_them(tmp_path: Path) -> None:
    request = ExecRequest(cmd="printf a; printf b >&2; printf c; seq 1 1000 >&2", merge_output=True, max_output=10)
    result = await run(request, cwd=str(tmp_path), env={"PATH": os.defpath})
    full = b"abc" + "".join(f"{i}\n" for i in range(1, 1001)).encode()
    assert result.output_bytes == full[:5] + full[-5:]
    assert (result.output_total, result.output_truncated) == (len(full), True)
    assert (result.stdout_bytes, result.stderr_bytes, result.stdout_total, result.stderr_total) == (b"", b"", 0, 0)
    assert (result.stdout_truncated, result.stderr_truncated) == (False, False)


async def test_run_kills_the_tree_of_a_command_that_times_out(tmp_path: Path) -> None:
    request = ExecRequest(cmd="echo start; setsid sleep 300 & echo $!; exec sleep 300", timeout=0.5)
    result = await run(request, cwd=str(tmp_path), env={"PATH": os.defpath})
    assert (result.exit_code, result.signal, result.timed_out) == (None, signal.SIGKILL, True)
    assert result.stdout_bytes.split(b"\n")[0] == b"start"
    assert _wait_gone([int(result.stdout_bytes.split(b"\n")[1])]) == []


async def test_run_streams_to_a_sink_and_only_counts_what_it_streamed(tmp_path: Path) -> None:
    got: list[tuple[str, bytes]] = []
    request = ExecRequest(cmd="seq 1 20000; printf err >&2", max_output=10)
    result = await run(request, cwd=str(tmp_path), env={"PATH": os.defpath}, sink=lambda s, d: got.append((s, d)))
    full = "".join(f"{i}\n" for i in range(1, 20001)).encode()
    assert b"".join(d for s, d in got if s == "stdout") == full
    assert b"".join(d for s, d in got if s == "stderr") == b"err"
    assert (result.stdout_bytes, result.stderr_bytes) == (b"", b"")
    assert (result.stdout_total, result.stderr_total) == (len(full), 3)
    assert (result.stdout_truncated, result.stderr_truncated, result.output_truncated) == (False, False, False)


async def chunks_of(data: bytes, size: int) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


async def test_streamed_stdin_larger_than_the_pipe_is_delivered_whole(tmp_path: Path) -> None:
    data = random.Random(7).randbytes(3 * 1024 * 1024 + 5)
    result = await run(
        ExecRequest(cmd=["sha256sum"]), cwd=str(tmp_path), env={"PATH": os.defpath}, stdin=chunks_of(data, 100_000)
    )
    assert result.exit_code == 0
    assert result.stdout_bytes.split()[0].decode() == hashlib.sha256(data).hexdigest()


async def test_stdin_a_command_leaves_unread_is_dropped_without_error(tmp_path: Path) -> None:
    request = ExecRequest(cmd="head -c 3", stdin=b"x" * (4 * 1024 * 1024))
    result = await run(request, cwd=str(tmp_path), env={"PATH": os.defpath})
    assert (result.exit_code, result.stdout_bytes) == (0, b"xxx")
    streamed = await run(
        ExecRequest(cmd="head -c 3"), cwd=str(tmp_path), env={"PATH": os.defpath}, stdin=chunks_of(b"y" * 2**22, 2**16)
    )
    assert (streamed.exit_code, streamed.stdout_bytes) == (0, b"yyy")


async def test_a_stdin_source_that_fails_kills_the_command_and_is_reported(tmp_path: Path) -> None:
    async def failing() -> AsyncIterator[bytes]:
        yield b"partial\n"
        raise ConnectionResetError("the client went away")

    # Without the kill, `cat` would wait for the rest of its stdin, and sleep would hold the output pipe.
    request = ExecRequest(cmd="cat > got; echo $$ > pid; exec sleep 300")
    with pytest.raises(ExecutorError) as info:
        await run(request, cwd=str(tmp_path), env={"PATH": os.defpath}, stdin=failing())
    assert info.value.error.code == "bad_request"
    assert info.value.error.message == (
        "the command's stdin ended early, so it was killed: ConnectionResetError('the client went away')"
    )


async def test_a_login_shell_is_bash_only_where_the_commands_path_has_it(tmp_path: Path) -> None:
    with_bash = tmp_path / "bin"
    with_bash.mkdir()
    (with_bash / "bash").symlink_to(shutil.which("bash") or "/bin/bash")
    which = ExecRequest(cmd='printf "%s" "${BASH_VERSION:+bash}"', login=True)
    assert (await run(which, cwd=str(tmp_path), env={"PATH": str(with_bash)})).stdout_bytes == b"bash"
    # A PATH without bash: /bin/sh, though /bin (the default PATH) has bash.
    assert (await run(which, cwd=str(tmp_path), env={"PATH": str(tmp_path)})).stdout_bytes == b""


async def test_paused_output_is_not_read_until_resumed(tmp_path: Path) -> None:
    got: list[bytes] = []
    total = 4 * 1024 * 1024

    def sink(stream: str, data: bytes) -> None:
        got.append(data)
        if len(got) == 1:
            running.pause_output(True)

    running = await start(
        ["head", "-c", str(total), "/dev/zero"],
        cwd=str(tmp_path),
        env={"PATH": os.defpath},
        stdin=None,
        timeout=None,
        sink=sink,
    )
    # Paused after its first read, the command blocks on a full pipe: it cannot finish.
    await asyncio.sleep(0.5)
    assert len(got) == 1
    assert running._child.returncode is None
    running.pause_output(False)
    assert (await running.wait())[:3] == (0, None, False)
    assert sum(map(len, got)) == total


async def test_a_child_is_tracked_from_its_spawn_until_it_is_reaped(tmp_path: Path) -> None:
    running = await start(["true"], cwd=str(tmp_path), env={}, stdin=None, timeout=None, sink=lambda s, d: None)
    assert running.pid in TRACKED
    assert (await running.wait())[:3] == (0, None, False)
    assert running.pid not in TRACKED


async def test_a_child_reaped_by_someone_else_counts_as_killed(tmp_path: Path) -> None:
    # At shutdown the executor's reaper may wait for a child first: its status is then lost.
    running = await start(["true"], cwd=str(tmp_path), env={}, stdin=None, timeout=None, sink=lambda s, d: None)
    os.waitpid(running.pid, 0)
    assert (await running.wait())[:3] == (None, signal.SIGKILL, False)
    assert running.pid not in TRACKED


async def test_without_pidfd_a_thread_waits_for_the_exit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Linux before 5.3 has no pidfd_open: what an executor does there, on this kernel."""

    def no_pidfd(pid: int, flags: int = 0) -> int:
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    result = await run(ExecRequest(cmd="echo hi; exit 5"), cwd=str(tmp_path), env={"PATH": os.defpath})
    assert (result.exit_code, result.signal, result.stdout_bytes) == (5, None, b"hi\n")
    killed = await run(ExecRequest(cmd="kill -TERM $$"), cwd=str(tmp_path), env={"PATH": os.defpath})
    assert (killed.exit_code, killed.signal) == (None, signal.SIGTERM)


async def test_a_leftover_holding_the_output_pipe_does_not_hold_up_the_result(tmp_path: Path) -> None:
    request = ExecRequest(cmd="setsid sleep 300 & echo $!; echo done >&2")
    result = await run(request, cwd=str(tmp_path), env={"PATH": os.defpath})
    leftover = int(result.stdout_bytes)
    try:
        assert (result.exit_code, result.stderr_bytes, result.timed_out) == (0, b"done\n", False)
    finally:
        os.kill(leftover, signal.SIGKILL)


def test_write_all_writes_everything_through_a_full_pipe_and_ignores_a_closed_reader() -> None:
    data = random.Random(3).randbytes(1024 * 1024 + 3)
    r, w = os.pipe()
    received = bytearray()

    def drain() -> None:
        while chunk := os.read(r, 65536):
            received.extend(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        write_all(w, data)
    finally:
        os.close(w)
        reader.join()
        os.close(r)
    assert bytes(received) == data
    r, w = os.pipe()
    os.close(r)
    try:
        write_all(w, b"nobody reads this")
    finally:
        os.close(w)


async def test_a_start_that_fails_leaves_no_descriptor_open(tmp_path: Path) -> None:
    def open_fds() -> set[str]:
        return set(os.listdir("/proc/self/fd"))

    for merge in (False, True):
        for stdin in (None, b"", b"data"):
            before = open_fds()
            with pytest.raises(ExecutorError):
                await start(
                    ["./no-such-program"],
                    cwd=str(tmp_path),
                    env={},
                    stdin=stdin,
                    timeout=None,
                    sink=lambda s, d: None,
                    merge=merge,
                )
            assert open_fds() == before, (merge, stdin)


async def test_no_stdin_and_empty_stdin_are_dev_null(tmp_path: Path) -> None:
    for stdin in (None, b""):
        request = ExecRequest(cmd="readlink /proc/self/fd/0", stdin=stdin)
        result = await run(request, cwd=str(tmp_path), env={"PATH": os.defpath})
        assert result.stdout_bytes == b"/dev/null\n", stdin


async def test_stdin_still_streaming_when_the_command_ends_is_not_read_further(tmp_path: Path) -> None:
    closed = asyncio.Event()

    async def endless() -> AsyncIterator[bytes]:
        try:
            yield b"x"
            await asyncio.Event().wait()
        finally:
            closed.set()

    # A leftover still holds the stdin pipe, so the feeding does not end with a broken pipe.
    request = ExecRequest(cmd="setsid sleep 300 >/dev/null 2>&1 & echo $!")
    result = await run(request, cwd=str(tmp_path), env={"PATH": os.defpath}, stdin=endless())
    try:
        assert result.exit_code == 0
        await asyncio.wait_for(closed.wait(), 60)
    finally:
        os.kill(int(result.stdout_bytes), signal.SIGKILL)


def test_kill_tree_goes_on_past_processes_it_may_not_signal() -> None:
    # A command running as another user (sudo -u in a sandbox): the kill cannot reach it, and must not fail.
    if os.geteuid() != 0:
        pytest.fail(
            "this test needs root, to start processes as another user and drop to a third (it could not run): "
            "run it as root",
            pytrace=False,
        )
    other = subprocess.Popen(
        ["sh", "-c", "sleep 300 & echo $!; wait"], stdout=subprocess.PIPE, user=65534, start_new_session=True
    )
    assert other.stdout is not None
    child = int(other.stdout.readline())
    try:
        os.seteuid(65533)
        try:
            kill_tree(other.pid)
        finally:
            os.seteuid(0)
        assert not _gone(other.pid)
        assert not _gone(child)
    finally:
        kill_tree(other.pid)
        other.wait()
        other.stdout.close()


async def test_stdin_is_written_without_blocking_the_executor(tmp_path: Path) -> None:
    # The command reads its stdin only once the test's own coroutine has run: a feeder
    # blocked in a write (on a pipe the command does not yet read) would stop that
    # coroutine with the whole loop, and the command gives up after 15 s with exit 9.
    async def go() -> None:
        while not (tmp_path / "ready").exists():
            await asyncio.sleep(0.01)
        (tmp_path / "go").touch()

    request = ExecRequest(
        cmd="touch ready; end=$(( $(date +%s) + 15 ));"
        " while [ ! -e go ]; do [ $(date +%s) -ge $end ] && exit 9; sleep 0.01; done; exec cat >/dev/null",
        stdin=b"x" * (4 * 1024 * 1024),
    )
    task = asyncio.create_task(go())
    try:
        result = await run(request, cwd=str(tmp_path), env={"PATH": os.defpath})
    finally:
        task.cancel()
    assert result.exit_code == 0


def test_build_argv_says_why_an_empty_list_is_refused() -> None:
    with pytest.raises(ExecutorError) as info:
        build_argv([], None)
    assert info.value.error.message == "cmd is an empty list"


def test_build_argv_login_without_a_path_looks_in_the_default_path_not_the_executors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A sandbox env without PATH: the executor's own PATH is not the command's.
    bash = tmp_path / "bash"
    bash.symlink_to(shutil.which("bash") or "/bin/bash")
    monkeypatch.setenv("PATH", str(tmp_path))
    shell = shutil.which("bash", path=os.defpath) or "/bin/sh"
    assert build_argv("x", None, login=True, path=None) == [shell, "-l", "-c", "x"]
    assert build_argv("x", None, login=True) == [shell, "-l", "-c", "x"]


async def test_running_commands_raises_nothing_in_the_loops_callbacks(tmp_path: Path) -> None:
    # A failing reader or writer callback does not fail the command: the loop logs it and goes on.
    loop = asyncio.get_running_loop()
    errors: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _, context: errors.append(context))
    try:
        for request in (
            ExecRequest(cmd="cat; printf err >&2", stdin=b"x" * 300_000),
            ExecRequest(cmd="printf a; printf b >&2", merge_output=True),
            ExecRequest(cmd="exec sleep 300", timeout=0.2),
        ):
            await run(request, cwd=str(tmp_path), env={"PATH": os.defpath})
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(None)
    assert errors == []


async def test_the_result_waits_for_every_output_pipe_to_close_and_no_longer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With a grace long enough for any machine, what a leftover writes to stderr after the
    # command exited (stdout long closed) is in the result, which comes as soon as it closes.
    monkeypatch.setattr(runner, "PIPE_GRACE", 600)
    request = ExecRequest(cmd="(sleep 0.2; printf late >&2) >/dev/null & printf out")
    result = await asyncio.wait_for(run(request, cwd=str(tmp_path), env={"PATH": os.defpath}), 60)
    assert (result.exit_code, result.stdout_bytes, result.stderr_bytes) == (0, b"out", b"late")


async def test_the_duration_is_within_the_time_the_call_took(tmp_path: Path) -> None:
    before = time.monotonic()
    result = await run(ExecRequest(cmd=["sleep", "0.1"]), cwd=str(tmp_path), env={"PATH": os.defpath})
    took = time.monotonic() - before
    assert 0.1 <= result.duration <= took
