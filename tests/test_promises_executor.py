"""README promises about the executor that no other module proved: each test names its sentence.

They run on the generic ``sb`` fixture (the local backend, unisolated and
under bubblewrap), against the real executor process.
"""

from __future__ import annotations

import asyncio
import io
import os
import subprocess
import sys
import tarfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

import orchard
from orchard import errors
from orchard._snapshot import Part, Snapshot
from orchard_executor.protocol import ExecRequest, ExecResult
from support import eventually, workdir_executors

pytestmark = [pytest.mark.executor, pytest.mark.filterwarnings("ignore::orchard.errors.UnisolatedWarning")]

MIB = 1024 * 1024
#: More than the executor's cache of finished exec results (DEDUP_BYTES, 64 MiB) holds.
FLOOD_RESULTS, FLOOD_MIB = 9, 8
SandboxFactory = Callable[..., Awaitable[orchard.Sandbox]]
APPEND = "echo run >> runs.log; cat /proc/sys/kernel/random/uuid"


async def run_lines(sb: orchard.Sandbox, name: str) -> int:
    return len((await sb.read_file(name)).splitlines())


async def test_finished_results_are_forgotten_past_the_cache_bound_while_an_older_exec_runs(
    sb: orchard.Sandbox,
) -> None:
    """README: "the executor's memory stays bounded whatever the command prints".

    An exec still running used to stop the eviction of every result finished
    after it: a long command in flight, and the cache of results kept for
    retries grew without bound. Here the oldest finished result must be
    forgotten (its request id runs again) while the older run, still going, is
    still deduplicated (its request id joins the run, which runs once).
    """
    long_req = ExecRequest(
        cmd="echo run >> long.log; while [ ! -e go ]; do sleep 0.02; done; echo done",
        request_id=uuid.uuid4().hex,
        timeout=60,
    )
    long_run = asyncio.create_task(sb._rpc.call("POST", "/v1/exec", ExecResult, long_req))
    try:
        await eventually(lambda: sb.exists("long.log"), what="the long exec started")
        first = ExecRequest(cmd=APPEND, request_id=uuid.uuid4().hex)
        assert (await sb._rpc.call("POST", "/v1/exec", ExecResult, first)).ok
        for _ in range(FLOOD_RESULTS):
            flood = ExecRequest(cmd=f"head -c {FLOOD_MIB * MIB} /dev/zero", request_id=uuid.uuid4().hex)
            result = await sb._rpc.call("POST", "/v1/exec", ExecResult, flood)
            assert (result.stdout_total, result.stdout_truncated) == (FLOOD_MIB * MIB, False)

        assert not long_run.done()
        assert (await sb._rpc.call("POST", "/v1/exec", ExecResult, first)).ok
        assert await run_lines(sb, "runs.log") == 2  # forgotten: the retry ran it again

        joined = asyncio.create_task(sb._rpc.call("POST", "/v1/exec", ExecResult, long_req))
        await sb.write_file("go", b"")
        results = await asyncio.wait_for(asyncio.gather(long_run, joined), 30)
        assert [r.stdout for r in results] == ["done\n", "done\n"]
        assert await run_lines(sb, "long.log") == 1  # the run still going was remembered
    finally:
        long_run.cancel()
        await asyncio.gather(long_run, return_exceptions=True)


async def test_an_exec_keeps_10_mib_per_stream_by_default(sb: orchard.Sandbox) -> None:
    """README: "Output beyond `max_output` per stream (default 10 MiB) keeps its first and last halves"."""
    whole = await sb.exec(["head", "-c", str(10 * MIB), "/dev/zero"])
    assert (whole.stdout_total, whole.stdout_truncated, len(whole.stdout_bytes)) == (10 * MIB, False, 10 * MIB)
    over = await sb.exec(f"printf H; head -c {10 * MIB - 1} /dev/zero; printf T")
    assert (over.stdout_total, over.stdout_truncated, len(over.stdout_bytes)) == (10 * MIB + 1, True, 10 * MIB)
    assert over.stdout_bytes[:1] == b"H"
    assert over.stdout_bytes[-1:] == b"T"


async def test_a_background_process_keeps_256_mib_per_stream_by_default(sb: orchard.Sandbox) -> None:
    """README: a process's output is kept "at most `max_output` bytes per stream (default 256 MiB)"."""
    p = await sb.start_process(["head", "-c", str(256 * MIB + 1), "/dev/zero"])
    st = await p.wait(timeout=60)
    assert (st.stdout_size, st.stdout_total, st.stdout_truncated) == (256 * MIB, 256 * MIB + 1, True)


