"""Scale beyond one node: the lifecycle protocol on KWOK fake nodes, real control plane.

KWOK (sigs.k8s.io/kwok) plays the kubelet of fake nodes against the dev
cluster's real API server, scheduler and etcd: every pod is really created,
scheduled, watched and deleted, and KWOK marks it Running with a pod IP from
127.100.0.0/16. All of 127.0.0.0/8 is loopback, so every fake pod IP reaches
ONE real executor on this host (port 28750, a random token for the run), which
runs every command for real. Orchard's client does exactly what it does on a
real cluster: a create per sandbox, one shared watch, /healthz at the pod IP,
exec at the pod IP, a delete.

Each N runs in a fresh child process, so its CPU seconds and peak RSS are the
client's own. The API server's request counters (from /metrics) and the CPU
seconds of the API server, KWOK and the executor are read before and after.

    python benchmarks/bench_scale.py --kubeconfig PATH [-n 1000 -n 5000] [--json PATH [--append]]

``--append`` adds the runs to those already in the JSON file (a run of the
same N is replaced), to rerun one N without the others.

KWOK is built once with ``go install`` into /var/cache/orchard/kwok (about 2
minutes cold); its stage definitions come from the same module.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import re
import resource
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import types
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

KWOK_VERSION = "v0.8.0"
KWOK_CACHE = Path("/var/cache/orchard/kwok") / KWOK_VERSION
# KWOK plays a kubelet per node; with its default 4 workers it, not the system under test, would pace the pods.
KWOK_CONFIG = """apiVersion: config.kwok.x-k8s.io/v1alpha1
kind: KwokConfiguration
options:
  podPlayStageParallelism: 32
  nodePlayStageParallelism: 8
"""
STAGES = ("node/fast/node-initialize", "node/heartbeat/node-heartbeat", "pod/fast/pod-ready", "pod/fast/pod-delete")
POD_CIDR = "127.100.0.0/16"
PORT = 28750
NAMESPACE = "orchard-scale"
NODE_LABEL = "orchard.dev/bench"
PODS_PER_NODE = 1000
IMAGE = "orchard-test/busybox:latest"  # never pulled: KWOK runs no containers
SPEC = {
    "node_selector": {NODE_LABEL: "kwok"},
    "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}],
}


def kubectl(kubeconfig: str, *args: str, stdin: str | None = None) -> str:
    found = shutil.which("kubectl") or str(next(Path("/var/cache/orchard/k8s").glob("v*/bin/kubectl")))
    return subprocess.run(
        [found, f"--kubeconfig={kubeconfig}", *args], input=stdin, check=True, capture_output=True, text=True
    ).stdout


def ensure_kwok() -> tuple[Path, Path]:
    """The kwok binary and its configuration (with the stages), built and written once into the cache."""
    binary, stages = KWOK_CACHE / "bin" / "kwok", KWOK_CACHE / "kwok.yaml"
    if not binary.exists():
        print(f"building kwok {KWOK_VERSION} with go install (once)...", flush=True)
        env = {**os.environ, "GOBIN": str(binary.parent)}
        subprocess.run(["go", "install", f"sigs.k8s.io/kwok/cmd/kwok@{KWOK_VERSION}"], env=env, check=True)
    if not stages.exists():
        info = json.loads(
            subprocess.check_output(["go", "mod", "download", "-json", f"sigs.k8s.io/kwok@{KWOK_VERSION}"])
        )
        root = Path(info["Dir"]) / "kustomize" / "stage"
        stages.write_text(KWOK_CONFIG + "".join(f"---\n{(root / f'{name}.yaml').read_text()}\n" for name in STAGES))
    return binary, stages


def fake_nodes(count: int) -> str:
    nodes = [
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": f"kwok-{i}",
                "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
                "labels": {NODE_LABEL: "kwok", "kubernetes.io/hostname": f"kwok-{i}", "type": "kwok"},
            },
            "spec": {"taints": [{"key": "kwok.x-k8s.io/node", "value": "fake", "effect": "NoSchedule"}]},
            "status": {
                "allocatable": {"cpu": "1000", "memory": "4Ti", "pods": str(PODS_PER_NODE)},
                "capacity": {"cpu": "1000", "memory": "4Ti", "pods": str(PODS_PER_NODE)},
            },
        }
        for i in range(count)
    ]
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": nodes})


def cpu_seconds(pid: int) -> float:
    """User+system CPU of a process and its reaped children."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def api_requests(kubeconfig: str) -> Counter[str]:
    """The API server's request counters, by VERB resource[/subresource]."""
    counts: Counter[str] = Counter()
    for line in kubectl(kubeconfig, "get", "--raw", "/metrics").splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
        key = f"{labels['verb']} {labels['resource']}" + (f"/{labels['subresource']}" if labels["subresource"] else "")
        counts[key] += int(float(line.rsplit(" ", 1)[1]))
    return counts


