"""The zygote's preload: what every executor builds first, built once before the zygote forks any.

``preload`` serves two requests with a real executor in the zygote's own
process, so it must leave that process as it found it, apart from the state
it was run for: no thread (a fork copies only the forking thread, and a lock
another held would stay locked in every executor), no file, no process, and
it must fail loudly rather than return having preloaded nothing. The
argument parser it caches must not cache what it reads from the
environment. Whether it pays is measured by ``benchmarks/bench_warm.py``
(the local cold start's phases), not here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchard_executor import __main__ as executor_main

pytestmark = pytest.mark.executor

REPORT = """
import json, os, threading
from orchard_executor import __main__ as m
m.preload()
print(json.dumps({
    "threads": threading.active_count(),
    "tasks": len(os.listdir("/proc/self/task")),
    "children": open(f"/proc/self/task/{os.getpid()}/children").read().split(),
    "parser_built": m._parser.cache_info().currsize,
    "left": os.listdir(os.environ["TMPDIR"]),
}))
"""


def run_preload(tmp_path: Path, code: str = REPORT) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter, as the zygote runs it (its temporary files under ``tmp_path``)."""
    env = {"PATH": os.defpath, "LANG": "C.UTF-8", "TMPDIR": str(tmp_path)}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, cwd="/", capture_output=True, text=True, timeout=60, check=False
    )


def test_preload_builds_the_parser_and_leaves_no_thread_process_or_file(tmp_path: Path) -> None:
    done = run_preload(tmp_path)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report == {"threads": 1, "tasks": 1, "children": [], "parser_built": 1, "left": []}
    # It served quietly: an executor that logged (a refused request, an error) would have written here.
    assert done.stderr == ""


def test_preload_fails_loudly_when_its_executor_does_not_answer_as_expected(tmp_path: Path) -> None:
    # The command it asks for now exists: the executor answers 200, not the 404 of a command not found.
    command = tmp_path / "exists"
    command.write_text("#!/bin/sh\nexit 0\n")
    command.chmod(0o755)
    code = f"from orchard_executor import __main__ as m\nm.PRELOAD_COMMAND = {str(command)!r}\nm.preload()\n"
    done = run_preload(tmp_path, code)
    assert done.returncode == 1
    assert "RuntimeError: orchard-executor: preload: the executor answered [b'200', b'200'], not [200, 404]" in (
        done.stderr
    )


def test_the_cached_parser_reads_the_token_hash_from_the_environment_at_each_parse(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    executor_main._parser()  # built, as in a zygote, before the environment below was set
    monkeypatch.setenv("ORCHARD_EXECUTOR_TOKEN_SHA256", "a" * 64)
    assert executor_main._parse([]).token_sha256 == "a" * 64
    monkeypatch.setenv("ORCHARD_EXECUTOR_TOKEN_SHA256", "b" * 64)
    assert executor_main._parse([]).token_sha256 == "b" * 64
    assert executor_main._parse([f"--token-sha256={'c' * 64}"]).token_sha256 == "c" * 64
    monkeypatch.delenv("ORCHARD_EXECUTOR_TOKEN_SHA256")
    assert executor_main._parse([]).token_sha256 is None
