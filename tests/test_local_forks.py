"""The local fork server (``LocalConfig(fork=True)``, the default): executors forked from one zygote.

Checked from the host, with and without bubblewrap: every executor is a
child of one zygote process (not a fresh interpreter); the zygote's death
loses no running sandbox and the next start gets a new one; a forked
executor's exit status still reaches the client. Under bubblewrap, what a
fork of a host process could leak into the sandbox does not: the executor
is in the sandbox's pid namespace and root, runs as its uid with no
capability and no_new_privs, and its /proc files (its host interpreter,
environment, memory, descriptors) are closed to the sandbox's code.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import orchard
from orchard import errors
from support import WAIT, eventually, host_pid_alive, host_processes, proc_stat

pytestmark = [pytest.mark.executor, pytest.mark.filterwarnings("ignore::orchard.errors.UnisolatedWarning")]


def parent(pid: int) -> int:
    stat = proc_stat(pid)
    assert stat is not None, f"no process {pid}"
    return int(stat[1])


def executors(directory: Path) -> list[int]:
    """Host pids of the forked executors whose command line names ``directory``."""
    needle = str(directory).encode()
    return [pid for pid, _, argv in host_processes() if argv[0] == b"orchard-executor" and needle in b" ".join(argv)]


def zygotes_of(pid: int) -> list[int]:
    """The zygote processes that are children of ``pid``."""
    return [p for p, ppid, argv in host_processes() if ppid == pid and b"orchard_executor.zygote" in b" ".join(argv)]


@pytest.fixture(params=["none", "bwrap"])
async def fork_client(request: pytest.FixtureRequest, local_root: Path) -> AsyncIterator[orchard.Client]:
    async with orchard.Client(orchard.LocalConfig(root=str(local_root), isolation=request.param)) as client:
        yield client


async def test_every_executor_is_a_fork_of_one_zygote(fork_client: orchard.Client, local_root: Path) -> None:
    async with fork_client.sandbox() as a, fork_client.sandbox() as b, fork_client.sandbox() as c:
        for sb in (a, b, c):
            assert (await sb.exec("echo ok")).stdout == "ok\n"
        (zygote,) = zygotes_of(os.getpid())
        pids = executors(local_root)
        assert len(pids) == 3
        assert {parent(pid) for pid in pids} == {zygote}
        # The zygote imported the executor once; the forks did not start interpreters of their own.
        assert all(os.readlink(f"/proc/{pid}/exe") == os.readlink(f"/proc/{zygote}/exe") for pid in pids)
    await eventually(lambda: executors(local_root) == [], what="the executors exit with their sandboxes")
    await fork_client.aclose()
    await eventually(lambda: zygotes_of(os.getpid()) == [], what="the zygote exits with the client")


async def test_a_fresh_interpreter_per_sandbox_without_fork(local_root: Path) -> None:
    config = orchard.LocalConfig(root=str(local_root), isolation="bwrap", fork=False)
    async with orchard.Client(config) as client, client.sandbox() as sb:
        assert (await sb.exec("echo ok")).stdout == "ok\n"
        assert zygotes_of(os.getpid()) == []
        assert executors(local_root) == []


async def test_a_dead_zygote_loses_no_sandbox_and_is_replaced(fork_client: orchard.Client, local_root: Path) -> None:
    async with fork_client.sandbox() as before:
        (zygote,) = zygotes_of(os.getpid())
        os.kill(zygote, signal.SIGKILL)
        await eventually(lambda: not host_pid_alive(zygote), what="the zygote dead")
        assert (await before.exec("echo still")).stdout == "still\n"
        async with fork_client.sandbox() as after:
            assert (await after.exec("echo new")).stdout == "new\n"
            (replacement,) = zygotes_of(os.getpid())
            assert replacement != zygote
        # The executor the dead zygote forked: its exit is still seen (its status is not).
        (orphan,) = executors(local_root)
        os.kill(orphan, signal.SIGKILL)
        with pytest.raises(errors.SandboxLost) as info:
            await asyncio.wait_for(before.exec("true"), WAIT)
        assert info.value.reason == "exited(-1)"


async def test_the_status_of_a_forked_executor_reaches_the_client(
    fork_client: orchard.Client, local_root: Path
) -> None:
    async with fork_client.sandbox() as sb:
        (pid,) = executors(local_root)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(errors.SandboxLost) as info:
            await sb.exec("true")
        assert info.value.reason == f"exited({-signal.SIGKILL})"


async def test_fifty_forked_sandboxes_at_once(fork_client: orchard.Client) -> None:
    sandboxes = await asyncio.gather(*(fork_client.create() for _ in range(50)))
    try:
        outs = await asyncio.gather(*(sb.exec("readlink /proc/self/ns/pid; pwd") for sb in sandboxes))
        assert all(r.ok for r in outs)
        assert len({r.stdout for r in outs}) == 50  # each its own directory (and, isolated, pid namespace)
    finally:
        await asyncio.gather(*(sb.aclose() for sb in sandboxes))


PROBE = """
for f in exe cwd root; do readlink /proc/$E/$f >/dev/null 2>&1 && echo "open $f"; done
for f in environ maps; do head -c1 /proc/$E/$f >/dev/null 2>&1 && echo "open $f"; done
ls /proc/$E/fd >/dev/null 2>&1 && echo "open fd"
(exec 3</proc/$E/mem) 2>/dev/null && echo "open mem"
grep -E '^(Uid|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs):' /proc/$E/status
"""


async def test_a_forked_executor_leaks_nothing_of_the_host_into_the_sandbox(local_root: Path, tmp_path: Path) -> None:
    marker = tmp_path / "host-only.txt"
    marker.write_text("the host's")
    async with (
        orchard.Client(orchard.LocalConfig(root=str(local_root), isolation="bwrap")) as client,
        client.sandbox() as sb,
    ):
        # The executor as the sandbox sees it, the parent of its commands: in its pid namespace.
        executor = int((await sb.exec("echo $PPID")).stdout)
        assert executor == (await sb.info()).pid
        assert executor > 1
        r = await sb.exec(PROBE, env={"E": str(executor)})
        lines = r.stdout.splitlines()
        # Not dumpable: the sandbox's uid (the executor's too) opens none of its /proc files.
        assert not [line for line in lines if line.startswith("open ")], r.stdout
        status = {k: v.split() for k, v in (line.split(":", 1) for line in lines)}
        uid = "65534" if os.getuid() == 0 else str(os.getuid())
        assert status["Uid"] == [uid] * 4
        for cap in ("CapPrm", "CapEff", "CapBnd", "CapAmb"):
            assert int(status[cap][0], 16) == 0, (cap, status[cap])
        assert status["NoNewPrivs"] == ["1"]
        # Its root is the sandbox's: a host file is not there for it to read.
        with pytest.raises(errors.PathNotFound):
            await sb.read_file(str(marker))
        assert not (await sb.exec(["test", "-e", str(marker)])).ok


async def test_the_placeholder_first_process_cannot_be_killed_from_inside(local_root: Path) -> None:
    async with (
        orchard.Client(orchard.LocalConfig(root=str(local_root), isolation="bwrap")) as client,
        client.sandbox() as sb,
    ):
        r = await sb.exec("kill -9 1; kill -TERM 1; sleep 0.2; cat /proc/1/comm")
        assert r.stdout.strip().endswith("cat"), r.stdout
        assert (await sb.exec("echo alive")).stdout == "alive\n"


async def test_the_zygote_answers_malformed_requests_with_an_error_and_keeps_serving() -> None:
    """Requests that are not JSON, name an unknown namespace or bring the wrong number of fds: each an error reply."""
    from orchard._backends._forks import LAUNCH
    from orchard._backends.local import _import_paths

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    zygote = subprocess.Popen(
        [sys.executable, "-I", "-c", LAUNCH.format(paths=_import_paths())], stdin=theirs, stderr=subprocess.DEVNULL
    )
    theirs.close()
    ours.settimeout(WAIT)
    try:
        pipes = [fd for _ in range(2) for fd in os.pipe()]
        request = {"argv": [], "env": {}, "cwd": "/", "hold": False}
        for message, fds in [
            (b"not json", pipes[:3]),
            (json.dumps(request | {"namespaces": ["bogus"]}).encode(), pipes[:4]),
            (json.dumps(request | {"namespaces": []}).encode(), pipes[:2]),
        ]:
            socket.send_fds(ours, [message], fds)
            reply, got, _, _ = socket.recv_fds(ours, 65536, 4)
            assert got == []
            assert "error" in json.loads(reply), reply
        assert zygote.poll() is None
    finally:
        ours.close()  # the zygote's cue to exit
        assert zygote.wait(WAIT) == 0
        for fd in pipes:
            os.close(fd)


def test_an_unisolated_fork_that_cannot_start_exits_with_its_reason_and_the_zygote_serves_on() -> None:
    """Forked once, with no middle process to fail first: its error goes to its stderr and its exit status."""
    from orchard._backends._forks import LAUNCH
    from orchard._backends.local import _import_paths

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    zygote = subprocess.Popen(
        [sys.executable, "-I", "-c", LAUNCH.format(paths=_import_paths())], stdin=theirs, stderr=subprocess.DEVNULL
    )
    theirs.close()
    ours.settimeout(WAIT)
    stdin_r, stdin_w = os.pipe()
    err_r, err_w = os.pipe()
    ready_r, ready_w = os.pipe()
    try:
        request = {"argv": [], "env": {}, "cwd": "/nonexistent/orchard-cwd", "hold": False, "namespaces": []}
        socket.send_fds(ours, [json.dumps(request).encode()], [stdin_r, err_w, ready_w])
        for fd in (stdin_r, err_w, ready_w):
            os.close(fd)
        reply, got, _, _ = socket.recv_fds(ours, 65536, 4)
        pid = json.loads(reply)["pid"]
        for fd in got:
            os.close(fd)
        exited, _, _, _ = socket.recv_fds(ours, 65536, 4)
        assert json.loads(exited) == {"exit": pid, "status": 1}
        with os.fdopen(err_r, "rb") as err:
            assert b"FileNotFoundError: [Errno 2] No such file or directory: '/nonexistent/orchard-cwd'" in err.read()
        with os.fdopen(ready_r, "rb") as ready:
            assert ready.read() == b""  # never ready
        # The next request is answered: the failed fork did not take the zygote's loop with it.
        socket.send_fds(ours, [b"not json"], [])
        assert "error" in json.loads(socket.recv_fds(ours, 65536, 4)[0])
        assert zygote.poll() is None
    finally:
        ours.close()
        assert zygote.wait(WAIT) == 0
        os.close(stdin_w)