@contextlib.contextmanager
def simulated_cluster(kubeconfig: str, nodes: int, token_sha256: str, log_dir: Path) -> Iterator[dict[str, int]]:
    """Fake nodes, KWOK and the one real executor; all removed again on exit."""
    binary, stages = ensure_kwok()
    kubectl(kubeconfig, "apply", "-f", "-", stdin=fake_nodes(nodes))
    with contextlib.suppress(subprocess.CalledProcessError):
        kubectl(kubeconfig, "create", "namespace", NAMESPACE)
    kwok = subprocess.Popen(
        [
            str(binary),
            f"--kubeconfig={kubeconfig}",
            f"--config={stages}",
            "--manage-all-nodes=false",
            "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
            f"--cidr={POD_CIDR}",
            "--node-ip=127.0.0.1",
            "--server-address=127.0.0.1:10247",
        ],
        stdout=open(log_dir / "kwok.log", "w"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
        env={**os.environ, "KUBE_FEATURE_WatchListClient": "false"},
    )
    workdir = tempfile.mkdtemp(prefix="orchard-scale-")
    executor = subprocess.Popen(
        [sys.executable, "-m", "orchard_executor", "--host=0.0.0.0", f"--port={PORT}", f"--workdir={workdir}"],
        stdout=open(log_dir / "executor.log", "w"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
        # A container's PATH, not this shell's (a pyenv shim costs a bash per python3).
        env={
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "ORCHARD_EXECUTOR_TOKEN_SHA256": token_sha256,
        },
    )
    try:
        deadline = time.monotonic() + 60
        while (
            kubectl(
                kubeconfig,
                "get",
                "nodes",
                "-l",
                NODE_LABEL,
                "-o",
                "jsonpath={.items[*].status.conditions[?(@.type=='Ready')].status}",
            )
            .split()
            .count("True")
            < nodes
        ):
            if time.monotonic() > deadline or kwok.poll() is not None:
                raise SystemExit(f"the KWOK nodes did not become Ready; see {log_dir / 'kwok.log'}")
            time.sleep(0.5)
        apiserver = int(subprocess.check_output(["pgrep", "-o", "-f", "bin/kube-apiserver"]).split()[0])
        yield {"kwok": kwok.pid, "executor": executor.pid, "apiserver": apiserver}
    finally:
        for proc in (executor, kwok):
            proc.terminate()
            proc.wait(10)
        kubectl(kubeconfig, "delete", "nodes", "-l", NODE_LABEL, "--wait=false")
        shutil.rmtree(workdir, ignore_errors=True)


def run_child(args: argparse.Namespace, n: int, token: str) -> dict[str, Any]:
    """One N in a fresh process: its CPU and peak RSS are the client's alone."""
    argv = [sys.executable, __file__, "--child", str(n), f"--kubeconfig={args.kubeconfig}"]
    argv += [f"--max-concurrent-starts={args.max_concurrent_starts}"]
    proc = subprocess.run(argv, input=token, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"N={n} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.splitlines()[-1])


async def child(n: int, kubeconfig: str, max_concurrent_starts: int, token: str) -> dict[str, Any]:
    # Every fake pod IP is the same executor, which has one token: hand it to the
    # Client in place of the random one it would generate for each sandbox.
    from bench_lifecycle import leftovers, run

    import orchard._client
    from orchard import KubernetesConfig

    orchard._client.secrets = types.SimpleNamespace(  # type: ignore[assignment]
        token_hex=secrets.token_hex, token_urlsafe=lambda nbytes=None: token
    )
    config = KubernetesConfig(namespace=NAMESPACE, kubeconfig=kubeconfig, transport="direct", executor_port=PORT)
    result = await run(n, config, IMAGE, SPEC, max_concurrent_starts)
    result["left_over"] = await leftovers(config)
    return result


def fds_needed(n: int) -> int:
    """File descriptors the client and the executor each need at N: a connection per pod IP, and some."""
    return n + 1000


def fds_fit(n: int) -> bool:
    """Whether this process's hard limit allows N (without the privilege to raise it)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return hard == resource.RLIM_INFINITY or hard >= fds_needed(n)


def raise_fd_limit(n: int) -> None:
    """Soft limit up to the hard one (above it, if root may), for this process and the ones it starts."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    limit = hard if fds_fit(n) else fds_needed(n)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    except (OSError, ValueError) as exc:
        raise SystemExit(f"N={n} needs a file descriptor limit of {limit} (ulimit -Hn): {exc}") from exc


def measure(args: argparse.Namespace) -> dict[str, Any]:
    raise_fd_limit(max(args.n))  # the client (a child) and the executor inherit it
    token = secrets.token_urlsafe(32)
    nodes = -(-max(args.n) // PODS_PER_NODE)
    log_dir = Path(tempfile.mkdtemp(prefix="orchard-scale-logs-"))
    out: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "load_before": os.getloadavg(), "python": sys.version.split()[0]},
        "kwok": KWOK_VERSION,
        "fake_nodes": nodes,
        "pods_per_node": PODS_PER_NODE,
        "runs": [],
    }
    with simulated_cluster(args.kubeconfig, nodes, hashlib.sha256(token.encode()).hexdigest(), log_dir) as pids:
        run_child(args, 10, token)  # warm-up: imports, the namespace's first pods
        for n in args.n:
            before_api, before_cpu = api_requests(args.kubeconfig), {k: cpu_seconds(p) for k, p in pids.items()}
            r = run_child(args, n, token)
            after_api = api_requests(args.kubeconfig)
            r["cpu_s"] = {k: cpu_seconds(p) - before_cpu[k] for k, p in pids.items()}
            r["fake_nodes"] = nodes
            delta = after_api - before_api
            r["apiserver_requests"] = {"total": sum(delta.values()), **dict(delta.most_common(12))}
            out["runs"].append(r)
            p = r["phases_ms"]
            print(
                f"N={n:<6} ok {r['succeeded']}/{n}  wall {r['wall_s']:.1f}s  {r['commands_per_s']:.0f} cmd/s  "
                f"create p50 {p['create']['p50']:.0f} ms p99 {p['create']['p99']:.0f} ms  "
                f"command p50 {p['command']['p50']:.1f} ms  client {r['client_cpu_s']:.1f} CPU-s "
                f"{r['client_peak_rss_mb']:.0f} MB  API requests {r['apiserver_requests']['total']}  "
                f"apiserver {r['cpu_s']['apiserver']:.0f} / kwok {r['cpu_s']['kwok']:.0f} / executor "
                f"{r['cpu_s']['executor']:.0f} CPU-s  left over {r['left_over']}",
                flush=True,
            )
            for e in r["errors"]:
                print("   error:", e)
    out["machine"]["load_after"] = os.getloadavg()
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, action="append", help="sandboxes (repeat; default 1000 and 5000)")
    parser.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG"))
    parser.add_argument("--max-concurrent-starts", type=int, default=64)
    parser.add_argument("--json", default=None)
    parser.add_argument("--append", action="store_true", help="add to the runs already in --json")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        figures = asyncio.run(child(args.child, args.kubeconfig, args.max_concurrent_starts, sys.stdin.read()))
        print(json.dumps(figures))
        sys.exit(0)
    if not args.kubeconfig:
        raise SystemExit("--kubeconfig (or $KUBECONFIG) is required: bring the dev cluster up first")
    args.n = args.n or [1000, 5000]
    result = measure(args)
    if args.json and args.append and Path(args.json).exists():
        earlier = json.loads(Path(args.json).read_text())
        kept = [x for x in earlier["runs"] if x["n"] not in args.n]
        result["runs"] = sorted(kept + result["runs"], key=lambda x: x["n"])
        result["fake_nodes"] = max(earlier["fake_nodes"], result["fake_nodes"])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
