"""Tar archives made and extracted as streams, shared by the executor and client.

tarfile is blocking, so the archive work runs in a thread and the chunks
cross to the event loop through bounded queues: memory stays at a few
chunks whatever the size of the tree.

Extraction trusts nothing in the stream, because a download unpacks on the
host what code in a sandbox made (and an upload, in the sandbox, what a
client sent). Only plain tar is read; only regular files, directories,
symlinks and hardlinks are accepted; setuid, setgid and sticky bits and
group/other write are dropped; nothing is chowned; a symlink must be relative
and resolve inside the destination, a hardlink must name an earlier file of
the same stream; members and bytes are capped. The stream is unpacked into a
staging directory and moved into place only once all of it was good, so a
refusal (``Refused``), a broken stream or a full disk leaves the destination
exactly as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import io
import os
import queue
import shutil
import stat
import tarfile
import tempfile
import threading
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Any, Self

CHUNK = 256 * 1024
_DEPTH = 16

#: Default cap on the sum of the member sizes of one stream (4 GiB).
MAX_BYTES = 4 * 1024**3
#: Default cap on the number of members of one stream.
MAX_MEMBERS = 100_000
#: Cap on one pax or GNU long-name header, which tarfile reads whole into memory.
MAX_HEADER = 1024 * 1024
#: The permission bits kept: no setuid, setgid or sticky bit, no group or other write.
SAFE_MODE = 0o755

_FILE_TYPES = (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE)
_META_TYPES = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE)
_KINDS = {
    tarfile.CHRTYPE: "a character device",
    tarfile.BLKTYPE: "a block device",
    tarfile.FIFOTYPE: "a FIFO",
    tarfile.GNUTYPE_SPARSE: "a sparse file",
}
#: gzip, bzip2, xz and zstd magic numbers.
_COMPRESSED = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00", b"\x28\xb5\x2f\xfd")
# A conflict between members (a file where a directory is, twice the same link) rather than a host failure.
_CLASHES = (errno.EEXIST, errno.ENOTDIR, errno.EISDIR, errno.ENOTEMPTY)


class Refused(ValueError):
    """A tar stream broke a transfer rule; nothing of it was written.

    Attributes:
        rule: The rule broken: ``type`` (a device, FIFO or other special
            member), ``path`` (an absolute name or one with ``..``), ``link``
            (a link that is absolute, leaves the destination, or is written
            through), ``conflict``, ``members`` or ``bytes`` (a cap),
            ``header``, ``compressed``, ``malformed``, or ``changed`` (a file
            replaced while it was archived).
        member: The member's name, when one member broke it.
    """

    def __init__(self, rule: str, member: str | None, why: str) -> None:
        super().__init__(f"tar member {member!r} {why}" if member is not None else f"tar stream {why}")
        self.rule = rule
        self.member = member


class _Broken(Exception):
    """The producer of the stream failed: whatever was read must not be kept."""


class _QueueReader(io.RawIOBase):
    """A blocking file object fed from the event loop through a bounded queue.

    ``None`` ends the stream; the producer sets ``broken`` first if it failed.
    """

    def __init__(self) -> None:
        self.queue: queue.Queue[bytes | None] = queue.Queue(maxsize=_DEPTH)
        self.broken = False
        self._pending = memoryview(b"")
        self._eof = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        while not self._pending and not self._eof:
            item = self.queue.get()
            if item is None:
                self._eof = True
            else:
                self._pending = memoryview(item)
        if self._eof and self.broken:
            raise _Broken("the tar stream broke off")
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n

    def finish(self) -> bool:
        """Discard the rest of the stream (so the producer never blocks); whether it ended cleanly."""
        while not self._eof:
            self._eof = self.queue.get() is None
        self._pending = memoryview(b"")
        return not self.broken


class _QueueWriter(io.RawIOBase):
    """A blocking file object whose writes are handed to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, out: asyncio.Queue[bytes | None]) -> None:
        self._loop = loop
        self._out = out

    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:  # type: ignore[override]
        asyncio.run_coroutine_threadsafe(self._out.put(bytes(data)), self._loop).result()
        return len(data)


