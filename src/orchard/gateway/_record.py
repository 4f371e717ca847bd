"""Where the gateway's call records go: a JSON-lines file, or a function, and memory.

Each record is one ``write(2)`` of one line to a file opened ``O_APPEND``, so
a process killed at any point leaves every finished call's record whole.
The fields are documented in docs/gateway.md; ``SCHEMA_VERSION`` is each
record's ``"v"``.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable
from typing import Any

import msgspec

from ..errors import ConfigError, RecordError

#: The ``"v"`` of every record; raised when a field changes meaning or goes away.
SCHEMA_VERSION = 1

Record = dict[str, Any]
#: What ``record=`` takes: a file path, a function called with each record, or None (memory only).
RecordTo = str | os.PathLike[str] | Callable[[Record], object] | None

_encode = msgspec.json.Encoder().encode
_log = logging.getLogger("orchard.gateway")


class Recorder:
    """Keeps every record in memory (by sandbox) and sends it to the file or function, if any."""

    def __init__(self, record: RecordTo) -> None:
        self._fd: int | None = None
        self._fn: Callable[[Record], object] | None = None
        self.path: str | None = None
        self.by_sandbox: dict[str | None, list[Record]] = {}
        self.all: list[Record] = []
        #: The first failure to write or deliver a record; raised when the gateway closes.
        self.failure: RecordError | None = None
        if record is None:
            return
        if isinstance(record, str | os.PathLike) and isinstance(path := os.fspath(record), str):
            try:
                # O_NONBLOCK: a FIFO without a reader fails (ENXIO) instead of hanging the open.
                fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
            except OSError as exc:
                raise RecordError(f"record={path!r} cannot be written: {exc.strerror}", path=path) from exc
            os.set_blocking(fd, True)
            self._fd, self.path = fd, path
        elif callable(record) and not isinstance(record, type):
            if inspect.iscoroutinefunction(record):
                raise ConfigError("record= takes a plain function of one record; an async one would never run")
            self._fn = record
        else:
            raise ConfigError(f"record= takes a file path, a function of one record, or None, not {record!r}")

    def emit(self, record: Record) -> None:
        """Keep ``record`` and write it; a failure is logged and kept for ``close`` to raise."""
        self.all.append(record)
        self.by_sandbox.setdefault(record["sandbox"], []).append(record)
        try:
            if self._fd is not None:
                data = _encode(record) + b"\n"
                while data:
                    data = data[os.write(self._fd, data) :]
            elif self._fn is not None:
                self._fn(record)
        except Exception as exc:
            where = f"record={self.path!r}" if self.path else "the record= function"
            _log.error("gateway: a call record could not be written to %s: %s", where, exc)
            if self.failure is None:
                self.failure = RecordError(f"{where}: a call record could not be written: {exc}", path=self.path)
                self.failure.__cause__ = exc

    def close(self) -> None:
        """Close the file; safe to call twice."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
