"""SWE-ReX's runtime interface over an Orchard sandbox: sessions, execute, files and SWE-ReX's own exceptions.

Generic: tests/docker and tests/k8s/generic run these on their backends too.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from swerex.exceptions import (
    CommandTimeoutError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
)
from swerex.runtime.abstract import (
    BashAction,
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
)

import orchard
from orchard.harness.swerex import OrchardRuntime


@pytest.fixture
async def rt(sb: orchard.Sandbox) -> OrchardRuntime:
    return OrchardRuntime(sb)


async def test_a_session_keeps_its_state_across_commands(rt: OrchardRuntime) -> None:
    await rt.create_session(CreateBashSessionRequest())
    await rt.run_in_session(BashAction(command="cd /tmp && export ROLL=17 && greet() { echo hi $1; }"))
    obs = await rt.run_in_session(BashAction(command="pwd; echo $ROLL; greet there; echo oops >&2"))
    assert obs.output == "/tmp\n17\nhi there\noops\n"
    assert obs.exit_code == 0
    await rt.create_session(CreateBashSessionRequest(session="other"))
    other = await rt.run_in_session(BashAction(command="echo ${ROLL:-unset}", session="other"))
    assert other.output == "unset\n"
    await rt.close()


async def test_checks_timeouts_and_session_errors_are_swerex_exceptions(rt: OrchardRuntime) -> None:
    await rt.create_session(CreateBashSessionRequest())
    with pytest.raises(SessionExistsError):
        await rt.create_session(CreateBashSessionRequest())
    with pytest.raises(NonZeroExitCodeError, match="exit code 3"):
        await rt.run_in_session(BashAction(command="echo before; (exit 3)"))
    silent = await rt.run_in_session(BashAction(command="(exit 4)", check="silent"))
    assert silent.exit_code == 4
    ignored = await rt.run_in_session(BashAction(command="(exit 5)", check="ignore"))
    assert ignored.exit_code is None
    with pytest.raises(CommandTimeoutError):
        await rt.run_in_session(BashAction(command="sleep 30", timeout=0.5))
    # The session survives its timed-out command.
    assert (await rt.run_in_session(BashAction(command="echo alive"))).output == "alive\n"
    with pytest.raises(SessionDoesNotExistError):
        await rt.run_in_session(BashAction(command="true", session="nope"))
    await rt.close_session(CloseBashSessionRequest())
    with pytest.raises(SessionDoesNotExistError):
        await rt.run_in_session(BashAction(command="true"))


async def test_execute_as_subprocess_run(rt: OrchardRuntime) -> None:
    r = await rt.execute(Command(command=["sh", "-c", "echo out; echo err >&2; exit 2"]))
    assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 2)
    merged = await rt.execute(Command(command="echo a; echo b >&2; echo c", shell=True, merge_output_streams=True))
    assert (merged.stdout, merged.stderr) == ("a\nb\nc\n", "")
    env = await rt.execute(Command(command="echo $X in $(pwd)", shell=True, env={"X": "y"}, cwd="/tmp"))
    assert env.stdout == "y in /tmp\n"
    with pytest.raises(NonZeroExitCodeError, match="exit code 1"):
        await rt.execute(Command(command=["false"], check=True))
    with pytest.raises(CommandTimeoutError):
        await rt.execute(Command(command=["sleep", "30"], timeout=0.5))


async def test_files_round_trip(rt: OrchardRuntime, tmp_path: Path) -> None:
    await rt.write_file(WriteFileRequest(path="/tmp/swerex/a/notes.txt", content="héllo\n"))
    assert (await rt.read_file(ReadFileRequest(path="/tmp/swerex/a/notes.txt"))).content == "héllo\n"
    with pytest.raises(FileNotFoundError):
        await rt.read_file(ReadFileRequest(path="/tmp/swerex/missing"))
    (tmp_path / "repo" / "pkg").mkdir(parents=True)
    (tmp_path / "repo" / "pkg" / "mod.py").write_text("X = 1\n")
    await rt.upload(UploadRequest(source_path=os.fspath(tmp_path / "repo"), target_path="/tmp/swerex/repo"))
    assert (await rt.read_file(ReadFileRequest(path="/tmp/swerex/repo/pkg/mod.py"))).content == "X = 1\n"
    with pytest.raises(FileNotFoundError):
        await rt.upload(UploadRequest(source_path=os.fspath(tmp_path / "nope"), target_path="/tmp/x"))
    assert await rt.is_alive()
