"""The published lifecycle protocol: N sandboxes, each create, 4 commands, delete.

Each sandbox runs ``python -c 'import sys; print(sys.version)'``, ``ls /``
and ``cat /etc/os-release | head -1`` twice, all N in parallel from one
Client. Reports success rate, wall time, commands/s, per-phase percentiles,
the client's CPU time and peak RSS, and what was left behind afterwards.

    python benchmarks/bench_lifecycle.py --backend local -n 1 -n 10 -n 50 [--json PATH]
    python benchmarks/bench_lifecycle.py --backend docker --image orchard-test/swe:latest -n 10
    python benchmarks/bench_lifecycle.py --backend kubernetes --kubeconfig PATH --image orchard-test/swe:latest -n max

``-n max`` on kubernetes is as many sandboxes as the cluster's nodes still
have pod slots for.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import time
from collections import defaultdict
from typing import Any

from _stats import pct

import orchard
from orchard._backends import BackendConfig, DockerConfig, KubernetesConfig, LocalConfig

COMMANDS = (
    "python3 -c 'import sys; print(sys.version)'",
    "ls /",
    "cat /etc/os-release | head -1",
    "cat /etc/os-release | head -1",
)


def summary_ms(values: list[float]) -> dict[str, float]:
    return {
        "p50": pct(values, 50) * 1000,
        "p95": pct(values, 95) * 1000,
        "p99": pct(values, 99) * 1000,
        "max": max(values) * 1000,
    }


def client_cost() -> tuple[float, float]:
    """CPU seconds used by this process so far, and its peak RSS in MB."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime, ru.ru_maxrss / 1024


async def one(client: orchard.Client, image: str, spec: dict[str, Any], phases: dict[str, list[float]]) -> bool:
    t0 = time.perf_counter()
    sb = await client.create(image, **spec)
    phases["create"].append(time.perf_counter() - t0)
    for name, at in sb.timings.items():  # the backend's own steps, seconds since the create call
        phases[f"start.{name}"].append(at)
    try:
        for cmd in COMMANDS:
            t = time.perf_counter()
            r = await sb.exec(cmd, timeout=120)
            phases["command"].append(time.perf_counter() - t)
            if r.exit_code != 0:
                return False
    finally:
        t = time.perf_counter()
        await sb.aclose()
        phases["delete"].append(time.perf_counter() - t)
    return True


async def run(
    n: int, config: BackendConfig, image: str, spec: dict[str, Any] | None = None, max_concurrent_starts: int = 64
) -> dict[str, Any]:
    """Run the protocol for N sandboxes at once from one Client; return the figures."""
    phases: dict[str, list[float]] = defaultdict(list)
    cpu0, _ = client_cost()
    async with orchard.Client(config, max_concurrent_starts=max_concurrent_starts) as client:
        t0 = time.perf_counter()
        outcomes = await asyncio.gather(
            *(one(client, image, spec or {}, phases) for _ in range(n)), return_exceptions=True
        )
        wall = time.perf_counter() - t0
        api_requests = dict(getattr(client._backend, "api_requests", {}))
    cpu1, peak_rss = client_cost()
    ok = sum(1 for o in outcomes if o is True)
    errors = sorted({repr(o)[:300] for o in outcomes if isinstance(o, BaseException)})[:5]
    return {
        "n": n,
        "backend": config.__struct_config__.tag,
        "image": image,
        "max_concurrent_starts": max_concurrent_starts,
        "succeeded": ok,
        "success_rate": ok / n,
        "wall_s": wall,
        "commands": len(phases["command"]),
        "commands_per_s": len(phases["command"]) / wall,
        "phases_ms": {name: summary_ms(v) for name, v in phases.items() if v},
        "client_cpu_s": cpu1 - cpu0,
        "client_peak_rss_mb": peak_rss,
        "api_requests": api_requests,
        "errors": errors,
    }


async def leftovers(config: BackendConfig) -> int:
    """Sandboxes of any session still present on the backend."""
    if isinstance(config, KubernetesConfig):
        from orchard._backends.kubernetes import list_sandboxes as k8s_ls

        return len(await k8s_ls(config))
    if isinstance(config, DockerConfig):
        from orchard._backends.docker import list_sandboxes as docker_ls

        return len(await docker_ls(config))
    assert isinstance(config, LocalConfig)
    assert config.root
    return len(os.listdir(config.root)) if os.path.isdir(config.root) else 0


