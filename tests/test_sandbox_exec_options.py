"""Exec options agents pass on every call: ``login`` (a login shell) and ``merge_output`` (one stream)."""

from __future__ import annotations

import pytest

import orchard
from orchard import ExitEvent, OutputEvent, errors
from support import WAIT

pytestmark = pytest.mark.executor

#: A command whose stdout and stderr alternate, line by line.
ALTERNATE = 'i=0; while [ $i -lt 300 ]; do i=$((i+1)); echo "out $i"; echo "err $i" >&2; done'
ALTERNATED = "".join(f"out {i}\nerr {i}\n" for i in range(1, 301))


async def write_profile(sb: orchard.Sandbox) -> None:
    """A login profile in the sandbox's HOME, as conda or a task image would set one up."""
    home = (await sb.exec('printf %s "$HOME"')).stdout
    assert home.startswith("/"), home
    profile = "export ORCHARD_LOGIN_MARK=from-profile\n"
    # bash reads .bash_profile; sh (where there is no bash) reads .profile.
    await sb.write_file(f"{home}/.bash_profile", profile)
    await sb.write_file(f"{home}/.profile", profile)


async def test_login_loads_the_profile_and_without_it_nothing_does(sb: orchard.Sandbox) -> None:
    await write_profile(sb)
    login = await sb.exec('echo "[$ORCHARD_LOGIN_MARK] ${BASH_VERSION:+bash}"', login=True)
    assert login.ok, login.stderr
    assert login.stdout == "[from-profile] bash\n"
    plain = await sb.exec('echo "[$ORCHARD_LOGIN_MARK]"')
    assert plain.stdout == "[]\n"
    assert (await sb.exec('echo "[$ORCHARD_LOGIN_MARK]"', login=False)).stdout == "[]\n"


async def test_login_with_an_argv_list_runs_it_uninterpreted_after_the_profile(sb: orchard.Sandbox) -> None:
    await write_profile(sb)
    r = await sb.exec(["printenv", "ORCHARD_LOGIN_MARK"], login=True)
    assert (r.exit_code, r.stdout) == (0, "from-profile\n")
    assert (await sb.exec(["printenv", "ORCHARD_LOGIN_MARK"])).exit_code == 1
    # No word splitting, globbing or expansion: the list reaches the program as given.
    r = await sb.exec(["printf", "%s|", "a b", "$HOME", "*", ";", ""], login=True)
    assert r.stdout == "a b|$HOME|*|;||"
    # A missing program is the shell's exit 127, as for a string command.
    r = await sb.exec(["no-such-program-xyz"], login=True)
    assert r.exit_code == 127
    assert "no-such-program-xyz" in r.stderr


async def test_login_with_an_explicit_shell_uses_that_shell(sb: orchard.Sandbox) -> None:
    await write_profile(sb)
    r = await sb.exec('echo "[$ORCHARD_LOGIN_MARK] ${BASH_VERSION:-no bash}"', login=True, shell="/bin/sh")
    assert r.stdout.startswith("[from-profile] ")
    with pytest.raises(errors.CommandNotFound, match="/no/such/shell"):
        await sb.exec("true", login=True, shell="/no/such/shell")


async def test_merge_output_keeps_the_true_order_in_one_stream(sb: orchard.Sandbox) -> None:
    r = await sb.exec(ALTERNATE + "; exit 3", merge_output=True)
    assert r.exit_code == 3
    assert r.output == ALTERNATED
    assert r.output_bytes == ALTERNATED.encode()
    assert r.output_total == len(ALTERNATED)
    assert not r.output_truncated
    assert (r.stdout, r.stderr, r.stdout_total, r.stderr_total) == ("", "", 0, 0)
    # Without it, the streams stay apart and there is no merged output.
    apart = await sb.exec(ALTERNATE)
    assert apart.stdout == "".join(f"out {i}\n" for i in range(1, 301))
    assert apart.stderr == "".join(f"err {i}\n" for i in range(1, 301))
    assert (apart.output, apart.output_total, apart.output_truncated) == ("", 0, False)


async def test_merged_output_is_capped_with_its_head_and_tail(sb: orchard.Sandbox) -> None:
    r = await sb.exec(ALTERNATE, merge_output=True, max_output=100)
    assert r.output_truncated
    assert r.output_total == len(ALTERNATED)
    assert r.output_bytes == ALTERNATED.encode()[:50] + ALTERNATED.encode()[-50:]
    assert not r.stdout_truncated
    assert not r.stderr_truncated


