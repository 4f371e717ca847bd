"""Tar archives made and extracted as streams, shared by the executor and client.

tarfile is blocking, so the archive work runs in a thread and the chunks
cross to the event loop through bounded queues: memory stays at a few
chunks whatever the size of the tree.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import queue
import tarfile
import threading
from collections.abc import AsyncIterable, AsyncIterator

CHUNK = 256 * 1024
_DEPTH = 16


class _QueueReader(io.RawIOBase):
    """A blocking file object fed from the event loop through a bounded queue."""

    def __init__(self) -> None:
        self.queue: queue.Queue[bytes | None] = queue.Queue(maxsize=_DEPTH)
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
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n


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


def _escapes(root: str, name: str) -> bool:
    target = os.path.realpath(os.path.join(root, name))
    return os.path.isabs(name) or not (target == root or target.startswith(root + os.sep))


def _outside(kind: str, member: tarfile.TarInfo, path: str) -> tarfile.TarError:
    error: type[tarfile.TarError] | None = getattr(tarfile, kind, None)
    if error is not None:
        return error(member, path)
    # CPython before 3.11.4 (Debian 12's 3.11.2, the injected runtime's) lacks PEP 706.
    return tarfile.TarError(f"{member.name!r} would be extracted to {path!r}, which is outside the destination")


def keep_inside(dest: str) -> tarfile._FilterType:  # type: ignore[name-defined]
    """A tar filter that keeps modes and symlinks but refuses paths leaving ``dest``."""
    root = os.path.realpath(dest)

    def check(member: tarfile.TarInfo, _path: str) -> tarfile.TarInfo:
        if _escapes(root, member.name):
            raise _outside("OutsideDestinationError", member, os.path.join(root, member.name))
        if member.islnk() and _escapes(root, member.linkname):
            raise _outside("LinkOutsideDestinationError", member, os.path.join(root, member.linkname))
        return member

    return check


def _extract_all(tar: tarfile.TarFile, dest: str) -> None:
    check = keep_inside(dest)
    if hasattr(tarfile, "data_filter"):  # PEP 706: CPython 3.11.4 and later
        tar.extractall(dest, filter=check)
        return
    # Earlier 3.11 releases: the same check, applied member by member as the stream is read.
    tar.extractall(dest, members=(check(member, dest) for member in tar))


async def extract(chunks: AsyncIterable[bytes], dest: str) -> None:
    """Extract a tar stream into ``dest`` (created if missing) as it arrives.

    Raises the OSError or tarfile.TarError that stopped the extraction.
    """
    os.makedirs(dest, exist_ok=True)
    reader = _QueueReader()
    errors: list[BaseException] = []

    def work() -> None:
        try:
            with tarfile.open(fileobj=io.BufferedReader(reader, CHUNK), mode="r|*") as tar:
                _extract_all(tar, dest)
        except BaseException as exc:
            errors.append(exc)
        # Keep draining so the producer never blocks on a full queue.
        while not reader._eof and reader.queue.get() is not None:
            pass

    thread = threading.Thread(target=work, name="orchard-untar", daemon=True)
    thread.start()
    loop = asyncio.get_running_loop()
    try:
        async for chunk in chunks:
            if errors:
                break
            await loop.run_in_executor(None, reader.queue.put, chunk)
    finally:
        await loop.run_in_executor(None, reader.queue.put, None)
        await loop.run_in_executor(None, thread.join)
    if errors:
        raise errors[0]


async def archive(src: str) -> AsyncIterator[bytes]:
    """Yield a tar archive of ``src`` as it is made.

    A directory is archived by its contents (names relative to it); anything
    else as one member under its own name. Raises the OSError that stopped it.
    """
    os.lstat(src)
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
                if os.path.isdir(src) and not os.path.islink(src):
                    for name in sorted(os.listdir(src)):
                        if stop.is_set():
                            return
                        tar.add(os.path.join(src, name), arcname=name)
                else:
                    tar.add(src, arcname=os.path.basename(src))
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
