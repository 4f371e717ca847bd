"""Safe transfers: what a sandbox made is unpacked on the host without trust, and hostile uploads are refused whole.

Generic: runs on every backend (tests/docker and tests/k8s/generic import it).
"""

from __future__ import annotations

import gzip
import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

import orchard
from orchard import errors

pytestmark = pytest.mark.executor


def listing(root: Path) -> dict[str, tuple[int, bytes | str | None]]:
    """Every entry under root (root included): lstat mode and content or link target."""
    found: dict[str, tuple[int, bytes | str | None]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in ["", *dirnames, *filenames]:
            path = Path(dirpath) / name
            st = os.lstat(path)
            body: bytes | str | None = None
            if stat.S_ISLNK(st.st_mode):
                body = os.readlink(path)
            elif stat.S_ISREG(st.st_mode):
                body = path.read_bytes()
            found[str(path.relative_to(root))] = (st.st_mode, body)
    return found


@pytest.fixture
def host(tmp_path: Path) -> Path:
    """A host directory of its own (the local backend keeps its sandboxes elsewhere in tmp_path)."""
    d = tmp_path / "host"
    d.mkdir()
    return d


async def sh(sb: orchard.Sandbox, script: str) -> str:
    r = await sb.exec(script)
    assert r.exit_code == 0, r.stderr
    return r.stdout


async def test_setuid_and_writable_bits_and_owners_do_not_reach_the_host(sb: orchard.Sandbox, host: Path) -> None:
    as_root = (await sh(sb, "id -u")).strip() == "0"
    await sb.write_file("tree/suid", "#!/bin/sh\necho hi\n")
    await sb.write_file("tree/sgid", "#!/bin/sh\n")
    await sb.write_file("tree/open", "anyone\n")
    await sb.mkdir("tree/tmp")
    # Where the sandbox runs as root, the setuid file is root's: on the host it would mean root.
    await sh(sb, ("chown 0:0 tree/suid && " if as_root else "") + "chmod 4755 tree/suid")
    await sh(sb, "chmod 2755 tree/sgid && chmod 666 tree/open && chmod 1777 tree/tmp")
    # A foreign owner, where the sandbox may chown at all.
    foreign = as_root and (await sb.exec("chown 4242:4242 tree/open")).exit_code == 0
    assert (await sb.stat("tree/suid")).mode == 0o4755

    await sb.download("tree", host / "out")
    await sb.download("tree/suid", host / "one-suid")

    modes = {name: stat.S_IMODE(os.lstat(host / "out" / name).st_mode) for name in ("suid", "sgid", "open", "tmp")}
    assert modes == {"suid": 0o755, "sgid": 0o755, "open": 0o644, "tmp": 0o755}
    assert stat.S_IMODE(os.stat(host / "one-suid").st_mode) == 0o755
    assert (host / "out" / "suid").read_text() == "#!/bin/sh\necho hi\n"
    owners = {os.lstat(host / "out" / name).st_uid for name in ("suid", "sgid", "open", "tmp")}
    assert owners == {os.getuid()}, f"foreign owner applied (sandbox could chown: {foreign})"


@pytest.mark.parametrize(
    ("make", "rule", "member"),
    [
        ("mkfifo tree/pipe", "type", "pipe"),
        ("ln -s /etc/passwd tree/abs", "link", "abs"),
        ("mkdir tree/sub && ln -s ../../.. tree/sub/up", "link", "sub/up"),
    ],
    ids=["fifo", "absolute-symlink", "escaping-symlink"],
)
async def test_a_hostile_tree_is_refused_and_nothing_lands(
    sb: orchard.Sandbox, host: Path, make: str, rule: str, member: str
) -> None:
    await sb.write_file("tree/a.txt", "a")
    await sh(sb, make)
    fresh, existing = host / "fresh", host / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("keep")
    before = listing(host)

    for dest in (fresh, existing):
        with pytest.raises(errors.UnsafeArchive) as info:
            await sb.download("tree", dest)
        assert (info.value.rule, info.value.member, info.value.sandbox_id) == (rule, member, sb.id)
        assert listing(host) == before


async def test_a_fifo_downloaded_as_a_file_is_refused_without_reading_it(sb: orchard.Sandbox, host: Path) -> None:
    await sh(sb, "mkfifo pipe")
    with pytest.raises(errors.UnsafeArchive) as info:
        await sb.download("pipe", host / "pipe")
    assert info.value.rule == "type"
    assert os.listdir(host) == []


async def test_download_caps_members_and_bytes(sb: orchard.Sandbox, host: Path) -> None:
    for i in range(3):
        await sb.write_file(f"tree/f{i}", b"x" * 100)
    with pytest.raises(errors.UnsafeArchive) as members:
        await sb.download("tree", host / "a", max_members=2)
    with pytest.raises(errors.UnsafeArchive) as size:
        await sb.download("tree", host / "b", max_bytes=250)
    with pytest.raises(errors.UnsafeArchive) as one:
        await sb.download("tree/f0", host / "c", max_bytes=99)
    assert (members.value.rule, size.value.rule, one.value.rule) == ("members", "bytes", "bytes")
    assert "max_members" in str(members.value)
    assert "max_bytes" in str(size.value)
    assert os.listdir(host) == []
    await sb.download("tree", host / "ok", max_members=3, max_bytes=300)
    assert sorted(os.listdir(host / "ok")) == ["f0", "f1", "f2"]


def hostile_tar(kind: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        good = tarfile.TarInfo("good.txt")
        good.size = 4
        tar.addfile(good, io.BytesIO(b"good"))
        evil = tarfile.TarInfo("evil")
        if kind == "fifo":
            evil.type = tarfile.FIFOTYPE
        elif kind == "char-device":
            evil.type, evil.devmajor, evil.devminor, evil.mode = tarfile.CHRTYPE, 1, 3, 0o666
        elif kind == "absolute-symlink":
            evil.type, evil.linkname = tarfile.SYMTYPE, "/etc/shadow"
        elif kind == "escaping-symlink":
            evil.type, evil.linkname = tarfile.SYMTYPE, "../../../etc"
        else:
            evil.type, evil.linkname = tarfile.LNKTYPE, "../outside.txt"
        tar.addfile(evil)
    return buf.getvalue()


@pytest.mark.parametrize(
    "kind", ["fifo", "char-device", "absolute-symlink", "escaping-symlink", "hardlink-out", "gzip"]
)
async def test_a_hostile_upload_is_refused_whole(sb: orchard.Sandbox, kind: str) -> None:
    await sb.write_file("outside.txt", "outside")
    await sb.write_file("dest/keep.txt", "keep")
    body = gzip.compress(hostile_tar("fifo")) if kind == "gzip" else hostile_tar(kind)
    before = await sh(sb, "find . -printf '%p %m %s %y %l\\n' | sort")

    with pytest.raises(errors.UnsafeUpload) as info:
        await sb.upload_tar("dest", body)
    assert isinstance(info.value, errors.UnsafeArchive)
    assert isinstance(info.value, errors.InvalidRequest)
    assert info.value.code == "unsafe_archive"
    with pytest.raises(errors.UnsafeUpload):
        await sb.upload_tar("new-dest", body)

    assert await sh(sb, "find . -printf '%p %m %s %y %l\\n' | sort") == before


async def test_uploaded_modes_lose_setuid_and_group_other_write(sb: orchard.Sandbox, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name, mode in (("suid", 0o4755), ("open", 0o666), ("plain", 0o640)):
        (src / name).write_text(name)
        os.chmod(src / name, mode)
    await sb.upload(src, "up")
    await sb.upload(src / "suid", "one-suid")
    modes = {name: (await sb.stat(f"up/{name}")).mode for name in ("suid", "open", "plain")}
    assert modes == {"suid": 0o755, "open": 0o644, "plain": 0o640}
    assert (await sb.stat("one-suid")).mode == 0o755


async def test_upload_caps_members(sb: orchard.Sandbox, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"f{i}").write_text("x")
    with pytest.raises(errors.UnsafeUpload) as info:
        await sb.upload(src, "up", max_members=2)
    assert "max_members" in str(info.value)
    assert not await sb.exists("up")
    await sb.upload(src, "up", max_members=3)
    assert sorted(e.name for e in await sb.list_dir("up")) == ["f0", "f1", "f2"]
