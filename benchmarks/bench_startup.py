"""Kubernetes create-to-ready, split into phases, for 1 and for N concurrent sandboxes, per injection.

Phases are seconds since the create call: created (the API server accepted
the pod), scheduled, initialized (the injector copied the runtime; with image
volumes there is nothing to copy), running, executor ready (its /healthz
answered at the pod IP). Each N runs with the runtime copied by an init
container and mounted as an image volume, alternating, in one session. N=1
is repeated (``--repeat``) and its phases are p50 / max over the repeats.
Also counts the API requests the client made. Exec latency is bench_exec.py's.

    python benchmarks/bench_startup.py --kubeconfig PATH [--namespace default] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import shutil
import time
from typing import Any

from _stats import pct

import orchard

IMAGE = "orchard-test/busybox:latest"


def stats(values: list[float]) -> dict[str, float]:
    return {"p50_ms": pct(values, 50) * 1000, "p99_ms": pct(values, 99) * 1000, "n": len(values)}


def kubectl() -> str:
    found = shutil.which("kubectl") or next(iter(sorted(glob.glob("/var/cache/orchard/k8s/v*/bin/kubectl"))), None)
    if not found:
        raise SystemExit("kubectl not found (bring the dev cluster up first)")
    return found


async def startup(cfg: orchard.KubernetesConfig, n: int, repeat: int) -> dict[str, Any]:
    phases: dict[str, list[float]] = {}
    walls: list[float] = []
    async with orchard.Client(cfg) as c:

        async def one() -> None:
            async with c.sandbox(IMAGE, memory="64Mi") as sb:
                for name, value in sb.timings.items():
                    phases.setdefault(name, []).append(value)

        for _ in range(repeat):
            t0 = time.perf_counter()
            await asyncio.gather(*(one() for _ in range(n)))
            walls.append(time.perf_counter() - t0)
        backend: Any = c._backend
        requests = {k: v for k, v in backend.api_requests.items() if v}
    return {
        "n": n,
        "injection": cfg.injection,
        "repeats": repeat,
        "wall_s": pct(walls, 50),
        "phases_ms": {k: {"p50": pct(v, 50) * 1000, "max": max(v) * 1000} for k, v in phases.items()},
        "api_requests": requests,
        "api_writes_per_sandbox": (requests["create"] + requests["delete"]) / (n * repeat),
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "load_before": os.getloadavg()}}
    out["startup"] = []
    for n in args.concurrency:
        for injection in ("init-container", "image-volume"):
            cfg = orchard.KubernetesConfig(namespace=args.namespace, kubeconfig=args.kubeconfig, injection=injection)
            out["startup"].append(await startup(cfg, n, args.repeat if n == 1 else 1))
    return out


def report(r: dict[str, Any]) -> str:
    lines = ["create to ready (ms since the create call; p50 / max):"]
    for s in r["startup"]:
        phases = "  ".join(f"{k} {v['p50']:.0f}/{v['max']:.0f}" for k, v in s["phases_ms"].items())
        lines.append(
            f"  N={s['n']:<3} {s['injection']:<14} wall {s['wall_s']:.2f}s  {phases}  "
            f"API writes/sandbox {s['api_writes_per_sandbox']:.0f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG", "/var/lib/orchard-devcluster/kubeconfig"))
    parser.add_argument("--namespace", default="default")
    parser.add_argument("--concurrency", type=int, action="append")
    parser.add_argument("--repeat", type=int, default=5, help="runs of N=1, one after another (default 5)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    args.concurrency = args.concurrency or [1, 50]
    results = asyncio.run(main(args))
    print(report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
