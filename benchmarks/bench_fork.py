"""Forks against redoing the setup: a virtualenv with a few packages, per backend.

    python benchmarks/bench_fork.py [--backend local docker kubernetes] [--runs 5]
                                    [--json benchmarks/results/fork.json]

The setup is what a task's preparation often is: a virtualenv made and
numpy, requests and PyYAML (with their dependencies) installed by pip, from
wheels uploaded into the sandbox (it has no network; the wheels are fetched
once from the package index into /var/cache/orchard/bench-wheels), then
removed. For each backend, in one run: a base sandbox does the setup and is
snapshotted (time, size); then ``--runs`` times, alternating, a sandbox
started cold that does the setup, one started with ``restore=`` the
snapshot, and one claimed from a warm pool with ``restore=``. Each figure is
the time from ``client.create`` until the venv's Python imports the three
packages. Timings are printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from _stats import pct, per_backend

import orchard
from orchard.errors import UnisolatedWarning

KUBECONFIG = os.environ.get("KUBECONFIG", "/var/lib/orchard-devcluster/kubeconfig")
IMAGES = {"local": "local", "docker": "orchard-test/swe:latest", "kubernetes": "orchard-test/swe:latest"}
WHEELS = Path("/var/cache/orchard/bench-wheels")
PACKAGES = ["numpy", "requests", "pyyaml"]
# The task images' Python (Debian 12's); the host's local backend runs the same /usr/bin/python3.
TARGET = ["--python-version", "3.11", "--platform", "manylinux2014_x86_64", "--only-binary=:all:"]
SETUP = (
    "set -e; python3 -m venv --without-pip venv; "
    "venv/bin/python wheels/pip.whl/pip install -q --no-index --no-cache-dir --find-links wheels "
    + " ".join(PACKAGES)
    + "; rm -rf wheels"
)
CHECK = "venv/bin/python -c 'import numpy, requests, yaml'"


def fetch_wheels() -> Path:
    """The wheels of PACKAGES and of pip itself, downloaded once."""
    if not (WHEELS / "pip.whl").exists():
        WHEELS.mkdir(parents=True, exist_ok=True)
        pip = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "-d", str(WHEELS)]
        subprocess.run([*pip, *TARGET, *PACKAGES], check=True)
        with tempfile.TemporaryDirectory() as d:
            subprocess.run([*pip[:-1], d, *TARGET, "--no-deps", "pip"], check=True)
            (wheel,) = Path(d).glob("pip-*.whl")
            os.replace(wheel, WHEELS / "pip.whl")  # pip runs from its wheel: python pip.whl/pip
    return WHEELS


def config(backend: str, root: str) -> Any:
    if backend == "local":
        return orchard.LocalConfig(root=root)  # bubblewrap, the default
    if backend == "docker":
        return orchard.DockerConfig()
    return orchard.KubernetesConfig(namespace="orchard-bench-fork", kubeconfig=KUBECONFIG)


async def run(sb: orchard.Sandbox, script: str) -> None:
    r = await sb.exec(script, timeout=600)
    if r.exit_code != 0:
        raise RuntimeError(f"{script!r} failed in {sb.id}: {r.stderr[-2000:]}")


async def setup(sb: orchard.Sandbox, wheels: Path) -> None:
    await sb.upload(wheels, "wheels")
    await run(sb, SETUP)


async def ready(client: orchard.Client, image: str, wheels: Path, snap: orchard.Snapshot | None) -> tuple[float, bool]:
    """Create to the venv importing its packages, by setup or by restore; and whether it was a warm claim."""
    t0 = time.perf_counter()
    async with client.sandbox(image, restore=snap) as sb:
        if snap is None:
            await setup(sb, wheels)
        await run(sb, CHECK)
        return time.perf_counter() - t0, "claim" in sb.timings


def stats(values: list[float]) -> dict[str, float]:
    return {"p50_s": pct(values, 50), "min_s": min(values), "max_s": max(values), "n": len(values)}


async def backend_figures(backend: str, runs: int, wheels: Path) -> dict[str, Any]:
    image = IMAGES[backend]
    with tempfile.TemporaryDirectory() as root:
        cold_client = orchard.Client(config(backend, root))
        warm_client = orchard.Client(config(backend, root), warm={image: 1})
        async with cold_client, warm_client:
            async with cold_client.sandbox(image) as base:
                t0 = time.perf_counter()
                await setup(base, wheels)
                setup_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                snap = await base.snapshot()
                snapshot_s = time.perf_counter() - t0
            setups, restores, warm_restores, missed = [], [], [], 0
            for _ in range(runs):
                setups.append((await ready(cold_client, image, wheels, None))[0])
                restores.append((await ready(cold_client, image, wheels, snap))[0])
                await warm_client.wait_warm(timeout=600)
                seconds, claimed = await ready(warm_client, image, wheels, snap)
                warm_restores.append(seconds)
                missed += not claimed
    return {
        "backend": backend,
        "image": image,
        "packages": PACKAGES,
        "base_setup_s": setup_s,
        "snapshot_s": snapshot_s,
        "snapshot_mib": snap.size / 2**20,
        "cold_setup": stats(setups),
        "cold_restore": stats(restores),
        "warm_restore": stats(warm_restores),
        "claims_missed": missed,
    }


def show(r: dict[str, Any]) -> None:
    s, c, w = r["cold_setup"]["p50_s"], r["cold_restore"]["p50_s"], r["warm_restore"]["p50_s"]
    print(
        f"{r['backend']:<11} snapshot {r['snapshot_mib']:.1f} MiB in {r['snapshot_s']:.2f} s; create to ready, p50: "
        f"cold + setup {s:.2f} s, cold + restore {c:.2f} s ({s / c:.1f}x), warm + restore {w:.2f} s ({s / w:.1f}x)"
        + (f"; {r['claims_missed']} claims fell back to cold" if r["claims_missed"] else "")
    )


async def main(args: argparse.Namespace) -> dict[str, Any]:
    warnings.simplefilter("ignore", UnisolatedWarning)
    wheels = fetch_wheels()
    return await per_backend(
        args.backend, "orchard-bench-fork", lambda backend: backend_figures(backend, args.runs, wheels), show
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", nargs="+", default=["local", "docker", "kubernetes"])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    figures = asyncio.run(main(args))
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
