"""The executor's file operations (orchard_executor.files), in this process on real files in tmp_path.

Each error is checked whole (code, message and path, as the client gets
them), and each operation by what it leaves on disk: contents, modes, no
temporary file left behind, the old file untouched by a failed write.
"""

from __future__ import annotations

import array
import asyncio
import errno
import fcntl
import io
import os
import stat
import tarfile
import threading
import time
import warnings
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from orchard_executor import files
from orchard_executor.errors import ExecutorError
from orchard_executor.protocol import Error, FileStat

pytestmark = pytest.mark.unit

MiB = 1024 * 1024


def error(code: str, message: str, path: str | None = None) -> Error:
    return Error(code=code, message=message, path=path)  # type: ignore[arg-type]


def os_error(err: int, path: str) -> Error:
    """The error from_os_error makes of ``err`` on ``path``."""
    return error(_CODES[err], f"{os.strerror(err)}: {path}", path)


_CODES = {
    errno.ENOENT: "file_not_found",
    errno.EEXIST: "file_exists",
    errno.ENOTEMPTY: "file_exists",
    errno.EISDIR: "is_a_directory",
    errno.ENOTDIR: "not_a_directory",
    errno.EACCES: "permission_denied",
    errno.EPERM: "permission_denied",
    errno.ELOOP: "bad_request",
}


