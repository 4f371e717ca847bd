"""The harness tools bundle on docker: its size per harness, and what tools=[...] costs a sandbox's start.

    python benchmarks/bench_tools.py [--backend docker|kubernetes] [--injection image-volume|init-container]
                                     [--reps 10] [--json PATH]

Same run, same machine, alternated so load falls on all alike: create a
sandbox of the SWE image and run its first command, without tools, with
claude alone and with every harness (``tools=list(KNOWN)``), then delete it.
On docker the tools volume is filled before timing (once per tools image on
a host: that fill is timed apart, from an empty volume); on kubernetes the
tools image is mounted as an image volume, or (``--injection init-container``)
an init container copies the chosen harnesses into each pod. Sizes are
measured inside a sandbox (``du`` of each part of the bundle), and each
harness's ``--version`` (mini's ``--help``) is timed there too. With ``--json``, the run
replaces that backend's (and injection's) entry in the file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from _stats import pct

import orchard
from orchard import _tools
from orchard._backends import docker
from orchard._backends.docker_engine import DockerError

IMAGE = "orchard-test/swe:latest"


async def start(client: orchard.Client, tools: list[str]) -> float:
    """Seconds from create to the first command's answer; the sandbox is then deleted."""
    t0 = time.perf_counter()
    async with client.sandbox(IMAGE, tools=tools) as sb:
        await sb.exec(["true"])
        return time.perf_counter() - t0


async def fill_from_empty(client: orchard.Client) -> float | None:
    """Seconds to fill the tools volume from nothing (the first tools sandbox on a host pays it)."""
    backend = (await client._ensure_open())[0]
    assert isinstance(backend, docker.DockerBackend)
    image_id = await backend._engine.image_id(backend.config.tools_image)
    assert image_id is not None, "orchard-tools:latest is missing: run scripts/docker-setup.sh"
    try:
        await backend._engine.request("DELETE", f"/volumes/orchard-tools-{image_id.removeprefix('sha256:')[:12]}")
    except DockerError as exc:
        if exc.status == 409:  # sandboxes of another process use it: not measured this run
            print(f"tools volume in use, its fill not measured: {exc.message}")
            return None
        if exc.status != 404:
            raise
    docker._FILLED.clear()
    backend._tools_volume = None
    t0 = time.perf_counter()
    await backend.tools_volume()
    return time.perf_counter() - t0


async def main(backend: str, reps: int, injection: str) -> dict[str, Any]:
    kubeconfig = os.environ.get("KUBECONFIG", "/var/lib/orchard-devcluster/kubeconfig")
    config: orchard.DockerConfig | orchard.KubernetesConfig = (
        orchard.DockerConfig()
        if backend == "docker"
        else orchard.KubernetesConfig(kubeconfig=kubeconfig, injection=injection)  # type: ignore[arg-type]
    )
    async with orchard.Client(config) as client:
        fill = await fill_from_empty(client) if backend == "docker" else None
        everything = list(_tools.KNOWN)
        kinds = {"without": [], "claude": ["claude"], "with": everything}
        for tools in kinds.values():  # warm every path
            await start(client, tools)
        samples: dict[str, list[float]] = {kind: [] for kind in kinds}
        for _ in range(reps):
            for kind, tools in kinds.items():
                samples[kind].append(await start(client, tools))
        async with client.sandbox(IMAGE, tools=everything) as sb:
            du = await sb.exec(f"cd {_tools.BUNDLE} && du -sb *")
            sizes = {name: int(n) for n, name in (line.split("\t") for line in du.stdout.splitlines())}
            version_s = {}
            for name in everything:
                t0 = time.perf_counter()
                flag = "--help" if name == "mini" else "--version"  # mini has no --version
                r = await sb.exec([name, flag], env={"HOME": f"/tmp/{name}"}, timeout=120)
                version_s[name] = time.perf_counter() - t0
                assert r.exit_code == 0, (name, r.stderr)
            versions = (await sb.read_file(f"{_tools.BUNDLE}/VERSIONS")).decode().split("\n")
    p50 = {k: pct(v, 50) * 1e3 for k, v in samples.items()}
    return {
        "backend": backend,
        **({"injection": injection} if backend == "kubernetes" else {}),
        "image": IMAGE,
        "reps": reps,
        "start_p50_ms": p50,
        "start_p90_ms": {k: pct(v, 90) * 1e3 for k, v in samples.items()},
        "with_tools_ratio": p50["with"] / p50["without"],
        "claude_ratio": p50["claude"] / p50["without"],
        "volume_fill_s": fill,
        "sizes_bytes": sizes,
        "version_s": version_s,
        "versions": [v for v in versions if v],
        "python": sys.version.split()[0],
    }


def show(r: dict[str, Any]) -> None:
    mib = 1 << 20
    print(f"tools bundle, {r['backend']}{', ' + r['injection'] if 'injection' in r else ''}, {r['image']}")
    for name, size in sorted(r["sizes_bytes"].items(), key=lambda kv: -kv[1]):
        took = r["version_s"].get(name)
        print(f"  {name:10} {size / mib:8.0f} MiB" + (f"   --version {took * 1e3:7.0f} ms" if took else ""))
    print(f"  {'total':10} {sum(r['sizes_bytes'].values()) / mib:8.0f} MiB")
    if r["volume_fill_s"] is not None:
        print(f"  volume fill from empty (once per tools image on a host): {r['volume_fill_s']:.1f} s")
    p50 = r["start_p50_ms"]
    print(
        f"  create to first exec p50: without tools {p50['without']:.0f} ms, claude {p50['claude']:.0f} ms "
        f"({r['claude_ratio']:.2f}x), all {len(r['version_s'])} {p50['with']:.0f} ms ({r['with_tools_ratio']:.2f}x); "
        f"{r['reps']} alternated rounds"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="docker", choices=["docker", "kubernetes"])
    parser.add_argument("--injection", default="image-volume", choices=["image-volume", "init-container"])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results = asyncio.run(main(args.backend, args.reps, args.injection))
    show(results)
    if args.json is not None:
        old = json.loads(args.json.read_text()) if args.json.exists() else {}
        key = (results["backend"], results.get("injection", "init-container"))
        runs = [r for r in old.get("runs", []) if (r["backend"], r.get("injection", "init-container")) != key]
        args.json.write_text(json.dumps({"runs": [*runs, results]}, indent=2) + "\n")
