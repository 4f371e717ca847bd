"""Local isolation (``isolation="bwrap"``) against a sandbox that tries to get out.

Each test is an attack tried from inside a sandbox, checked from the host:
host files and sockets, other sandboxes, the client process, root's
privileges, the log the client reads, and processes that outlive a killed
executor. Requires bubblewrap and util-linux's setpriv (the CI image has both).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import warnings
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import orchard
from orchard import errors
from support import eventually, host_pid_alive

pytestmark = pytest.mark.executor


@pytest.fixture
async def bwrap_client(local_root: Path) -> AsyncIterator[orchard.Client]:
    async with orchard.Client(orchard.LocalConfig(root=str(local_root), isolation="bwrap")) as client:
        yield client


def host_pids(needle: bytes) -> list[int]:
    """Live host processes with ``needle`` as a whole argv element."""
    return [pid for pid, argv in host_pids_containing(needle) if needle in argv]


def host_pids_containing(needle: bytes) -> list[tuple[int, list[bytes]]]:
    """Live host processes with an argv element containing ``needle``, and their argv."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if any(needle in arg for arg in argv) and host_pid_alive(int(entry)):
            found.append((int(entry), argv))
    return found


def parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        raw = f.read()
    return int(raw[raw.rfind(b")") + 2 :].split()[1])


async def sandbox_dir(sb: orchard.Sandbox) -> Path:
    return Path((await sb.info()).cwd).parent


CONNECT = """
import socket, sys
family, address = (socket.AF_UNIX, sys.argv[1]) if sys.argv[1].startswith("/") else (
    socket.AF_INET, (sys.argv[1], int(sys.argv[2])))
s = socket.socket(family)
s.settimeout(5)
try:
    s.connect(address)
except OSError as exc:
    print("refused", type(exc).__name__)
else:
    print("CONNECTED")
"""


async def test_host_secrets_are_not_in_the_sandbox(bwrap_client: orchard.Client) -> None:
    name = f"orchard-test-{secrets.token_hex(4)}"
    root_secret = Path("/root") / name
    home = Path("/home") / name
    root_secret.write_text("root secret")
    home.mkdir(parents=True)
    (home / "secret").write_text("home secret")
    try:
        async with bwrap_client.sandbox() as sb:
            r = await sb.exec(["cat", "/etc/shadow"])
            assert r.exit_code != 0, r.stdout
            assert (await sb.exec(["cat", str(root_secret)])).exit_code != 0
            assert (await sb.exec(["cat", str(home / "secret")])).exit_code != 0
            for directory in ("/root", "/home"):
                r = await sb.exec(["ls", "-a", directory])
                assert name not in r.stdout, (directory, r.stdout)
            # /etc is an allowlist: no shadow, no gshadow, no ssh host keys, no sudoers.
            r = await sb.exec("ls -a /etc /etc/ssl")
            for secret in ("shadow", "gshadow", "ssh", "sudoers", "private"):
                assert secret not in r.stdout.split(), r.stdout
    finally:
        root_secret.unlink()
        shutil.rmtree(home)


async def test_host_sockets_and_run_are_not_in_the_sandbox(bwrap_client: orchard.Client) -> None:
    path = Path("/run") / f"orchard-test-{secrets.token_hex(4)}.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen()
    try:
        async with bwrap_client.sandbox() as sb:
            assert (await sb.exec(["python3", "-c", CONNECT, str(path)])).stdout.startswith("refused")
            for gone in ("/run", "/var/run", "/var/run/docker.sock", "/run/docker.sock"):
                assert (await sb.exec(["test", "-e", gone])).exit_code == 1, gone
    finally:
        server.close()
        path.unlink()


