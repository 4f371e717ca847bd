"""Streamed tar in and out (shared by client and executor), in-process on a temp dir."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from orchard_executor import tarstream

pytestmark = pytest.mark.unit


def tar_bytes(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def member(name: str, data: bytes = b"", **attrs: object) -> tuple[tarfile.TarInfo, bytes | None]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    for k, v in attrs.items():
        setattr(info, k, v)
    return info, data if info.isreg() else None


async def chunks(data: bytes, size: int = 1000) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


async def test_archive_then_extract_keeps_the_tree(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "a" / "empty").mkdir(parents=True)
    (src / "a" / "f.bin").write_bytes(os.urandom(3 * tarstream.CHUNK + 7))
    (src / "x").write_text("x")
    os.chmod(src / "x", 0o600)
    os.symlink("a/f.bin", src / "link")
    dest = tmp_path / "dest"

    await tarstream.extract(tarstream.archive(str(src)), str(dest))

    assert sorted(os.listdir(dest)) == ["a", "link", "x"]
    assert (dest / "a" / "f.bin").read_bytes() == (src / "a" / "f.bin").read_bytes()
    assert (dest / "a" / "empty").is_dir()
    assert stat.S_IMODE(os.stat(dest / "x").st_mode) == 0o600
    assert os.readlink(dest / "link") == "a/f.bin"


async def test_a_single_file_is_archived_under_its_own_name(tmp_path: Path) -> None:
    (tmp_path / "one.txt").write_text("1")
    data = b"".join([c async for c in tarstream.archive(str(tmp_path / "one.txt"))])
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert tar.getnames() == ["one.txt"]


async def test_archiving_a_missing_path_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        async for _ in tarstream.archive(str(tmp_path / "missing")):
            pass


@pytest.mark.parametrize(
    "evil",
    [
        [member("../escaped.txt", b"x")],
        [member("/abs-escaped.txt", b"x")],
        [member("inner/../../escaped.txt", b"x")],
        # A symlink out of the tree, then a file written through it.
        [member("link", type=tarfile.SYMTYPE, linkname=".."), member("link/escaped.txt", b"x")],
        [member("hard", type=tarfile.LNKTYPE, linkname="../outside-target")],
    ],
    ids=["dotdot", "absolute", "nested-dotdot", "through-symlink", "hardlink-out"],
)
async def test_members_leaving_the_destination_are_refused(
    tmp_path: Path, evil: list[tuple[tarfile.TarInfo, bytes | None]]
) -> None:
    (tmp_path / "outside-target").write_text("secret")
    dest = tmp_path / "dest"
    with pytest.raises(tarfile.TarError):
        await tarstream.extract(chunks(tar_bytes(evil)), str(dest))
    assert not (tmp_path / "escaped.txt").exists()
    assert not Path("/abs-escaped.txt").exists()
    assert (tmp_path / "outside-target").read_text() == "secret"


async def test_garbage_is_a_tar_error_and_does_not_hang(tmp_path: Path) -> None:
    with pytest.raises(tarfile.TarError):
        await tarstream.extract(chunks(b"this is not a tar archive" * 1000), str(tmp_path / "d"))
