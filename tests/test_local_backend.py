"""The local backend specifically: host pids, sandbox directories, leaks, executor memory.

The executor and everything it runs are processes on this host, so these
tests look at them directly (``/proc``, ``os.kill``) rather than through the
sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import secrets
import signal
import sys
import time
from pathlib import Path

import pytest

import orchard
from orchard import errors
from support import (
    WAIT,
    agen,
    cancel_twice,
    eventually,
    host_pid_alive,
    host_processes,
    pattern_chunks,
    proc_stat,
    read_pid,
)

pytestmark = [
    pytest.mark.executor,
    # These tests look at host pids and directories, so they run unisolated on purpose.
    pytest.mark.filterwarnings("ignore::orchard.errors.UnisolatedWarning"),
]

MB = 1000 * 1000


def executors_under(root: Path) -> list[int]:
    """Live processes whose command line mentions ``root``: executors of sandboxes there."""
    found = []
    needle = str(root).encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if needle in cmdline and host_pid_alive(int(entry)):
            found.append(int(entry))
    return found


def leftovers(root: Path) -> list[str]:
    return sorted(os.listdir(root)) if root.exists() else []


def vm_hwm_kib(pid: int) -> int:
    """Peak resident memory of a process, in KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmHWM for {pid}")


async def sandbox_dir(sb: orchard.Sandbox) -> Path:
    return Path((await sb.info()).cwd).parent


async def test_sandboxes_live_under_the_configured_root(local_client: orchard.Client, local_root: Path) -> None:
    async with local_client.sandbox() as sb:
        info = await sb.info()
        directory = await sandbox_dir(sb)
        assert directory.parent == local_root
        assert directory.name.startswith(sb.id)
        assert info.cwd == str(directory / "work")
        assert executors_under(local_root) == [info.pid]
        assert host_pid_alive(info.pid)
        # Commands run as children of the executor, on this host.
        r = await sb.exec("echo $PPID")
        assert int(r.stdout) == info.pid
        assert (await sb.exec(["sh", "-c", 'echo "$HOME"'])).stdout.strip() == info.cwd


async def test_an_absolute_workdir_is_used(local_client: orchard.Client, tmp_path: Path) -> None:
    workdir = tmp_path / "my" / "workdir"
    async with local_client.sandbox(workdir=str(workdir)) as sb:
        assert (await sb.info()).cwd == str(workdir)
        await sb.write_file("here.txt", "x")
    assert (workdir / "here.txt").read_text() == "x"  # a workdir of the user's is not deleted


async def test_a_relative_workdir_is_a_config_error(local_client: orchard.Client, local_root: Path) -> None:
    with pytest.raises(errors.ConfigError, match="workdir"):
        await local_client.create(workdir="relative/dir")
    assert leftovers(local_root) == []


@pytest.mark.parametrize(("python", "reason"), [("/no/such/python", "spawn"), ("/bin/false", "exited")])
async def test_an_executor_that_cannot_start_is_a_start_error(local_root: Path, python: str, reason: str) -> None:
    async with orchard.Client(orchard.LocalConfig(root=str(local_root), python=python, isolation="none")) as client:
        with pytest.raises(errors.SandboxStartError) as info:
            await client.create()
    assert info.value.reason == reason
    assert info.value.sandbox_id
    assert leftovers(local_root) == []


async def test_leaving_the_block_kills_everything_and_removes_the_directory(
    local_client: orchard.Client, local_root: Path
) -> None:
    async with local_client.sandbox() as sb:
        executor = (await sb.info()).pid
        directory = await sandbox_dir(sb)
        background = await sb.start_process("sleep 300 & echo $! > bg.pid; wait")
        grandchild = await read_pid(sb, "bg.pid")
        shell = await sb.shell()
        await shell.exec("cd /tmp")
        assert all(host_pid_alive(p) for p in (executor, background.pid, grandchild))
        assert directory.is_dir()
    assert not host_pid_alive(executor)
    assert not directory.exists()
    await eventually(lambda: not host_pid_alive(background.pid), what="background process killed")
    await eventually(lambda: not host_pid_alive(grandchild), what="background grandchild killed")
    assert leftovers(local_root) == []


async def test_an_exception_in_the_block_still_deletes_the_sandbox(
    local_client: orchard.Client, local_root: Path
) -> None:
    class Boom(Exception):
        pass

    pids: list[int] = []

    async def fail_inside() -> None:
        async with local_client.sandbox() as sb:
            pids.append((await sb.info()).pid)
            raise Boom

    with pytest.raises(Boom):
        await fail_inside()
    assert pids
    assert not host_pid_alive(pids[0])
    assert leftovers(local_root) == []


