"""Run the benchmark suite (all of it, or some parts), then regenerate README's tables and plots.

    scripts/bench                            # the documented command: sets up, then runs this
    python benchmarks/run.py                 # everything, the dev cluster already up
    python benchmarks/run.py --only exec,scale [--quick]

Parts, each also a script of its own (see its docstring):

- ``local``     bench_local.py: local backend exec vs a bare spawn, executor RSS and start
- ``executor``  images/executor/measure_bundle.py: the injected runtime's size, start, RSS
- ``exec``      bench_exec.py: exec latency matrix and file throughput on Kubernetes
- ``startup``   bench_startup.py: create-to-ready phases at N=1 and N=50
- ``lifecycle`` bench_lifecycle.py: the published protocol on kubernetes, local and docker
- ``scale``     bench_scale.py: the protocol at N=100, 1000, 5000 and 10000 on KWOK fake nodes
- ``tls``       bench_tls.py: TLS to the executor vs plain HTTP on docker, and HMAC signing's cost
- ``sync``      bench_sync.py: orchard.sync's overhead per exec against the async call
- ``trace``     bench_trace.py: trace='s overhead per exec
- ``frozen``    bench_frozen.py: how soon a call on a frozen executor fails, with the default deadlines
- ``forward``   bench_forward.py: sb.forward latency and throughput against reaching the server from inside,
                on local, local-bwrap, docker and kubernetes (both transports)
- ``rollout``   bench_rollout.py: orchard.rollout's attempts per second and utilisation at concurrency 8, 32
                and 128 on docker and kubernetes, and what adaptive=True saves
- ``warm``      bench_warm.py: warm pool claims against cold starts on local, docker and kubernetes
- ``fork``      bench_fork.py: starting from a snapshot against redoing the setup (a venv with packages)
- ``chaos``     bench_chaos.py: 12 sandboxes at work while faults fire at the dev cluster (as root), every
                outcome accounted for: typed errors, lost files, hung calls, pods left over

Results go to benchmarks/results/NAME.json, plots to benchmarks/results/*.png.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import bench_scale

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PARTS = (
    "local",
    "executor",
    "exec",
    "startup",
    "lifecycle",
    "scale",
    "tls",
    "sync",
    "trace",
    "frozen",
    "forward",
    "rollout",
    "warm",
    "fork",
    "gui",
    "chaos",
)
IMAGE = "orchard-test/swe:latest"  # Debian with python3: the protocol's first command needs it


def python(*argv: str) -> None:
    subprocess.run([sys.executable, *argv], cwd=ROOT, check=True)


def lifecycle(kubeconfig: str, quick: bool) -> None:
    """The protocol on kubernetes at 1, 10, 50 and the node's max; local and docker at the same N."""
    ns = ["1", "10"] if quick else ["1", "10", "50", "max"]
    out: dict[str, list[dict[str, object]]] = {}
    for backend, image in (("kubernetes", IMAGE), ("docker", IMAGE), ("local", "local")):
        path = RESULTS / f".lifecycle-{backend}.json"
        argv = ["benchmarks/bench_lifecycle.py", f"--backend={backend}", f"--image={image}", f"--json={path}"]
        if backend == "kubernetes":
            argv.append(f"--kubeconfig={kubeconfig}")
        python(*argv, *(arg for n in ns for arg in ("-n", n)))
        out[backend] = json.loads(path.read_text())
        path.unlink()
        if backend == "kubernetes":  # the others run the same N, "max" included
            ns = [str(r["n"]) for r in out[backend]]
    (RESULTS / "lifecycle.json").write_text(json.dumps(out, indent=2))


def forward(kubeconfig: str, quick: bool) -> None:
    """bench_forward.py on every backend and transport, into one forward.json."""
    os.environ["KUBECONFIG"] = kubeconfig  # bench_forward.py reads it
    runs = []
    for backend, transport in (
        ("local", "direct"),
        ("local-bwrap", "direct"),
        ("docker", "direct"),
        ("kubernetes", "direct"),
        ("kubernetes", "port-forward"),
    ):
        path = RESULTS / f".forward-{backend}-{transport}.json"
        argv = [f"--backend={backend}", f"--transport={transport}", f"--json={path}"]
        python("benchmarks/bench_forward.py", *argv, *(["--reps=50", "--mib=8"] if quick else []))
        runs.append(json.loads(path.read_text()))
        path.unlink()
    (RESULTS / "forward.json").write_text(json.dumps({"runs": runs}, indent=2) + "\n")


