"""Streamed tar in and out (shared by client and executor), in-process on a temp dir.

The extraction rules are the defence of the host against what a sandbox made:
every hostile case must raise ``tarstream.Refused`` and leave the destination
exactly as it was.
"""

from __future__ import annotations

import asyncio
import bz2
import errno
import gzip
import io
import lzma
import os
import shutil
import socket
import stat
import subprocess
import tarfile
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from orchard_executor import tarstream

pytestmark = pytest.mark.unit

Member = tuple[tarfile.TarInfo, bytes | None]


def tar_bytes(members: list[Member], fmt: int = tarfile.GNU_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def member(name: str, data: bytes = b"", **attrs: object) -> Member:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    for k, v in attrs.items():
        setattr(info, k, v)
    if not info.isreg():
        info.size = 0
    return info, data if info.isreg() else None


async def chunks(data: bytes, size: int = 1000) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


def snapshot(root: Path) -> dict[str, tuple[int, int, int, bytes | str | None]]:
    """Every entry under root: lstat mode, owner, size, and content or link target."""
    found: dict[str, tuple[int, int, int, bytes | str | None]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                body: bytes | str | None = os.readlink(path)
            elif stat.S_ISREG(st.st_mode):
                body = path.read_bytes()
            else:
                body = None
            found[str(path.relative_to(root))] = (st.st_mode, st.st_uid, st.st_size, body)
    return found


@pytest.fixture
def dest(tmp_path: Path) -> Path:
    """A destination that already holds a file and a directory, beside a file outside it."""
    d = tmp_path / "dest"
    (d / "sub").mkdir(parents=True)
    (d / "keep.txt").write_text("keep")
    os.chmod(d / "keep.txt", 0o640)
    (d / "sub" / "old.txt").write_text("old")
    (tmp_path / "outside-target").write_text("secret")
    return d


async def test_archive_then_extract_keeps_the_tree(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "a" / "empty").mkdir(parents=True)
    (src / "a" / "f.bin").write_bytes(os.urandom(3 * tarstream.CHUNK + 7))
    (src / "x").write_text("x")
    os.chmod(src / "x", 0o600)
    os.symlink("a/f.bin", src / "link")
    os.link(src / "x", src / "hard")
    dest = tmp_path / "dest"

    await tarstream.extract(tarstream.archive(str(src)), str(dest))

    assert sorted(os.listdir(dest)) == ["a", "hard", "link", "x"]
    assert (dest / "a" / "f.bin").read_bytes() == (src / "a" / "f.bin").read_bytes()
    assert (dest / "a" / "empty").is_dir()
    assert stat.S_IMODE(os.stat(dest / "x").st_mode) == 0o600
    assert os.readlink(dest / "link") == "a/f.bin"
    assert os.stat(dest / "hard").st_ino == os.stat(dest / "x").st_ino
    assert [p for p in os.listdir(tmp_path) if p not in ("src", "dest")] == []


async def test_a_single_file_is_archived_under_its_own_name(tmp_path: Path) -> None:
    (tmp_path / "one.txt").write_text("1")
    data = b"".join([c async for c in tarstream.archive(str(tmp_path / "one.txt"))])
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert tar.getnames() == ["one.txt"]


async def test_archiving_a_missing_path_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        async for _ in tarstream.archive(str(tmp_path / "missing")):
            pass


async def test_extracting_merges_into_an_existing_destination(dest: Path) -> None:
    data = tar_bytes([member("sub/new.txt", b"new"), member("top.txt", b"top"), member("keep.txt", b"replaced")])
    await tarstream.extract(chunks(data), str(dest))
    assert (dest / "sub" / "old.txt").read_text() == "old"
    assert (dest / "sub" / "new.txt").read_text() == "new"
    assert (dest / "top.txt").read_text() == "top"
    assert (dest / "keep.txt").read_text() == "replaced"


@pytest.mark.parametrize(
    ("kind", "mode", "expected"),
    [
        (tarfile.REGTYPE, 0o4755, 0o755),
        (tarfile.REGTYPE, 0o2755, 0o755),
        (tarfile.REGTYPE, 0o6777, 0o755),
        (tarfile.REGTYPE, 0o666, 0o644),
        (tarfile.REGTYPE, 0o622, 0o600),
        (tarfile.DIRTYPE, 0o1777, 0o755),
        (tarfile.DIRTYPE, 0o2775, 0o755),
    ],
    ids=[
        "setuid",
        "setgid",
        "setuid-setgid-world-writable",
        "world-writable",
        "group-write",
        "sticky-dir",
        "setgid-dir",
    ],
)
async def test_modes_lose_setuid_setgid_sticky_and_group_other_write(
    tmp_path: Path, kind: bytes, mode: int, expected: int
) -> None:
    data = tar_bytes([member("it", b"#!/bin/sh\n" if kind == tarfile.REGTYPE else b"", type=kind, mode=mode)])
    await tarstream.extract(chunks(data), str(tmp_path / "d"))
    assert stat.S_IMODE(os.lstat(tmp_path / "d" / "it").st_mode) == expected


async def test_foreign_owners_are_not_applied(tmp_path: Path) -> None:
    data = tar_bytes(
        [
            member("dir", type=tarfile.DIRTYPE, mode=0o755, uid=4242, gid=4343, uname="evil", gname="evil"),
            member("dir/f", b"x", uid=4242, gid=4343, uname="evil", gname="evil"),
            member("dir/l", type=tarfile.SYMTYPE, linkname="f", uid=4242, gid=4343),
        ]
    )
    await tarstream.extract(chunks(data), str(tmp_path / "d"))
    for name in ("dir", "dir/f", "dir/l"):
        st = os.lstat(tmp_path / "d" / name)
        assert (st.st_uid, st.st_gid) == (os.getuid(), os.getgid()), name


def gzipped(data: bytes) -> bytes:
    return gzip.compress(data)


#: Hostile streams, each after a good member: the rule it breaks.
HOSTILE: dict[str, tuple[list[Member], str]] = {
    "char-device": ([member("null", type=tarfile.CHRTYPE, devmajor=1, devminor=3, mode=0o666)], "type"),
    "block-device": ([member("sda", type=tarfile.BLKTYPE, devmajor=8, devminor=0, mode=0o666)], "type"),
    "fifo": ([member("pipe", type=tarfile.FIFOTYPE)], "type"),
    "absolute-symlink": ([member("l", type=tarfile.SYMTYPE, linkname="/etc/passwd")], "link"),
    "dotdot-symlink": ([member("l", type=tarfile.SYMTYPE, linkname="../outside-target")], "link"),
    "nested-dotdot-symlink": ([member("a/b/l", type=tarfile.SYMTYPE, linkname="../../../outside-target")], "link"),
    "symlink-chain": (
        [
            member("up", type=tarfile.SYMTYPE, linkname="."),
            member("sub", type=tarfile.DIRTYPE, mode=0o755),
            # Lexically "up/sub/../.." is ".", but up is the root itself: it resolves to the parent.
            member("esc", type=tarfile.SYMTYPE, linkname="up/sub/../.."),
        ],
        "link",
    ),
    "symlink-to-symlink-out": (
        [
            member("l1", type=tarfile.SYMTYPE, linkname="l2/x"),
            member("l2", type=tarfile.SYMTYPE, linkname="../.."),
        ],
        "link",
    ),
    "write-through-symlink": (
        [member("link", type=tarfile.SYMTYPE, linkname="sub"), member("link/escaped.txt", b"x")],
        "link",
    ),
    "hardlink-out": ([member("hard", type=tarfile.LNKTYPE, linkname="../outside-target")], "link"),
    "hardlink-absolute": ([member("hard", type=tarfile.LNKTYPE, linkname="/etc/passwd")], "link"),
    "hardlink-to-destination-file": ([member("hard", type=tarfile.LNKTYPE, linkname="keep.txt")], "link"),
    "hardlink-to-itself": ([member("good.txt", type=tarfile.LNKTYPE, linkname="good.txt")], "link"),
    "dotdot-name": ([member("../escaped.txt", b"x")], "path"),
    "absolute-name": ([member("/abs-escaped.txt", b"x")], "path"),
    "nested-dotdot-name": ([member("inner/../../escaped.txt", b"x")], "path"),
    "huge-pax-header": ([member("p", b"x", pax_headers={"comment": "c" * (2 * 1024 * 1024)})], "header"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
async def test_hostile_members_are_refused_and_nothing_is_written(tmp_path: Path, dest: Path, case: str) -> None:
    evil, rule = HOSTILE[case]
    fmt = tarfile.PAX_FORMAT if case == "huge-pax-header" else tarfile.GNU_FORMAT
    data = tar_bytes([member("good.txt", b"good"), *evil], fmt)
    before = snapshot(tmp_path)
    with pytest.raises(tarstream.Refused) as info:
        await tarstream.extract(chunks(data), str(dest))
    assert info.value.rule == rule
    assert info.value.member is not None
    assert info.value.member in str(info.value)
    assert snapshot(tmp_path) == before
    assert not Path("/abs-escaped.txt").exists()


async def test_a_compressed_stream_is_refused(tmp_path: Path, dest: Path) -> None:
    before = snapshot(tmp_path)
    with pytest.raises(tarstream.Refused) as info:
        await tarstream.extract(chunks(gzipped(tar_bytes([member("a.txt", b"a" * 100_000)]))), str(dest))
    assert info.value.rule == "compressed"
    assert snapshot(tmp_path) == before


async def test_too_many_members_is_refused(tmp_path: Path, dest: Path) -> None:
    data = tar_bytes([member(f"f{i}", b"") for i in range(4)])
    before = snapshot(tmp_path)
    with pytest.raises(tarstream.Refused) as info:
        await tarstream.extract(chunks(data), str(dest), max_members=3)
    assert info.value.rule == "members"
    assert snapshot(tmp_path) == before
    await tarstream.extract(chunks(data), str(dest), max_members=4)
    assert (dest / "f3").exists()


async def test_too_many_bytes_is_refused(tmp_path: Path, dest: Path) -> None:
    data = tar_bytes([member("a", b"a" * 60), member("b", b"b" * 41)])
    before = snapshot(tmp_path)
    with pytest.raises(tarstream.Refused) as info:
        await tarstream.extract(chunks(data), str(dest), max_bytes=100)
    assert info.value.rule == "bytes"
    assert snapshot(tmp_path) == before
    await tarstream.extract(chunks(data), str(dest), max_bytes=101)
    assert (dest / "b").read_bytes() == b"b" * 41


async def test_a_stream_broken_between_members_leaves_nothing(tmp_path: Path, dest: Path) -> None:
    whole = tar_bytes([member("one.txt", b"1" * 700), member("two.txt", b"2")])
    cut = 512 + 1024  # the first member's header and data, nothing more

    async def broken() -> AsyncIterator[bytes]:
        yield whole[:cut]
        raise ConnectionResetError("the sandbox went away")

    before = snapshot(tmp_path)
    with pytest.raises(ConnectionResetError):
        await tarstream.extract(broken(), str(dest))
    assert snapshot(tmp_path) == before


async def test_a_refused_download_into_a_missing_directory_creates_nothing(tmp_path: Path) -> None:
    data = tar_bytes([member("good.txt", b"good"), member("pipe", type=tarfile.FIFOTYPE)])
    with pytest.raises(tarstream.Refused):
        await tarstream.extract(chunks(data), str(tmp_path / "new" / "deeper"))
    assert os.listdir(tmp_path) == []


async def test_garbage_is_refused_and_does_not_hang(tmp_path: Path) -> None:
    with pytest.raises(tarstream.Refused) as info:
        await tarstream.extract(chunks(b"this is not a tar archive" * 1000), str(tmp_path / "d"))
    assert info.value.rule == "malformed"
    assert os.listdir(tmp_path) == []


async def test_a_fifo_in_the_source_is_archived_as_a_header_and_refused(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("a")
    os.mkfifo(src / "pipe")
    with pytest.raises(tarstream.Refused) as info:
        await tarstream.extract(tarstream.archive(str(src)), str(tmp_path / "out"))
    assert (info.value.rule, info.value.member) == ("type", "pipe")
    assert not (tmp_path / "out").exists()


def test_a_file_swapped_for_a_fifo_or_symlink_is_refused_without_blocking(tmp_path: Path) -> None:
    (tmp_path / "was-a-file").write_text("x")
    expected = os.lstat(tmp_path / "was-a-file")
    os.unlink(tmp_path / "was-a-file")
    os.mkfifo(tmp_path / "was-a-file")  # no writer: a blocking open would never return
    os.symlink("/etc/passwd", tmp_path / "link")
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in ("was-a-file", "link"):
            with pytest.raises(tarstream.Refused) as info:
                tarstream.open_regular(name, dir_fd, expected)
            assert info.value.rule == "changed"
    finally:
        os.close(dir_fd)


def pax_member(name: str, pax: dict[str, str], data: bytes = b"", **attrs: object) -> Member:
    """A member whose pax header overrides its name or link target, which may then hold anything (a NUL)."""
    info, body = member(name, data, **attrs)
    info.pax_headers = pax
    return info, body


#: Bad names and hardlink targets: the rule, the member named, and the message the user reads.
BAD_NAMES: dict[str, tuple[list[Member], str, str, str]] = {
    "nul-in-name": (
        [pax_member("evil", {"path": "evil\0name"}, b"x")],
        "path",
        "evil\0name",
        "tar member 'evil\\x00name' has a NUL byte in its name",
    ),
    "nul-in-hardlink-target": (
        [pax_member("h", {"linkpath": "good.txt\0"}, type=tarfile.LNKTYPE)],
        "link",
        "h",
        "tar member 'h' has a NUL byte in its hardlink target",
    ),
    "absolute-name": (
        [member("/abs-escaped.txt", b"x")],
        "path",
        "/abs-escaped.txt",
        "tar member '/abs-escaped.txt' has an absolute name '/abs-escaped.txt'",
    ),
    "dotdot-name": (
        [member("inner/../../escaped.txt", b"x")],
        "path",
        "inner/../../escaped.txt",
        "tar member 'inner/../../escaped.txt' has '..' in its name 'inner/../../escaped.txt'",
    ),
    "absolute-hardlink-target": (
        [member("hard", type=tarfile.LNKTYPE, linkname="/etc/passwd")],
        "link",
        "hard",
        "tar member 'hard' has an absolute hardlink target '/etc/passwd'",
    ),
    "dotdot-hardlink-target": (
        [member("hard", type=tarfile.LNKTYPE, linkname="sub/../../outside-target")],
        "link",
        "hard",
        "tar member 'hard' has '..' in its hardlink target 'sub/../../outside-target'",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_NAMES))
async def test_a_bad_name_or_hardlink_target_is_refused_with_its_reason(tmp_path: Path, dest: Path, case: str) -> None:
    evil, rule, name, message = BAD_NAMES[case]
    data = tar_bytes([member("good.txt", b"good"), *evil], tarfile.PAX_FORMAT)
    before = snapshot(tmp_path)
    with pytest.raises(tarstream.Refused) as info:
        await tarstream.extract(chunks(data), str(dest))
    assert (info.value.rule, info.value.member, str(info.value)) == (rule, name, message)
    assert snapshot(tmp_path) == before


async def test_names_are_taken_without_empty_and_dot_components(tmp_path: Path) -> None:
    # As GNU tar writes them ("./" first), and with doubled slashes: the same paths as the plain names,
    # so a hardlink may name its target either way, and "." is the destination, whose mode stays its own.
    data = tar_bytes(
        [
            member(".", type=tarfile.DIRTYPE, mode=0o700),
            member("./dir//f", b"data"),
            member("h1", type=tarfile.LNKTYPE, linkname="dir/f"),
            member("./h2", type=tarfile.LNKTYPE, linkname="./dir/./f"),
            member("dir//./h3", type=tarfile.LNKTYPE, linkname="dir//f"),
        ]
    )
    out = tmp_path / "out"
    await tarstream.extract(chunks(data), str(out))
    assert sorted(os.listdir(out)) == ["dir", "h1", "h2"]
    assert sorted(os.listdir(out / "dir")) == ["f", "h3"]
    inode = os.stat(out / "dir" / "f").st_ino
    assert [os.stat(out / n).st_ino for n in ("h1", "h2", "dir/h3")] == [inode] * 3
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o755


async def test_a_restore_writes_nested_members_under_a_destination_whose_name_ends_in_a_space(
    tmp_path: Path,
) -> None:
    # The destination's own path, not its name with the blanks trimmed, is what members must lie under.
    data = tar_bytes([member("d", type=tarfile.DIRTYPE, mode=0o755), member("d/f", b"nested")])
    out = tmp_path / "snap "
    await tarstream.extract(chunks(data), str(out), restore=True)
    assert (out / "d" / "f").read_bytes() == b"nested"


#: Streams meeting a non-directory with a directory (or the reverse) in the destination:
#: the path of the clash. The clash is beside many new files, which must not be written either.
CLASHES: dict[str, tuple[list[Member], str]] = {
    "file-over-directory": ([member("sub", b"a file")], "sub"),
    "directory-over-file": ([member("keep.txt/inner.txt", b"x")], "keep.txt"),
    "empty-directory-over-file": ([member("keep.txt", type=tarfile.DIRTYPE, mode=0o755)], "keep.txt"),
    "nested": (
        [*(member(f"sub/new-{i:03}.txt", b"new") for i in range(50)), member("sub/old.txt/inner.txt", b"x")],
        "sub/old.txt",
    ),
}


@pytest.mark.parametrize("case", sorted(CLASHES))
async def test_a_clash_with_the_destination_is_refused_before_anything_moves(
    tmp_path: Path, dest: Path, case: str
) -> None:
    clash, where = CLASHES[case]
    data = tar_bytes([*(member(f"new-{i:03}.txt", b"new") for i in range(100)), *clash])
    before = snapshot(tmp_path)
    with pytest.raises(OSError, match="a directory and a non-directory") as info:
        await tarstream.extract(chunks(data), str(dest))
    exc = info.value
    assert type(exc) is FileExistsError
    assert (exc.errno, exc.strerror, exc.filename) == (
        errno.EEXIST,
        "a directory and a non-directory of the same name",
        str(dest / where),
    )
    assert snapshot(tmp_path) == before


def corrupt_header(data: bytes, offset: int) -> bytes:
    """``data`` with the checksum of the header at ``offset`` spoiled."""
    spoiled = bytearray(data)
    spoiled[offset + 148 : offset + 156] = b"garbage!"
    return bytes(spoiled)


TWO_FILES = tar_bytes([member("a.txt", b"a"), member("b.txt", b"b")])

#: Streams that are not a plain, whole tar: the message the user reads (the rule is "malformed" unless compressed).
MALFORMED: dict[str, tuple[bytes, str]] = {
    "empty": (b"", "tar stream is not a readable tar: empty file"),
    "corrupt-first-header": (corrupt_header(TWO_FILES, 0), "tar stream is not a readable tar: invalid header"),
    # tarfile alone takes a bad header after the first for the end of the archive, and drops the rest.
    "corrupt-second-header": (
        corrupt_header(TWO_FILES, 1024),
        "tar stream has a corrupt header at byte 1024: invalid header",
    ),
    "cut-in-a-header": (TWO_FILES[: 2048 + 100], "tar stream has a corrupt header at byte 2048: truncated header"),
    "gzip": (gzip.compress(TWO_FILES), "tar stream is compressed; only a plain (uncompressed) tar is accepted"),
    "bzip2": (bz2.compress(TWO_FILES), "tar stream is compressed; only a plain (uncompressed) tar is accepted"),
    "xz": (lzma.compress(TWO_FILES), "tar stream is compressed; only a plain (uncompressed) tar is accepted"),
    "zstd": (
        b"\x28\xb5\x2f\xfd" + TWO_FILES,
        "tar stream is compressed; only a plain (uncompressed) tar is accepted",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
async def test_a_stream_that_is_not_a_plain_whole_tar_is_refused_with_its_reason(tmp_path: Path, case: str) -> None:
    data, message = MALFORMED[case]
    with pytest.raises(tarstream.Refused) as info:
        await tarstream.extract(chunks(data), str(tmp_path / "d"))
    rule = "compressed" if "compressed" in message else "malformed"
    assert (info.value.rule, info.value.member, str(info.value)) == (rule, None, message)
    assert os.listdir(tmp_path) == []


async def test_a_sparse_member_is_refused_with_its_reason(tmp_path: Path) -> None:
    data = tar_bytes([member("good.txt", b"good"), member("holes", type=tarfile.GNUTYPE_SPARSE)])
    with pytest.raises(tarstream.Refused) as info:
        await tarstream.extract(chunks(data), str(tmp_path / "d"))
    assert (info.value.rule, info.value.member, str(info.value)) == (
        "type",
        "holes",
        "tar member 'holes' is a sparse file; only plain files are accepted",
    )
    assert os.listdir(tmp_path) == []


def with_pax_comment(size: int) -> bytes:
    """A one-file pax stream whose extended header is ``size`` bytes long (its record is 17 bytes and the value)."""
    data = tar_bytes([member("p", b"x", pax_headers={"comment": "c" * (size - 17)})], tarfile.PAX_FORMAT)
    assert int(data[124:136].rstrip(b"\0 "), 8) == size  # the pax header's own size field
    return data


async def test_a_metadata_header_is_capped_at_max_header_bytes(tmp_path: Path) -> None:
    await tarstream.extract(chunks(with_pax_comment(tarstream.MAX_HEADER)), str(tmp_path / "ok"))
    assert (tmp_path / "ok" / "p").read_bytes() == b"x"
    with pytest.raises(tarstream.Refused) as info:
        await tarstream.extract(chunks(with_pax_comment(tarstream.MAX_HEADER + 1)), str(tmp_path / "d"))
    assert (info.value.rule, info.value.member, str(info.value)) == (
        "header",
        "././@PaxHeader",
        "tar member '././@PaxHeader' is a 1048577-byte metadata header (limit 1048576)",
    )
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("size", [tarstream.CHUNK - 1, tarstream.CHUNK + 1, 3 * tarstream.CHUNK + 5])
async def test_chunks_of_any_size_are_read_whole(tmp_path: Path, size: int) -> None:
    body = os.urandom(2 * tarstream.CHUNK + 3)
    data = tar_bytes([member("big.bin", body), member("small.txt", b"small")])
    await tarstream.extract(chunks(data, size), str(tmp_path / "d"))
    assert (tmp_path / "d" / "big.bin").read_bytes() == body
    assert (tmp_path / "d" / "small.txt").read_bytes() == b"small"


def hostile(case: str) -> list[Member]:
    return HOSTILE[case][0]


#: Hostile streams (each after a good member), with the rule, member and exact message the user reads.
REFUSALS: dict[str, tuple[list[Member], str, str, str]] = {
    "char-device": (
        hostile("char-device"),
        "type",
        "null",
        "tar member 'null' is a character device; only files, directories and links are accepted",
    ),
    "block-device": (
        hostile("block-device"),
        "type",
        "sda",
        "tar member 'sda' is a block device; only files, directories and links are accepted",
    ),
    "fifo": (
        hostile("fifo"),
        "type",
        "pipe",
        "tar member 'pipe' is a FIFO; only files, directories and links are accepted",
    ),
    "unknown-type": (
        [member("odd", type=b"Z")],
        "type",
        "odd",
        "tar member 'odd' is of type b'Z'; only files, directories and links are accepted",
    ),
    "absolute-symlink": (
        hostile("absolute-symlink"),
        "link",
        "l",
        "tar member 'l' is a symlink to '/etc/passwd', which is not relative",
    ),
    "symlink-without-target": (
        [member("l", type=tarfile.SYMTYPE, linkname="")],
        "link",
        "l",
        "tar member 'l' is a symlink to '', which is not relative",
    ),
    "symlink-nul-target": (
        [pax_member("l", {"linkpath": "x\0y"}, type=tarfile.SYMTYPE)],
        "link",
        "l",
        "tar member 'l' is a symlink to 'x\\x00y', which is not relative",
    ),
    "symlink-as-destination": (
        [member(".", type=tarfile.SYMTYPE, linkname="good.txt")],
        "link",
        ".",
        "tar member '.' would replace the destination with a symlink",
    ),
    "dotdot-symlink": (
        hostile("dotdot-symlink"),
        "link",
        "l",
        "tar member 'l' is a symlink to '../outside-target', which resolves outside the destination",
    ),
    "symlink-chain": (
        hostile("symlink-chain"),
        "link",
        "esc",
        "tar member 'esc' is a symlink to 'up/sub/../..', which resolves outside the destination",
    ),
    "write-through-symlink": (
        hostile("write-through-symlink"),
        "link",
        "link/escaped.txt",
        "tar member 'link/escaped.txt' goes through the symlink 'link'",
    ),
    "nested-write-through-symlink": (
        [
            member("a", type=tarfile.DIRTYPE, mode=0o755),
            member("a/link", type=tarfile.SYMTYPE, linkname="."),
            member("a/link/x", b"x"),
        ],
        "link",
        "a/link/x",
        "tar member 'a/link/x' goes through the symlink 'a/link'",
    ),
    "hardlink-to-destination-file": (
        hostile("hardlink-to-destination-file"),
        "link",
        "hard",
        "tar member 'hard' is a hardlink to 'keep.txt', not a file of this stream",
    ),
    "file-then-directory": (
        [member("f", b"x"), member("f/x", b"x")],
        "conflict",
        "f/x",
        "tar member 'f/x' clashes with another member (File exists)",
    ),
    "directory-then-file": (
        [member("d", type=tarfile.DIRTYPE, mode=0o755), member("d", b"x")],
        "conflict",
        "d",
        "tar member 'd' clashes with another member (a directory is in the way)",
    ),
    "file-then-symlink": (
        [member("s", b"x"), member("s", type=tarfile.SYMTYPE, linkname="good.txt")],
        "conflict",
        "s",
        "tar member 's' clashes with another member (File exists)",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
async def test_a_refusal_names_the_member_the_rule_and_why(tmp_path: Path, dest: Path, case: str) -> None:
    evil, rule, name, message = REFUSALS[case]
    data = tar_bytes([member("good.txt", b"good"), *evil], tarfile.PAX_FORMAT)
    before = snapshot(tmp_path)
    with pytest.raises(tarstream.Refused) as info:
        await tarstream.extract(chunks(data), str(dest))
    assert (info.value.rule, info.value.member, str(info.value)) == (rule, name, message)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("kind", [tarfile.REGTYPE, tarfile.LNKTYPE])
async def test_a_file_or_hardlink_cannot_replace_the_destination(tmp_path: Path, dest: Path, kind: bytes) -> None:
    data = tar_bytes([member("good.txt", b"good"), member(".", b"", type=kind, linkname="good.txt")])
    before = snapshot(tmp_path)
    with pytest.raises(tarstream.Refused) as info:
        await tarstream.extract(chunks(data), str(dest))
    assert info.value.rule == "path"
    assert info.value.member is not None
    assert str(info.value).startswith("tar member ")
    assert str(info.value).endswith(" would replace the destination with a file")
    assert snapshot(tmp_path) == before


async def test_the_caps_name_the_member_that_passed_them(tmp_path: Path) -> None:
    data = tar_bytes([member("a", b"a" * 60), member("b", b"b" * 41)])
    with pytest.raises(tarstream.Refused) as info:
        await tarstream.extract(chunks(data), str(tmp_path / "d"), max_bytes=100)
    assert (info.value.member, str(info.value)) == (
        "b",
        "tar member 'b' takes the stream past the limit of 100 bytes (max_bytes)",
    )
    data = tar_bytes([member(f"f{i}") for i in range(4)])
    with pytest.raises(tarstream.Refused) as info:
        await tarstream.extract(chunks(data), str(tmp_path / "d"), max_members=3)
    assert (info.value.member, str(info.value)) == (
        "f3",
        "tar member 'f3' is past the limit of 3 members (max_members)",
    )
    assert os.listdir(tmp_path) == []


async def test_a_hardlink_may_name_an_earlier_hardlink(tmp_path: Path) -> None:
    data = tar_bytes(
        [
            member("a", b"data"),
            member("h1", type=tarfile.LNKTYPE, linkname="a"),
            member("h2", type=tarfile.LNKTYPE, linkname="h1"),
        ]
    )
    await tarstream.extract(chunks(data), str(tmp_path / "d"))
    inode = os.stat(tmp_path / "d" / "a").st_ino
    assert [os.stat(tmp_path / "d" / n).st_ino for n in ("h1", "h2")] == [inode, inode]


async def test_a_later_member_of_the_same_name_replaces_the_earlier(tmp_path: Path) -> None:
    data = tar_bytes([member("f", b"first"), member("f", b"second"), member("f", b"third")])
    await tarstream.extract(chunks(data), str(tmp_path / "d"))
    assert os.listdir(tmp_path / "d") == ["f"]
    assert (tmp_path / "d" / "f").read_bytes() == b"third"


async def test_modes_of_directories_made_and_met(tmp_path: Path, dest: Path) -> None:
    # dest/sub (and its new child dir) already exist with modes of their own, which stay;
    # a parent made for a member (no header of its own) is 0o755; a new directory gets its header's mode.
    (dest / "sub" / "inner").mkdir()
    os.chmod(dest / "sub", 0o711)
    os.chmod(dest / "sub" / "inner", 0o700)
    data = tar_bytes(
        [
            member("sub", type=tarfile.DIRTYPE, mode=0o755),
            member("sub/inner", type=tarfile.DIRTYPE, mode=0o755),
            member("sub/inner/f", b"f"),
            member("made/for/f", b"f"),
            member("new", type=tarfile.DIRTYPE, mode=0o750),
        ]
    )
    await tarstream.extract(chunks(data), str(dest))

    def mode(name: str) -> int:
        return stat.S_IMODE(os.stat(dest / name).st_mode)

    assert [mode(n) for n in ("sub", "sub/inner", "made", "made/for", "new")] == [0o711, 0o700, 0o755, 0o755, 0o750]
    assert (dest / "sub" / "inner" / "f").read_bytes() == b"f"


async def test_a_file_keeps_its_mtime_and_an_mtime_the_os_refuses_is_ignored(tmp_path: Path) -> None:
    data = tar_bytes(
        [
            member("dated", b"x", mtime=1_000_000_000),
            pax_member("far", {"mtime": "1e300"}, b"x"),
            pax_member("nan", {"mtime": "nan"}, b"x"),
        ],
        tarfile.PAX_FORMAT,
    )
    await tarstream.extract(chunks(data), str(tmp_path / "d"))
    assert os.stat(tmp_path / "d" / "dated").st_mtime == 1_000_000_000
    assert (tmp_path / "d" / "far").read_bytes() == (tmp_path / "d" / "nan").read_bytes() == b"x"


async def test_extracting_into_a_file_is_not_a_directory(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError) as info:
        await tarstream.extract(chunks(tar_bytes([member("a", b"a")])), str(tmp_path / "file"))
    assert (info.value.errno, info.value.strerror, info.value.filename) == (
        errno.ENOTDIR,
        "not a directory",
        str(tmp_path / "file"),
    )
    assert (tmp_path / "file").read_text() == "x"
    assert os.listdir(tmp_path) == ["file"]


@pytest.mark.parametrize("exists", [True, False], ids=["existing", "new"])
async def test_the_stream_is_staged_beside_the_destination_and_a_refusal_leaves_it_untouched(
    tmp_path: Path, exists: bool
) -> None:
    dest = tmp_path / "dest"
    if exists:
        dest.mkdir()
        (dest / "keep").write_text("keep")
        os.utime(dest, ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))
    data = tar_bytes([member("a", b"a" * 5000), member("pipe", type=tarfile.FIFOTYPE)])
    seen: list[str] = []

    async def watched() -> AsyncIterator[bytes]:
        yield data[:1024]
        for _ in range(500):  # until the worker has made its staging directory
            seen[:] = [n for n in os.listdir(tmp_path) if n != "dest"]
            if seen:
                break
            await asyncio.sleep(0.01)
        yield data[1024:]

    before = os.stat(dest).st_mtime_ns if exists else None
    with pytest.raises(tarstream.Refused):
        await tarstream.extract(watched(), str(dest))
    assert len(seen) == 1
    assert seen[0].startswith(".dest.")
    assert seen[0].endswith(".orchard-part")
    assert [n for n in os.listdir(tmp_path) if n != "dest"] == []
    if exists:
        assert os.listdir(dest) == ["keep"]
        assert os.stat(dest).st_mtime_ns == before
    else:
        assert not dest.exists()


async def archived(src: Path, **options: object) -> list[tarfile.TarInfo]:
    """The members of ``archive(src, **options)``, read back with tarfile."""
    data = b"".join([c async for c in tarstream.archive(str(src), **options)])  # type: ignore[arg-type]
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return tar.getmembers()


async def test_archive_caps_name_the_entry_that_passed_them(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_bytes(b"a" * 60)
    (src / "b").write_bytes(b"b" * 41)
    (src / "c").write_bytes(b"")
    assert [m.name for m in await archived(src, max_bytes=101, max_members=3)] == ["a", "b", "c"]
    with pytest.raises(tarstream.Refused) as info:
        await archived(src, max_bytes=100)
    assert (info.value.rule, info.value.member, str(info.value)) == (
        "bytes",
        "b",
        "tar member 'b' takes the archive past the limit of 100 bytes (max_bytes)",
    )
    with pytest.raises(tarstream.Refused) as info:
        await archived(src, max_members=2)
    assert (info.value.rule, info.value.member, str(info.value)) == (
        "members",
        "c",
        "tar member 'c' is past the limit of 2 members (max_members)",
    )


async def test_archive_sends_devices_and_fifos_as_headers_and_skips_sockets(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    os.mkfifo(src / "pipe")
    (src / "f").write_text("f")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(src / "sock"))
        assert [(m.name, m.type) for m in await archived(src)] == [("f", tarfile.REGTYPE), ("pipe", tarfile.FIFOTYPE)]
    [null] = await archived(Path("/dev/null"))
    assert (null.name, null.type, null.devmajor, null.devminor) == ("null", tarfile.CHRTYPE, 1, 3)


async def test_a_changes_only_archive_takes_what_changed_since_and_not_the_excluded(tmp_path: Path) -> None:
    src = tmp_path / "src"
    for d in ("same", "grows", "skip"):
        (src / d).mkdir(parents=True)
        (src / d / "old").write_text("old")
    await asyncio.sleep(0.05)  # past the kernel's coarse clock, on both sides of since
    since = time.time_ns()
    await asyncio.sleep(0.05)
    (src / "same" / "old").write_text("rewritten")  # a file changed in a directory whose entries did not
    (src / "grows" / "new").write_text("new")  # a new file: its directory changed too
    (src / "skip" / "new").write_text("new")
    found = await archived(src, changed_since_ns=since, excluded=(str(src / "skip"),))
    assert sorted(m.name for m in found) == ["grows", "grows/new", "same/old"]
    assert sorted(m.name for m in await archived(src)) == [
        "grows",
        "grows/new",
        "grows/old",
        "same",
        "same/old",
        "skip",
        "skip/new",
        "skip/old",
    ]


def test_a_swapped_file_is_refused_with_its_name_and_why(tmp_path: Path) -> None:
    (tmp_path / "was-a-file").write_text("x")
    expected = os.lstat(tmp_path / "was-a-file")
    (tmp_path / "new").write_text("another file")  # made while the first exists: another inode
    os.replace(tmp_path / "new", tmp_path / "was-a-file")
    os.symlink("was-a-file", tmp_path / "link")
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name, why in [
            ("was-a-file", "was replaced while it was archived"),
            ("link", "was replaced by a symlink while it was archived"),
        ]:
            with pytest.raises(tarstream.Refused) as info:
                tarstream.open_regular(name, dir_fd, expected)
            assert (info.value.rule, info.value.member, str(info.value)) == (
                "changed",
                name,
                f"tar member {name!r} {why}",
            )
    finally:
        os.close(dir_fd)


async def test_extract_closes_the_stream_it_was_given_when_it_stops_early(tmp_path: Path) -> None:
    closed: list[bool] = []

    async def stream() -> AsyncIterator[bytes]:
        try:
            yield tar_bytes([member("pipe", type=tarfile.FIFOTYPE)])
            while True:
                yield b"\0" * 512
        finally:
            closed.append(True)

    chunks_given = stream()
    with pytest.raises(tarstream.Refused):
        await tarstream.extract(chunks_given, str(tmp_path / "d"))
    assert closed == [True]


async def test_extract_takes_an_iterable_without_aclose(tmp_path: Path) -> None:
    class Chunks:
        def __init__(self, data: bytes) -> None:
            self.data = data

        def __aiter__(self) -> AsyncIterator[bytes]:
            return chunks(self.data)

    await tarstream.extract(Chunks(tar_bytes([member("a", b"a")])), str(tmp_path / "d"))
    assert (tmp_path / "d" / "a").read_bytes() == b"a"


async def test_many_small_chunks_arrive_whole_when_the_worker_falls_behind(tmp_path: Path) -> None:
    bodies = {f"f{i:03}": os.urandom(3000 + i) for i in range(100)}
    data = tar_bytes([member(name, body) for name, body in bodies.items()])
    await tarstream.extract(chunks(data, 64), str(tmp_path / "d"))
    assert {p.name: p.read_bytes() for p in (tmp_path / "d").iterdir()} == bodies


async def restore(data: bytes, dest: Path, **caps: int) -> None:
    await tarstream.extract(chunks(data), str(dest), restore=True, **caps)


async def test_a_restore_keeps_absolute_symlinks_owners_modes_and_times_but_not_setuid(tmp_path: Path) -> None:
    out = tmp_path / "root"
    data = tar_bytes(
        [
            member(".", type=tarfile.DIRTYPE, mode=0o700),
            member("bin", type=tarfile.DIRTYPE, mode=0o1777, mtime=1_000_000_000, uid=4242, gid=4343),
            member("bin/tool", b"#!/bin/sh\n", mode=0o6775, mtime=1_100_000_000, uid=4242, gid=4343),
            member("bin/python", type=tarfile.SYMTYPE, linkname="/usr/bin/python3", uid=4242, gid=4343),
            member("bin/tool2", type=tarfile.LNKTYPE, linkname="bin/tool"),
            member("deep/er/f", b"f", mode=0o640, mtime=1_200_000_000),
        ]
    )
    await restore(data, out)
    tool, bindir = os.stat(out / "bin" / "tool"), os.stat(out / "bin")
    assert (stat.S_IMODE(tool.st_mode), tool.st_mtime) == (0o775, 1_100_000_000)
    assert (stat.S_IMODE(bindir.st_mode), bindir.st_mtime) == (0o1777, 1_000_000_000)  # set after its children
    assert os.readlink(out / "bin" / "python") == "/usr/bin/python3"
    assert os.stat(out / "bin" / "tool2").st_ino == tool.st_ino
    assert (out / "deep" / "er" / "f").read_bytes() == b"f"
    assert stat.S_IMODE(os.stat(out / "deep" / "er" / "f").st_mode) == 0o640
    owners = {
        (os.lstat(p).st_uid, os.lstat(p).st_gid) for p in (out / "bin", out / "bin" / "tool", out / "bin" / "python")
    }
    assert owners == ({(4242, 4343)} if os.geteuid() == 0 else {(os.getuid(), os.getgid())})
    assert stat.S_IMODE(os.stat(out).st_mode) != 0o700  # "." is the destination, left as it is


async def test_a_restore_replaces_what_stands_in_the_way_without_following_symlinks(tmp_path: Path, dest: Path) -> None:
    os.symlink(tmp_path / "outside-target", dest / "was-a-link")
    (dest / "was-a-file").write_text("file")
    (dest / "was-empty-dir").mkdir()
    data = tar_bytes(
        [
            member("was-a-link", b"new"),
            member("was-a-file", type=tarfile.DIRTYPE, mode=0o755),
            member("was-empty-dir", b"now a file"),
            member("keep.txt", type=tarfile.SYMTYPE, linkname="sub/old.txt"),
        ]
    )
    await restore(data, dest)
    assert (tmp_path / "outside-target").read_text() == "secret"
    assert not (dest / "was-a-link").is_symlink()
    assert (dest / "was-a-link").read_bytes() == b"new"
    assert (dest / "was-a-file").is_dir()
    assert (dest / "was-empty-dir").read_bytes() == b"now a file"
    assert os.readlink(dest / "keep.txt") == "sub/old.txt"


async def test_a_restore_writes_through_a_symlink_inside_the_destination_only(tmp_path: Path, dest: Path) -> None:
    await restore(tar_bytes([member("inner", type=tarfile.SYMTYPE, linkname="sub"), member("inner/x", b"x")]), dest)
    assert (dest / "sub" / "x").read_bytes() == b"x"
    data = tar_bytes([member("out", type=tarfile.SYMTYPE, linkname=str(tmp_path)), member("out/escaped.txt", b"x")])
    with pytest.raises(tarstream.Refused) as info:
        await restore(data, dest)
    assert (info.value.rule, info.value.member, str(info.value)) == (
        "link",
        "out/escaped.txt",
        "tar member 'out/escaped.txt' would be written through a symlink that leaves the destination",
    )
    assert not (tmp_path / "escaped.txt").exists()


#: What a restore still refuses: the member, and the rule and message.
RESTORE_REFUSALS: dict[str, tuple[list[Member], str, str, str]] = {
    "dotdot-name": (
        [member("a/../../escaped.txt", b"x")],
        "path",
        "a/../../escaped.txt",
        "tar member 'a/../../escaped.txt' has '..' in its name 'a/../../escaped.txt'",
    ),
    "fifo": (
        [member("pipe", type=tarfile.FIFOTYPE)],
        "type",
        "pipe",
        "tar member 'pipe' is a FIFO; only files, directories and links are accepted",
    ),
    "unknown-type": (
        [member("odd", type=b"Z")],
        "type",
        "odd",
        "tar member 'odd' is of type b'Z'; only files, directories and links are accepted",
    ),
    "symlink-without-target": (
        [member("l", type=tarfile.SYMTYPE, linkname="")],
        "link",
        "l",
        "tar member 'l' is a symlink to ''",
    ),
    "symlink-nul-target": (
        [pax_member("l", {"linkpath": "x\0y"}, type=tarfile.SYMTYPE)],
        "link",
        "l",
        "tar member 'l' is a symlink to 'x\\x00y'",
    ),
    "hardlink-to-a-file-not-in-the-stream": (
        [member("h", type=tarfile.LNKTYPE, linkname="keep.txt")],
        "link",
        "h",
        "tar member 'h' is a hardlink to 'keep.txt', not a file of this stream",
    ),
    "hardlink-to-itself": (
        [member("good.txt", type=tarfile.LNKTYPE, linkname="good.txt")],
        "link",
        "good.txt",
        "tar member 'good.txt' is a hardlink to 'good.txt', not a file of this stream",
    ),
    "hardlink-out": (
        [member("h", type=tarfile.LNKTYPE, linkname="../outside-target")],
        "link",
        "h",
        "tar member 'h' has '..' in its hardlink target '../outside-target'",
    ),
}


@pytest.mark.parametrize("case", sorted(RESTORE_REFUSALS))
async def test_a_restore_refuses_what_an_upload_refuses(tmp_path: Path, dest: Path, case: str) -> None:
    evil, rule, name, message = RESTORE_REFUSALS[case]
    data = tar_bytes([member("good.txt", b"good"), *evil], tarfile.PAX_FORMAT)
    with pytest.raises(tarstream.Refused) as info:
        await restore(data, dest)
    assert (info.value.rule, info.value.member, str(info.value)) == (rule, name, message)
    assert (tmp_path / "outside-target").read_text() == "secret"
    assert (dest / "keep.txt").read_text() == "keep"
    assert not (tmp_path / "escaped.txt").exists()


async def test_a_restore_has_the_upload_caps(tmp_path: Path) -> None:
    data = tar_bytes([member("a", b"a" * 60), member("b", b"b" * 41), member("c")])
    await restore(data, tmp_path / "ok", max_bytes=101, max_members=3)
    assert (tmp_path / "ok" / "b").read_bytes() == b"b" * 41
    with pytest.raises(tarstream.Refused) as info:
        await restore(data, tmp_path / "d", max_bytes=100)
    assert (info.value.rule, info.value.member, str(info.value)) == (
        "bytes",
        "b",
        "tar member 'b' takes the stream past the limit of 100 bytes (max_bytes)",
    )
    with pytest.raises(tarstream.Refused) as info:
        await restore(data, tmp_path / "d", max_members=2)
    assert (info.value.rule, info.value.member, str(info.value)) == (
        "members",
        "c",
        "tar member 'c' is past the limit of 2 members (max_members)",
    )


async def test_a_refusal_keeps_a_parent_it_made_once_something_else_is_in_it(tmp_path: Path) -> None:
    dest = tmp_path / "new" / "deeper"
    data = tar_bytes([member("a", b"a" * 5000), member("pipe", type=tarfile.FIFOTYPE)])

    async def meanwhile() -> AsyncIterator[bytes]:
        yield data[:1024]
        for _ in range(500):  # until the worker has made the parent and its staging directory in it
            if (tmp_path / "new").exists() and os.listdir(tmp_path / "new"):
                break
            await asyncio.sleep(0.01)
        (tmp_path / "new" / "someone-else").write_text("theirs")
        yield data[1024:]

    with pytest.raises(tarstream.Refused) as info:
        await tarstream.extract(meanwhile(), str(dest))
    assert info.value.rule == "type"
    assert os.listdir(tmp_path / "new") == ["someone-else"]


async def test_extracting_into_a_mount_point_stages_inside_it() -> None:
    # A mount point's parent is another file system, where no rename could reach: the staging goes inside.
    mount = Path("/dev/shm")
    if not mount.is_dir() or os.stat(mount).st_dev == os.stat(mount.parent).st_dev:
        pytest.fail("this test needs a tmpfs mounted at /dev/shm (it could not run)", pytrace=False)
    name = f"orchard-test-{os.getpid()}-{time.time_ns()}"
    try:
        await tarstream.extract(chunks(tar_bytes([member(f"{name}/f", b"f")])), str(mount))
        assert (mount / name / "f").read_bytes() == b"f"
        assert not [n for n in os.listdir(mount) if n.endswith(".orchard-part")]
    finally:
        shutil.rmtree(mount / name, ignore_errors=True)


async def test_a_restore_replaces_a_symlink_where_the_snapshot_has_a_directory(tmp_path: Path, dest: Path) -> None:
    # The snapshot's directory is made in its place: nothing is chmodded, chowned or written through the link.
    outside = tmp_path / "outside-dir"
    outside.mkdir()
    os.chmod(outside, 0o755)
    os.utime(outside, (1_000_000, 1_000_000))
    os.symlink(outside, dest / "d")
    data = tar_bytes([member("d", type=tarfile.DIRTYPE, mode=0o700, mtime=2_000_000), member("d/f", b"f")])
    await restore(data, dest)
    assert (stat.S_IMODE(os.stat(outside).st_mode), os.stat(outside).st_mtime, os.listdir(outside)) == (
        0o755,
        1_000_000,
        [],
    )
    assert not (dest / "d").is_symlink()
    assert (stat.S_IMODE(os.stat(dest / "d").st_mode), os.stat(dest / "d").st_mtime) == (0o700, 2_000_000)
    assert (dest / "d" / "f").read_bytes() == b"f"


async def test_directories_met_at_any_depth_keep_their_modes(dest: Path) -> None:
    (dest / "sub" / "inner" / "deep").mkdir(parents=True)
    os.chmod(dest / "sub" / "inner", 0o711)
    os.chmod(dest / "sub" / "inner" / "deep", 0o700)
    data = tar_bytes(
        [
            member("sub/inner", type=tarfile.DIRTYPE, mode=0o755),
            member("sub/inner/deep", type=tarfile.DIRTYPE, mode=0o755),
            member("sub/inner/deep/f", b"f"),
        ]
    )
    await tarstream.extract(chunks(data), str(dest))
    assert [stat.S_IMODE(os.stat(dest / p).st_mode) for p in ("sub/inner", "sub/inner/deep")] == [0o711, 0o700]
    assert (dest / "sub" / "inner" / "deep" / "f").read_bytes() == b"f"


async def test_a_restore_links_hardlinks_to_what_the_stream_made_without_following_it(
    tmp_path: Path, dest: Path
) -> None:
    # "t" is first a file, then a symlink out of the destination (a restore keeps absolute symlinks):
    # a hardlink to "t" links that symlink, never the file outside.
    data = tar_bytes(
        [
            member("a", b"data"),
            member("h1", type=tarfile.LNKTYPE, linkname="a"),
            member("h2", type=tarfile.LNKTYPE, linkname="h1"),
            member("t", b"t"),
            member("t", type=tarfile.SYMTYPE, linkname=str(tmp_path / "outside-target")),
            member("h3", type=tarfile.LNKTYPE, linkname="t"),
        ]
    )
    await restore(data, dest)
    inode = os.stat(dest / "a").st_ino
    assert [os.stat(dest / n).st_ino for n in ("h1", "h2")] == [inode, inode]
    assert os.readlink(dest / "h3") == str(tmp_path / "outside-target")
    assert os.stat(tmp_path / "outside-target").st_nlink == 1


async def test_a_restore_ignores_an_mtime_the_os_refuses(tmp_path: Path) -> None:
    data = tar_bytes(
        [
            pax_member("d", {"mtime": "1e300"}, type=tarfile.DIRTYPE, mode=0o755),
            pax_member("d/far", {"mtime": "1e300"}, b"x"),
            pax_member("d/nan", {"mtime": "nan"}, b"x"),
        ],
        tarfile.PAX_FORMAT,
    )
    await restore(data, tmp_path / "r")
    assert (tmp_path / "r" / "d" / "far").read_bytes() == (tmp_path / "r" / "d" / "nan").read_bytes() == b"x"


async def test_archive_sends_a_block_device_as_a_header(tmp_path: Path) -> None:
    try:
        os.mknod(tmp_path / "loop", stat.S_IFBLK | 0o600, os.makedev(7, 42))
    except PermissionError:
        pytest.fail(
            "this test needs CAP_MKNOD to make a block device (it could not run): run it as root", pytrace=False
        )
    [blk] = await archived(tmp_path / "loop")
    assert (blk.name, blk.type, blk.devmajor, blk.devminor) == ("loop", tarfile.BLKTYPE, 7, 42)


async def test_a_changes_only_archive_takes_a_file_changed_at_the_very_nanosecond(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("f")
    since = os.lstat(src / "f").st_ctime_ns
    assert "f" in [m.name for m in await archived(src, changed_since_ns=since)]
    assert "f" not in [m.name for m in await archived(src, changed_since_ns=since + 1)]


async def test_a_restore_sets_no_mode_through_a_symlink_that_later_replaced_a_directory(
    tmp_path: Path, dest: Path
) -> None:
    # A directory's mode and times are set last; by then a later member may have put a symlink out in its place.
    outside = tmp_path / "outside-dir"
    outside.mkdir()
    os.chmod(outside, 0o755)
    os.utime(outside, (1_000_000, 1_000_000))
    data = tar_bytes(
        [
            member("d", type=tarfile.DIRTYPE, mode=0o700, mtime=2_000_000),
            member("d", type=tarfile.SYMTYPE, linkname=str(outside)),
        ]
    )
    await restore(data, dest)
    assert os.readlink(dest / "d") == str(outside)
    assert (stat.S_IMODE(os.stat(outside).st_mode), os.stat(outside).st_mtime) == (0o755, 1_000_000)


async def test_a_restore_sets_the_modes_of_the_directories_before_one_a_symlink_replaced(tmp_path: Path) -> None:
    # Directories are finished deepest (latest) first: one replaced by a symlink is passed over, not the end.
    data = tar_bytes(
        [
            member("a", type=tarfile.DIRTYPE, mode=0o751),
            member("b", type=tarfile.DIRTYPE, mode=0o700),
            member("b", type=tarfile.SYMTYPE, linkname="a"),
        ]
    )
    await restore(data, tmp_path / "r")
    assert os.readlink(tmp_path / "r" / "b") == "a"
    assert stat.S_IMODE(os.lstat(tmp_path / "r" / "a").st_mode) == 0o751


async def test_a_refusal_after_the_staging_directory_vanished_is_still_the_refusal(tmp_path: Path) -> None:
    # Undoing removes what is left of the staging directory: that nothing is left is no second error.
    data = tar_bytes([member("../x", b"x")])

    async def stream() -> AsyncIterator[bytes]:
        yield data[:100]  # not yet a whole header: the worker waits for the rest
        while not (staged := list(tmp_path.glob(".dest.*.orchard-part"))):
            await asyncio.sleep(0.01)
        shutil.rmtree(staged[0])
        yield data[100:]

    with pytest.raises(tarstream.Refused) as info:
        await tarstream.extract(stream(), str(tmp_path / "dest"))
    assert info.value.rule == "path"
    assert os.listdir(tmp_path) == []


def daemons(name: str) -> list[bool]:
    """Whether each running thread of that name is a daemon (an earlier test's may be ending)."""
    return [t.daemon for t in threading.enumerate() if t.name == name]


async def test_extract_unpacks_in_a_daemon_thread_named_orchard_untar(tmp_path: Path) -> None:
    # A daemon, so that a stream never ended cannot keep the process from exiting; named for thread dumps.
    data = tar_bytes([member("f", b"f")])
    seen: list[bool] = []

    async def stream() -> AsyncIterator[bytes]:
        yield data[:100]
        seen.extend(daemons("orchard-untar"))
        yield data[100:]

    await tarstream.extract(stream(), str(tmp_path / "d"))
    assert seen
    assert all(seen)
    assert (tmp_path / "d" / "f").read_bytes() == b"f"


async def test_archive_tars_in_a_daemon_thread_named_orchard_tar(tmp_path: Path) -> None:
    # More than the queue and the buffer hold, so the worker is still writing when the first chunk arrives.
    (tmp_path / "big").write_bytes(os.urandom(8 * tarstream.CHUNK + tarstream._DEPTH * tarstream.CHUNK))
    stream = tarstream.archive(str(tmp_path / "big"))
    try:
        await anext(stream)
        seen = daemons("orchard-tar")
        assert seen
        assert all(seen)
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


async def test_archive_yields_chunks_of_chunk_bytes(tmp_path: Path) -> None:
    # Few large chunks, not many small ones: each is a message to the other side.
    (tmp_path / "big").write_bytes(os.urandom(4 * tarstream.CHUNK))
    sizes = [len(c) async for c in tarstream.archive(str(tmp_path / "big"))]
    assert len(sizes) <= 4 + 2, sizes  # 4 chunks of data, the header and end blocks, a partial chunk


async def test_a_file_bind_mounted_twice_in_the_tree_is_archived_twice_not_as_a_hardlink(tmp_path: Path) -> None:
    # One inode at two names, but with one link: a hardlink member would make two names of what are two files.
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_bytes(b"a")
    (src / "b").write_bytes(b"")
    if subprocess.run(["mount", "--bind", str(src / "a"), str(src / "b")], capture_output=True).returncode:
        pytest.fail("this test needs to bind-mount a file (it could not run): run it as root", pytrace=False)
    try:
        members = await archived(src)
    finally:
        subprocess.run(["umount", str(src / "b")], check=True)
    assert [(m.name, m.type, m.size) for m in members] == [("a", tarfile.REGTYPE, 1), ("b", tarfile.REGTYPE, 1)]
