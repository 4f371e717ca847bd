"""``orchard doctor --backend local``, run as the real command: a healthy machine, and bubblewrap missing or broken."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from orchard._doctor import normalized_image

UNISOLATED = "or LocalConfig(isolation='none') to run sandbox commands on the host unisolated (trusted code only)"


def doctor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchard", "doctor", *args], capture_output=True, text=True, timeout=60, env=env
    )


@pytest.mark.executor
def test_a_healthy_machine_passes_every_local_check_and_starts_a_sandbox() -> None:
    r = doctor("--backend", "local", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    checks = {c["check"]: c for c in report["checks"]}
    assert report["ok"] is True
    assert {name: c["status"] for name, c in checks.items()} == {
        "python": "pass",
        "bubblewrap": "pass",
        "isolation": "pass",
        "slirp4netns": "pass",
        "sandbox": "pass",
    }
    assert {c["backend"] for c in report["checks"]} == {"local"}
    assert checks["isolation"]["detail"].startswith("isolation='auto' gives 'bwrap'")
    assert re.fullmatch(r"started in \d+ ms; 'echo orchard doctor' answered in \d+ ms", checks["sandbox"]["detail"])


@pytest.mark.executor
@pytest.mark.parametrize("bwrap", ["missing", "broken"])
def test_without_a_working_bubblewrap_auto_cannot_isolate_and_no_sandbox_is_tried(tmp_path: Path, bwrap: str) -> None:
    if bwrap == "broken":  # present, but refused its namespaces (as in an unprivileged container)
        fake = tmp_path / "bwrap"
        fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
        fake.chmod(0o755)
        failure = (
            f"FAIL local/bubblewrap: {fake} cannot create a sandbox's namespaces here (exit 1: bwrap: No permissions "
            "to create new namespace), so isolation='auto' cannot start a sandbox | fix: allow namespaces where the "
            "client runs (not an unprivileged container; sysctl user.max_user_namespaces > 0 and, without root, "
            f"kernel.unprivileged_userns_clone=1), {UNISOLATED}"
        )
    else:
        failure = (
            "FAIL local/bubblewrap: bwrap is not on PATH, so isolation='auto' (the default) cannot start a sandbox"
            f" | fix: apt-get install bubblewrap, {UNISOLATED}"
        )
    # Not a terminal: one plain line per check, without ANSI codes or table borders.
    r = doctor("--backend", "local", env={**os.environ, "PATH": str(tmp_path)})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "\x1b" not in r.stdout
    assert r.stderr == ""
    assert r.stdout.splitlines() == [
        f"PASS local/python: Python {'.'.join(map(str, sys.version_info[:3]))} at {sys.executable} "
        "(3.11 or later needed)",
        failure,
        "SKIP local/isolation: not run: the bubblewrap check failed",
        "WARN local/slirp4netns: no slirp4netns from /usr on PATH: isolated sandboxes with network=True fail "
        "(without network they work, loopback only) | fix: apt-get install slirp4netns",
        "SKIP local/sandbox: not run: the bubblewrap check failed",
        "orchard doctor: 1 passed, 1 warned, 1 failed, 2 skipped",
    ]


@pytest.mark.unit
def test_image_names_compare_as_nodes_report_them() -> None:
    assert normalized_image("orchard-executor:latest") == "docker.io/library/orchard-executor:latest"
    assert normalized_image("orchard-test/busybox") == "docker.io/orchard-test/busybox:latest"
    assert normalized_image("registry.k8s.io/pause:3.6") == "registry.k8s.io/pause:3.6"
    assert normalized_image("localhost:5000/x") == "localhost:5000/x:latest"
    assert normalized_image("busybox@sha256:ab") == "docker.io/library/busybox@sha256:ab"
