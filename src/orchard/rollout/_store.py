"""The ``out=`` directory: results.jsonl appended as attempts end, run.json with the parameters."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from ..errors import ConfigError

RESULTS = "results.jsonl"
PARAMS = "run.json"
#: The version of the record schema (docs/rollout.md), in every record as ``v``.
SCHEMA_VERSION = 1


def dumps(record: dict[str, Any]) -> str:
    """One record as a JSON line; what JSON cannot hold (an answer's objects) is written as its repr."""
    return json.dumps(record, default=repr, ensure_ascii=False) + "\n"


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a results.jsonl, the last one of each (task, attempt) winning.

    A last line without its newline (a process killed while writing it) is ignored.
    """
    latest: dict[tuple[str, int], dict[str, Any]] = {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.endswith("\n"):
                break
            try:
                record = json.loads(line)
                key = (str(record["task"]), int(record["attempt"]))
            except (ValueError, KeyError, TypeError) as exc:
                raise ConfigError(f"{path}:{number}: not a rollout record ({exc})") from None
            latest[key] = record
    return list(latest.values())


def safe_name(task_id: str) -> str:
    """A task id as a file name (traces)."""
    digest = hashlib.sha256(task_id.encode()).hexdigest()[:8]  # two ids that read alike stay apart
    return f"{re.sub(r'[^A-Za-z0-9._-]', '_', task_id)[:100]}-{digest}"


class Store:
    """An ``out=`` directory held by one run at a time (an exclusive lock on results.jsonl)."""

    def __init__(self, out: str | os.PathLike[str]) -> None:
        self.dir = Path(out)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._file = open(self.dir / RESULTS, "a+", encoding="utf-8")  # noqa: SIM115 (held until close)
        except OSError as exc:
            raise ConfigError(f"out={os.fspath(out)!r} cannot be written: {exc}") from exc
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._file.close()
            raise ConfigError(f"out={os.fspath(out)!r} is in use by another run (results.jsonl is locked)") from None
        self._drop_partial_line()

    def _drop_partial_line(self) -> None:
        """Cut a last line left without its newline, so the next record starts on a line of its own."""
        f = self._file
        f.seek(0, os.SEEK_END)
        size = f.tell()
        if size == 0:
            return
        with open(self.dir / RESULTS, "rb") as raw:
            data = raw.read()
        if data.endswith(b"\n"):
            return
        f.truncate(data.rfind(b"\n") + 1)
        f.seek(0, os.SEEK_END)

    def records(self) -> list[dict[str, Any]]:
        """The records already written (the last of each attempt)."""
        return read_records(self.dir / RESULTS)

    def params(self) -> dict[str, Any] | None:
        """The run.json of an earlier run, if any."""
        try:
            with open(self.dir / PARAMS, encoding="utf-8") as f:
                value: dict[str, Any] = json.load(f)
                return value
        except FileNotFoundError:
            return None
        except ValueError as exc:
            raise ConfigError(f"{self.dir / PARAMS}: not JSON ({exc})") from None

    def write_params(self, params: dict[str, Any]) -> None:
        """Write run.json atomically."""
        tmp = self.dir / (PARAMS + ".tmp")
        tmp.write_text(json.dumps(params, default=repr, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        os.replace(tmp, self.dir / PARAMS)

    def append(self, record: dict[str, Any]) -> None:
        """Append one record and flush it: once this returns, a crash loses it no more."""
        self._file.write(dumps(record))
        self._file.flush()

    def trace_path(self, task_id: str, attempt: int) -> str:
        """Where an attempt's sandbox trace goes (every try appends to it)."""
        directory = self.dir / "traces" / safe_name(task_id)
        directory.mkdir(parents=True, exist_ok=True)
        return str(directory / f"{attempt}.jsonl")

    def close(self) -> None:
        """Release the lock."""
        with contextlib.suppress(OSError):
            self._file.close()
