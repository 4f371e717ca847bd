"""Persistent shell sessions: state carries over between commands, timeouts do not wedge them."""

from __future__ import annotations

import os

import pytest

import orchard
from orchard import errors

pytestmark = pytest.mark.executor


async def test_cwd_env_variables_and_functions_carry_over(sb: orchard.Sandbox) -> None:
    workdir = (await sb.info()).cwd
    await sb.mkdir("proj/src")
    sh = await sb.shell()
    r = await sh.exec(
        'cd proj/src && export TOKEN=\'a b "c"\' && PLAIN=$((40 + 2)) && greet() { echo "hi $1"; }'
        " && ARR=(x 'y z') && set -o pipefail"
    )
    assert r.ok, r.stderr
    r = await sh.exec('pwd; printf "%s\\n" "$TOKEN" "$PLAIN" "${ARR[1]}"; greet you; false | true; echo rc=$?')
    assert r.stdout.splitlines() == [
        os.path.join(workdir, "proj", "src"),
        'a b "c"',
        "42",
        "y z",
        "hi you",
        "rc=1",
    ]
    # Exported means exported: a child process sees TOKEN, not PLAIN.
    r = await sh.exec('sh -c \'printf "%s|%s" "$TOKEN" "${PLAIN-unset}"\'')
    assert r.stdout == 'a b "c"|unset'


async def test_unset_carries_over(sb: orchard.Sandbox) -> None:
    sh = await sb.shell(env={"FROM_START": "1"})
    await sh.exec("export E=1; V=2; f() { :; }")
    r = await sh.exec("unset E V FROM_START; unset -f f")
    assert r.ok
    r = await sh.exec(
        'printf "%s %s %s " "${E-unset}" "${V-unset}" "${FROM_START-unset}"; type f >/dev/null 2>&1 || echo nofunc'
    )
    assert r.stdout == "unset unset unset nofunc\n"


async def test_a_timed_out_command_neither_wedges_the_session_nor_applies_its_changes(sb: orchard.Sandbox) -> None:
    await sb.mkdir("before")
    sh = await sb.shell()
    assert (await sh.exec("cd before && export A=old && B=old")).ok
    r = await sh.exec("echo partial; cd / && export A=new && B=new && sleep 30", timeout=1)
    assert r.timed_out
    assert r.stdout == "partial\n"
    r = await sh.exec('printf "%s %s %s" "$A" "$B" "$(basename "$PWD")"')
    assert r.ok
    assert r.stdout == "old old before"
    r = await sh.exec("export A=next; echo works")
    assert r.stdout == "works\n"
    assert (await sh.exec('echo "$A"')).stdout == "next\n"


async def test_exit_status_output_and_state_of_a_failing_command(sb: orchard.Sandbox) -> None:
    sh = await sb.shell()
    r = await sh.exec("Z=5; echo out; echo err >&2; exit 7")
    assert (r.exit_code, r.stdout, r.stderr) == (7, "out\n", "err\n")
    # The session survives an explicit exit, with the state it had then.
    r = await sh.exec('echo "$Z"')
    assert r.ok
    assert r.stdout == "5\n"


async def test_sessions_are_independent(sb: orchard.Sandbox) -> None:
    one, two = await sb.shell(), await sb.shell()
    assert one.id != two.id
    await one.exec("X=one; cd /")
    r = await two.exec('printf "%s" "${X-unset}"; pwd')
    assert r.stdout.startswith("unset")
    assert r.stdout[len("unset") :].strip() == (await sb.info()).cwd


async def test_start_cwd_env_and_stdin(sb: orchard.Sandbox) -> None:
    await sb.mkdir("start")
    sh = await sb.shell(cwd="start", env={"K": "v"})
    r = await sh.exec('pwd; echo "$K"; cat', stdin="from stdin")
    cwd, env, stdin = r.stdout.splitlines()
    assert cwd == f"{(await sb.info()).cwd}/start"
    assert [env, stdin] == ["v", "from stdin"]


async def test_session_output_cap(sb: orchard.Sandbox) -> None:
    sh = await sb.shell()
    r = await sh.exec("seq 1 100000", max_output=100)
    assert r.stdout_truncated
    assert len(r.stdout_bytes) == 100
    assert r.stdout_bytes.startswith(b"1\n2\n3\n")
    assert r.stdout_bytes.endswith(b"99999\n100000\n")


async def test_closing_a_session(sb: orchard.Sandbox) -> None:
    async with await sb.shell() as sh:
        assert (await sb.info()).sessions == 1
    assert (await sb.info()).sessions == 0
    with pytest.raises(errors.SessionNotFound) as info:
        await sh.exec("true")
    assert isinstance(info.value, LookupError)


async def test_session_errors(sb: orchard.Sandbox) -> None:
    with pytest.raises(errors.CommandNotFound, match="bash"):
        await sb.shell(shell="no-such-shell")
    with pytest.raises(errors.PathNotFound):
        await sb.shell(cwd="missing-dir")
    sh = await sb.shell()
    with pytest.raises(errors.InvalidRequest):
        await sh.exec("true", max_output=-1)
