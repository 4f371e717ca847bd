"""``orchard doctor --backend docker``, run as the real command against the real engine, and against none."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.docker

ENGINE_FIX = (
    "start dockerd (scripts/docker-setup.sh installs and starts one), or point DOCKER_HOST (DockerConfig(host=...)) "
    "at a running engine"
)


def doctor(*args: str, docker_host: str | None = None) -> tuple[int, dict[str, Any], float]:
    """Exit status, JSON report and seconds taken of ``orchard doctor --backend docker --json ARGS``."""
    env = dict(os.environ)
    if docker_host is not None:
        env["DOCKER_HOST"] = docker_host
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "orchard", "doctor", "--backend", "docker", "--json", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert "Traceback" not in r.stderr, r.stderr
    return r.returncode, json.loads(r.stdout), time.monotonic() - t0


def by_name(report: dict[str, Any]) -> dict[str, dict[str, str]]:
    return {c["check"]: c for c in report["checks"]}


def test_a_healthy_engine_passes_and_runs_a_sandbox() -> None:
    rc, report, _ = doctor()
    checks = by_name(report)
    assert rc == 0, report
    assert report["ok"] is True
    assert {n: c["status"] for n, c in checks.items()} == {
        "engine": "pass",
        "injector-image": "pass",
        "trial-image": "pass",
        "sandbox": "pass",
    }
    assert re.fullmatch(
        r"started in \d+ ms over a unix socket; 'echo orchard doctor' answered in \d+ ms", checks["sandbox"]["detail"]
    )


def test_no_engine_fails_at_once_with_the_fix() -> None:
    rc, report, took = doctor(docker_host="unix:///nonexistent.sock")
    checks = by_name(report)
    assert rc == 1
    assert report["ok"] is False
    assert took < 10
    assert checks["engine"]["status"] == "fail"
    assert checks["engine"]["detail"].startswith("cannot reach the Docker engine at unix:///nonexistent.sock: ")
    assert checks["engine"]["fix"] == ENGINE_FIX
    for name in ("injector-image", "trial-image", "sandbox"):
        assert checks[name] == {
            "backend": "docker",
            "check": name,
            "status": "skip",
            "detail": "not run: the engine check failed",
            "fix": "",
        }


def test_an_engine_that_never_answers_fails_within_the_deadline(tmp_path: Path) -> None:
    path = tmp_path / "silent.sock"
    with socket.socket(socket.AF_UNIX) as silent:  # connections are accepted (the backlog), never answered
        silent.bind(str(path))
        silent.listen(8)
        rc, report, took = doctor(docker_host=f"unix://{path}")
    engine = by_name(report)["engine"]
    assert rc == 1
    assert took < 15
    assert engine["status"] == "fail"
    assert engine["detail"] == f"the Docker engine at unix://{path} did not answer within 5 s"
    assert engine["fix"] == "restart dockerd, or point DOCKER_HOST (DockerConfig(host=...)) at an engine that answers"


def test_a_missing_trial_image_fails_naming_it() -> None:
    rc, report, _ = doctor("--image", "orchard-test/no-such-image:1")
    checks = by_name(report)
    assert rc == 1
    assert checks["engine"]["status"] == "pass"
    assert checks["injector-image"]["status"] == "pass"
    assert checks["trial-image"] == {
        "backend": "docker",
        "check": "trial-image",
        "status": "fail",
        "detail": "orchard-test/no-such-image:1 is not on the engine (doctor does not pull)",
        "fix": "docker pull orchard-test/no-such-image:1, or --image IMAGE for an image the engine has",
    }
    assert checks["sandbox"]["status"] == "skip"
    assert checks["sandbox"]["detail"] == "not run: the trial-image check failed"