async def test_closing_the_client_deletes_sandboxes_left_open(local_root: Path) -> None:
    client = orchard.Client(orchard.LocalConfig(root=str(local_root), isolation="none"))
    sandboxes = [await client.create() for _ in range(3)]
    pids = [(await sb.info()).pid for sb in sandboxes]
    assert len(leftovers(local_root)) == 3
    await client.aclose()
    assert not any(host_pid_alive(p) for p in pids)
    assert leftovers(local_root) == []
    with pytest.raises(errors.SandboxClosed):
        await client.create()


CLIENT_SCRIPT = """
import asyncio, sys
import orchard

async def main():
    client = orchard.Client(orchard.LocalConfig(root=sys.argv[1], isolation="none"))
    sb = await client.create()
    info = await sb.info()
    p = await sb.start_process("sleep 300")
    print(info.pid, info.cwd, p.pid, flush=True)
    await asyncio.sleep(300)

asyncio.run(main())
"""


async def test_a_client_killed_with_sigkill_leaks_nothing(local_root: Path) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLIENT_SCRIPT, str(local_root), stdout=asyncio.subprocess.PIPE
    )
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), WAIT)  # type: ignore[union-attr]
        executor, cwd, background = line.decode().split()
        pids = [int(executor), int(background)]
        assert all(host_pid_alive(p) for p in pids)
        assert Path(cwd).is_dir()
    finally:
        proc.kill()
        await proc.wait()
    await eventually(lambda: not any(host_pid_alive(p) for p in pids), what="executor and its command exit")
    await eventually(lambda: not Path(cwd).parent.exists(), what="the orphaned sandbox directory is removed")
    assert leftovers(local_root) == []
    assert executors_under(local_root) == []


async def test_an_idle_executor_exits_and_the_next_call_says_so(local_client: orchard.Client, local_root: Path) -> None:
    async with local_client.sandbox(idle_timeout=1) as sb:
        # No requests from here on (a request would restart the idle clock): watch from the host.
        await eventually(lambda: executors_under(local_root) == [], what="the idle executor exits")
        with pytest.raises(errors.SandboxLost) as info:
            await sb.exec(["true"])
    assert info.value.sandbox_id == sb.id
    assert info.value.reason == "exited(0)"
    assert "idle" in str(info.value)
    assert isinstance(info.value, ConnectionError)
    assert leftovers(local_root) == []


async def test_a_busy_executor_is_not_idle(local_client: orchard.Client) -> None:
    async with local_client.sandbox(idle_timeout=2) as sb:
        # One request that lasts longer than the idle timeout keeps it alive.
        r = await sb.exec(["sleep", "4"])
        assert r.ok
        assert (await sb.exec(["true"])).ok


async def test_a_killed_executor_raises_sandbox_lost_with_a_reason(local_client: orchard.Client) -> None:
    async with local_client.sandbox() as sb:
        pid = (await sb.info()).pid
        os.kill(pid, signal.SIGKILL)
        await eventually(lambda: not host_pid_alive(pid), what="executor dead")
        with pytest.raises(errors.SandboxLost) as info:
            await sb.exec(["true"])
        assert info.value.reason == f"exited({-signal.SIGKILL})"
        assert info.value.sandbox_id == sb.id
        with pytest.raises(errors.SandboxLost):
            await sb.read_file("x")
        with pytest.raises(errors.SandboxLost):
            async for _ in sb.exec_stream("true"):
                pass


async def test_an_executor_dying_mid_request_raises_sandbox_lost(local_client: orchard.Client) -> None:
    async with local_client.sandbox() as sb:
        pid = (await sb.info()).pid
        with pytest.raises(errors.SandboxLost):
            await sb.exec(f"kill -9 {pid}; sleep 1")


async def test_an_exec_in_flight_when_the_executor_stops_is_lost_not_a_result(local_client: orchard.Client) -> None:
    # As when a pod is deleted or evicted: SIGTERM to the executor, which kills its commands on the way out.
    async with local_client.sandbox() as sb:
        pid = (await sb.info()).pid
        running = asyncio.create_task(sb.exec(["sleep", "120"]))
        await asyncio.sleep(0.5)
        os.kill(pid, signal.SIGTERM)
        with pytest.raises(errors.SandboxLost):
            await asyncio.wait_for(running, WAIT)


async def test_ttl_ends_the_sandbox(local_client: orchard.Client, local_root: Path) -> None:
    async with local_client.sandbox(ttl=1) as sb:
        lost: list[errors.SandboxLost] = []

        async def ended() -> bool:
            try:
                await sb.exec(["true"])  # activity does not extend a ttl
            except errors.SandboxLost as exc:
                lost.append(exc)
                return True
            return False

        await eventually(ended, what="the sandbox ends at its ttl")
        assert lost[0].reason == "ttl"
        await eventually(lambda: executors_under(local_root) == [], what="the executor has exited")


