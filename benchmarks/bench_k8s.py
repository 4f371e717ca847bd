"""Kubernetes backend figures on a real cluster, each path measured in the same run.

1. Exec round trip of ``true`` on ONE pod: through the executor at the pod IP
   (the library), through the API server with the client library's exec
   (kubernetes_asyncio websocket), and with ``kubectl exec``.
2. Create-to-ready split into phases (created, scheduled, initialized,
   running, executor ready) for 1 and for N concurrent sandboxes.

    python benchmarks/bench_k8s.py --kubeconfig PATH [--namespace default] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import shutil
import statistics
import subprocess
import time
from typing import Any

import orchard

IMAGE = "orchard-test/busybox:latest"


def pct(values: list[float], q: int) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def stats(values: list[float]) -> dict[str, float]:
    return {"p50_ms": pct(values, 50) * 1000, "p99_ms": pct(values, 99) * 1000, "n": len(values)}


def kubectl() -> str:
    found = shutil.which("kubectl") or next(iter(sorted(glob.glob("/var/cache/orchard/k8s/v*/bin/kubectl"))), None)
    if not found:
        raise SystemExit("kubectl not found (bring the dev cluster up first)")
    return found


async def exec_paths(cfg: orchard.KubernetesConfig, iterations: int, kubectl_iterations: int) -> dict[str, Any]:
    from kubernetes_asyncio import client, config
    from kubernetes_asyncio.stream import WsApiClient

    async with orchard.Client(cfg) as c, c.sandbox(IMAGE) as sb:
        kcfg = client.Configuration()
        await config.load_kube_config(config_file=cfg.kubeconfig, client_configuration=kcfg)
        async with WsApiClient(configuration=kcfg) as ws:
            core = client.CoreV1Api(ws)

            async def api_exec() -> None:
                out = await core.connect_get_namespaced_pod_exec(
                    sb.id, cfg.namespace, container="sandbox", command=["true"], stderr=True, stdout=True
                )
                assert out == "", out

            async def direct() -> None:
                r = await sb.exec(["true"])
                assert r.exit_code == 0

            for fn in (direct, api_exec):  # warm up both
                for _ in range(5):
                    await fn()
            lib: list[float] = []
            api: list[float] = []
            for _ in range(10):  # interleaved blocks, so noise hits both alike
                for fn, samples, count in ((direct, lib, iterations // 10), (api_exec, api, max(1, iterations // 40))):
                    for _ in range(count):
                        t0 = time.perf_counter()
                        await fn()
                        samples.append(time.perf_counter() - t0)
        cli: list[float] = []
        argv = [
            kubectl(),
            f"--kubeconfig={cfg.kubeconfig}",
            "-n",
            cfg.namespace,
            "exec",
            sb.id,
            "-c",
            "sandbox",
            "--",
            "true",
        ]
        for _ in range(kubectl_iterations):
            t0 = time.perf_counter()
            subprocess.run(argv, check=True, capture_output=True)
            cli.append(time.perf_counter() - t0)
    result = {"pod_ip": stats(lib), "api_server_exec": stats(api), "kubectl_exec": stats(cli)}
    result["speedup_p50_vs_api_exec"] = result["api_server_exec"]["p50_ms"] / result["pod_ip"]["p50_ms"]
    result["speedup_p50_vs_kubectl"] = result["kubectl_exec"]["p50_ms"] / result["pod_ip"]["p50_ms"]
    return result


async def startup(cfg: orchard.KubernetesConfig, n: int) -> dict[str, Any]:
    phases: dict[str, list[float]] = {}
    async with orchard.Client(cfg) as c:

        async def one() -> None:
            async with c.sandbox(IMAGE, memory="64Mi") as sb:
                for name, value in sb.timings.items():
                    phases.setdefault(name, []).append(value)

        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        wall = time.perf_counter() - t0
        backend: Any = c._backend
        requests = dict(backend.api_requests)
    return {
        "n": n,
        "wall_s": wall,
        "phases_ms": {k: {"p50": pct(v, 50) * 1000, "max": max(v) * 1000} for k, v in phases.items()},
        "api_requests": requests,
        "api_writes_per_sandbox": (requests["create"] + requests["delete"]) / n,
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    cfg = orchard.KubernetesConfig(namespace=args.namespace, kubeconfig=args.kubeconfig)
    out: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "load_before": os.getloadavg()}}
    out["exec"] = await exec_paths(cfg, args.iterations, args.kubectl_iterations)
    out["startup"] = [await startup(cfg, n) for n in args.concurrency]
    return out


def report(r: dict[str, Any]) -> str:
    e = r["exec"]
    lines = [
        "exec round trip of `true` on one pod:",
        *(
            f"  {name:<34} p50 {e[key]['p50_ms']:8.2f} ms   p99 {e[key]['p99_ms']:8.2f} ms   (n={e[key]['n']})"
            for name, key in (
                ("orchard, direct to the pod IP", "pod_ip"),
                ("API-server exec (client library)", "api_server_exec"),
                ("kubectl exec", "kubectl_exec"),
            )
        ),
        f"  pod IP is {e['speedup_p50_vs_api_exec']:.0f}x faster than API-server exec at p50, "
        f"{e['speedup_p50_vs_kubectl']:.0f}x faster than kubectl exec (target >= 20x)",
        "create to ready (ms since the create call; p50 / max):",
    ]
    for s in r["startup"]:
        phases = "  ".join(f"{k} {v['p50']:.0f}/{v['max']:.0f}" for k, v in s["phases_ms"].items())
        lines.append(
            f"  N={s['n']:<3} wall {s['wall_s']:.1f}s  {phases}  API writes/sandbox {s['api_writes_per_sandbox']:.0f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG", "/var/lib/orchard-devcluster/kubeconfig"))
    parser.add_argument("--namespace", default="default")
    parser.add_argument("--iterations", type=int, default=400)
    parser.add_argument("--kubectl-iterations", type=int, default=20)
    parser.add_argument("--concurrency", type=int, action="append")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    args.concurrency = args.concurrency or [1, 50]
    results = asyncio.run(main(args))
    print(report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