async def chunks_of(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


async def collect(stream: AsyncIterator[bytes]) -> bytes:
    return b"".join([chunk async for chunk in stream])


def tar_of(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def file_member(name: str, data: bytes, mode: int = 0o644) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    return info, data


def symlink_member(name: str, target: str) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    return info, None


def names_in(data: bytes) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        return tar.getnames()


_FS_IOC_GETFLAGS = 0x80086601
_FS_IOC_SETFLAGS = 0x40086602
_FS_IMMUTABLE_FL = 0x10


def _set_immutable(path: Path, on: bool) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        flags = array.array("i", [0])
        fcntl.ioctl(fd, _FS_IOC_GETFLAGS, flags, True)
        flags[0] = flags[0] | _FS_IMMUTABLE_FL if on else flags[0] & ~_FS_IMMUTABLE_FL
        fcntl.ioctl(fd, _FS_IOC_SETFLAGS, flags, True)
    finally:
        os.close(fd)


@contextmanager
def unwritable(directory: Path) -> Iterator[int]:
    """Make ``directory`` refuse new and removed entries (immutable as root, read-only otherwise); yields the errno."""
    if os.geteuid() == 0:
        try:
            _set_immutable(directory, True)
        except OSError as exc:
            pytest.fail(
                f"this test needs the immutable flag on {directory}'s file system (it could not run): {exc.strerror}",
                pytrace=False,
            )
        try:
            yield errno.EPERM
        finally:
            _set_immutable(directory, False)
    else:
        directory.chmod(0o500)
        try:
            yield errno.EACCES
        finally:
            directory.chmod(0o700)


# -- resolve ------------------------------------------------------------------


def test_an_empty_path_is_a_bad_request() -> None:
    with pytest.raises(ExecutorError) as exc:
        files.resolve("", "/work")
    assert exc.value.error == error("bad_request", "path is empty")
    assert str(exc.value) == "path is empty"


def test_a_path_holding_a_nul_byte_is_a_bad_request() -> None:
    with pytest.raises(ExecutorError) as exc:
        files.resolve("a\0b", "/work")
    assert exc.value.error == error("bad_request", "a path cannot hold a NUL byte")
    assert str(exc.value) == "a path cannot hold a NUL byte"


def test_a_relative_path_is_taken_from_the_working_directory_and_normalized() -> None:
    assert files.resolve("x/../y/./z", "/work") == "/work/y/z"
    assert files.resolve("/abs/../b//c/", "/work") == "/b/c"
    assert files.resolve(".", "/work") == "/work"


# -- open_regular ---------------------------------------------------------------


def test_open_regular_opens_a_file_non_blocking_and_close_on_exec(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"hello")
    for follow in (True, False):
        fd = files.open_regular(str(path), follow=follow)
        try:
            assert os.read(fd, 100) == b"hello"
            assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NONBLOCK
            assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
            assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
        finally:
            os.close(fd)


def test_open_regular_follows_a_symlink_by_default(tmp_path: Path) -> None:
    (tmp_path / "target").write_bytes(b"through the link")
    (tmp_path / "link").symlink_to("target")
    fd = files.open_regular(str(tmp_path / "link"))
    try:
        assert os.read(fd, 100) == b"through the link"
    finally:
        os.close(fd)


def test_open_regular_without_follow_refuses_a_symlink_even_to_a_file_out_of_the_root(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.write_bytes(b"secret")
    root = tmp_path / "root"
    root.mkdir()
    (root / "file").write_bytes(b"inside")
    for name, target in (("in", "file"), ("out", str(outside)), ("up", "../outside")):
        link = root / name
        link.symlink_to(target)
        with pytest.raises(ExecutorError) as exc:
            files.open_regular(str(link), follow=False)
        assert exc.value.error == error("bad_request", f"{link} is a symlink", str(link))


def test_open_regular_without_follow_reports_a_missing_file_as_not_found(tmp_path: Path) -> None:
    path = str(tmp_path / "missing")
    for follow in (False, True):
        with pytest.raises(ExecutorError) as exc:
            files.open_regular(path, follow=follow)
        assert exc.value.error == os_error(errno.ENOENT, path)


def test_open_regular_reports_a_symlink_loop_it_follows_with_the_os_reason(tmp_path: Path) -> None:
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    path = str(tmp_path / "a")
    with pytest.raises(ExecutorError) as exc:
        files.open_regular(path)
    assert exc.value.error == os_error(errno.ELOOP, path)


def test_open_regular_refuses_a_directory(tmp_path: Path) -> None:
    for follow in (True, False):
        with pytest.raises(ExecutorError) as exc:
            files.open_regular(str(tmp_path), follow=follow)
        assert exc.value.error == error("is_a_directory", f"{tmp_path} is a directory", str(tmp_path))


def test_open_regular_refuses_a_device(tmp_path: Path) -> None:
    with pytest.raises(ExecutorError) as exc:
        files.open_regular("/dev/null")
    assert exc.value.error == error("bad_request", "/dev/null is not a regular file", "/dev/null")


def test_open_regular_refuses_a_fifo_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    errors: list[Error] = []

    def open_it() -> None:
        try:
            files.open_regular(str(fifo), follow=False)
        except ExecutorError as exc:
            errors.append(exc.error)

    opener = threading.Thread(target=open_it)
    opener.start()
    opener.join(5)
    if opener.is_alive():
        os.close(os.open(fifo, os.O_WRONLY))  # a writer releases the open waiting for one
        opener.join()
        pytest.fail("opening a FIFO waited for a writer")
    assert errors == [error("bad_request", f"{fifo} is not a regular file", str(fifo))]


# -- read_at ----------------------------------------------------------------------


@pytest.fixture
def big_file(tmp_path: Path) -> Iterator[tuple[int, bytes]]:
    data = os.urandom(3 * MiB + 123)
    path = tmp_path / "big"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        yield fd, data
    finally:
        os.close(fd)


def test_read_at_reads_across_many_reads_from_an_offset(big_file: tuple[int, bytes]) -> None:
    fd, data = big_file
    size = 2 * MiB + MiB // 2 + 7
    assert files.read_at(fd, 10, size) == data[10 : 10 + size]
    assert files.read_at(fd, 0, len(data)) == data


def test_read_at_stops_at_the_end_of_the_file(big_file: tuple[int, bytes]) -> None:
    fd, data = big_file
    assert files.read_at(fd, 100, len(data) * 2) == data[100:]
    assert files.read_at(fd, len(data) - 3, 10) == data[-3:]
    assert files.read_at(fd, len(data), 10) == b""
    assert files.read_at(fd, len(data) + 10, 10) == b""


def test_read_at_reads_exactly_the_size_asked(big_file: tuple[int, bytes]) -> None:
    fd, data = big_file
    assert files.read_at(fd, 5, 1) == data[5:6]
    assert files.read_at(fd, 7, 2) == data[7:9]
    assert files.read_at(fd, 0, 0) == b""
    assert files.read_at(fd, 0, -1) == b""


# -- file_stat and list_dir -----------------------------------------------------------


def test_file_stat_of_a_file(tmp_path: Path) -> None:
    path = tmp_path / "f.txt"
    path.write_bytes(b"12345")
    path.chmod(0o640)
    st = os.lstat(path)
    assert files.file_stat(str(path)) == FileStat(
        path=str(path), name="f.txt", type="file", size=5, mode=0o640, mtime=st.st_mtime, link_target=None
    )


def test_file_stat_of_a_directory_a_symlink_and_a_fifo(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir(mode=0o750)
    (tmp_path / "d").chmod(0o750)
    (tmp_path / "l").symlink_to("d")
    os.mkfifo(tmp_path / "p", 0o600)
    d = files.file_stat(str(tmp_path / "d"))
    assert (d.name, d.type, d.mode, d.link_target) == ("d", "directory", 0o750, None)
    link = files.file_stat(str(tmp_path / "l"))
    assert (link.name, link.type, link.size, link.link_target) == ("l", "symlink", 1, "d")
    fifo = files.file_stat(str(tmp_path / "p"))
    assert (fifo.type, fifo.mode, fifo.link_target) == ("other", 0o600, None)


def test_file_stat_of_the_root_is_named_by_its_path() -> None:
    st = files.file_stat("/")
    assert (st.path, st.name, st.type) == ("/", "/", "directory")


def test_file_stat_of_a_missing_path(tmp_path: Path) -> None:
    path = str(tmp_path / "missing")
    with pytest.raises(ExecutorError) as exc:
        files.file_stat(path)
    assert exc.value.error == os_error(errno.ENOENT, path)


def test_list_dir_lists_entries_sorted_by_name_without_following_links(tmp_path: Path) -> None:
    for name in ("b", "a", "C"):
        (tmp_path / name).write_bytes(name.encode())
    (tmp_path / "sub").mkdir()
    (tmp_path / "link").symlink_to("sub")
    entries = files.list_dir(str(tmp_path))
    assert [(e.name, e.type) for e in entries] == [
        ("C", "file"),
        ("a", "file"),
        ("b", "file"),
        ("link", "symlink"),
        ("sub", "directory"),
    ]
    assert [e.path for e in entries] == [str(tmp_path / e.name) for e in entries]
    assert files.list_dir(str(tmp_path / "sub")) == []


def test_list_dir_of_a_missing_directory_or_a_file(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing")
    with pytest.raises(ExecutorError) as exc:
        files.list_dir(missing)
    assert exc.value.error == os_error(errno.ENOENT, missing)
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(ExecutorError) as exc:
        files.list_dir(str(tmp_path / "f"))
    assert exc.value.error == os_error(errno.ENOTDIR, str(tmp_path / "f"))


def test_list_dir_leaves_out_an_entry_it_cannot_stat(tmp_path: Path) -> None:
    # A directory whose path is short enough to list, holding one entry whose full path is past
    # PATH_MAX: listing it works, the entry's lstat fails (as for an entry removed meanwhile).
    deep = str(tmp_path)
    while len(deep) < 4000:
        deep = os.path.join(deep, "d" * min(200, 4000 - len(deep)))
    os.makedirs(deep)
    fd = os.open(deep, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.close(os.open("x" * 200, os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd))
        os.close(os.open("y", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd))
    finally:
        os.close(fd)
    assert sorted(os.listdir(deep)) == ["x" * 200, "y"]
    assert [e.name for e in files.list_dir(deep)] == ["y"]


# -- mkdir --------------------------------------------------------------------------


def test_mkdir_makes_a_directory_with_exactly_the_mode_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        files.mkdir(str(tmp_path / "one"), parents=False, mode=0o775, exist_ok=False)
        files.mkdir(str(tmp_path / "a" / "b" / "c"), parents=True, mode=0o751, exist_ok=False)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "one").st_mode) == 0o775
    assert stat.S_IMODE(os.stat(tmp_path / "a" / "b" / "c").st_mode) == 0o751


def test_mkdir_leaves_an_existing_directory_and_its_mode(tmp_path: Path) -> None:
    path = tmp_path / "d"
    path.mkdir()
    path.chmod(0o700)
    (path / "kept").write_bytes(b"")
    for parents in (False, True):
        files.mkdir(str(path), parents=parents, mode=0o755, exist_ok=True)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    assert os.listdir(path) == ["kept"]


def test_mkdir_of_an_existing_directory_without_exist_ok(tmp_path: Path) -> None:
    path = str(tmp_path)
    for parents in (False, True):
        with pytest.raises(ExecutorError) as exc:
            files.mkdir(path, parents=parents, mode=0o755, exist_ok=False)
        assert exc.value.error == os_error(errno.EEXIST, path)


def test_mkdir_where_a_file_stands_even_with_exist_ok(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"data")
    for parents in (False, True):
        with pytest.raises(ExecutorError) as exc:
            files.mkdir(str(path), parents=parents, mode=0o755, exist_ok=True)
        assert exc.value.error == os_error(errno.EEXIST, str(path))
    assert path.read_bytes() == b"data"


def test_mkdir_without_parents_of_a_missing_parent(tmp_path: Path) -> None:
    path = str(tmp_path / "no" / "dir")
    with pytest.raises(ExecutorError) as exc:
        files.mkdir(path, parents=False, mode=0o755, exist_ok=True)
    assert exc.value.error == os_error(errno.ENOENT, path)


def test_mkdir_with_parents_through_a_file_names_the_path_asked(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"")
    path = str(tmp_path / "f" / "sub" / "leaf")
    with pytest.raises(ExecutorError) as exc:
        files.mkdir(path, parents=True, mode=0o755, exist_ok=True)
    assert exc.value.error == os_error(errno.ENOTDIR, path)


# -- remove ---------------------------------------------------------------------------


def test_remove_a_file_and_a_symlink_but_not_its_target(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "inner").write_bytes(b"kept")
    (tmp_path / "link").symlink_to("d")
    files.remove(str(tmp_path / "f"), recursive=False, missing_ok=False)
    files.remove(str(tmp_path / "link"), recursive=True, missing_ok=False)
    assert sorted(os.listdir(tmp_path)) == ["d"]
    assert (tmp_path / "d" / "inner").read_bytes() == b"kept"


def test_remove_an_empty_directory_and_a_tree_only_when_recursive(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    files.remove(str(tmp_path / "empty"), recursive=False, missing_ok=False)
    tree = tmp_path / "tree"
    (tree / "a" / "b").mkdir(parents=True)
    (tree / "a" / "b" / "f").write_bytes(b"")
    with pytest.raises(ExecutorError) as exc:
        files.remove(str(tree), recursive=False, missing_ok=False)
    assert exc.value.error == os_error(errno.ENOTEMPTY, str(tree))
    assert (tree / "a" / "b" / "f").exists()
    files.remove(str(tree), recursive=True, missing_ok=False)
    assert os.listdir(tmp_path) == []


def test_remove_a_missing_path(tmp_path: Path) -> None:
    path = str(tmp_path / "missing")
    for recursive in (False, True):
        files.remove(path, recursive=recursive, missing_ok=True)
        with pytest.raises(ExecutorError) as exc:
            files.remove(path, recursive=recursive, missing_ok=False)
        assert exc.value.error == os_error(errno.ENOENT, path)


def test_remove_of_a_tree_holding_an_entry_it_cannot_remove_names_the_tree(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    stuck = tree / "sub" / "stuck"
    stuck.write_bytes(b"")
    with unwritable(tree / "sub") as err:
        for missing_ok in (False, True):
            with pytest.raises(ExecutorError) as exc:
                files.remove(str(tree), recursive=True, missing_ok=missing_ok)
            assert exc.value.error == os_error(err, str(tree))
        with pytest.raises(ExecutorError) as exc:
            files.remove(str(stuck), recursive=False, missing_ok=False)
        assert exc.value.error == os_error(err, str(stuck))
    assert stuck.exists()


# -- write_atomic ---------------------------------------------------------------------


async def test_write_atomic_writes_the_chunks_with_exactly_the_mode(tmp_path: Path) -> None:
    big = os.urandom(3 * MiB + 5)
    path = tmp_path / "f"
    old = os.umask(0o077)
    try:
        await files.write_atomic(str(path), chunks_of(b"head-", b"", big, b"-tail"), mode=0o754, parents=False)
    finally:
        os.umask(old)
    assert path.read_bytes() == b"head-" + big + b"-tail"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o754
    assert os.listdir(tmp_path) == ["f"]


async def test_write_atomic_of_nothing_makes_an_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty"
    await files.write_atomic(str(path), chunks_of(), mode=0o600, parents=False)
    assert path.read_bytes() == b""
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


async def test_write_atomic_writes_into_a_hidden_temporary_file_beside_the_path(tmp_path: Path) -> None:
    path = tmp_path / "data.bin"
    path.write_bytes(b"old")
    seen: list[list[str]] = []

    async def chunks() -> AsyncIterator[bytes]:
        yield b"new "
        seen.append(sorted(os.listdir(tmp_path)))
        assert path.read_bytes() == b"old"  # replaced only at the end
        yield b"data"

    await files.write_atomic(str(path), chunks(), mode=0o644, parents=False)
    [listing] = seen
    assert len(listing) == 2
    tmp, name = listing
    assert name == "data.bin"
    assert tmp.startswith(".data.bin.")
    assert tmp.endswith(".orchard-tmp")
    assert path.read_bytes() == b"new data"
    assert os.listdir(tmp_path) == ["data.bin"]


async def test_write_atomic_replaces_the_file_whole(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"the old contents, longer than the new")
    with open(path, "rb") as reader:
        await files.write_atomic(str(path), chunks_of(b"new"), mode=0o644, parents=False)
        assert reader.read() == b"the old contents, longer than the new"  # a reader keeps the old file
    assert path.read_bytes() == b"new"


async def test_write_atomic_makes_the_parents_when_asked(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "f"
    await files.write_atomic(str(path), chunks_of(b"x"), mode=0o644, parents=True)
    assert path.read_bytes() == b"x"
    missing = str(tmp_path / "c" / "f")
    with pytest.raises(ExecutorError) as exc:
        await files.write_atomic(missing, chunks_of(b"x"), mode=0o644, parents=False)
    assert exc.value.error == os_error(errno.ENOENT, missing)
    assert not (tmp_path / "c").exists()


async def test_write_atomic_over_a_directory(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    path = str(tmp_path / "d")
    with pytest.raises(ExecutorError) as exc:
        await files.write_atomic(path, chunks_of(b"x"), mode=0o644, parents=True)
    assert exc.value.error == error("is_a_directory", f"{path} is a directory", path)
    assert os.listdir(path) == []


async def test_write_atomic_under_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"kept")
    parent = str(tmp_path / "f")
    with pytest.raises(ExecutorError) as exc:
        await files.write_atomic(str(tmp_path / "f" / "x"), chunks_of(b"x"), mode=0o644, parents=True)
    assert exc.value.error == error("not_a_directory", f"{parent} is not a directory", parent)
    path = str(tmp_path / "f" / "x")
    with pytest.raises(ExecutorError) as exc:
        await files.write_atomic(path, chunks_of(b"x"), mode=0o644, parents=False)
    assert exc.value.error == os_error(errno.ENOTDIR, path)
    assert (tmp_path / "f").read_bytes() == b"kept"


async def test_a_broken_upload_leaves_the_old_file_and_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"old")

    async def chunks() -> AsyncIterator[bytes]:
        yield b"partial"
        raise ConnectionResetError("the upload broke")

    with pytest.raises(ExecutorError) as exc:
        await files.write_atomic(str(path), chunks(), mode=0o644, parents=False)
    assert exc.value.error == error("internal", f"the upload broke: {path}", str(path))

    async def cancelled() -> AsyncIterator[bytes]:
        yield b"partial"
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        await files.write_atomic(str(path), cancelled(), mode=0o644, parents=False)
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["f"]


async def test_a_directory_made_at_the_path_during_the_write_fails_it_cleanly(tmp_path: Path) -> None:
    path = tmp_path / "f"

    async def chunks() -> AsyncIterator[bytes]:
        yield b"data"
        path.mkdir()

    with pytest.raises(ExecutorError) as exc:
        await files.write_atomic(str(path), chunks(), mode=0o644, parents=False)
    assert exc.value.error == os_error(errno.EISDIR, str(path))
    assert os.listdir(tmp_path) == ["f"]
    assert os.listdir(path) == []


async def test_a_temporary_file_removed_by_another_process_fails_the_write(tmp_path: Path) -> None:
    path = tmp_path / "f"

    def remove_temporary() -> None:
        for name in os.listdir(tmp_path):
            if name.endswith(".orchard-tmp"):
                os.unlink(tmp_path / name)

    async def chunks() -> AsyncIterator[bytes]:
        yield b"data"
        remove_temporary()

    with pytest.raises(ExecutorError) as exc:
        await files.write_atomic(str(path), chunks(), mode=0o644, parents=False)
    assert exc.value.error == os_error(errno.ENOENT, str(path))

    async def broken() -> AsyncIterator[bytes]:
        yield b"data"
        remove_temporary()
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        await files.write_atomic(str(path), broken(), mode=0o644, parents=False)
    assert os.listdir(tmp_path) == []


async def test_write_atomic_warns_of_nothing(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        await files.write_atomic(str(tmp_path / "f"), chunks_of(b"a\nb\n"), mode=0o644, parents=False)
    assert (tmp_path / "f").read_bytes() == b"a\nb\n"


# -- extract_tar ------------------------------------------------------------------------


async def test_extract_tar_unpacks_into_a_new_destination(tmp_path: Path) -> None:
    dest = tmp_path / "out"
    await files.extract_tar(str(dest), chunks_of(tar_of([file_member("d/f", b"hello", 0o640)])))
    assert (dest / "d" / "f").read_bytes() == b"hello"
    assert stat.S_IMODE(os.stat(dest / "d" / "f").st_mode) == 0o640


async def test_extract_tar_refuses_an_absolute_symlink_unless_restoring(tmp_path: Path) -> None:
    data = tar_of([file_member("f", b"x"), symlink_member("l", "/etc")])
    dest = tmp_path / "out"
    with pytest.raises(ExecutorError) as exc:
        await files.extract_tar(str(dest), chunks_of(data))
    assert exc.value.error == error(
        "unsafe_archive", "tar member 'l' is a symlink to '/etc', which is not relative", str(dest)
    )
    assert not dest.exists()
    await files.extract_tar(str(dest), chunks_of(data), restore=True)
    assert os.readlink(dest / "l") == "/etc"
    assert (dest / "f").read_bytes() == b"x"


async def test_extract_tar_keeps_to_the_caps(tmp_path: Path) -> None:
    data = tar_of([file_member("a", b"12345"), file_member("b", b"67890")])
    dest = tmp_path / "out"
    with pytest.raises(ExecutorError) as exc:
        await files.extract_tar(str(dest), chunks_of(data), max_bytes=9)
    assert exc.value.error == error(
        "unsafe_archive", "tar member 'b' takes the stream past the limit of 9 bytes (max_bytes)", str(dest)
    )
    with pytest.raises(ExecutorError) as exc:
        await files.extract_tar(str(dest), chunks_of(data), max_members=1)
    assert exc.value.error == error(
        "unsafe_archive", "tar member 'b' is past the limit of 1 members (max_members)", str(dest)
    )
    assert not dest.exists()
    await files.extract_tar(str(dest), chunks_of(data), max_bytes=10, max_members=2)
    assert sorted(os.listdir(dest)) == ["a", "b"]


async def test_extract_tar_failing_on_disk_names_the_destination(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"")
    dest = str(tmp_path / "f" / "sub" / "out")
    with pytest.raises(ExecutorError) as exc:
        await files.extract_tar(dest, chunks_of(tar_of([file_member("a", b"x")])))
    assert exc.value.error == os_error(errno.ENOTDIR, dest)


async def test_extract_tar_failing_to_stage_names_the_destination(tmp_path: Path) -> None:
    # The stream is staged in a temporary directory beside the destination: that one fails.
    parent = tmp_path / "parent"
    parent.mkdir()
    dest = str(parent / "out")
    with unwritable(parent) as err:
        with pytest.raises(ExecutorError) as exc:
            await files.extract_tar(dest, chunks_of(tar_of([file_member("a", b"x")])))
        assert exc.value.error == os_error(err, dest)
        with pytest.raises(ExecutorError) as exc:
            await files.extract_tar(dest, chunks_of(tar_of([file_member("a", b"x")])), restore=True)
        assert exc.value.error == os_error(err, dest)
    assert os.listdir(parent) == []


async def test_a_restore_failing_on_disk_names_the_path_that_failed(tmp_path: Path) -> None:
    dest = tmp_path / "out"
    (dest / "x").mkdir(parents=True)
    (dest / "x" / "inner").write_bytes(b"")
    with pytest.raises(ExecutorError) as exc:
        await files.extract_tar(str(dest), chunks_of(tar_of([file_member("x", b"file")])), restore=True)
    assert exc.value.error == os_error(errno.ENOTEMPTY, str(dest / "x"))
    (tmp_path / "f").write_bytes(b"")
    under_file = str(tmp_path / "f" / "out")
    with pytest.raises(ExecutorError) as exc:
        await files.extract_tar(under_file, chunks_of(tar_of([file_member("a", b"x")])), restore=True)
    assert exc.value.error == os_error(errno.ENOTDIR, under_file)


# -- stream_tar ---------------------------------------------------------------------------


async def test_stream_tar_archives_a_directory_by_its_contents_or_one_file(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "f").write_bytes(b"data")
    (tmp_path / "top").write_bytes(b"top")
    assert names_in(await collect(files.stream_tar(str(tmp_path)))) == ["sub", "sub/f", "top"]
    assert names_in(await collect(files.stream_tar(str(tmp_path / "top")))) == ["top"]


async def test_stream_tar_of_only_what_changed_leaves_out_the_excluded(tmp_path: Path) -> None:
    (tmp_path / "old").write_bytes(b"")
    (tmp_path / "state").mkdir()
    time.sleep(0.02)
    since = time.time_ns()
    time.sleep(0.02)
    (tmp_path / "new").write_bytes(b"")
    (tmp_path / "state" / "new").write_bytes(b"")
    src = str(tmp_path)
    assert names_in(await collect(files.stream_tar(src, changed_since_ns=since))) == ["new", "state", "state/new"]
    changed = files.stream_tar(src, changed_since_ns=since, excluded=(str(tmp_path / "state"),))
    assert names_in(await collect(changed)) == ["new"]


async def test_stream_tar_past_its_caps_is_too_large_naming_the_member(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"12345")
    (tmp_path / "b").write_bytes(b"67890")
    src = str(tmp_path)
    with pytest.raises(ExecutorError) as exc:
        await collect(files.stream_tar(src, max_bytes=9))
    assert exc.value.error == error(
        "too_large", "tar member 'b' takes the archive past the limit of 9 bytes (max_bytes)", str(tmp_path / "b")
    )
    with pytest.raises(ExecutorError) as exc:
        await collect(files.stream_tar(src, max_members=1))
    assert exc.value.error == error(
        "too_large", "tar member 'b' is past the limit of 1 members (max_members)", str(tmp_path / "b")
    )
    assert names_in(await collect(files.stream_tar(src, max_bytes=10, max_members=2))) == ["a", "b"]


async def test_stream_tar_of_a_missing_path(tmp_path: Path) -> None:
    src = str(tmp_path / "missing")
    with pytest.raises(ExecutorError) as exc:
        await collect(files.stream_tar(src))
    assert exc.value.error == os_error(errno.ENOENT, src)


async def test_stream_tar_of_an_entry_removed_while_archiving_names_the_source(tmp_path: Path) -> None:
    # "a" is larger than the chunks queued: its archiver waits on the reader, past listing "b".
    (tmp_path / "a").write_bytes(os.urandom(8 * MiB))
    (tmp_path / "b").write_bytes(b"")
    stream = files.stream_tar(str(tmp_path))
    first = await anext(stream)
    assert first
    (tmp_path / "b").unlink()
    with pytest.raises(ExecutorError) as exc:
        await collect(stream)
    assert exc.value.error == os_error(errno.ENOENT, str(tmp_path))


async def test_stream_tar_of_a_file_swapped_while_archived_is_an_unsafe_archive(tmp_path: Path) -> None:
    # The archiver checks that the file it opens is the one it listed. Swap "f" between two
    # files, as another process could, until an archive catches it between the two.
    src = tmp_path / "src"
    src.mkdir()
    (tmp_path / "one").write_bytes(b"one")
    (tmp_path / "two").write_bytes(b"two")
    os.link(tmp_path / "one", src / "f")
    stop = threading.Event()

    def swap() -> None:
        while not stop.is_set():
            for name in ("two", "one"):
                os.link(tmp_path / name, tmp_path / "next")
                os.replace(tmp_path / "next", src / "f")

    swapper = threading.Thread(target=swap)
    swapper.start()
    caught = None
    try:
        deadline = time.monotonic() + 20
        while caught is None and time.monotonic() < deadline:
            try:
                await collect(files.stream_tar(str(src)))
            except ExecutorError as exc:
                caught = exc
    finally:
        stop.set()
        swapper.join()
    assert caught is not None
    assert caught.error == error("unsafe_archive", "tar member 'f' was replaced while it was archived", str(src))


async def test_stream_tar_of_one_file_past_its_caps_names_that_file(tmp_path: Path) -> None:
    # A file (or a symlink, even to a directory) is archived as one member under its own name:
    # the path is the file's, not that name joined under it.
    (tmp_path / "big.bin").write_bytes(b"12345")
    src = str(tmp_path / "big.bin")
    with pytest.raises(ExecutorError) as exc:
        await collect(files.stream_tar(src, max_bytes=4))
    assert exc.value.error == error(
        "too_large", "tar member 'big.bin' takes the archive past the limit of 4 bytes (max_bytes)", src
    )
    (tmp_path / "dir").mkdir()
    (tmp_path / "link").symlink_to("dir")
    link = str(tmp_path / "link")
    with pytest.raises(ExecutorError) as exc:
        await collect(files.stream_tar(link, max_members=0))
    assert exc.value.error == error("too_large", "tar member 'link' is past the limit of 0 members (max_members)", link)
