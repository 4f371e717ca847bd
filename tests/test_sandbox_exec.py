"""Sandbox.exec against a real executor: the generic behaviour every backend must show."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
from typing import Any

import pytest

import orchard
import orchard_executor
from orchard import ExitEvent, OutputEvent, errors
from support import WAIT, eventually, read_pid, sandbox_pid_alive

pytestmark = pytest.mark.executor

NASTY = b"\xff\xfe\x00bin\x00\x80ary\xc3(\n"


async def test_argv_is_not_interpreted_by_a_shell(sb: orchard.Sandbox) -> None:
    r = await sb.exec(["printf", "%s|", "a b", "$HOME", "*", ";"])
    assert r.exit_code == 0
    assert r.stdout == "a b|$HOME|*|;|"


async def test_a_string_runs_through_the_shell(sb: orchard.Sandbox) -> None:
    r = await sb.exec("echo $((6 * 7)) | tr 4 x && echo second")
    assert r.ok
    assert r.stdout == "x2\nsecond\n"


async def test_the_shell_option_picks_the_shell(sb: orchard.Sandbox) -> None:
    r = await sb.exec('echo "${BASH_VERSION:+bash}"', shell="bash")
    assert r.stdout == "bash\n"


async def test_stdout_stderr_and_exit_code_are_separate(sb: orchard.Sandbox) -> None:
    r = await sb.exec("printf out; printf err >&2; printf more; exit 42")
    assert r.stdout == "outmore"
    assert r.stderr == "err"
    assert r.exit_code == 42
    assert r.signal is None
    assert not r.ok
    assert not r.timed_out
    assert (r.stdout_total, r.stderr_total) == (7, 3)
    assert not r.stdout_truncated
    assert not r.stderr_truncated


async def test_a_signal_is_reported_instead_of_an_exit_code(sb: orchard.Sandbox) -> None:
    r = await sb.exec("echo before; kill -TERM $$; echo after")
    assert r.exit_code is None
    assert r.signal == signal.SIGTERM
    assert r.stdout == "before\n"
    assert not r.ok
    assert not r.timed_out


async def test_duration_covers_the_run(sb: orchard.Sandbox) -> None:
    quick = await sb.exec(["true"])
    slow = await sb.exec(["sleep", "0.3"])
    assert quick.duration > 0
    # A lower bound only: the command cannot finish sooner than it sleeps.
    assert slow.duration >= 0.3


async def test_cwd_relative_to_the_workdir_and_absolute(sb: orchard.Sandbox) -> None:
    workdir = (await sb.info()).cwd
    await sb.mkdir("sub/deeper")
    r = await sb.exec(["pwd"], cwd="sub/deeper")
    assert r.stdout.strip() == os.path.join(workdir, "sub", "deeper")
    r = await sb.exec("pwd", cwd=os.path.join(workdir, "sub"))
    assert r.stdout.strip() == os.path.join(workdir, "sub")
    assert (await sb.exec(["pwd"])).stdout.strip() == workdir


async def test_env_adds_to_the_sandbox_environment(sandbox: orchard.Sandbox) -> None:
    sb = await sandbox(env={"FROM_SPEC": "spec value"})
    r = await sb.exec('printf "%s|%s|%s" "$FROM_SPEC" "$FROM_CALL" "${PATH:+has-path}"', env={"FROM_CALL": "x=1 y"})
    assert r.stdout == "spec value|x=1 y|has-path"
    r = await sb.exec('printf "%s" "${FROM_CALL-unset}"')
    assert r.stdout == "unset"
    r = await sb.exec(["sh", "-c", 'printf "%s" "$FROM_SPEC"'], env={"FROM_SPEC": "overridden"})
    assert r.stdout == "overridden"


async def test_stdin_bytes_and_text(sb: orchard.Sandbox) -> None:
    r = await sb.exec(["cat"], stdin=NASTY)
    assert r.stdout_bytes == NASTY
    r = await sb.exec(["wc", "-c"], stdin="héllo")
    assert r.stdout.strip() == str(len("héllo".encode()))


async def test_without_stdin_a_reader_sees_eof(sb: orchard.Sandbox) -> None:
    r = await sb.exec(["cat"], timeout=WAIT)
    assert r.ok
    assert r.stdout_bytes == b""


async def test_large_stdin_is_delivered_whole(sb: orchard.Sandbox) -> None:
    data = os.urandom(3 * 1024 * 1024)
    r = await sb.exec(["sha256sum"], stdin=data)
    assert r.stdout.split()[0] == hashlib.sha256(data).hexdigest()


async def test_output_is_bytes_safe(sb: orchard.Sandbox) -> None:
    r = await sb.exec(["printf", "\\377\\376\\000bin\\000\\200ary\\303(\\n"])
    assert r.stdout_bytes == NASTY
    assert "\ufffd" in r.stdout  # the text view replaces, the bytes stay exact
    r = await sb.exec("printf '\\377\\000' >&2")
    assert r.stderr_bytes == b"\xff\x00"
    assert r.stdout_bytes == b""


async def test_binary_output_survives_byte_exact(sb: orchard.Sandbox) -> None:
    blob = bytes(range(256)) * 4096 + os.urandom(100_000)
    await sb.write_file("blob.bin", blob)
    r = await sb.exec(["cat", "blob.bin"])
    assert r.stdout_bytes == blob
    assert r.stdout_total == len(blob)


async def test_timeout_returns_partial_output_and_kills_the_group(sb: orchard.Sandbox) -> None:
    r = await sb.exec("echo before; echo err >&2; sleep 300 & echo $! > bg.pid; wait", timeout=1)
    assert r.timed_out
    assert r.exit_code is None
    assert r.signal == signal.SIGKILL
    assert not r.ok
    assert r.stdout == "before\n"
    assert r.stderr == "err\n"
    grandchild = await read_pid(sb, "bg.pid")
    await eventually(lambda: _dead(sb, grandchild), what=f"grandchild {grandchild} killed")


async def test_timeout_kills_a_grandchild_that_left_the_group(sb: orchard.Sandbox) -> None:
    # The grandchild records its pid and session id, then sleeps in a session of its own.
    r = await sb.exec(
        "setsid sh -c 'echo $$ $(cut -d\" \" -f6 /proc/$$/stat) > esc.pid; exec sleep 300' &"
        " while [ ! -s esc.pid ]; do sleep 0.01; done; echo ready; wait",
        timeout=3,
    )
    assert r.timed_out
    assert r.stdout == "ready\n"
    pid, sid = (int(x) for x in (await sb.read_file("esc.pid")).split())
    assert sid == pid, "the grandchild did not escape into its own session"
    await eventually(lambda: _dead(sb, pid), what=f"escaped grandchild {pid} killed")


async def _dead(sb: orchard.Sandbox, pid: int) -> bool:
    return not await sandbox_pid_alive(sb, pid)


async def test_a_command_that_finishes_in_time_is_not_timed_out(sb: orchard.Sandbox) -> None:
    r = await sb.exec("echo fine", timeout=WAIT)
    assert r.ok
    assert not r.timed_out


def _seq(n: int) -> bytes:
    return "".join(f"{i}\n" for i in range(1, n + 1)).encode()


async def test_output_beyond_the_cap_keeps_head_and_tail(sb: orchard.Sandbox) -> None:
    cap = 64 * 1024
    full = _seq(300_000)
    r = await sb.exec(["seq", "1", "300000"], max_output=cap)
    assert r.exit_code == 0
    assert r.stdout_truncated
    assert r.stdout_total == len(full)
    assert len(r.stdout_bytes) == cap
    assert r.stdout_bytes == full[: cap // 2] + full[-cap // 2 :]
    assert not r.stderr_truncated
    assert r.stderr_total == 0


async def test_each_stream_is_capped_on_its_own(sb: orchard.Sandbox) -> None:
    full = _seq(100_000)
    r = await sb.exec("seq 1 100000 >&2; echo small", max_output=1000)
    assert r.stderr_truncated
    assert r.stderr_total == len(full)
    assert r.stderr_bytes == full[:500] + full[-500:]
    assert not r.stdout_truncated
    assert r.stdout == "small\n"


async def test_output_exactly_at_the_cap_is_whole(sb: orchard.Sandbox) -> None:
    r = await sb.exec(["head", "-c", "5000", "/dev/urandom"], max_output=5000)
    assert len(r.stdout_bytes) == 5000
    assert not r.stdout_truncated


async def test_zero_max_output_keeps_nothing_but_counts(sb: orchard.Sandbox) -> None:
    r = await sb.exec(["seq", "1", "1000"], max_output=0)
    assert r.stdout_bytes == b""
    assert r.stdout_truncated
    assert r.stdout_total == len(_seq(1000))


async def test_a_hundred_concurrent_execs(sb: orchard.Sandbox) -> None:
    async def one(i: int) -> None:
        r = await sb.exec(f"echo out{i}; echo err{i} >&2; exit {i % 7}", env={"I": str(i)})
        assert (r.stdout, r.stderr, r.exit_code) == (f"out{i}\n", f"err{i}\n", i % 7)
        r2 = await sb.exec(["sh", "-c", 'printf "$I"'], env={"I": str(i)})
        assert r2.stdout == str(i)

    await asyncio.gather(*(one(i) for i in range(100)))


async def test_cancelling_an_exec_kills_the_command(sb: orchard.Sandbox) -> None:
    task = asyncio.create_task(sb.exec("sleep 300 & echo $! > cancelled.pid; wait"))
    pid = await read_pid(sb, "cancelled.pid")
    assert await sandbox_pid_alive(sb, pid)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await eventually(lambda: _dead(sb, pid), what=f"command {pid} of a cancelled exec killed")


async def test_a_missing_program_raises_command_not_found(sb: orchard.Sandbox) -> None:
    with pytest.raises(errors.CommandNotFound, match="no-such-program") as info:
        await sb.exec(["no-such-program-xyz", "arg"])
    assert isinstance(info.value, FileNotFoundError)
    assert info.value.sandbox_id == sb.id
    assert (await sb.exec(["true"])).ok  # the sandbox is fine afterwards


async def test_a_missing_shell_raises_command_not_found(sb: orchard.Sandbox) -> None:
    with pytest.raises(errors.CommandNotFound):
        await sb.exec("true", shell="/no/such/shell")


async def test_a_string_command_not_found_is_exit_127(sb: orchard.Sandbox) -> None:
    r = await sb.exec("no-such-program-xyz")
    assert r.exit_code == 127
    assert "not found" in r.stderr


async def test_a_missing_cwd_raises_path_not_found(sb: orchard.Sandbox) -> None:
    with pytest.raises(errors.PathNotFound, match="no-such-dir") as info:
        await sb.exec(["true"], cwd="no-such-dir")
    assert isinstance(info.value, FileNotFoundError)


async def test_a_file_that_is_not_executable_raises_permission_denied(sb: orchard.Sandbox) -> None:
    await sb.write_file("script.sh", "#!/bin/sh\necho hi\n", mode=0o644)
    with pytest.raises(errors.PermissionDenied):
        await sb.exec(["./script.sh"])


@pytest.mark.parametrize("max_output", [-1, 10**12])
async def test_bad_max_output_is_an_invalid_request(sb: orchard.Sandbox, max_output: int) -> None:
    with pytest.raises(errors.InvalidRequest, match="max_output") as info:
        await sb.exec(["true"], max_output=max_output)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("timeout", [0, -5])
async def test_a_non_positive_timeout_is_an_invalid_request(sb: orchard.Sandbox, timeout: float) -> None:
    with pytest.raises(errors.InvalidRequest, match="timeout"):
        await sb.exec(["true"], timeout=timeout)


async def test_an_empty_argv_is_an_invalid_request(sb: orchard.Sandbox) -> None:
    with pytest.raises(errors.InvalidRequest, match="empty"):
        await sb.exec([])


async def test_info_describes_the_executor(sb: orchard.Sandbox) -> None:
    info = await sb.info()
    assert info.api == "v1"
    assert info.version == orchard_executor.__version__
    assert info.pid > 0
    assert info.uptime >= 0
    assert len(info.load) == 3
    p = await sb.start_process(["sleep", "300"])
    await sb.shell()
    info = await sb.info()
    assert (info.running_processes, info.sessions) == (1, 1)
    await p.kill()
    assert (await sb.info()).running_processes == 0


async def test_calls_in_flight_when_the_sandbox_block_exits_fail_at_once(
    client: orchard.Client, generic_image: tuple[str, dict[str, Any]]
) -> None:
    image, spec = generic_image
    async with client.sandbox(image, **spec) as sb:
        shell = await sb.shell()
        stream = sb.exec_stream("echo started; exec sleep 300")
        assert isinstance(await anext(stream), OutputEvent)

        async def next_event() -> OutputEvent | ExitEvent:
            return await anext(stream)

        calls = {
            "exec": asyncio.create_task(sb.exec("echo $$ > exec.pid; exec sleep 300")),
            "shell": asyncio.create_task(shell.exec("echo $$ > shell.pid; sleep 300")),
            "stream": asyncio.create_task(next_event()),
        }
        for name in ("exec", "shell"):
            await read_pid(sb, f"{name}.pid")
    results = await asyncio.wait_for(asyncio.gather(*calls.values(), return_exceptions=True), 5)
    # The stream was not failed: it ended with its command's kill (an ExitEvent, local) or SandboxLost (docker).
    assert {name: type(r).__name__ for name, r in zip(calls, results, strict=True)} == dict.fromkeys(
        calls, "SandboxClosed"
    ), results


async def test_a_closed_sandbox_refuses_calls(sandbox: orchard.Sandbox) -> None:
    sb = await sandbox()
    await sb.aclose()
    await sb.aclose()  # twice is fine
    with pytest.raises(errors.SandboxClosed):
        await sb.exec(["true"])
    with pytest.raises(errors.SandboxClosed):
        await sb.read_file("x")


async def test_a_command_that_cannot_start_is_reported_with_its_reason_and_path(sb: orchard.Sandbox) -> None:
    """What exec raises when the program cannot be started: the class, code, message and path a user reads."""
    workdir = (await sb.info()).cwd
    await sb.write_file("script.sh", "#!/bin/sh\necho hi\n", mode=0o644)
    await sb.write_file("empty", b"", mode=0o755)  # executable, but no format the kernel runs
    not_found = "was not found in the sandbox"
    cases: list[tuple[dict[str, Any], type[errors.ExecutorError], str, str, str]] = [
        (
            {"cmd": ["no-such-program-xyz", "arg"]},
            errors.CommandNotFound,
            "command_not_found",
            f"'no-such-program-xyz' {not_found}",
            "no-such-program-xyz",
        ),
        (
            {"cmd": "true", "shell": "/no/such/shell"},
            errors.CommandNotFound,
            "command_not_found",
            f"'/no/such/shell' {not_found} (a string cmd needs a shell; pass an argv list instead)",
            "/no/such/shell",
        ),
        (
            {"cmd": ["true", "arg"], "shell": "/no/such/shell", "login": True},
            errors.CommandNotFound,
            "command_not_found",
            f"'/no/such/shell' {not_found} (login=True needs a shell, bash or /bin/sh, in the sandbox)",
            "/no/such/shell",
        ),
        (
            {"cmd": ["true"], "cwd": "no-such-dir"},
            errors.PathNotFound,
            "file_not_found",
            f"working directory {os.path.join(workdir, 'no-such-dir')!r} does not exist",
            os.path.join(workdir, "no-such-dir"),
        ),
        (
            {"cmd": ["./script.sh", "arg"]},
            errors.PermissionDenied,
            "permission_denied",
            "cannot execute './script.sh': Permission denied",
            "./script.sh",
        ),
        (
            {"cmd": ["./empty", "arg"]},
            errors.InvalidRequest,
            "bad_request",
            "cannot execute './empty': [Errno 8] Exec format error: './empty'",
            "./empty",
        ),
    ]
    for kwargs, cls, code, message, path in cases:
        with pytest.raises(errors.ExecutorError) as info:
            await sb.exec(**kwargs)
        exc = info.value
        assert (type(exc), exc.code, str(exc), exc.path) == (cls, code, message, path), kwargs
        assert exc.sandbox_id == sb.id
    assert (await sb.exec(["true"])).ok  # the sandbox is fine afterwards