def gui(kubeconfig: str, quick: bool) -> None:
    """bench_gui.py on docker and kubernetes, then the dev node's GUI capacity, into one gui.json."""
    os.environ["KUBECONFIG"] = kubeconfig  # bench_gui.py reads it
    out: dict[str, Any] = {"runs": []}
    for backend in ("docker", "kubernetes"):
        path = RESULTS / f".gui-{backend}.json"
        python(
            "benchmarks/bench_gui.py",
            f"--backend={backend}",
            f"--json={path}",
            *(["--reps=10", "--starts=2"] if quick else []),
        )
        out["runs"].append(json.loads(path.read_text()))
        path.unlink()
    path = RESULTS / ".gui-capacity.json"
    python(
        "benchmarks/bench_gui.py",
        "--capacity",
        "--backend=kubernetes",
        f"--json={path}",
        *(["--max=5"] if quick else []),
    )
    out["capacity"] = json.loads(path.read_text())
    path.unlink()
    (RESULTS / "gui.json").write_text(json.dumps(out, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of: {', '.join(PARTS)}")
    parser.add_argument("--quick", action="store_true", help="small sizes, to check the suite runs")
    parser.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG", "/var/lib/orchard-devcluster/kubeconfig"))
    args = parser.parse_args()
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise SystemExit(f"unknown part(s) {unknown}; choose from {', '.join(PARTS)}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    kube = f"--kubeconfig={args.kubeconfig}"
    timings: dict[str, float] = {}
    t_suite = time.monotonic()
    for part in parts:
        print(f"\n== {part}", flush=True)
        t0 = time.monotonic()
        json_out = f"--json={RESULTS / f'{part}.json'}"
        if part == "local":
            python("benchmarks/bench_local.py", json_out, *(["--iterations=200"] if args.quick else []))
        elif part == "executor":
            python("images/executor/measure_bundle.py", json_out, *(["--starts=3"] if args.quick else []))
        elif part == "exec":
            python("benchmarks/bench_exec.py", kube, json_out, *(["--quick"] if args.quick else []))
        elif part == "startup":
            python(
                "benchmarks/bench_startup.py",
                kube,
                json_out,
                *(["--concurrency=1", "--concurrency=5"] if args.quick else []),
            )
        elif part == "lifecycle":
            lifecycle(args.kubeconfig, args.quick)
        elif part == "scale":
            sizes = [100] if args.quick else [100, 1000, 5000, 10000]
            if not bench_scale.fds_fit(sizes[-1]):
                print(f"scale: N={sizes[-1]} left out, it needs ulimit -Hn of {bench_scale.fds_needed(sizes[-1])}")
                sizes.pop()
            python("benchmarks/bench_scale.py", kube, json_out, *(f"-n{n}" for n in sizes))
        elif part == "tls":
            python("benchmarks/bench_tls.py", json_out, *(["--reps=100", "--mib=16"] if args.quick else []))
        elif part in ("sync", "trace"):
            python(f"benchmarks/bench_{part}.py", json_out, *(["--iterations=200"] if args.quick else []))
        elif part == "frozen":
            python("benchmarks/bench_frozen.py", json_out, *(["--runs=1"] if args.quick else []))
        elif part == "forward":
            forward(args.kubeconfig, args.quick)
        elif part == "gui":
            gui(args.kubeconfig, args.quick)
        elif part == "chaos":
            python("benchmarks/bench_chaos.py", kube, json_out, *(["--quick"] if args.quick else []))
        elif part in ("rollout", "warm", "fork"):
            os.environ["KUBECONFIG"] = args.kubeconfig  # each reads it
            quick = {"rollout": ["--quick"], "warm": ["--runs=5", "--burst=4"], "fork": ["--runs=2"]}[part]
            python(f"benchmarks/bench_{part}.py", json_out, *(quick if args.quick else []))
        timings[part] = time.monotonic() - t0
        print(f"== {part}: {timings[part]:.0f} s", flush=True)
    if not args.quick:
        suite = RESULTS / "suite.json"
        previous = json.loads(suite.read_text()) if suite.exists() else {}
        previous.update({"parts_s": {**previous.get("parts_s", {}), **timings}})
        if set(parts) == set(PARTS):
            previous["total_s"] = time.monotonic() - t_suite
        suite.write_text(json.dumps(previous, indent=2))
        python("benchmarks/readme.py")
    print(f"\nsuite: {time.monotonic() - t_suite:.0f} s for {', '.join(parts)}")


if __name__ == "__main__":
    main()
