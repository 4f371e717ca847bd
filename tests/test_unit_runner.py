"""OutputBuffer (head + tail capture) and argv building: pure logic."""

from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path

import pytest

from orchard_executor.errors import ExecutorError
from orchard_executor.runner import OutputBuffer, build_argv, spawn_error

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
