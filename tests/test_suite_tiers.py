"""Plain ``pytest`` runs every tier ``scripts/test`` runs, and fails, never drops, one that cannot run.

The suite itself is run here, in a subprocess, the way a developer types it:
no ``ORCHARD_TEST_BACKENDS`` in the environment.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.executor

ROOT = Path(__file__).resolve().parents[1]
#: One quick generic test: plain pytest must run it on each local tier.
GENERIC = "tests/test_sandbox_exec.py::test_argv_is_not_interpreted_by_a_shell"


def test_plain_pytest_runs_the_bubblewrap_tier_and_fails_it_where_bubblewrap_cannot_run(tmp_path: Path) -> None:
    # First on PATH, a bwrap refused its namespaces, as in an unprivileged container.
    fake = tmp_path / "bin" / "bwrap"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "ORCHARD_TEST_BACKENDS"}
    env["PATH"] = f"{fake.parent}{os.pathsep}{env.get('PATH', '')}"
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", "--basetemp", str(tmp_path / "t"), GENERIC],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    out = r.stdout + r.stderr
    assert f"{GENERIC}[local] PASSED" in out, out
    assert f"{GENERIC}[local-bwrap] ERROR" in out, out
    assert "the local-bwrap tier cannot run: isolation='bwrap' but bubblewrap is not installed" in out, out
    assert r.returncode == 1, out
