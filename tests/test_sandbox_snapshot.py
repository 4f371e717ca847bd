"""Snapshots and forks: set up once, start others from what the setup made.

Generic: runs on every backend (tests/docker and tests/k8s/generic import it).
A fork sees the prepared files (contents, modes, symlinks, hardlinks) and no
later change of its base; a snapshot over its limit is a typed error naming
the file and keeps nothing; a hostile snapshot cannot write outside the
directory it is restored in.
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

import orchard
from orchard import errors
from orchard._snapshot import Part, Snapshot

pytestmark = pytest.mark.executor

#: The ``sandbox`` fixture: ``await sandbox(**spec)`` starts one, deleted after the test.
SandboxFactory = Callable[..., Awaitable[orchard.Sandbox]]

SETUP = """
set -e
mkdir -p pkg/sub
printf 'v1\\n' > pkg/a.txt
printf '#!/bin/sh\\necho ran\\n' > pkg/run.sh
chmod 755 pkg/run.sh
ln -s a.txt pkg/link
ln pkg/a.txt pkg/sub/hard
printf 'outside\\n' > other.txt
"""


async def sh(sb: orchard.Sandbox, script: str) -> str:
    r = await sb.exec(script)
    assert r.exit_code == 0, r.stderr
    return r.stdout


async def test_a_fork_sees_the_prepared_files_and_no_later_change_of_its_base(sandbox: SandboxFactory) -> None:
    base = await sandbox()
    await sh(base, SETUP)
    snap = await base.snapshot()
    assert snap.size > 0
    await sh(base, "printf 'v2\\n' > pkg/a.txt; rm pkg/run.sh; echo later > pkg/later.txt")

    fork = await sandbox(restore=snap)
    assert "restore" in fork.timings
    assert await fork.read_file("pkg/a.txt") == b"v1\n"
    assert await sh(fork, "./pkg/run.sh") == "ran\n"
    assert (await fork.stat("pkg/run.sh")).mode & 0o777 == 0o755
    assert await sh(fork, "readlink pkg/link; cat pkg/link") == "a.txt\nv1\n"
    assert await sh(fork, "cat pkg/sub/hard; stat -c %h pkg/a.txt") == "v1\n2\n"
    assert await fork.read_file("other.txt") == b"outside\n"
    assert not await fork.exists("pkg/later.txt")
    # The fork is a sandbox of its own: its changes do not reach the base either.
    await sh(fork, "echo fork > pkg/a.txt")
    assert await base.read_file("pkg/a.txt") == b"v2\n"


async def test_listed_paths_are_taken_whole_and_nothing_else(sandbox: SandboxFactory, tmp_path: Path) -> None:
    base = await sandbox()
    await sh(base, SETUP)
    snap = await base.snapshot(["pkg"], file=tmp_path / "snap.tar")
    assert snap.data is None
    assert (tmp_path / "snap.tar").stat().st_size == snap.size
    fork = await sandbox(restore=snap)
    assert await fork.read_file("pkg/a.txt") == b"v1\n"
    assert await sh(fork, "./pkg/run.sh") == "ran\n"
    assert not await fork.exists("other.txt")
    # A snapshot is reused as often as asked: a second fork from the same file.
    again = await sandbox(restore=snap)
    assert await again.read_file("pkg/sub/hard") == b"v1\n"


async def test_a_snapshot_over_its_limit_names_the_file_and_keeps_nothing(
    sandbox: SandboxFactory, tmp_path: Path
) -> None:
    sb = await sandbox()
    await sh(sb, "mkdir big && head -c 600000 /dev/zero > big/1 && head -c 600000 /dev/zero > big/2")
    with pytest.raises(errors.SnapshotTooLarge) as info:
        await sb.snapshot(["big"], max_bytes=1_000_000, file=tmp_path / "snap.tar")
    assert info.value.path is not None
    assert info.value.path.endswith("big/2")
    assert not (tmp_path / "snap.tar").exists()
    with pytest.raises(errors.SnapshotTooLarge) as info:
        await sb.snapshot(["big"], max_members=1)
    assert info.value.path is not None
    assert info.value.path.endswith("big/2")
    assert len((await sb.snapshot(["big"], max_bytes=1_200_000)).data or b"") > 1_200_000


def crafted(*members: tuple[str, str, bytes | str]) -> bytes:
    """A tar of (name, kind, content or link target) members."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, kind, body in members:
            info = tarfile.TarInfo(name)
            if kind in ("symlink", "hardlink"):
                info.type = tarfile.SYMTYPE if kind == "symlink" else tarfile.LNKTYPE
                info.linkname = str(body)
                tar.addfile(info)
            elif kind == "fifo":
                info.type = tarfile.FIFOTYPE
                tar.addfile(info)
            else:
                data = body if isinstance(body, bytes) else body.encode()
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


@pytest.mark.parametrize(
    "members",
    [
        # A symlink out of the directory, then a member written through it.
        [("escape", "symlink", "/tmp"), ("escape/orchard-pwned", "file", "x")],
        [("sub", "symlink", "../.."), ("sub/orchard-pwned", "file", "x")],
        [("../orchard-pwned", "file", "x")],
        # A hardlink to a file that is not of the stream (one outside it would be written through).
        [("orchard-pwned", "hardlink", "../../../../etc/hostname")],
        [("orchard-pwned", "fifo", "")],
    ],
    ids=["absolute-symlink", "relative-symlink", "dotdot", "hardlink", "fifo"],
)
async def test_a_hostile_snapshot_cannot_write_outside_where_it_is_restored(
    sandbox: SandboxFactory, members: list[tuple[str, str, bytes | str]]
) -> None:
    sb = await sandbox()
    workdir = (await sb.info()).cwd
    data = crafted(*members)
    snap = Snapshot((Part(f"{workdir}/restored", 0, len(data)),), workdir, len(data), data=data)
    with pytest.raises(errors.UnsafeUpload):
        await sb.restore(snap)
    assert await sh(sb, "ls /tmp/orchard-pwned ../orchard-pwned orchard-pwned 2>/dev/null || true") == ""
    # Through Client.create, the fork whose restore failed is deleted.
    with pytest.raises(errors.UnsafeUpload):
        await sandbox(restore=snap)


async def test_snapshot_and_restore_are_traced(sandbox: SandboxFactory, tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    base = await sandbox(trace=str(trace))
    await sh(base, SETUP)
    snap = await base.snapshot(["pkg"], max_bytes=10_000)
    await base.restore(snap)
    found = [json.loads(line) for line in trace.read_text().splitlines()]
    kinds = [r["type"] for r in found]
    # The stat and info calls inside them are not records of their own.
    assert kinds == ["sandbox_create", "exec", "snapshot", "restore"]
    taken, restored = found[2], found[3]
    assert (taken["paths"], taken["max_bytes"], taken["bytes"], taken["error"]) == (["pkg"], 10_000, snap.size, None)
    assert taken["parts"] == restored["parts"] == [part.path for part in snap.parts]
    assert restored["bytes"] == snap.size