MEMORY = "64Mi"  # each kubernetes sandbox's memory request and limit: executor ~30 MB, python3 -c ~10 MB
UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9}


def quantity(q: str) -> int:
    """Bytes in a Kubernetes memory quantity such as 64Mi or 24Gi."""
    for suffix, factor in UNITS.items():
        if q.endswith(suffix):
            return int(float(q[: -len(suffix)]) * factor)
    return int(q)


async def node_capacity(config: KubernetesConfig) -> int:
    """Sandboxes the cluster's schedulable nodes still hold: free pod slots, and memory for MEMORY each."""
    from kubernetes_asyncio import client
    from kubernetes_asyncio import config as kconfig

    cfg = client.Configuration()
    await kconfig.load_kube_config(config_file=config.kubeconfig, client_configuration=cfg)
    async with client.ApiClient(cfg) as api:
        core = client.CoreV1Api(api)
        nodes = (await core.list_node()).items
        pods = (
            await core.list_pod_for_all_namespaces(field_selector="status.phase!=Succeeded,status.phase!=Failed")
        ).items
    free = 0
    for node in nodes:
        if node.spec.unschedulable or node.spec.taints:
            continue
        on_node = [p for p in pods if p.spec.node_name == node.metadata.name]
        requested = sum(
            quantity(((c.resources and c.resources.requests) or {}).get("memory", "0"))
            for p in on_node
            for c in p.spec.containers
        )
        slots = int(node.status.allocatable["pods"]) - len(on_node)
        memory = (quantity(node.status.allocatable["memory"]) - requested) // quantity(MEMORY)
        free += max(0, min(slots, memory))
    return free


async def ensure_namespace(config: KubernetesConfig) -> None:
    """The benchmark's own namespace, so that its leftover count sees nothing else."""
    from kubernetes_asyncio import client
    from kubernetes_asyncio import config as kconfig
    from kubernetes_asyncio.client.exceptions import ApiException

    cfg = client.Configuration()
    await kconfig.load_kube_config(config_file=config.kubeconfig, client_configuration=cfg)
    async with client.ApiClient(cfg) as api:
        try:
            await client.CoreV1Api(api).create_namespace({"metadata": {"name": config.namespace}})
        except ApiException as exc:
            if exc.status != 409:
                raise


def make_backend(args: argparse.Namespace) -> BackendConfig:
    if args.backend == "kubernetes":
        return KubernetesConfig(namespace=args.namespace, kubeconfig=args.kubeconfig, transport="direct")
    if args.backend == "docker":
        return DockerConfig()
    return LocalConfig(root=args.root, isolation=args.isolation)


def line(r: dict[str, Any]) -> str:
    p = r["phases_ms"]
    return (
        f"{r['backend']:<10} N={r['n']:<5} ok {r['succeeded']}/{r['n']}  wall {r['wall_s']:.2f}s  "
        f"{r['commands_per_s']:.1f} cmd/s  create p50 {p['create']['p50']:.0f} ms  "
        f"command p50 {p['command']['p50']:.1f} ms p99 {p['command']['p99']:.1f} ms  "
        f"delete p50 {p['delete']['p50']:.0f} ms  client {r['client_cpu_s']:.1f} CPU-s "
        f"{r['client_peak_rss_mb']:.0f} MB  left over {r['left_over']}"
    )


async def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    config = make_backend(args)
    spec: dict[str, Any] = {"memory": MEMORY} if args.backend == "kubernetes" else {}
    if isinstance(config, KubernetesConfig):
        await ensure_namespace(config)
    results = []
    for want in args.n:
        n = await node_capacity(config) if want == "max" else int(want)  # type: ignore[arg-type]
        r = await run(n, config, args.image, spec, args.max_concurrent_starts)
        r["requested"] = want
        r["left_over"] = await leftovers(config)
        results.append(r)
        print(line(r), flush=True)
        for e in r["errors"]:
            print("   error:", e)
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="local", choices=["local", "docker", "kubernetes"])
    parser.add_argument("--image", default="local")
    parser.add_argument("-n", action="append", help="sandboxes, or 'max' (repeat for several runs)")
    parser.add_argument("--root", default=f"/tmp/orchard-bench-{os.getpid()}", help="local backend's root")
    parser.add_argument("--isolation", default="auto", help="local backend's isolation")
    parser.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG"))
    parser.add_argument("--namespace", default="orchard-lifecycle")
    parser.add_argument("--max-concurrent-starts", type=int, default=64)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    args.n = args.n or ["1", "10", "50"]
    out = asyncio.run(main(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