async def test_merged_output_of_a_timed_out_command_is_kept(sb: orchard.Sandbox) -> None:
    r = await sb.exec("echo before; echo oops >&2; sleep 60", merge_output=True, timeout=2)
    assert r.timed_out
    assert r.output == "before\noops\n"


async def test_login_and_merge_output_together(sb: orchard.Sandbox) -> None:
    await write_profile(sb)
    r = await sb.exec('echo "$ORCHARD_LOGIN_MARK"; echo warn >&2; echo done', login=True, merge_output=True)
    assert r.ok
    assert r.output == "from-profile\nwarn\ndone\n"


async def test_exec_stream_merges_into_output_events(sb: orchard.Sandbox) -> None:
    events = [ev async for ev in sb.exec_stream(ALTERNATE, merge_output=True, timeout=WAIT)]
    chunks = [ev for ev in events if isinstance(ev, OutputEvent)]
    assert {ev.stream for ev in chunks} == {"output"}
    assert b"".join(ev.data for ev in chunks) == ALTERNATED.encode()
    end = events[-1]
    assert isinstance(end, ExitEvent)
    assert end.result.exit_code == 0
    assert (end.result.output_total, end.result.stdout_total, end.result.stderr_total) == (len(ALTERNATED), 0, 0)
    assert end.result.output_bytes == b""


async def test_exec_stream_with_login(sb: orchard.Sandbox) -> None:
    await write_profile(sb)
    events = [ev async for ev in sb.exec_stream('echo "$ORCHARD_LOGIN_MARK"', login=True, timeout=WAIT)]
    assert b"".join(ev.data for ev in events if isinstance(ev, OutputEvent)) == b"from-profile\n"


async def test_a_login_shell_session_loads_the_profile_once_and_keeps_what_it_set(sb: orchard.Sandbox) -> None:
    await write_profile(sb)
    home = (await sb.exec('printf %s "$HOME"')).stdout
    # The profile appends to a file each time it runs: a login session runs it once.
    await sb.write_file(f"{home}/.bash_profile", 'export ORCHARD_LOGIN_MARK=from-profile\necho x >> "$HOME/.runs"\n')
    sh = await sb.shell(login=True)
    assert (await sh.exec('echo "[$ORCHARD_LOGIN_MARK]"; ORCHARD_LOGIN_MARK=changed')).stdout == "[from-profile]\n"
    assert (await sh.exec('echo "[$ORCHARD_LOGIN_MARK]"')).stdout == "[changed]\n"
    assert (await sb.read_file(f"{home}/.runs")) == b"x\n"
    plain = await sb.shell()
    assert (await plain.exec('echo "[$ORCHARD_LOGIN_MARK]"')).stdout == "[]\n"


async def test_a_shell_login_that_is_not_a_bool_is_refused(sb: orchard.Sandbox) -> None:
    with pytest.raises(errors.InvalidRequest, match="login"):
        await sb.shell(login="yes")  # type: ignore[arg-type]


async def test_shell_exec_merges_output(sb: orchard.Sandbox) -> None:
    sh = await sb.shell()
    r = await sh.exec("X=kept; " + ALTERNATE, merge_output=True)
    assert r.output == ALTERNATED
    assert (r.stdout, r.stderr) == ("", "")
    # The session's state still carries over.
    assert (await sh.exec('echo "$X"')).stdout == "kept\n"


async def test_a_background_process_merges_into_its_stdout(sb: orchard.Sandbox) -> None:
    await write_profile(sb)
    p = await sb.start_process('echo "$ORCHARD_LOGIN_MARK"; ' + ALTERNATE, merge_output=True, login=True)
    st = await p.wait(timeout=WAIT)
    assert st.exit_code == 0
    assert await p.output("stdout") == b"from-profile\n" + ALTERNATED.encode()
    assert await p.output("stderr") == b""
    assert st.stderr_total == 0


async def test_options_of_the_wrong_type_are_refused(sb: orchard.Sandbox) -> None:
    # A truthy string must not pass for a flag: the executor refuses it, typed.
    with pytest.raises(errors.InvalidRequest, match="login"):
        await sb.exec("true", login="no")  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidRequest, match="merge_output"):
        await sb.exec("true", merge_output="yes")  # type: ignore[arg-type]
    assert (await sb.exec("true")).ok
