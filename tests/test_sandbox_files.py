"""Files: atomic streamed writes, reads, stat/list/mkdir/remove, typed errors, big files, tar trees."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import stat
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import orchard
from orchard import errors
from support import agen, eventually, pattern_chunks, sha256_file

pytestmark = pytest.mark.executor

MiB = 1024 * 1024


async def names(sb: orchard.Sandbox, path: str = ".") -> list[str]:
    return [e.name for e in await sb.list_dir(path)]


async def no_temp_files(sb: orchard.Sandbox, path: str = ".") -> bool:
    return not any("orchard-tmp" in n for n in await names(sb, path))


async def test_text_and_bytes_round_trip(sb: orchard.Sandbox) -> None:
    st = await sb.write_file("t.txt", "héllo\nwörld")
    assert st.type == "file"
    assert st.size == len("héllo\nwörld".encode())
    assert await sb.read_file("t.txt") == "héllo\nwörld".encode()
    every_byte = bytes(range(256)) * 3
    await sb.write_file("b.bin", every_byte)
    assert await sb.read_file("b.bin") == every_byte
    await sb.write_file("empty", b"")
    assert await sb.read_file("empty") == b""
    # The files are where commands see them.
    assert (await sb.exec(["cat", "t.txt"])).stdout == "héllo\nwörld"


async def test_relative_paths_resolve_against_the_workdir(sb: orchard.Sandbox) -> None:
    workdir = (await sb.info()).cwd
    st = await sb.write_file("rel.txt", "r")
    assert st.path == os.path.join(workdir, "rel.txt")
    assert await sb.read_file(os.path.join(workdir, "rel.txt")) == b"r"
    assert await sb.read_file("./sub/../rel.txt") == b"r"


async def test_overwrite_replaces_and_leaves_no_temp_files(sb: orchard.Sandbox) -> None:
    for i in range(5):
        await sb.write_file("f.txt", f"version {i}" * (i + 1))
    assert await sb.read_file("f.txt") == b"version 4" * 5
    assert await names(sb) == ["f.txt"]


async def test_mode_is_honoured(sb: orchard.Sandbox) -> None:
    for mode in (0o600, 0o755, 0o640, 0o777):
        st = await sb.write_file(f"m{mode:o}", "#!/bin/sh\necho ran\n", mode=mode)
        assert st.mode == mode
        assert (await sb.stat(f"m{mode:o}")).mode == mode
    assert (await sb.exec(["./m755"])).stdout == "ran\n"
    st = await sb.write_file("m755", "#!/bin/sh\necho rewritten\n", mode=0o700)
    assert st.mode == 0o700
    assert (await sb.exec(["stat", "-c", "%a", "m755"])).stdout.strip() == "700"


async def test_parents_are_created(sb: orchard.Sandbox) -> None:
    st = await sb.write_file("a/b/c/deep.txt", "deep")
    assert st.name == "deep.txt"
    assert (await sb.stat("a/b")).type == "directory"
    assert await sb.read_file("a/b/c/deep.txt") == b"deep"


async def test_without_parents_a_missing_directory_fails(sb: orchard.Sandbox) -> None:
    with pytest.raises(errors.PathNotFound) as info:
        await sb.write_file("missing/x.txt", "x", parents=False)
    assert isinstance(info.value, FileNotFoundError)
    assert not await sb.exists("missing")


async def test_a_write_under_a_regular_file_fails_cleanly(sb: orchard.Sandbox) -> None:
    await sb.write_file("plain", "i am a file")
    for parents in (True, False):
        with pytest.raises(errors.NotADirectory) as info:
            await sb.write_file("plain/x.txt", "x", parents=parents)
        assert isinstance(info.value, NotADirectoryError)
    assert await sb.read_file("plain") == b"i am a file"
    assert await names(sb) == ["plain"]


async def test_writing_over_a_directory_fails_and_keeps_it(sb: orchard.Sandbox) -> None:
    await sb.write_file("dir/inside", "kept")
    with pytest.raises(errors.IsADirectory) as info:
        await sb.write_file("dir", "x")
    assert isinstance(info.value, IsADirectoryError)
    assert await sb.read_file("dir/inside") == b"kept"


async def test_a_broken_upload_leaves_the_existing_file_untouched(sb: orchard.Sandbox) -> None:
    await sb.write_file("precious", "original content")

    class UploadFailed(Exception):
        pass

    async def failing() -> AsyncIterator[bytes]:
        for _ in range(4):
            yield b"x" * MiB
            await asyncio.sleep(0)
        raise UploadFailed("the source broke mid-way")

    # The error from the source surfaces as itself, not as a lost sandbox.
    with pytest.raises(UploadFailed):
        await sb.write_file("precious", failing())
    assert await sb.read_file("precious") == b"original content"
    await eventually(lambda: no_temp_files(sb), what="the partial temp file is removed")
    assert await names(sb) == ["precious"]


async def test_read_errors_are_typed(sb: orchard.Sandbox) -> None:
    with pytest.raises(errors.PathNotFound):
        await sb.read_file("nope.txt")
    await sb.mkdir("d")
    with pytest.raises(errors.IsADirectory):
        await sb.read_file("d")


async def test_pseudo_files_are_read_whole(sb: orchard.Sandbox) -> None:
    # /proc files report size 0 but have content.
    data = await sb.read_file("/proc/version")
    assert data
    assert data == (await sb.exec(["cat", "/proc/version"])).stdout_bytes


async def test_stat_of_file_directory_and_symlink(sb: orchard.Sandbox) -> None:
    await sb.write_file("dir/file.txt", "12345", mode=0o640)
    await sb.exec(["ln", "-s", "dir/file.txt", "link"])
    f = await sb.stat("dir/file.txt")
    assert (f.name, f.type, f.size, f.mode, f.link_target) == ("file.txt", "file", 5, 0o640, None)
    assert f.mtime > 0
    d = await sb.stat("dir")
    assert d.type == "directory"
    link = await sb.stat("link")
    assert (link.type, link.link_target) == ("symlink", "dir/file.txt")
    assert await sb.read_file("link") == b"12345"  # reading follows the link
    with pytest.raises(errors.PathNotFound):
        await sb.stat("missing")
    assert await sb.exists("link")
    assert not await sb.exists("missing")


async def test_list_dir(sb: orchard.Sandbox) -> None:
    assert await sb.list_dir() == []
    await sb.write_file("b.txt", "bb")
    await sb.mkdir("a_dir")
    await sb.write_file(".hidden", "")
    await sb.exec(["ln", "-s", "b.txt", "c_link"])
    entries = await sb.list_dir(".")
    assert [(e.name, e.type) for e in entries] == [
        (".hidden", "file"),
        ("a_dir", "directory"),
        ("b.txt", "file"),
        ("c_link", "symlink"),
    ]
    assert entries[2].size == 2
    assert entries[3].link_target == "b.txt"
    with pytest.raises(errors.PathNotFound):
        await sb.list_dir("missing")
    with pytest.raises(errors.NotADirectory):
        await sb.list_dir("b.txt")


async def test_mkdir(sb: orchard.Sandbox) -> None:
    st = await sb.mkdir("x/y/z", mode=0o750)
    assert st.type == "directory"
    assert st.mode == 0o750
    # Exactly the mode asked for, as with files: no umask.
    assert (await sb.mkdir("open", mode=0o777)).mode == 0o777
    assert (await sb.mkdir("flat", mode=0o777, parents=False)).mode == 0o777
    # exist_ok by default, and an existing directory keeps its mode.
    assert (await sb.mkdir("x/y/z")).mode == 0o750
    with pytest.raises(errors.PathExists) as info:
        await sb.mkdir("x/y/z", exist_ok=False)
    assert isinstance(info.value, FileExistsError)
    with pytest.raises(errors.PathNotFound):
        await sb.mkdir("no/parent", parents=False)
    await sb.write_file("f", "")
    with pytest.raises(errors.PathExists):
        await sb.mkdir("f")  # exist_ok does not cover a file in the way
    with pytest.raises(errors.NotADirectory):
        await sb.mkdir("f/sub")


async def test_remove(sb: orchard.Sandbox) -> None:
    await sb.write_file("tree/a/b.txt", "b")
    await sb.write_file("tree/c.txt", "c")
    await sb.write_file("target/keep.txt", "keep")
    await sb.exec(["ln", "-s", "target", "dirlink"])
    await sb.write_file("single", "s")

    await sb.remove("single")
    assert not await sb.exists("single")
    with pytest.raises(errors.PathNotFound) as info:
        await sb.remove("single")
    assert isinstance(info.value, FileNotFoundError)
    await sb.remove("single", missing_ok=True)

    with pytest.raises(errors.OrchardError) as not_empty:
        await sb.remove("tree")
    assert isinstance(not_empty.value, OSError)
    assert await sb.read_file("tree/a/b.txt") == b"b"
    await sb.remove("tree", recursive=True)
    assert not await sb.exists("tree")

    await sb.remove("dirlink", recursive=True)  # the link goes, not what it points at
    assert not await sb.exists("dirlink")
    assert await sb.read_file("target/keep.txt") == b"keep"

    await sb.mkdir("emptydir")
    await sb.remove("emptydir")
    assert await names(sb) == ["target"]


async def test_a_100_mib_file_streamed_both_ways(sb: orchard.Sandbox) -> None:
    chunks = pattern_chunks(100 * MiB, MiB, seed=1)
    digest = hashlib.sha256(b"".join(chunks)).hexdigest()
    st = await sb.write_file("big.bin", agen(chunks))
    assert st.size == 100 * MiB
    del chunks
    assert (await sb.exec(["sha256sum", "big.bin"])).stdout.split()[0] == digest
    h, n, pieces = hashlib.sha256(), 0, 0
    async for chunk in sb.stream_file("big.bin"):
        h.update(chunk)
        n += len(chunk)
        pieces += 1
    assert n == 100 * MiB
    assert pieces > 1
    assert h.hexdigest() == digest


async def test_a_100_mib_file_uploaded_and_downloaded(sb: orchard.Sandbox, tmp_path: Path) -> None:
    local = tmp_path / "up.bin"
    with open(local, "wb") as f:
        for chunk in pattern_chunks(100 * MiB + 12345, MiB, seed=2):
            f.write(chunk)
    os.chmod(local, 0o640)
    digest = sha256_file(local)
    st = await sb.upload(local, "remote/up.bin")
    assert (st.size, st.mode) == (100 * MiB + 12345, 0o640)
    assert (await sb.exec(["sha256sum", "remote/up.bin"])).stdout.split()[0] == digest
    back = tmp_path / "down.bin"
    await sb.download("remote/up.bin", back)
    assert sha256_file(back) == digest
    assert not (tmp_path / "down.bin.orchard-part").exists()


def _tree(root: Path) -> dict[str, tuple[str, int, bytes | str | None]]:
    """Every entry under root: type, permission bits, contents or link target."""
    found: dict[str, tuple[str, int, bytes | str | None]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                found[rel] = ("symlink", 0, os.readlink(path))
            elif stat.S_ISDIR(st.st_mode):
                found[rel] = ("dir", stat.S_IMODE(st.st_mode), None)
            else:
                found[rel] = ("file", stat.S_IMODE(st.st_mode), path.read_bytes())
    return found


async def test_a_directory_tree_round_trips_through_tar(sb: orchard.Sandbox, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "bin").mkdir(parents=True)
    (src / "nested" / "empty" / "deeper").mkdir(parents=True)
    (src / "bin" / "run.sh").write_text("#!/bin/sh\necho from-tar\n")
    os.chmod(src / "bin" / "run.sh", 0o755)
    (src / "secret.key").write_bytes(b"\x00\xffkey")
    os.chmod(src / "secret.key", 0o600)
    (src / "readme.md").write_text("read me\n")
    os.chmod(src / "readme.md", 0o644)
    (src / "big.bin").write_bytes(os.urandom(2 * MiB + 3))
    os.symlink("bin/run.sh", src / "run-link")
    os.symlink("../readme.md", src / "nested" / "up-link")
    os.chmod(src / "nested" / "empty", 0o700)
    expected = _tree(src)

    st = await sb.upload(src, "dest")
    assert st.type == "directory"
    # Inside the sandbox: modes, links and executability are real.
    assert (await sb.stat("dest/secret.key")).mode == 0o600
    assert (await sb.stat("dest/bin/run.sh")).mode == 0o755
    assert (await sb.stat("dest/nested/up-link")).link_target == "../readme.md"
    assert (await sb.stat("dest/nested/empty/deeper")).type == "directory"
    assert (await sb.exec(["./run-link"], cwd="dest")).stdout == "from-tar\n"

    out = tmp_path / "out"
    await sb.download("dest", out)
    assert _tree(out) == expected


async def test_upload_tar_refuses_paths_leaving_the_destination(sb: orchard.Sandbox) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        ok = tarfile.TarInfo("fine.txt")
        ok.size = 2
        tar.addfile(ok, io.BytesIO(b"ok"))
        evil = tarfile.TarInfo("../escaped.txt")
        evil.size = 4
        tar.addfile(evil, io.BytesIO(b"evil"))
    with pytest.raises(errors.InvalidRequest):
        await sb.upload_tar("dest", buf.getvalue())
    assert not await sb.exists("escaped.txt")


async def test_upload_tar_rejects_garbage(sb: orchard.Sandbox) -> None:
    with pytest.raises(errors.InvalidRequest):
        await sb.upload_tar("dest", b"not a tar" * 1000)


async def test_download_tar_of_a_missing_path(sb: orchard.Sandbox, tmp_path: Path) -> None:
    with pytest.raises(errors.PathNotFound):
        async for _ in sb.download_tar("missing"):
            pass
    with pytest.raises(errors.PathNotFound):
        await sb.download("missing", tmp_path / "x")
    assert not (tmp_path / "x").exists()