async def test_a_command_given_a_timeout_may_run_past_read_timeout(local_root: Path) -> None:
    """README: "a command with a `timeout` gets that plus `read_timeout`"; one without a deadline is probed instead.

    With ``read_timeout=1``, a two-second command given ``timeout=30`` ends with
    its result, not with ``SandboxTimeout``.
    """
    config = orchard.LocalConfig(root=str(local_root), isolation="none")
    client = orchard.Client(config, read_timeout=1.0, liveness_timeout=1.0)
    async with client, client.sandbox() as sb:
        r = await sb.exec("sleep 2; echo done", timeout=30)
        assert (r.exit_code, r.timed_out, r.stdout) == (0, False, "done\n")


async def test_max_concurrent_starts_bounds_the_sandboxes_starting_at_once(
    local_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README: the Client "bounds how many sandboxes start at once (`max_concurrent_starts`)".

    Six creates at once with a bound of two. Each start is held where its
    executor runs but has not said it is ready, until two are held: no third
    start begins meanwhile, and at no point are more than two under way.
    """
    from orchard._backends.local import LocalBackend

    read_ready = LocalBackend._read_ready
    under_way: list[int] = [0, 0]  # now, most ever
    go = asyncio.Event()

    async def held(self: LocalBackend, *args: Any) -> int:
        under_way[0] += 1
        under_way[1] = max(under_way)
        try:
            await go.wait()
            return await read_ready(self, *args)
        finally:
            under_way[0] -= 1

    monkeypatch.setattr(LocalBackend, "_read_ready", held)
    config = orchard.LocalConfig(root=str(local_root), isolation="none")
    async with orchard.Client(config, max_concurrent_starts=2) as client:
        creating = asyncio.gather(*(client.create() for _ in range(6)))
        await eventually(lambda: under_way[0] >= 2, what="two starts under way")
        await asyncio.sleep(0.5)  # time for four more executors to be spawned, were they let
        assert under_way == [2, 2]
        go.set()
        sandboxes = await asyncio.wait_for(creating, 60)
        try:
            assert under_way == [0, 2]
            assert sum(sb.timings["queued"] > 0.5 for sb in sandboxes) == 4
        finally:
            await asyncio.gather(*(sb.aclose() for sb in sandboxes))


async def test_a_pooled_sandbox_is_replaced_at_half_its_ttl(local_root: Path) -> None:
    """README: "a pooled sandbox's `ttl` and `idle_timeout` run from its start, so pooled ones are replaced at half of either"."""
    config = orchard.LocalConfig(root=str(local_root), isolation="none")
    client = orchard.Client(config, warm={"local": {"size": 1, "ttl": 4}})
    async with client:
        await client.wait_warm(timeout=60)
        [first] = workdir_executors(local_root)
        # Past half the ttl (2 s) the pooled one goes and a fresh one takes its place,
        # long before the ttl would end it.
        await eventually(lambda: first not in workdir_executors(local_root), timeout=30, what="the first one retired")
        await client.wait_warm(timeout=60)
        assert client.warm_status()["local"]["starts"] >= 2
        async with client.sandbox(ttl=4) as sb:
            assert "claim" in sb.timings
            assert (await sb.info()).pid != first


HOLD = """
import socket
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen()
with open("port.txt", "w") as f:
    f.write(str(server.getsockname()[1]))
held = []
while True:
    held.append(server.accept()[0])
"""


async def test_an_open_tunnel_counts_as_activity_for_idle_timeout(sandbox: SandboxFactory) -> None:
    """README (forward): "an open tunnel counts as activity for `idle_timeout`".

    With ``idle_timeout=1`` and nothing but an open forwarded connection for
    three seconds, the executor is still there to run the next command
    (tests/test_local_backend.py shows it exits once idle without one).
    """
    sb = await sandbox(idle_timeout=1)
    await sb.start_process(["python3", "-c", HOLD])
    await eventually(lambda: sb.exists("port.txt"), what="the server listens")
    port = int(await sb.read_file("port.txt"))
    async with sb.forward(port, wait=10) as url:
        _, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
        try:
            await asyncio.sleep(3)
            assert (await sb.exec(["echo", "alive"])).stdout == "alive\n"
        finally:
            writer.close()


async def test_a_local_sandbox_gets_a_clean_environment(
    sandbox: SandboxFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README (local): "a clean environment (`PATH`, `HOME`, `TMPDIR`, `LANG` plus your `env`)"."""
    monkeypatch.setenv("ORCHARD_CLIENT_SECRET", "not-for-the-sandbox")
    sb = await sandbox(env={"MINE": "1"})
    names = {line.split("=", 1)[0]: line.split("=", 1)[1] for line in (await sb.exec(["env"])).stdout.splitlines()}
    assert set(names) == {"PATH", "HOME", "TMPDIR", "LANG", "MINE"}
    assert names["HOME"] == (await sb.info()).cwd


@pytest.fixture
async def bwrap_client(bwrap_ready: None, local_root: Path) -> AsyncIterator[orchard.Client]:
    """A local Client under bubblewrap, whose sandboxes see the host's /usr read-only."""
    async with orchard.Client(orchard.LocalConfig(root=str(local_root), isolation="bwrap")) as client:
        yield client


def one_file_tar(name: str, data: bytes) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


async def test_a_restore_that_cannot_write_names_the_path_and_deletes_the_fork(
    bwrap_client: orchard.Client, local_root: Path
) -> None:
    """README: "a restore that cannot write a path (`PermissionDenied` for a read-only one) names it and deletes the fork"."""
    async with bwrap_client.sandbox() as base:
        data = one_file_tar("f.txt", b"x")
        read_only = "/usr/share/orchard-restore-here"  # the host's /usr, bound read-only
        snap = Snapshot((Part(read_only, 0, len(data)),), (await base.info()).cwd, len(data), data=data)
        with pytest.raises(errors.PermissionDenied) as info:
            await base.restore(snap)
        assert info.value.path == read_only
        before = workdir_executors(local_root)
        assert len(before) == 1
        with pytest.raises(errors.PermissionDenied) as info:
            await bwrap_client.create(restore=snap)
        assert info.value.path == read_only
        assert read_only in str(info.value)
        # The fork is gone: only the base's directory and executor are left.
        assert [d.name.startswith(base.id) for d in local_root.iterdir()] == [True]
        assert workdir_executors(local_root) == before


async def test_a_write_that_fills_the_disk_is_no_space_and_leaves_the_old_file(bwrap_client: orchard.Client) -> None:
    """README: "a failed write (full disk, broken connection) leaves the old file untouched"; errors name `NoSpace`.

    The disk is the sandbox's own 1 MiB /dev/shm; the 2 MiB write cannot fit
    beside the file it would replace.
    """
    async with bwrap_client.sandbox(shm="1Mi") as sb:
        await sb.write_file("/dev/shm/kept", b"the old content")
        with pytest.raises(errors.NoSpace):
            await sb.write_file("/dev/shm/kept", bytes(2 * MIB))
        assert await sb.read_file("/dev/shm/kept") == b"the old content"
        assert [e.name for e in await sb.list_dir("/dev/shm")] == ["kept"]  # no temp file left


def test_the_demo_without_a_working_bubblewrap_runs_unisolated_and_says_so(tmp_path: Path) -> None:
    """README: "with bubblewrap installed its sandboxes are isolated; without it they run unisolated, and it says so"."""
    fake = tmp_path / "bwrap"  # present, but refused its namespaces (as in an unprivileged container)
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:/usr/bin:/bin"}
    run = subprocess.run(
        [sys.executable, "-m", "orchard", "demo", "-n", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert run.stderr.splitlines()[1] == (
        "orchard demo: NOTICE: bubblewrap is not available here, so these sandboxes run UNISOLATED on the host "
        "(fine for the demo's own code; install bubblewrap before running untrusted code)"
    )
    assert "sandboxes: 2/2 succeeded, 0 failed" in run.stdout


async def test_a_reverse_port_the_executor_may_not_bind_is_permission_denied(bwrap_client: orchard.Client) -> None:
    """README (reverse_forward): a port "the executor may not bind (below 1024 without the privilege) a `PermissionDenied`".

    Under bubblewrap the executor runs without capabilities, so port 80 is refused, naming the fix.
    """
    async with bwrap_client.sandbox() as sb:
        with pytest.raises(errors.PermissionDenied, match="remote_port") as info:
            async with sb.reverse_forward(80, "http://127.0.0.1:9"):
                pass
        assert info.value.sandbox_id == sb.id
        async with sb.reverse_forward(0, "http://127.0.0.1:9") as port:
            assert port >= 1024


async def test_the_sandbox_shortcut_starts_one_and_deletes_it(local_root: Path) -> None:
    """README: "`orchard.sandbox()` is the shortcut for scripts that need only one"; deleted when the block exits."""
    config = orchard.LocalConfig(root=str(local_root), isolation="none")
    async with orchard.sandbox(backend=config, env={"WHO": "shortcut"}) as sb:
        assert (await sb.exec('echo "$WHO"')).stdout == "shortcut\n"
        assert len(workdir_executors(local_root)) == 1
    assert workdir_executors(local_root) == []
    assert list(local_root.iterdir()) == []
    with pytest.raises(errors.SandboxClosed):
        await sb.exec(["true"])
