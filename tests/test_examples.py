"""The examples run as a user would run them, and say what they should."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.executor

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_quickstart(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / "quickstart.py")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[1] == "3 'hello\\n' 'oops\\n'"
    assert lines[2] == "timed out: True 'started\\n'"
    assert "main.py says 45" in lines
    assert "listing: ['main.py']" in lines
    assert any(line.startswith("hi from /") and line.endswith("/app") for line in lines)
    assert [line for line in lines if line.startswith("streamed:")] == [f"streamed: line {i}" for i in (1, 2, 3)]
    assert "exit code: 0" in lines
    assert lines[-1] == "background: 0 done"


def test_demo_command_runs_and_reports(tmp_path: Path) -> None:
    # README's "orchard demo -n 100 runs more sandboxes", as written (about 11 s here).
    run = subprocess.run(
        [sys.executable, "-m", "orchard", "demo", "-n", "100"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    # Progress on stderr, one plain line a sandbox here (not a terminal: no redraws, no escape codes); the table
    # and totals on stdout.
    assert run.stderr.splitlines()[-1] == "100/100 sandboxes  ok=100 failed=0"
    assert "\x1b" not in run.stderr + run.stdout
    report = run.stdout
    assert report.splitlines()[0].split() == [
        "OPERATION",
        "OK",
        "FAILED",
        "P50",
        "MS",
        "P95",
        "MS",
        "P99",
        "MS",
        "MAX",
        "MS",
    ]
    assert "sandboxes: 100/100 succeeded, 0 failed" in report
    for op in ("create", "write", "run", "test_fail", "fix", "test_pass", "read", "delete"):
        assert any(line.split()[:3] == [op, "100", "0"] for line in report.splitlines()), op
