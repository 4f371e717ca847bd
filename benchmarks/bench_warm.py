"""Warm pools against cold starts: create (or claim) to the first command's answer, per backend.

    python benchmarks/bench_warm.py [--backend local local-none docker kubernetes] [--runs 20] [--burst 16]
                                    [--json benchmarks/results/warm.json]

For each backend, in one run: ``--runs`` sandboxes one at a time started
cold, then as many claimed from ``Client(warm={image: size})`` with the pool
full before each claim; then a burst of ``--burst`` at once (a GRPO group),
cold, then claimed from a full pool of that size. On kubernetes the same
again for a pool shared across processes (``orchard pool keep``, here a
keeper in this process; a claim lists the pool's pods, wins one by a
compare-and-swap patch and re-keys it). On local (``local``: bubblewrap,
``local-none``: unisolated) cold starts are forks of the backend's fork
server, measured against a fresh interpreter per sandbox (``fork=False``),
the fork server started before the figures. On docker they use the unix
transport (the default: a socket in a bind-mounted directory, no network),
measured against ``transport="tcp"`` (TLS on a bridge network). Each figure is the time
from ``client.create`` to the answer of ``exec("true")``. Cold and warm runs
alternate per sample, so the machine's load hits both alike. The cold starts'
phases (``sb.timings``: when each startup step ended, from the create call)
are kept as medians, to show where a cold start's time goes. Timings are
printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import msgspec
from _stats import pct, per_backend

import orchard
from orchard.errors import UnisolatedWarning

KUBECONFIG = os.environ.get("KUBECONFIG", "/var/lib/orchard-devcluster/kubeconfig")
IMAGES = {
    "local": "local",
    "local-none": "local",
    "docker": "orchard-test/busybox:latest",
    "kubernetes": "orchard-test/busybox:latest",
}


def baseline(backend: str, root: str) -> tuple[str, Any] | None:
    """What a backend's cold starts are measured against in the same run: (its key in the figures, its config)."""
    if backend.startswith("local"):
        return "fresh", config(backend, root, fork=False)  # a fresh interpreter per sandbox
    if backend == "docker":
        return "tcp", orchard.DockerConfig(transport="tcp")  # TLS to the executor on Orchard's bridge network
    return None


def config(backend: str, root: str, *, fork: bool = True) -> Any:
    if backend == "local":
        return orchard.LocalConfig(root=root, fork=fork)  # bubblewrap, the default
    if backend == "local-none":
        return orchard.LocalConfig(root=root, isolation="none", fork=fork)
    if backend == "docker":
        return orchard.DockerConfig()
    return orchard.KubernetesConfig(namespace="orchard-bench-warm", kubeconfig=KUBECONFIG)


async def first_command(
    client: orchard.Client, image: str, phases: list[dict[str, float]] | None = None
) -> tuple[float, bool]:
    t0 = time.perf_counter()
    async with client.sandbox(image) as sb:
        await sb.exec("true")
        seconds = time.perf_counter() - t0
        if phases is not None:
            phases.append({**sb.timings, "first_command": seconds})
        return seconds, "claim" in sb.timings


def phase_medians(phases: list[dict[str, float]]) -> dict[str, float]:
    """Median ms of each startup phase's end, from the create call (``sb.timings``), in the order they end."""
    names = sorted({k for p in phases for k in p}, key=lambda k: statistics.median(p.get(k, 0) for p in phases))
    return {k: statistics.median(p[k] for p in phases if k in p) * 1000 for k in names}


def stats(values: list[float]) -> dict[str, float]:
    return {"p50_ms": pct(values, 50) * 1000, "p99_ms": pct(values, 99) * 1000, "n": len(values)}


class Shared:
    """A shared kubernetes pool of ``size`` (a keeper in this process) and a client claiming from it."""

    def __init__(self, size: int) -> None:
        from orchard._backends.k8s_pool import Keeper
        from orchard._spec import make_spec

        self.size = size
        self.keeper = Keeper(config("kubernetes", ""), "bench", make_spec(IMAGES["kubernetes"], {}), size)
        self.client = orchard.Client(msgspec.structs.replace(config("kubernetes", ""), pool="bench"))

    async def full(self) -> None:
        async with asyncio.timeout(600):
            while self.keeper.free < self.size or self.keeper.starts == 0:
                await asyncio.sleep(0.1)


