"""The ``orchard`` command as a newcomer meets it: one or two lines saying what failed and what fixes it.

Each runs the real command in a subprocess; what it lacks (a kubeconfig, a Docker engine) is really absent.
"""

from __future__ import annotations

from pathlib import Path

from support import orchard_cli


def test_no_kubeconfig_says_which_file_is_missing_and_how_to_pass_one(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    run = orchard_cli("ls", env={"KUBECONFIG": str(missing)})
    assert (run.returncode, run.stdout) == (1, "")
    assert run.stderr == (
        f"orchard ls: no kubeconfig: {missing} does not exist ($KUBECONFIG): pass kubeconfig=PATH "
        "(orchard's commands: --kubeconfig PATH) or set KUBECONFIG; inside a cluster, in_cluster=True\n"
    )
    # Neither $KUBECONFIG nor ~/.kube/config: the default path is named.
    run = orchard_cli("gc", "--dry-run", env={"KUBECONFIG": "", "HOME": str(tmp_path)})
    assert run.returncode == 1
    assert run.stderr.startswith("orchard gc: no kubeconfig: ~/.kube/config does not exist: pass kubeconfig=PATH")


def test_a_malformed_kubeconfig_is_one_line_naming_the_file_and_where_it_breaks(tmp_path: Path) -> None:
    bad = tmp_path / "kubeconfig"
    bad.write_text("apiVersion: v1\nclusters: [\n  - {name: x\n")
    run = orchard_cli("ls", "--kubeconfig", str(bad))
    assert (run.returncode, run.stdout) == (1, "")
    [line] = run.stderr.splitlines()  # the YAML parser's error spans three lines
    assert line.startswith(f"orchard ls: cannot load Kubernetes credentials (kubeconfig='{bad}', context=None): ")
    assert f'in "{bad}", line 3, column 3' in line


def test_no_docker_engine_names_the_address_and_the_fix(tmp_path: Path) -> None:
    sock = tmp_path / "docker.sock"
    run = orchard_cli("ls", "--backend", "docker", env={"DOCKER_HOST": f"unix://{sock}"}, timeout=30)
    assert (run.returncode, run.stdout) == (1, "")
    assert run.stderr.startswith(f"orchard ls: cannot reach the Docker engine at unix://{sock}: ")
    assert run.stderr.endswith(
        "is dockerd running (scripts/docker-setup.sh starts one)? Otherwise set DockerConfig(host=...) or DOCKER_HOST\n"
    )
    assert len(run.stderr.splitlines()) == 1


def test_debug_adds_the_traceback_and_usage_errors_exit_2(tmp_path: Path) -> None:
    env = {"KUBECONFIG": str(tmp_path / "nope.yaml")}
    run = orchard_cli("ls", "--debug", env=env)
    assert run.returncode == 1
    assert run.stderr.startswith("Traceback (most recent call last):")
    assert "orchard.errors.ConfigError: no kubeconfig" in run.stderr
    assert run.stderr.splitlines()[-1].startswith("orchard ls: no kubeconfig:")
    assert orchard_cli("--debug", "ls", env=env).stderr.startswith("Traceback")  # before the command too
    run = orchard_cli("ls", "--backend", "nomad")
    assert run.returncode == 2
    assert "argument --backend: invalid choice: 'nomad'" in run.stderr
    run = orchard_cli("demo", "-n", "0")
    assert (run.returncode, run.stderr) == (2, "orchard demo: --sandboxes must be at least 1\n")


def test_demo_quiet_prints_only_the_results(tmp_path: Path) -> None:
    run = orchard_cli("demo", "-n", "2", "--quiet", cwd=str(tmp_path))
    assert run.returncode == 0, run.stderr
    assert "sandboxes" not in run.stderr  # no progress, no header (an UNISOLATED notice would still show)
    assert run.stdout.splitlines()[0].split()[:3] == ["OPERATION", "OK", "FAILED"]
    assert "sandboxes: 2/2 succeeded, 0 failed" in run.stdout