async def test_no_network_but_loopback_and_no_other_sandbox(bwrap_client: orchard.Client) -> None:
    connections = 0

    def count(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        writer.close()

    server = await asyncio.start_server(count, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with bwrap_client.sandbox() as a, bwrap_client.sandbox() as b:
            r = await a.exec("cat /proc/net/dev")
            interfaces = [line.split(":")[0].strip() for line in r.stdout.splitlines()[2:]]
            assert interfaces == ["lo"], r.stdout
            r = await a.exec(["python3", "-c", CONNECT, "127.0.0.1", str(port)])
            assert r.stdout.startswith("refused"), r.stdout
            # The other sandbox's executor: its socket is not in this sandbox's file system.
            b_dir = await sandbox_dir(b)
            r = await a.exec(["sh", "-c", f"ls -a {b_dir} {b_dir.parent}"])
            assert b_dir.name not in r.stdout, r.stdout
            b_sockets = [str(p) for p in b_dir.rglob("*") if p.is_socket()]
            for path in b_sockets:
                assert (await a.exec(["python3", "-c", CONNECT, path])).stdout.startswith("refused"), path
            assert (await b.exec(["true"])).ok
        assert connections == 0
    finally:
        server.close()
        await server.wait_closed()


async def test_the_client_process_is_out_of_reach(
    bwrap_client: orchard.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = f"orchard-marker-{secrets.token_hex(8)}"
    monkeypatch.setenv("ORCHARD_TEST_MARKER", marker)
    async with bwrap_client.sandbox() as sb:
        r = await sb.exec(f"cat /proc/{os.getpid()}/environ; cat /proc/*/environ; grep -l {marker} /proc/*/environ")
        assert marker not in r.stdout
        r = await sb.exec("ls /proc | grep -c '^[0-9]'")
        assert int(r.stdout) < 10, "the sandbox sees more than its own few processes"


async def test_the_sandbox_is_not_host_root(bwrap_client: orchard.Client) -> None:
    if os.getuid() != 0:
        pytest.fail("this test needs a root client (CI runs as root)")
    async with bwrap_client.sandbox() as sb:
        r = await sb.exec("id -u; id -g; touch made-here; grep Cap /proc/self/status")
        uid, gid = (int(x) for x in r.stdout.split()[:2])
        assert uid != 0
        assert gid != 0
        assert "CapEff:\t0000000000000000" in r.stdout
        made = Path((await sb.info()).cwd) / "made-here"
        assert made.stat().st_uid == 65534
        # Root-only files (owner root, mode 0600) stay closed even where they are visible.
        assert (await sb.exec(["sh", "-c", "echo x >> /proc/sys/kernel/hostname"])).exit_code != 0


async def test_a_planted_log_symlink_leaks_nothing(bwrap_client: orchard.Client, tmp_path: Path) -> None:
    marker = f"orchard-marker-{secrets.token_hex(8)}"
    secret = tmp_path / "client-secret"
    secret.write_text(marker)
    secret.chmod(0o600)
    async with bwrap_client.sandbox() as sb:
        directory = await sandbox_dir(sb)
        # Wherever the sandbox can write: its directory (the old log lived there) and below,
        # pointing at a file of the client's and at the client's own environment.
        plant = (
            f"for d in {directory} {directory}/*; do"
            f" rm -f $d/executor.log; ln -s {secret} $d/executor.log;"
            f" for f in log stderr; do rm -f $d/$f; ln -s /proc/{os.getpid()}/environ $d/$f; done; done"
        )
        await sb.exec(["sh", "-c", plant])
        with pytest.raises(errors.SandboxLost) as info:
            await sb.exec(["sh", "-c", "echo dying >&2; kill -9 $PPID; sleep 5"])
        assert marker not in str(info.value)
        assert "PATH=" not in str(info.value)
        assert info.value.reason is not None
        assert info.value.reason.startswith("exited")


@pytest.mark.parametrize("victim", ["executor", "bwrap"])
async def test_a_killed_executor_takes_its_commands_with_it(bwrap_client: orchard.Client, victim: str) -> None:
    seconds = str(100000 + secrets.randbelow(100000))
    async with bwrap_client.sandbox() as sb:
        directory = str(await sandbox_dir(sb)).encode()
        await sb.start_process(["sleep", seconds])
        await sb.start_process(f"setsid sleep {seconds} &")
        await eventually(lambda: len(host_pids(seconds.encode())) == 2, what="both sleeps run")
        sleeps = host_pids(seconds.encode())
        processes = host_pids_containing(directory)
        if victim == "bwrap":  # the bwrap process the client started
            pids = [pid for pid, _ in processes if parent(pid) == os.getpid()]
        else:  # the executor's own (python) process
            pids = [pid for pid, _ in processes if Path(f"/proc/{pid}/exe").resolve().name != "bwrap"]
        assert pids, processes
        os.kill(pids[0], signal.SIGKILL)
        for pid in sleeps:
            await eventually(lambda pid=pid: not host_pid_alive(pid), what=f"sleep {pid} killed with the {victim}")


async def test_auto_without_bubblewrap_is_a_config_error(local_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(errors.ConfigError) as info:
        async with orchard.Client(orchard.LocalConfig(root=str(local_root))) as client:
            await client.create()
    assert "isolation='none'" in str(info.value)
    assert "apt-get install bubblewrap" in str(info.value)
    assert not local_root.exists() or os.listdir(local_root) == []


async def test_a_backend_that_cannot_be_built_leaves_no_http_session_open(
    local_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gc

    monkeypatch.setenv("PATH", "/nonexistent")
    client = orchard.Client(orchard.LocalConfig(root=str(local_root)))
    with pytest.raises(errors.ConfigError):
        await client.__aenter__()
    assert client._http is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del client
        gc.collect()
    assert not [w for w in caught if "Unclosed" in str(w.message)]


async def test_no_isolation_warns_once_per_backend(local_root: Path) -> None:
    from orchard.errors import UnisolatedWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        async with orchard.Client(orchard.LocalConfig(root=str(local_root), isolation="none")) as client:
            async with client.sandbox() as sb, client.sandbox():
                assert (await sb.exec(["true"])).ok
    unisolated = [w for w in caught if issubclass(w.category, UnisolatedWarning)]
    assert len(unisolated) == 1, [str(w.message) for w in caught]
    assert "unisolated" in str(unisolated[0].message)


@pytest.mark.parametrize("squat", ["others may write it", "another user owns it"])
async def test_a_root_another_user_could_change_is_refused(tmp_path: Path, squat: str) -> None:
    # Another user who made /tmp/orchard-<uid> first (or any directory others may write) could swap a
    # socket of theirs in for an executor's before the client holds it, and be sent the sandbox's token.
    root = tmp_path / "squatted"
    root.mkdir()
    if squat == "others may write it":
        root.chmod(0o777)
    else:
        os.chown(root, 65534, 65534)  # the tests run as root (scripts/test); nobody's
    async with orchard.Client(orchard.LocalConfig(root=str(root))) as client:
        with pytest.raises(errors.ConfigError, match="not this user's own directory"):
            await client.create()
    assert os.listdir(root) == []


def etc_dirs(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir()) if parent.exists() else []


async def test_the_sandbox_etc_is_one_read_only_copy_of_the_allowlist_removed_with_the_client(
    local_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from orchard._backends.local import _ETC

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    parent = tmp_path / f"orchard-etc-{os.getuid()}"
    async with orchard.Client(orchard.LocalConfig(root=str(local_root))) as client:
        async with client.sandbox() as a, client.sandbox() as b:
            # One copy for the client's sandboxes (without a network), made at the first start.
            (made,) = etc_dirs(parent)
            assert made.startswith(f"etc-{os.getpid()}-")
            assert stat.S_IMODE((parent / made).stat().st_mode) == 0o755
            listed = (await a.exec(["ls", "-A", "/etc"])).stdout.split()
            expected = {name.split("/")[0] for name in _ETC if os.path.lexists(f"/etc/{name}")}
            assert set(listed) == expected | {"passwd", "group", "hosts"}
            for name in ("debian_version", "ld.so.cache", "ssl/certs/ca-certificates.crt"):
                if os.path.exists(f"/etc/{name}"):
                    assert (await a.read_file(f"/etc/{name}")) == Path(f"/etc/{name}").read_bytes(), name
            assert (await b.exec(["cat", "/etc/hosts"])).stdout.startswith("127.0.0.1 localhost orchard\n")
            # Read-only: one sandbox cannot change what the next one (or its own programs) read.
            r = await a.exec("echo 6.6.6.6 pypi.org >> /etc/hosts; echo x > /etc/new")
            assert r.exit_code != 0
            assert "Read-only file system" in r.stderr, r
            assert (await b.exec(["cat", "/etc/hosts"])).stdout.count("\n") == 2
    assert etc_dirs(parent) == []


async def test_the_etc_of_a_client_that_died_is_removed_by_the_next_and_a_live_ones_kept(
    local_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    parent = tmp_path / f"orchard-etc-{os.getuid()}"
    parent.mkdir(mode=0o700)
    dead = subprocess.Popen(["true"])
    dead.wait()
    (parent / f"etc-{dead.pid}-abc").mkdir()
    (parent / f"etc-{dead.pid}-abc" / "hosts").write_text("left behind")
    live = f"etc-{os.getppid()}-def"
    (parent / live).mkdir()
    (parent / "unrelated").mkdir()
    async with orchard.Client(orchard.LocalConfig(root=str(local_root))) as client, client.sandbox():
        left = etc_dirs(parent)
        assert f"etc-{dead.pid}-abc" not in left
        ours = [name for name in left if name.startswith(f"etc-{os.getpid()}-")]
        assert len(ours) == 1
        assert sorted(set(left) - set(ours)) == sorted([live, "unrelated"])
    assert etc_dirs(parent) == sorted([live, "unrelated"])


async def test_an_etc_directory_another_user_could_write_is_refused(
    local_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another user who could write it could change what every sandbox's programs read (ld.so.conf.d)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    parent = tmp_path / f"orchard-etc-{os.getuid()}"
    parent.mkdir()
    parent.chmod(0o777)
    async with orchard.Client(orchard.LocalConfig(root=str(local_root))) as client:
        with pytest.raises(errors.ConfigError, match=r"orchard-etc-\d+ is not this user's own directory .* TMPDIR"):
            await client.create()
    assert etc_dirs(parent) == []
