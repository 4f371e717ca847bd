"""Snapshots: what a sandbox's filesystem gained, kept by the client, to start other sandboxes from.

A snapshot is one or more plain tar streams, each with the sandbox directory
it is relative to, held in memory or in one file. The client never unpacks
one: it only passes the bytes from one sandbox to another, whose executor
restores them in place (``orchard_executor.tarstream._restore``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from collections.abc import AsyncIterator

_CHUNK = 256 * 1024


@dataclasses.dataclass(frozen=True)
class Part:
    """One tar stream of a snapshot: restored under ``path``; bytes ``start:end`` of its store."""

    path: str
    start: int
    end: int


@dataclasses.dataclass(frozen=True, eq=False)
class Snapshot:
    """What ``Sandbox.snapshot`` captured; ``client.sandbox(image, restore=snap)`` starts from it.

    Held in memory (``data``) or in the file ``file``; reusable any number of
    times, from any Client of this process or, with ``file``, another one.
    """

    parts: tuple[Part, ...]
    #: The working directory of the sandbox it was taken in: paths under it
    #: are restored under the new sandbox's working directory.
    workdir: str
    #: Bytes of tar in all.
    size: int
    data: bytes | None = None
    file: str | None = None

    def where(self, part: Part, workdir: str) -> str:
        """Where ``part`` goes in a sandbox whose working directory is ``workdir``."""
        if part.path == self.workdir or part.path.startswith(self.workdir.rstrip("/") + "/"):
            return workdir.rstrip("/") + part.path[len(self.workdir.rstrip("/")) :] or "/"
        return part.path

    async def chunks(self, part: Part) -> AsyncIterator[bytes]:
        """The bytes of one part, a chunk at a time."""
        if self.data is not None:
            view = memoryview(self.data)
            for at in range(part.start, part.end, _CHUNK):
                yield bytes(view[at : min(at + _CHUNK, part.end)])
            return
        assert self.file is not None
        with open(self.file, "rb") as f:
            f.seek(part.start)
            left = part.end - part.start
            while left > 0:
                chunk = await asyncio.to_thread(f.read, min(_CHUNK, left))
                if not chunk:
                    raise EOFError(f"snapshot file {self.file} ends before its byte {part.end}")
                left -= len(chunk)
                yield chunk


class Store:
    """Where a snapshot's bytes go as they arrive: a bytearray, or a file (removed again on failure)."""

    def __init__(self, file: str | os.PathLike[str] | None) -> None:
        self.file = None if file is None else os.fspath(file)
        self.size = 0
        self._buffer = bytearray()
        self._f = None if self.file is None else open(self.file, "wb")  # noqa: SIM115 - closed by finish or discard

    async def write(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self._f is None:
            self._buffer += chunk
        else:
            await asyncio.to_thread(self._f.write, chunk)

    def finish(self, parts: list[Part], workdir: str) -> Snapshot:
        if self._f is not None:
            self._f.close()
            return Snapshot(tuple(parts), workdir, self.size, file=self.file)
        return Snapshot(tuple(parts), workdir, self.size, data=bytes(self._buffer))

    def discard(self) -> None:
        self._buffer = bytearray()
        if self._f is not None:
            self._f.close()
            assert self.file is not None
            with contextlib.suppress(FileNotFoundError):  # nothing is kept of a failed snapshot
                os.unlink(self.file)