async def backend_figures(backend: str, runs: int, burst: int) -> dict[str, Any]:
    image = IMAGES[backend]
    with tempfile.TemporaryDirectory() as root:
        cold_client = orchard.Client(config(backend, root))
        warm_client = orchard.Client(config(backend, root), warm={image: max(1, burst)})
        shared = Shared(max(1, burst)) if backend == "kubernetes" else None
        keeping = asyncio.create_task(shared.keeper.run()) if shared is not None else None
        # Local: the fork server's cold starts against a fresh interpreter per sandbox (fork=False);
        # docker: the unix transport's against tcp.
        base = baseline(backend, root)
        base_client = orchard.Client(base[1]) if base is not None else None
        async with cold_client, warm_client, contextlib.AsyncExitStack() as stack:
            if shared is not None:
                await stack.enter_async_context(shared.client)
            if base_client is not None:
                await stack.enter_async_context(base_client)
                # What each client does once (the fork server, a network, the runtime volume), before the figures.
                await first_command(cold_client, image)
                await first_command(base_client, image)

            async def settled() -> None:
                """Every pool full: no refill of one competes with a claim from another."""
                await warm_client.wait_warm(timeout=600)
                if shared is not None:
                    await shared.full()

            await settled()
            cold, warm, shared_warm, based, missed, phases = [], [], [], [], 0, []
            for _ in range(runs):
                if base_client is not None:
                    based.append((await first_command(base_client, image))[0])
                cold.append((await first_command(cold_client, image, phases))[0])
                await settled()
                seconds, claimed = await first_command(warm_client, image)
                warm.append(seconds)
                missed += not claimed
                if shared is not None:
                    await settled()
                    seconds, claimed = await first_command(shared.client, image)
                    shared_warm.append(seconds)
                    missed += not claimed
            # The burst's figure is its slowest sandbox: when the whole group has answered.
            base_burst = None
            if base_client is not None:
                base_burst = max(
                    s for s, _ in await asyncio.gather(*(first_command(base_client, image) for _ in range(burst)))
                )
            cold_burst = max(
                s for s, _ in await asyncio.gather(*(first_command(cold_client, image) for _ in range(burst)))
            )
            await settled()
            claims = await asyncio.gather(*(first_command(warm_client, image) for _ in range(burst)))
            warm_burst = max(s for s, _ in claims)
            missed += sum(not claimed for _, claimed in claims)
            shared_burst = None
            if shared is not None:
                await settled()
                claims = await asyncio.gather(*(first_command(shared.client, image) for _ in range(burst)))
                shared_burst = max(s for s, _ in claims)
                missed += sum(not claimed for _, claimed in claims)
        if keeping is not None:
            keeping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeping
    extra = {"shared": stats(shared_warm), "shared_burst_s": shared_burst} if shared is not None else {}
    if base is not None:
        extra |= {base[0]: stats(based), f"{base[0]}_burst_s": base_burst}
    return {
        "backend": backend,
        "image": image,
        "cold": stats(cold),
        "cold_phases_ms": phase_medians(phases),
        "warm": stats(warm),
        "burst": burst,
        "cold_burst_s": cold_burst,
        "warm_burst_s": warm_burst,
        "claims_missed": missed,
        **extra,
    }


def show(r: dict[str, Any]) -> None:
    c, w = r["cold"], r["warm"]
    print(
        f"{r['backend']:<11} create to first command, p50/p99 ms: cold {c['p50_ms']:.1f}/{c['p99_ms']:.1f}, "
        f"warm {w['p50_ms']:.1f}/{w['p99_ms']:.1f} ({c['p50_ms'] / w['p50_ms']:.0f}x); "
        f"{r['burst']} at once: cold {r['cold_burst_s']:.2f} s, warm {r['warm_burst_s']:.2f} s"
        + (f"; {r['claims_missed']} claims fell back to cold" if r["claims_missed"] else "")
    )
    if "fresh" in r:
        f = r["fresh"]
        print(
            " " * 12 + f"a fresh interpreter per sandbox (fork=False): p50/p99 ms {f['p50_ms']:.1f}/{f['p99_ms']:.1f} "
            f"(the fork server {f['p50_ms'] / c['p50_ms']:.1f}x faster); {r['burst']} at once {r['fresh_burst_s']:.2f} s"
        )
    if "tcp" in r:
        t = r["tcp"]
        print(
            " " * 12 + f"transport tcp (TLS on a bridge network): p50/p99 ms {t['p50_ms']:.1f}/{t['p99_ms']:.1f} "
            f"(unix {t['p50_ms'] / c['p50_ms']:.1f}x faster); {r['burst']} at once {r['tcp_burst_s']:.2f} s"
        )
    if "shared" in r:
        s = r["shared"]
        print(
            " " * 12 + f"shared pool (orchard pool keep): p50/p99 ms {s['p50_ms']:.1f}/{s['p99_ms']:.1f} "
            f"({c['p50_ms'] / s['p50_ms']:.0f}x); {r['burst']} at once {r['shared_burst_s']:.2f} s"
        )
    print(
        " " * 12
        + "cold phases, median ms from create: "
        + ", ".join(f"{k} {v:.0f}" for k, v in r["cold_phases_ms"].items())
    )


async def main(args: argparse.Namespace) -> dict[str, Any]:
    warnings.simplefilter("ignore", UnisolatedWarning)
    return await per_backend(
        args.backend, "orchard-bench-warm", lambda backend: backend_figures(backend, args.runs, args.burst), show
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", nargs="+", default=["local", "docker", "kubernetes"])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--burst", type=int, default=16)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    figures = asyncio.run(main(args))
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
