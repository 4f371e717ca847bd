"""The ``orchard`` command on the docker backend: its default image, images that are not there, ls's formats."""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path

import pytest
from docker_support import BUSYBOX, SWE

import orchard
from support import orchard_cli

pytestmark = pytest.mark.docker


def test_demo_runs_the_repo_task_image_by_default(docker_ready: str, tmp_path: Path) -> None:
    run = orchard_cli("demo", "--backend", "docker", "-n", "2", cwd=str(tmp_path), timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stderr.splitlines()[0] == f"orchard demo: 2 sandboxes on the docker backend ({SWE}), in parallel"
    assert "sandboxes: 2/2 succeeded, 0 failed" in run.stdout


def test_the_image_name_local_is_refused_before_any_container_is_made(docker_ready: str, tmp_path: Path) -> None:
    run = orchard_cli("demo", "--backend", "docker", "--image", "local", "-n", "8", "-q", cwd=str(tmp_path))
    assert (run.returncode, run.stdout) == (1, "")
    assert run.stderr == (
        "orchard demo: image 'local' is not a container image: the docker backend needs one, such as "
        "'orchard-test/swe' (scripts/docker-setup.sh builds the test images)\n"
    )


async def test_the_library_refuses_the_image_name_local_too(docker_ready: str) -> None:
    async with orchard.Client("docker") as client:
        with pytest.raises(orchard.errors.ConfigError, match="image 'local' is not a container image"):
            await client.create()


def test_a_missing_image_fails_once_with_its_reason_and_fast(docker_ready: str, tmp_path: Path) -> None:
    image = f"orchard-test/missing-{secrets.token_hex(3)}:1"
    t0 = time.monotonic()
    run = orchard_cli("demo", "--backend", "docker", "--image", image, "-n", "8", "-q", cwd=str(tmp_path))
    took = time.monotonic() - t0
    assert (run.returncode, run.stdout) == (1, "")
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr  # the first sandbox's failure, once: not 8 of 8
    assert lines[0].startswith("orchard demo: sandbox sb-")
    assert f"image {image!r} is not on the Docker host and pulling it failed: " in lines[0]
    assert lines[0].endswith(
        "; build or load it there (scripts/docker-setup.sh builds orchard-test/*), or name an image it has"
    )
    print(f"a missing image failed the demo in {took:.1f} s")


async def test_ls_json_and_quiet_list_a_running_sandbox(docker_ready: str) -> None:
    async with orchard.sandbox(BUSYBOX, backend="docker") as sb:
        # Blocking this loop while ls runs is fine: the sandbox needs nothing from its client meanwhile.
        run = orchard_cli("ls", "--backend", "docker", "--json")
        assert run.returncode == 0, run.stderr
        rows = {row["name"]: row for row in json.loads(run.stdout)}
        assert rows[sb.id]["image"] == BUSYBOX
        assert rows[sb.id]["phase"] == "running"
        assert rows[sb.id]["gc"] == ""
        assert sb.id in orchard_cli("ls", "--backend", "docker", "-q").stdout.splitlines()
        table = orchard_cli("ls", "--backend", "docker").stdout.splitlines()
        assert table[0].split() == ["NAME", "SESSION", "PHASE", "IMAGE", "CREATED", "GC"]
        assert any(line.split()[0] == sb.id for line in table[1:])