class _TarInfo(tarfile.TarInfo):
    """Headers read with limits: bounded metadata, and a corrupt header is an error, not the end."""

    @classmethod
    def fromtarfile(cls, tar: tarfile.TarFile) -> Self:
        try:
            return super().fromtarfile(tar)
        except (tarfile.InvalidHeaderError, tarfile.TruncatedHeaderError) as exc:  # type: ignore[attr-defined]
            # tarfile takes a bad header after the first for the end of the archive: that would drop the rest.
            if tar.offset == 0:
                raise
            raise Refused("malformed", None, f"has a corrupt header at byte {tar.offset}: {exc}") from exc

    def _proc_member(self, tar: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type in _META_TYPES and self.size > MAX_HEADER:
            raise Refused("header", self.name, f"is a {self.size}-byte metadata header (limit {MAX_HEADER})")
        if self.type == tarfile.GNUTYPE_SPARSE:
            raise Refused("type", self.name, "is a sparse file; only plain files are accepted")
        return super()._proc_member(tar)  # type: ignore[misc,no-any-return]


def _relative(member: str, name: str, rule: str, what: str) -> str:
    """``name`` as a clean relative path ("" for the destination itself), or Refused."""
    if "\0" in name:
        raise Refused(rule, member, f"has a NUL byte in its {what}")
    if name.startswith("/"):
        raise Refused(rule, member, f"has an absolute {what} {name!r}")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise Refused(rule, member, f"has '..' in its {what} {name!r}")
    return "/".join(parts)


def _inside(root: str, path: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


class _Unpacker:
    """Writes accepted members under a private staging directory.

    No symlink exists in the staging tree until every other member is
    written (symlinks are made last), so no write can pass through one.
    """

    def __init__(self, staging: str, max_bytes: int, max_members: int) -> None:
        self.root = staging
        self.max_bytes = max_bytes
        self.max_members = max_members
        self.count = 0
        self.total = 0
        self.files: set[str] = set()
        self.symlinks: dict[str, str] = {}
        #: Every directory made, with the mode it gets once everything is in place.
        self.dirs: dict[str, int] = {}

    def add(self, tar: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        """Check one member and write it (a symlink is only recorded)."""
        self.count += 1
        if self.count > self.max_members:
            raise Refused("members", member.name, f"is past the limit of {self.max_members} members (max_members)")
        name = _relative(member.name, member.name, "path", "name")
        parts = name.split("/")
        for i in range(1, len(parts) + 1):
            if "/".join(parts[:i]) in self.symlinks:
                raise Refused("link", member.name, f"goes through the symlink {'/'.join(parts[:i])!r}")
        try:
            self._add(tar, member, name)
        except OSError as exc:
            if exc.errno in _CLASHES:
                raise Refused("conflict", member.name, f"clashes with another member ({exc.strerror})") from exc
            raise

    def _add(self, tar: tarfile.TarFile, member: tarfile.TarInfo, name: str) -> None:
        if member.isdir():
            if name:  # "." is the destination itself, whose mode is not the stream's to set
                self._makedirs(name)
                self.dirs[name] = member.mode & SAFE_MODE
        elif member.issym():
            if not name:
                raise Refused("link", member.name, "would replace the destination with a symlink")
            if not member.linkname or "\0" in member.linkname or member.linkname.startswith("/"):
                raise Refused("link", member.name, f"is a symlink to {member.linkname!r}, which is not relative")
            self.symlinks[name] = member.linkname
        elif member.islnk():
            target = _relative(member.name, member.linkname, "link", "hardlink target")
            if target not in self.files or target == name:
                raise Refused("link", member.name, f"is a hardlink to {member.linkname!r}, not a file of this stream")
            path = self._new_file(name)
            os.link(os.path.join(self.root, target), path, follow_symlinks=False)
            self.files.add(name)
        elif member.type in _FILE_TYPES and member.sparse is None:
            self.total += member.size
            if self.total > self.max_bytes:
                raise Refused(
                    "bytes", member.name, f"takes the stream past the limit of {self.max_bytes} bytes (max_bytes)"
                )
            self._write(tar, member, self._new_file(name))
            self.files.add(name)
        else:
            kind = _KINDS.get(member.type, f"of type {member.type!r}")
            raise Refused("type", member.name, f"is {kind}; only files, directories and links are accepted")

    def _makedirs(self, name: str) -> None:
        path = self.root
        for part in name.split("/"):
            path = os.path.join(path, part)
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                if not stat.S_ISDIR(os.lstat(path).st_mode):
                    raise
                continue
            self.dirs[os.path.relpath(path, self.root)] = 0o755

    def _new_file(self, name: str) -> str:
        """Where a file or hardlink goes: parents made, any earlier member of that name removed."""
        if not name:
            raise Refused("path", name, "would replace the destination with a file")
        if "/" in name:
            self._makedirs(os.path.dirname(name))
        path = os.path.join(self.root, name)
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISDIR(os.lstat(path).st_mode):
                raise IsADirectoryError(errno.EISDIR, "a directory is in the way", path)
            os.unlink(path)
        return path

    def _write(self, tar: tarfile.TarFile, member: tarfile.TarInfo, path: str) -> None:
        source = tar.extractfile(member)
        assert source is not None  # a regular member always has a file object
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as out:
            shutil.copyfileobj(source, out, CHUNK)
            out.flush()
            os.fchmod(fd, member.mode & SAFE_MODE)
            with contextlib.suppress(OverflowError, ValueError, OSError):
                os.utime(fd, (member.mtime, member.mtime))

    def link(self) -> None:
        """Make the recorded symlinks, then refuse any that resolves outside the staging root."""
        for name, target in self.symlinks.items():
            try:
                if "/" in name:
                    self._makedirs(os.path.dirname(name))
                os.symlink(target, os.path.join(self.root, name))
            except OSError as exc:
                if exc.errno in _CLASHES:
                    raise Refused("conflict", name, f"clashes with another member ({exc.strerror})") from exc
                raise
        root = os.path.realpath(self.root)
        for name, target in self.symlinks.items():
            # Resolved on disk, chains and '..' after a link included, as the kernel will.
            if not _inside(root, os.path.realpath(os.path.join(root, name))):
                raise Refused("link", name, f"is a symlink to {target!r}, which resolves outside the destination")


class _Destination:
    """Where a stream is staged and how it is moved into place, or undone."""

    def __init__(self, dest: str) -> None:
        self.dest = os.path.abspath(dest)
        self.made_parents: list[str] = []
        try:
            st = os.stat(self.dest)
        except FileNotFoundError:
            self.exists = False
            parent = os.path.dirname(self.dest)
            probe = parent
            while not os.path.lexists(probe):
                self.made_parents.append(probe)
                probe = os.path.dirname(probe)
            os.makedirs(parent, exist_ok=True)
            self.staging = self._mkdtemp(parent)
            return
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", self.dest)
        self.exists = True
        target = os.path.realpath(self.dest)
        parent = os.path.dirname(target)
        try:
            if os.stat(parent).st_dev != st.st_dev:
                raise OSError(errno.EXDEV, "the destination is a mount point")
            self.staging = self._mkdtemp(parent)
        except OSError:
            # Beside a mount point, or in a parent we may not write: stage inside, on the same filesystem.
            self.staging = self._mkdtemp(target)

    def _mkdtemp(self, where: str) -> str:
        return tempfile.mkdtemp(prefix=f".{os.path.basename(self.dest)}.", suffix=".orchard-part", dir=where)

    def commit(self, unpacked: _Unpacker) -> None:
        """Move the staged tree into place, merged with what the destination already holds."""
        merged: set[str] = set()
        if not self.exists:
            os.rename(self.staging, self.dest)
            os.chmod(self.dest, 0o755)
        else:
            _check_merge(self.staging, self.dest)
            _merge(self.staging, self.dest, "", merged)
            shutil.rmtree(self.staging)
        for name, mode in unpacked.dirs.items():
            # Modes last, since a directory made read-only could not take its children; and
            # a directory the destination already had keeps its own.
            if name in merged:
                continue
            fd = os.open(os.path.join(self.dest, name), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            try:
                os.fchmod(fd, mode)
            finally:
                os.close(fd)

    def undo(self) -> None:
        """Remove the staging directory and any parent made for the destination."""
        shutil.rmtree(self.staging, ignore_errors=True)
        for path in self.made_parents:
            with contextlib.suppress(OSError):
                os.rmdir(path)


def _check_merge(src: str, dst: str) -> None:
    """Refuse, before anything moves, a staged directory meeting a non-directory (or the reverse)."""
    for name in os.listdir(src):
        s, d = os.path.join(src, name), os.path.join(dst, name)
        try:
            existing = os.lstat(d).st_mode
        except FileNotFoundError:
            continue
        incoming = os.lstat(s).st_mode
        if stat.S_ISDIR(incoming) and stat.S_ISDIR(existing):
            _check_merge(s, d)
        elif stat.S_ISDIR(incoming) or stat.S_ISDIR(existing):
            raise FileExistsError(errno.EEXIST, "a directory and a non-directory of the same name", d)


def _merge(src: str, dst: str, rel: str, merged: set[str]) -> None:
    for name in os.listdir(src):
        s, d = os.path.join(src, name), os.path.join(dst, name)
        if stat.S_ISDIR(os.lstat(s).st_mode) and os.path.lexists(d):
            merged.add(os.path.join(rel, name))
            _merge(s, d, os.path.join(rel, name), merged)
        else:
            os.replace(s, d)


def _read_members(reader: _QueueReader, add: Callable[[tarfile.TarFile, tarfile.TarInfo], None]) -> None:
    """Pass each member of a plain tar stream to ``add``; Refused if compressed or malformed, _Broken if cut."""
    buffered = io.BufferedReader(reader, CHUNK)
    if buffered.peek(8).startswith(_COMPRESSED):
        raise Refused("compressed", None, "is compressed; only a plain (uncompressed) tar is accepted")
    try:
        with tarfile.open(fileobj=buffered, mode="r|", tarinfo=_TarInfo) as tar:
            while (member := tar.next()) is not None:
                add(tar, member)
                # tarfile keeps every header for random access, which a stream never needs.
                tar.members.clear()  # type: ignore[attr-defined]
    except (Refused, OSError, _Broken):
        raise
    except (tarfile.TarError, RecursionError, ValueError, EOFError) as exc:
        raise Refused("malformed", None, f"is not a readable tar: {exc}") from exc
    if not reader.finish():
        raise _Broken("the tar stream broke off")


def _unpack(reader: _QueueReader, dest: str, max_bytes: int, max_members: int) -> None:
    """Read the whole stream into staging, then commit it; any failure undoes everything."""
    place = _Destination(dest)
    try:
        unpacker = _Unpacker(place.staging, max_bytes, max_members)
        _read_members(reader, unpacker.add)
        unpacker.link()
        place.commit(unpacked=unpacker)
    except BaseException:
        place.undo()
        raise


def _restore(reader: _QueueReader, dest: str, max_bytes: int, max_members: int) -> None:
    """Write a snapshot's members in place under ``dest``, as they come.

    A snapshot is restored where it was taken, into a sandbox as trusted as the
    one that made it, so unlike an upload it keeps absolute symlinks (a
    virtualenv's ``bin/python``) and, run as root, the owners. It still only
    writes under ``dest``: names are relative without '..', no member is
    written through a symlink that leaves ``dest``, a hardlink names a file of
    the stream, and the caps and the member types are those of an upload. Not
    all or nothing: a sandbox whose restore failed is to be discarded.
    """
    os.makedirs(dest, exist_ok=True)
    writer = _Restorer(os.path.realpath(dest), max_bytes, max_members)
    _read_members(reader, writer.add)
    writer.finish()


class _Restorer:
    """Writes a snapshot's members in place; directory modes are set last, deepest first."""

    def __init__(self, root: str, max_bytes: int, max_members: int) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.max_members = max_members
        self.count = 0
        self.total = 0
        self.files: set[str] = set()
        self.dirs: list[tuple[str, tarfile.TarInfo]] = []
        self.owner = os.geteuid() == 0

    def add(self, tar: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        self.count += 1
        if self.count > self.max_members:
            raise Refused("members", member.name, f"is past the limit of {self.max_members} members (max_members)")
        name = _relative(member.name, member.name, "path", "name")
        if not name:
            return  # the destination itself
        path = os.path.join(self.root, name)
        parent = os.path.realpath(os.path.dirname(path))
        if not _inside(self.root, parent):
            raise Refused("link", member.name, "would be written through a symlink that leaves the destination")
        if member.isdir():
            # A symlink in the way is replaced, not followed: its target's mode is not the snapshot's to set.
            if os.path.islink(path) or not os.path.isdir(path):
                self._clear(path)
                os.makedirs(path, 0o700, exist_ok=True)
            self.dirs.append((path, member))
            return
        os.makedirs(parent, exist_ok=True)
        if member.issym():
            if not member.linkname or "\0" in member.linkname:
                raise Refused("link", member.name, f"is a symlink to {member.linkname!r}")
            self._clear(path)
            os.symlink(member.linkname, path)
        elif member.islnk():
            target = _relative(member.name, member.linkname, "link", "hardlink target")
            if target not in self.files or target == name:
                raise Refused("link", member.name, f"is a hardlink to {member.linkname!r}, not a file of this stream")
            self._clear(path)
            os.link(os.path.join(self.root, target), path, follow_symlinks=False)
            self.files.add(name)
            return
        elif member.type in _FILE_TYPES and member.sparse is None:
            self.total += member.size
            if self.total > self.max_bytes:
                raise Refused(
                    "bytes", member.name, f"takes the stream past the limit of {self.max_bytes} bytes (max_bytes)"
                )
            self._clear(path)
            source = tar.extractfile(member)
            assert source is not None  # a regular member always has a file object
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as out:
                shutil.copyfileobj(source, out, CHUNK)
            self.files.add(name)
        else:
            kind = _KINDS.get(member.type, f"of type {member.type!r}")
            raise Refused("type", member.name, f"is {kind}; only files, directories and links are accepted")
        self._attrs(path, member)

    def _clear(self, path: str) -> None:
        """Remove what stands at ``path`` (not a directory with contents) so a member can take its place."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            os.rmdir(path)
        else:
            os.unlink(path)

    def _attrs(self, path: str, member: tarfile.TarInfo) -> None:
        if self.owner:
            os.chown(path, member.uid, member.gid, follow_symlinks=False)
        if member.issym():
            return
        os.chmod(path, stat.S_IMODE(member.mode) & ~(stat.S_ISUID | stat.S_ISGID))
        with contextlib.suppress(OverflowError, ValueError, OSError):
            os.utime(path, (member.mtime, member.mtime), follow_symlinks=False)

    def finish(self) -> None:
        for path, member in reversed(self.dirs):
            # A later member may have taken the directory's place (a symlink out, say): not its mode to set.
            if os.path.islink(path) or not os.path.isdir(path):
                continue
            self._attrs(path, member)


async def _close(chunks: AsyncIterable[bytes]) -> None:
    aclose: Any = getattr(chunks, "aclose", None)
    if aclose is not None:
        await aclose()


async def extract(
    chunks: AsyncIterable[bytes],
    dest: str,
    *,
    max_bytes: int = MAX_BYTES,
    max_members: int = MAX_MEMBERS,
    restore: bool = False,
) -> None:
    """Extract a plain tar stream into ``dest`` as it arrives, all or nothing.

    ``dest`` is created if missing; what it already holds is kept, and a file
    of the stream replaces one of the same name. Nothing changes in ``dest``
    unless the whole stream was read and accepted.

    With ``restore``, the stream is a snapshot restored in place instead
    (``_restore``): not staged, absolute symlinks and owners kept.

    Raises:
        Refused: The stream broke a rule (see the module docstring) or a cap.
        OSError: The destination could not be written.
    """
    unpack = _restore if restore else _unpack
    reader = _QueueReader()
    errors: list[BaseException] = []
    loop = asyncio.get_running_loop()
    # The worker reports its end through a future: a thread.join would hold a default-executor
    # thread for the whole extraction, and many downloads at once would starve the pool.
    done: asyncio.Future[None] = loop.create_future()

    def work() -> None:
        try:
            unpack(reader, dest, max_bytes, max_members)
        except BaseException as exc:
            errors.append(exc)
        reader.finish()
        with contextlib.suppress(RuntimeError):  # the loop is already closed
            loop.call_soon_threadsafe(_settle, done)

    async def put(item: bytes | None) -> None:
        try:
            reader.queue.put_nowait(item)
        except queue.Full:
            # Only until the worker, a thread of its own, takes the next chunk.
            await loop.run_in_executor(None, reader.queue.put, item)

    threading.Thread(target=work, name="orchard-untar", daemon=True).start()
    clean = False
    try:
        async for chunk in chunks:
            if errors:
                break
            if chunk:
                await put(chunk)
        else:
            clean = True
    finally:
        reader.broken = not clean
        try:
            await put(None)
            await done
        finally:
            await _close(chunks)
    if errors:
        raise errors[0]


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def open_regular(name: str, dir_fd: int | None, expected: os.stat_result) -> int:
    """Open for reading a file that must still be the regular file ``expected``.

    Never blocks on a FIFO (``O_NONBLOCK``) nor follows a symlink
    (``O_NOFOLLOW``): a path swapped since it was listed is refused.
    """
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Refused("changed", name, "was replaced by a symlink while it was archived") from exc
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (expected.st_dev, expected.st_ino):
        os.close(fd)
        raise Refused("changed", name, "was replaced while it was archived")
    return fd


def _info(arcname: str, st: os.stat_result) -> tarfile.TarInfo:
    info = tarfile.TarInfo(arcname)
    info.mode = stat.S_IMODE(st.st_mode)
    info.mtime = st.st_mtime
    info.uid, info.gid = st.st_uid, st.st_gid
    return info


class _Archiver:
    """Adds a tree to a tar by directory file descriptors, so no path is followed through a swapped link."""

    def __init__(
        self, tar: tarfile.TarFile, stop: threading.Event, changes: _Changes | None, max_bytes: int, max_members: int
    ) -> None:
        self.tar = tar
        self.stop = stop
        self.changes = changes
        self.max_bytes = max_bytes
        self.max_members = max_members
        self.total = 0
        self.count = 0
        self.hardlinks: dict[tuple[int, int], str] = {}

    def add(self, dir_fd: int | None, name: str, arcname: str) -> None:
        if self.stop.is_set():
            return
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        mode = st.st_mode
        if self.changes is not None:
            # Checked before any header is made: a changes-only walk passes over every file of the image.
            if not self.changes.wanted(st):
                return
            if stat.S_ISDIR(mode) and not self.changes.changed(st):
                # An unchanged directory is walked for changes below it, but not sent itself.
                self._walk(name, dir_fd, arcname)
                return
        info = _info(arcname, st)
        self.count += 1
        if self.count > self.max_members:
            raise Refused("members", arcname, f"is past the limit of {self.max_members} members (max_members)")
        if stat.S_ISREG(mode):
            key = (st.st_dev, st.st_ino)
            if st.st_nlink > 1 and key in self.hardlinks:
                info.type, info.linkname = tarfile.LNKTYPE, self.hardlinks[key]
                self.tar.addfile(info)
                return
            self.total += st.st_size
            if self.total > self.max_bytes:
                raise Refused(
                    "bytes", arcname, f"takes the archive past the limit of {self.max_bytes} bytes (max_bytes)"
                )
            self.hardlinks[key] = arcname
            with os.fdopen(open_regular(name, dir_fd, st), "rb") as f:
                info.size = st.st_size
                self.tar.addfile(info, f)
        elif stat.S_ISDIR(mode):
            info.type = tarfile.DIRTYPE
            self.tar.addfile(info)
            self._walk(name, dir_fd, arcname)
        elif stat.S_ISLNK(mode):
            info.type, info.linkname = tarfile.SYMTYPE, os.readlink(name, dir_fd=dir_fd)
            self.tar.addfile(info)
        elif stat.S_ISFIFO(mode) or stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
            # Sent as a header only (never opened): the extracting side names and refuses it.
            info.type = (
                tarfile.FIFOTYPE if stat.S_ISFIFO(mode) else tarfile.CHRTYPE if stat.S_ISCHR(mode) else tarfile.BLKTYPE
            )
            info.devmajor, info.devminor = os.major(st.st_rdev), os.minor(st.st_rdev)
            self.tar.addfile(info)
        # Sockets are skipped, as tar does.

    def _walk(self, name: str, dir_fd: int | None, arcname: str) -> None:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            self.children(fd, arcname + "/")
        finally:
            os.close(fd)

    def children(self, dir_fd: int, prefix: str) -> None:
        for name in sorted(os.listdir(dir_fd)):
            self.add(dir_fd, name, prefix + name)


class _Changes:
    """Which entries a changes-only archive takes: changed (ctime) since ``since_ns``, on one file system.

    The ctime, unlike the mtime, cannot be set back by the sandbox's code: a
    file written, chmodded or renamed after ``since_ns`` is one. Directories
    of other file systems (``/proc``, volumes, the executor's own mounts) and
    the ``excluded`` paths are not entered.
    """

    def __init__(self, since_ns: int, device: int, excluded: tuple[str, ...]) -> None:
        self.since_ns = since_ns
        self.device = device
        self.excluded = {(st.st_dev, st.st_ino) for st in map(_lstat, excluded) if st is not None}

    def changed(self, st: os.stat_result) -> bool:
        return st.st_ctime_ns >= self.since_ns

    def wanted(self, st: os.stat_result) -> bool:
        if st.st_dev != self.device or (st.st_dev, st.st_ino) in self.excluded:
            return False
        return stat.S_ISDIR(st.st_mode) or self.changed(st)


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:
        return None


async def archive(
    src: str,
    *,
    changed_since_ns: int | None = None,
    excluded: tuple[str, ...] = (),
    max_bytes: int = MAX_BYTES,
    max_members: int = MAX_MEMBERS,
) -> AsyncIterator[bytes]:
    """Yield a tar archive of ``src`` as it is made.

    A directory is archived by its contents (names relative to it); anything
    else as one member under its own name. Files are opened without
    following symlinks or blocking on FIFOs; FIFOs and devices go in as
    headers, for the extracting side to refuse. With ``changed_since_ns``,
    only what changed since then on ``src``'s file system (see ``_Changes``).
    Raises the OSError (or ``Refused``, for a file swapped meanwhile or files
    of more than ``max_bytes`` in all, or more than ``max_members``) that
    stopped it.
    """
    top = os.lstat(src)
    changes = None if changed_since_ns is None else _Changes(changed_since_ns, top.st_dev, excluded)
    loop = asyncio.get_running_loop()
    out: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=_DEPTH)
    errors: list[BaseException] = []
    stop = threading.Event()

    def work() -> None:
        try:
            with (
                io.BufferedWriter(_QueueWriter(loop, out), CHUNK) as buffered,  # type: ignore[type-var]
                tarfile.open(fileobj=buffered, mode="w|") as tar,
            ):
                archiver = _Archiver(tar, stop, changes, max_bytes, max_members)
                if stat.S_ISDIR(top.st_mode):
                    fd = os.open(src, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
                    try:
                        archiver.children(fd, "")
                    finally:
                        os.close(fd)
                else:
                    archiver.add(None, src, os.path.basename(src))
        except BaseException as exc:
            errors.append(exc)
        finally:
            asyncio.run_coroutine_threadsafe(out.put(None), loop).result()

    thread = threading.Thread(target=work, name="orchard-tar", daemon=True)
    thread.start()
    try:
        while (chunk := await out.get()) is not None:
            yield chunk
    finally:
        stop.set()
        # Unblock a producer waiting on a full queue, then let it finish.
        while thread.is_alive():
            with contextlib.suppress(asyncio.QueueEmpty):
                out.get_nowait()
            await asyncio.sleep(0.001)
    if errors:
        raise errors[0]