@pytest.mark.parametrize("isolation", ["none", "bwrap"])
async def test_ttl_ends_a_command_in_flight(local_root: Path, isolation: str) -> None:
    # README: ttl ends the sandbox "whatever it is doing".
    argv = ["sleep", f"300.{secrets.randbelow(10**6):06d}"]  # found on the host by its argv, in any pid namespace
    async with (
        orchard.Client(orchard.LocalConfig(root=str(local_root), isolation=isolation)) as client,
        client.sandbox(ttl=1) as sb,
    ):
        t0 = time.monotonic()
        command = asyncio.create_task(sb.exec(argv))

        def running() -> bool:
            return any(seen == [a.encode() for a in argv] for _, _, seen in host_processes())

        await eventually(running, timeout=1, what="the command runs")
        with pytest.raises(errors.SandboxLost) as info:
            await asyncio.wait_for(command, 10)
        assert info.value.reason == "ttl"
        assert time.monotonic() - t0 < 4
        assert not running()


async def test_a_timeout_kills_grandchildren_seen_from_the_host(local_client: orchard.Client) -> None:
    async with local_client.sandbox() as sb:
        run = asyncio.create_task(
            sb.exec(
                "echo before; echo $$ > main.pid;"
                " sleep 300 & echo $! > plain.pid;"
                " setsid sh -c 'echo $$ > escaped.pid; exec sleep 300' &"
                " while [ ! -s escaped.pid ]; do sleep 0.01; done; wait",
                timeout=3,
            )
        )
        main, plain, escaped = [await read_pid(sb, f"{n}.pid") for n in ("main", "plain", "escaped")]
        # While it runs: the plain grandchild is in the command's process group
        # and session, the escaped one in a session of its own.
        stats = {pid: proc_stat(pid) for pid in (main, plain, escaped)}
        if not run.done():
            assert all(stats.values()), stats
            session = {pid: int(st[3]) for pid, st in stats.items() if st}
            assert session[main] == session[plain] == main
            assert session[escaped] == escaped
        r = await run
        assert r.timed_out
        assert r.stdout == "before\n"
        for pid in (plain, escaped):
            await eventually(lambda pid=pid: not host_pid_alive(pid), what=f"grandchild {pid} killed")
            await eventually(lambda pid=pid: proc_stat(pid) is None, what=f"grandchild {pid} reaped")
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)


async def test_200_mb_of_output_is_capped_with_bounded_executor_memory(local_client: orchard.Client) -> None:
    async with local_client.sandbox() as sb:
        pid = (await sb.info()).pid
        cap = 1024 * 1024
        # Warm up the code paths first so that only the big run is measured.
        await sb.exec(["head", "-c", str(4 * cap), "/dev/zero"], max_output=cap)
        before = vm_hwm_kib(pid)
        r = await sb.exec("printf HEAD; head -c 200000000 /dev/zero; printf TAIL", max_output=cap)
        grown_mb = (vm_hwm_kib(pid) - before) * 1024 / MB
        assert r.exit_code == 0
        assert r.stdout_truncated
        assert r.stdout_total == 200 * MB + 8
        assert len(r.stdout_bytes) == cap
        half = cap // 2
        assert r.stdout_bytes == b"HEAD" + bytes(half - 4) + bytes(half - 4) + b"TAIL"
        assert grown_mb < 60, f"executor peak memory grew by {grown_mb:.0f} MB for 200 MB of output"


async def test_streaming_and_files_keep_executor_memory_bounded(local_client: orchard.Client) -> None:
    async with local_client.sandbox() as sb:
        pid = (await sb.info()).pid
        await sb.write_file("warm", agen(pattern_chunks(8 * MB, MB, seed=3)))
        async for _ in sb.stream_file("warm"):
            pass
        before = vm_hwm_kib(pid)
        total = 0
        async for ev in sb.exec_stream(["head", "-c", str(100 * MB), "/dev/zero"]):
            if isinstance(ev, orchard.OutputEvent):
                total += len(ev.data)
        assert total == 100 * MB
        await sb.write_file("big", agen(pattern_chunks(100 * MB, MB, seed=4)))
        read = 0
        async for chunk in sb.stream_file("big"):
            read += len(chunk)
        assert read == 100 * MB
        grown_mb = (vm_hwm_kib(pid) - before) * 1024 / MB
        assert grown_mb < 60, f"executor peak memory grew by {grown_mb:.0f} MB moving 300 MB"


