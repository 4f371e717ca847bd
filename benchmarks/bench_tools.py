"""The harness tools bundle on docker: its size per harness, and what tools=[...] costs a sandbox's start.

    python benchmarks/bench_tools.py [--reps 10] [--json PATH]

Same run, same machine, alternated so load falls on both alike: create a
sandbox of the SWE image and run its first command, without tools and with
every harness (``tools=list(KNOWN)``), then delete it. The tools volume is
filled before timing (once per tools image on a host: that fill is timed
apart, from an empty volume). Sizes are measured inside a sandbox (``du``
of each part of the mounted bundle), and each harness's ``--version`` is
timed there too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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


async def fill_from_empty(client: orchard.Client) -> float:
    """Seconds to fill the tools volume from nothing (the first tools sandbox on a host pays it)."""
    backend = client._ensure_open()[0]
    assert isinstance(backend, docker.DockerBackend)
    image_id = await backend._engine.image_id(backend.config.tools_image)
    assert image_id is not None, "orchard-tools:latest is missing: run scripts/docker-setup.sh"
    try:  # no sandbox may be using it
        await backend._engine.request("DELETE", f"/volumes/orchard-tools-{image_id.removeprefix('sha256:')[:12]}")
    except DockerError as exc:
        if exc.status != 404:
            raise
    docker._FILLED.clear()
    backend._tools_volume = None
    t0 = time.perf_counter()
    await backend.tools_volume()
    return time.perf_counter() - t0


async def main(reps: int) -> dict[str, Any]:
    async with orchard.Client("docker") as client:
        fill = await fill_from_empty(client)
        everything = list(_tools.KNOWN)
        for tools in ([], everything):  # warm both paths
            await start(client, tools)
        samples: dict[str, list[float]] = {"without": [], "with": []}
        for _ in range(reps):
            samples["without"].append(await start(client, []))
            samples["with"].append(await start(client, everything))
        async with client.sandbox(IMAGE, tools=everything) as sb:
            du = await sb.exec(f"cd {_tools.BUNDLE} && du -sb *")
            sizes = {name: int(n) for n, name in (line.split("\t") for line in du.stdout.splitlines())}
            version_s = {}
            for name in everything:
                t0 = time.perf_counter()
                r = await sb.exec([name, "--version"], env={"HOME": f"/tmp/{name}"}, timeout=120)
                version_s[name] = time.perf_counter() - t0
                assert r.exit_code == 0, (name, r.stderr)
            versions = (await sb.read_file(f"{_tools.BUNDLE}/VERSIONS")).decode().split("\n")
    p50 = {k: pct(v, 50) * 1e3 for k, v in samples.items()}
    return {
        "backend": "docker",
        "image": IMAGE,
        "reps": reps,
        "start_p50_ms": p50,
        "start_p90_ms": {k: pct(v, 90) * 1e3 for k, v in samples.items()},
        "with_tools_ratio": p50["with"] / p50["without"],
        "volume_fill_s": fill,
        "sizes_bytes": sizes,
        "version_s": version_s,
        "versions": [v for v in versions if v],
        "python": sys.version.split()[0],
    }


def show(r: dict[str, Any]) -> None:
    mib = 1 << 20
    print(f"tools bundle, docker, {r['image']}")
    for name, size in sorted(r["sizes_bytes"].items(), key=lambda kv: -kv[1]):
        took = r["version_s"].get(name)
        print(f"  {name:10} {size / mib:8.0f} MiB" + (f"   --version {took * 1e3:7.0f} ms" if took else ""))
    print(f"  {'total':10} {sum(r['sizes_bytes'].values()) / mib:8.0f} MiB")
    print(f"  volume fill from empty (once per tools image on a host): {r['volume_fill_s']:.1f} s")
    w, wo = r["start_p50_ms"]["with"], r["start_p50_ms"]["without"]
    print(f"  create to first exec p50: without tools {wo:.0f} ms, with all {len(r['version_s'])} {w:.0f} ms")
    print(f"  ratio with/without: {r['with_tools_ratio']:.2f} ({r['reps']} alternated pairs)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results = asyncio.run(main(args.reps))
    show(results)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
