"""File operations: streamed atomic writes, reads, stat/list, tar in and out."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import stat
import tempfile
from collections.abc import AsyncIterator

from . import tarstream
from .errors import ExecutorError
from .protocol import FileStat, FileType

CHUNK = tarstream.CHUNK


def resolve(path: str, cwd: str) -> str:
    """An absolute path, relative ones taken from the executor's working directory."""
    if not path:
        raise ExecutorError("bad_request", "path is empty")
    if "\0" in path:
        raise ExecutorError("bad_request", "a path cannot hold a NUL byte")
    return os.path.normpath(os.path.join(cwd, path))


def open_regular(path: str, *, follow: bool = True) -> int:
    """Open a regular file for reading; anything else (a FIFO, a device) is refused.

    O_NONBLOCK makes opening a FIFO return at once instead of waiting for a
    writer, and the fstat after the open sees what was opened, so a path
    swapped between a check and the open cannot freeze the caller.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow:
            raise ExecutorError("bad_request", f"{path} is a symlink", path) from exc
        raise ExecutorError.from_os_error(exc, path) from exc
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        if stat.S_ISDIR(mode):
            raise ExecutorError("is_a_directory", f"{path} is a directory", path)
        raise ExecutorError("bad_request", f"{path} is not a regular file", path)
    return fd


def read_at(fd: int, offset: int, size: int) -> bytes:
    """Read up to ``size`` bytes at ``offset``, however many reads it takes (run in a thread)."""
    parts = []
    while size > 0 and (data := os.pread(fd, min(size, CHUNK * 4), offset)):
        parts.append(data)
        offset += len(data)
        size -= len(data)
    return b"".join(parts)


def _type(mode: int) -> FileType:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


def file_stat(path: str) -> FileStat:
    """Stat ``path`` without following a final symlink."""
    try:
        st = os.lstat(path)
        target = os.readlink(path) if stat.S_ISLNK(st.st_mode) else None
    except OSError as exc:
        raise ExecutorError.from_os_error(exc, path) from exc
    return FileStat(
        path=path,
        name=os.path.basename(path) or path,
        type=_type(st.st_mode),
        size=st.st_size,
        mode=stat.S_IMODE(st.st_mode),
        mtime=st.st_mtime,
        link_target=target,
    )


def list_dir(path: str) -> list[FileStat]:
    """The entries of a directory, sorted by name."""
    try:
        names = sorted(os.listdir(path))
    except OSError as exc:
        raise ExecutorError.from_os_error(exc, path) from exc
    entries = []
    for name in names:
        with contextlib.suppress(ExecutorError):  # removed while listing
            entries.append(file_stat(os.path.join(path, name)))
    return entries


def mkdir(path: str, *, parents: bool, mode: int, exist_ok: bool) -> None:
    """Create a directory with exactly ``mode`` (the umask does not apply, as with files)."""
    existed = os.path.isdir(path)
    try:
        if parents:
            os.makedirs(path, mode=mode, exist_ok=exist_ok)
        else:
            os.mkdir(path, mode)
    except FileExistsError as exc:
        if not (exist_ok and os.path.isdir(path)):
            raise ExecutorError.from_os_error(exc, path) from exc
    except OSError as exc:
        raise ExecutorError.from_os_error(exc, path) from exc
    if not existed:  # an existing directory keeps its mode
        with contextlib.suppress(OSError):
            os.chmod(path, mode)


def remove(path: str, *, recursive: bool, missing_ok: bool) -> None:
    """Remove a file or symlink, or a directory (a tree with ``recursive``)."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            if recursive:
                shutil.rmtree(path)
            else:
                os.rmdir(path)
        else:
            os.unlink(path)
    except FileNotFoundError as exc:
        if not missing_ok:
            raise ExecutorError.from_os_error(exc, path) from exc
    except OSError as exc:
        raise ExecutorError.from_os_error(exc, path) from exc


async def write_atomic(path: str, chunks: AsyncIterator[bytes], *, mode: int, parents: bool) -> None:
    """Stream ``chunks`` into a temporary file beside ``path``, then rename it over.

    On any failure (a full disk, a broken upload) the temporary file is
    removed and whatever was at ``path`` is untouched.
    """
    directory = os.path.dirname(path)
    if os.path.isdir(path):
        raise ExecutorError("is_a_directory", f"{path} is a directory", path)
    try:
        if parents:
            os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".orchard-tmp", dir=directory)
    except FileExistsError as exc:
        # makedirs reports a file standing where the parent directory should be as EEXIST.
        raise ExecutorError("not_a_directory", f"{directory} is not a directory", directory) from exc
    except OSError as exc:
        raise ExecutorError.from_os_error(exc, path) from exc
    try:
        with os.fdopen(fd, "wb", buffering=0) as f:
            async for chunk in chunks:
                # Disk writes can block for long (a full or slow disk): never on the event loop.
                await asyncio.to_thread(_write_all, f.fileno(), chunk)
            os.fchmod(f.fileno(), mode)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise ExecutorError.from_os_error(exc, path) from exc
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


async def extract_tar(
    dest: str,
    chunks: AsyncIterator[bytes],
    *,
    max_bytes: int = tarstream.MAX_BYTES,
    max_members: int = tarstream.MAX_MEMBERS,
    restore: bool = False,
) -> None:
    """Extract a plain tar stream into ``dest`` (created if missing), all or nothing.

    A stream breaking a transfer rule (see ``tarstream``) is an
    ``unsafe_archive`` error and writes nothing. With ``restore``, a snapshot
    restored in place (``tarstream._restore``), not all or nothing.
    """
    try:
        await tarstream.extract(chunks, dest, max_bytes=max_bytes, max_members=max_members, restore=restore)
    except tarstream.Refused as exc:
        raise ExecutorError("unsafe_archive", str(exc), dest) from exc
    except OSError as exc:
        # A restore writes in place: the path that failed (a read-only one, say) is the one to name.
        raise ExecutorError.from_os_error(exc, None if restore and exc.filename else dest) from exc


async def stream_tar(
    src: str,
    *,
    changed_since_ns: int | None = None,
    excluded: tuple[str, ...] = (),
    max_bytes: int = tarstream.MAX_BYTES,
    max_members: int = tarstream.MAX_MEMBERS,
) -> AsyncIterator[bytes]:
    """Yield a tar archive of ``src`` (a directory's contents, or one file); see ``tarstream.archive``.

    Past ``max_bytes`` or ``max_members``: a ``too_large`` error naming the member.
    """
    try:
        async for chunk in tarstream.archive(
            src, changed_since_ns=changed_since_ns, excluded=excluded, max_bytes=max_bytes, max_members=max_members
        ):
            yield chunk
    except tarstream.Refused as exc:
        if exc.rule in ("bytes", "members"):
            # A directory's members are named from inside it; anything else is one member under its own name.
            inside = os.path.isdir(src) and not os.path.islink(src)
            raise ExecutorError("too_large", str(exc), os.path.join(src, exc.member or "") if inside else src) from exc
        raise ExecutorError("unsafe_archive", str(exc), src) from exc
    except OSError as exc:
        raise ExecutorError.from_os_error(exc, src) from exc