async def test_fifty_sandboxes_in_parallel_leave_nothing_behind(local_client: orchard.Client, local_root: Path) -> None:
    async def one(i: int) -> tuple[int, Path]:
        async with local_client.sandbox(env={"N": str(i)}) as sb:
            await sb.write_file("in.txt", f"sandbox {i}")
            r = await sb.exec('cat in.txt; printf " %s %s" "$N" "$((N * 2))"')
            assert r.stdout == f"sandbox {i} {i} {i * 2}", r
            p = await sb.start_process(["sleep", "300"])
            assert (await p.status()).running
            info = await sb.info()
            return info.pid, Path(info.cwd).parent

    results = await asyncio.gather(*(one(i) for i in range(50)))
    pids = [pid for pid, _ in results]
    assert len(set(pids)) == 50
    assert len({d for _, d in results}) == 50
    assert not any(host_pid_alive(p) for p in pids)
    assert leftovers(local_root) == []
    await eventually(lambda: executors_under(local_root) == [], what="no processes left under the root")


async def test_tools_on_a_backend_that_cannot_mount_them_is_a_config_error(
    local_client: orchard.Client, local_root: Path
) -> None:
    with pytest.raises(errors.ConfigError, match="local backend cannot mount the harness tools"):
        await local_client.create(tools=["codex"])
    assert not local_client._live
    assert not local_root.exists() or not any(local_root.iterdir())


async def test_a_cancel_during_the_close_waits_for_it(local_client: orchard.Client, local_root: Path) -> None:
    """``Client.sandbox``: a task cancelled while its sandbox closes returns only once the sandbox is gone."""
    closing, gate = asyncio.Event(), asyncio.Event()
    finished: list[bool] = []

    async def use() -> None:
        async with local_client.sandbox() as sb:
            close = sb.aclose

            async def gated_close() -> None:
                closing.set()
                await gate.wait()
                await close()
                finished.append(True)

            sb.aclose = gated_close  # type: ignore[method-assign]

    task = asyncio.create_task(use())
    await closing.wait()
    task.cancel()
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert finished == [True]
    assert executors_under(local_root) == []


@pytest.mark.parametrize("isolation", ["none", "bwrap"])
async def test_a_start_cancelled_twice_still_deletes_what_it_began(
    isolation: str, local_root: Path, request: pytest.FixtureRequest, unretrieved: list[str]
) -> None:
    """A second cancel, landing while the first one's cleanup runs, does not cut that cleanup short."""
    if isolation == "bwrap":
        request.getfixturevalue("bwrap_ready")
    async with orchard.Client(orchard.LocalConfig(root=str(local_root), isolation=isolation)) as client:
        async with client.sandbox() as sb:  # the fork server is up: the starts below are quick
            await sb.exec("true")
        for i in range(60):
            # The first cancel at a different step of the start each time, the second 0 to 1.5 ms later.
            await cancel_twice(asyncio.create_task(client.create()), i / 2000, (i % 4) / 2000)
            assert leftovers(local_root) == [], f"cancelled after {i / 2:g} ms, again {i % 4 / 2:g} ms later"
            # Killed bwraps' namespace inits die with them (--die-with-parent), a moment later; one killed before
            # its setup was done stayed for good.
            await eventually(lambda: executors_under(local_root) == [], what="no processes left under the root")
    gc.collect()
    assert unretrieved == []


async def test_a_start_cancelled_during_its_spawn_leaves_nothing_without_the_fork_server(
    local_root: Path, bwrap_ready: None, unretrieved: list[str]
) -> None:
    """``fork=False``: a cancel while bwrap and the executor are being spawned no longer kills bwrap mid-setup."""
    async with orchard.Client(orchard.LocalConfig(root=str(local_root), isolation="bwrap", fork=False)) as client:
        for i in range(12):
            await cancel_twice(asyncio.create_task(client.create()), i / 1000, 0)
            assert leftovers(local_root) == [], f"cancelled after {i} ms"
            # A killed bwrap before its setup was done left its namespace's first process behind for good.
            await eventually(lambda: executors_under(local_root) == [], what="no processes left under the root")
    gc.collect()
    assert unretrieved == []


@pytest.mark.parametrize("closing", ["sandbox", "client"])
async def test_a_close_cancelled_midway_still_deletes_the_sandbox(local_root: Path, closing: str) -> None:
    """``sb.aclose()`` and ``client.aclose()`` finish before the cancel is raised: nothing is left half closed."""
    async with orchard.Client(orchard.LocalConfig(root=str(local_root), isolation="none")) as client:
        for delay in (0, 0.0005, 0.001, 0.002, 0.005):
            sb = await client.create()
            await sb.exec("true")
            pid = (await sb.info()).pid
            close = asyncio.create_task(sb.aclose() if closing == "sandbox" else client.aclose())
            await asyncio.sleep(delay)
            close.cancel()
            await asyncio.sleep(0)
            close.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await close
            assert leftovers(local_root) == [], f"cancelled {delay * 1000:g} ms into the close"
            assert not host_pid_alive(pid)
            if closing == "client":
                break  # closed for good
