"""The injected executor in images that have nothing it could use: a static busybox, and no shell at all."""

from __future__ import annotations

import io
import signal
import tarfile
from pathlib import Path

import pytest
from docker_support import BUSYBOX, NOSHELL, SWE, SandboxFactory, live_processes

import orchard
from orchard import errors

pytestmark = pytest.mark.docker

BARE = [BUSYBOX, NOSHELL]
#: What the executor's launcher could leak into its commands' environment.
LEAKS = ("PYTHON", "LD_", "LC_", "ORCHARD_")


def env_of(result: orchard.ExecResult) -> dict[str, str]:
    return dict(line.split("=", 1) for line in result.stdout.splitlines())


@pytest.mark.parametrize("image", BARE)
async def test_argv_exec_exit_codes_and_stdin(sandbox: SandboxFactory, image: str) -> None:
    sb = await sandbox(image)
    r = await sb.exec(["echo", "hello", "world"])
    assert (r.exit_code, r.stdout, r.stderr) == (0, "hello world\n", "")
    assert (await sb.exec(["false"])).exit_code == 1
    r = await sb.exec(["cat"], stdin=b"\x00\xffbytes")
    assert r.stdout_bytes == b"\x00\xffbytes"
    r = await sb.exec(["head", "-c", "3"], stdin="abcdef")
    assert r.stdout == "abc"


@pytest.mark.parametrize("image", [BUSYBOX, NOSHELL, SWE])
async def test_commands_get_the_container_environment_and_nothing_of_the_bundle(
    sandbox: SandboxFactory, image: str
) -> None:
    sb = await sandbox(image, env={"FROM_SPEC": "1"})
    env = env_of(await sb.exec(["env"]))
    image_path = {BUSYBOX: "/bin", NOSHELL: "/bin"}.get(
        image, "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    )
    assert env["PATH"] == image_path
    assert env["FROM_SPEC"] == "1"
    if image == SWE:
        assert env["TASK"] == "calc-add"  # the image's own ENV
        assert env["LANG"] == "C.UTF-8"
    assert not [k for k in env if k.startswith(LEAKS)], env
    assert not [v for v in env.values() if "/.orchard" in v], env
    # Per-call env adds to it and is gone on the next call.
    r = await sb.exec(["env"], env={"PER_CALL": "x"})
    assert env_of(r)["PER_CALL"] == "x"
    assert "PER_CALL" not in env_of(await sb.exec(["env"]))


@pytest.mark.parametrize("image", BARE)
async def test_timeouts_kill_and_return_partial_output(sandbox: SandboxFactory, image: str) -> None:
    sb = await sandbox(image)
    r = await sb.exec(["sleep", "300"], timeout=1)
    assert r.timed_out
    assert r.signal == signal.SIGKILL
    assert r.exit_code is None
    assert 1 <= r.duration < 60
    assert (await sb.exec(["true"])).ok  # the sandbox carries on


async def test_a_shell_pipeline_times_out_whole_in_busybox(sandbox: SandboxFactory) -> None:
    sb = await sandbox(BUSYBOX)
    r = await sb.exec("echo start; sleep 300 | cat; echo never", timeout=1)
    assert r.timed_out
    assert r.stdout == "start\n"
    r = await sb.exec("echo $((6 * 7)) | tr 4 x")
    assert r.stdout == "x2\n"
    procs = live_processes((await sb.exec("cat /proc/[0-9]*/stat")).stdout)
    # Only the executor and the cat listing them are left: the pipeline went whole.
    assert [p[1] for p in procs] == ["ld.so", "cat"], procs


async def test_without_a_shell_string_commands_fail_clearly_and_argv_works(sandbox: SandboxFactory) -> None:
    sb = await sandbox(NOSHELL)
    assert not await sb.exists("/bin/sh")
    with pytest.raises(errors.CommandNotFound, match="needs a shell") as info:
        await sb.exec("echo hi")
    assert info.value.sandbox_id == sb.id
    with pytest.raises(errors.CommandNotFound):
        await sb.start_process("sleep 1")
    r = await sb.exec(["printf", "%s-%s", "a", "b"])
    assert r.stdout == "a-b"
    p = await sb.start_process(["sleep", "0.2"])
    status = await p.wait(30)
    assert status.exit_code == 0


@pytest.mark.parametrize("image", BARE)
async def test_no_libc_python_or_shell_is_needed_from_the_image(sandbox: SandboxFactory, image: str) -> None:
    sb = await sandbox(image)
    assert not await sb.exists("/usr/bin/python3")
    assert not await sb.exists("/usr/lib/python3.11")
    if image == BUSYBOX:
        # Nothing but busybox: no libc at all.
        assert not await sb.exists("/lib")
        assert not await sb.exists("/lib64")
    info = await sb.info()
    assert info.pid == 1
    assert info.cwd == "/"


@pytest.mark.parametrize("image", BARE)
async def test_files_round_trip(sandbox: SandboxFactory, image: str, tmp_path: Path) -> None:
    sb = await sandbox(image, workdir="/work")
    st = await sb.write_file("dir/a.txt", "héllo", mode=0o640)
    assert (st.path, st.size, st.mode & 0o777) == ("/work/dir/a.txt", len("héllo".encode()), 0o640)
    assert await sb.read_file("dir/a.txt") == "héllo".encode()
    assert (await sb.exec(["cat", "dir/a.txt"])).stdout == "héllo"
    await sb.mkdir("dir/sub")
    assert [e.name for e in await sb.list_dir("dir")] == ["a.txt", "sub"]
    await sb.remove("dir", recursive=True)
    assert not await sb.exists("dir")
    src = tmp_path / "tree"
    (src / "x").mkdir(parents=True)
    (src / "x" / "f.bin").write_bytes(bytes(range(256)) * 100)
    await sb.upload(src, "up")
    assert (await sb.exec(["ls", "up/x"])).stdout == "f.bin\n"
    out = tmp_path / "out"
    await sb.download("up", out)
    assert (out / "x" / "f.bin").read_bytes() == bytes(range(256)) * 100


async def test_a_tar_escaping_its_destination_is_refused_on_the_bundled_python(sandbox: SandboxFactory) -> None:
    # The bundle's CPython is Debian 12's 3.11.2, older than tarfile's extraction filters.
    sb = await sandbox(BUSYBOX, workdir="/work")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        evil = tarfile.TarInfo("../escaped.txt")
        evil.size = 1
        tar.addfile(evil, io.BytesIO(b"x"))
    with pytest.raises(errors.UnsafeUpload, match=r"'\.\.' in its name"):
        await sb.upload_tar("dest", buf.getvalue())
    assert not await sb.exists("/escaped.txt")
