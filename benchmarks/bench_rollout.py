"""orchard.rollout: attempts per second and sandbox utilisation by concurrency, and what adaptive=True saves.

    python benchmarks/bench_rollout.py [--backend docker kubernetes] [--concurrency 8 32 128]
                                       [--quick] [--json benchmarks/results/rollout.json]

**Throughput.** The toy tasks (examples/tasks/swe-mini.jsonl: six small
repositories, image orchard-test/toys) x n attempts of
``orchard.tasks.ScriptedPolicy(p_right=0.5)``, graded by
``orchard.tasks.swe_reward`` (a fresh sandbox per grade: the patch applied,
the tests run, swebench's grading), at each concurrency on each backend.
Each attempt holds one sandbox at a time (the agent's, then the reward's),
so concurrency 128 means up to 128 containers or pods. n is chosen so that
there are at least twice as many attempts as slots (at least 8 per task):
the run spends most of its time full, not draining. Reported: attempts per
second (attempts / wall), and sandbox utilisation: the attempts' time in
flight (start to end, all tries) / (concurrency x wall): 1.0 means every
slot held an attempt the whole run.

**Adaptive.** The same budget (tasks x n = 30 x 8) with adaptive=False and
adaptive=True, on the local backend (what is counted is attempts, not
seconds): generic tasks whose solve rates are spread as an RL task pool's
often are (40% never solved, 20% always, 40% in between, seeded), a seeded
agent, a reward that grades the answer without a sandbox. Reported: the
groups with mixed outcomes at the end, and the attempts each mode ran to
reach the same number of mixed groups (the smaller of the two finals),
counting attempts in the order they ended; and the attempts that fell in
mixed groups (those a GRPO trainer learns from).

Timings are printed, never asserted. With ``--json`` the file is rewritten
with this run's figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import orchard
import orchard.rollout
from orchard import tasks as otasks
from orchard.errors import UnisolatedWarning
from orchard.tasks import Reward, Task

ROOT = Path(__file__).resolve().parent.parent
TOYS = ROOT / "examples" / "tasks" / "swe-mini.jsonl"
KUBECONFIG = os.environ.get("KUBECONFIG", "/var/lib/orchard-devcluster/kubeconfig")


def client_config(backend: str) -> Any:
    if backend == "kubernetes":
        return orchard.KubernetesConfig(namespace="orchard-bench-rollout", kubeconfig=KUBECONFIG)
    if backend == "docker":
        return orchard.DockerConfig()
    raise SystemExit(f"--backend {backend!r}: docker or kubernetes")


async def ensure_namespace(name: str) -> None:
    """The benchmark's own namespace (created if missing), so its pods are counted apart from others'."""
    from kubernetes_asyncio import client, config
    from kubernetes_asyncio.client.api_client import ApiClient
    from kubernetes_asyncio.client.exceptions import ApiException

    cfg = client.Configuration()
    await config.load_kube_config(config_file=KUBECONFIG, client_configuration=cfg)
    async with ApiClient(configuration=cfg) as api:
        try:
            await client.CoreV1Api(api).create_namespace({"metadata": {"name": name}})
        except ApiException as exc:
            if exc.status != 409:
                raise
        for _ in range(300):  # pods are refused until the namespace's default service account exists
            sas = await client.CoreV1Api(api).list_namespaced_service_account(name)
            if sas.items:
                return
            await asyncio.sleep(0.1)


def per_task(concurrency: int, quick: bool, tasks: int) -> int:
    """Attempts per task: twice as many attempts as slots, at least 8 per task (2 and one per slot if quick)."""
    if quick:
        return max(2, math.ceil(concurrency / tasks))
    return max(8, math.ceil(2 * concurrency / tasks))


async def throughput(backend: str, concurrency: int, quick: bool) -> dict[str, Any]:
    toys = otasks.load(TOYS)
    n = per_task(concurrency, quick, len(toys))
    policy = otasks.ScriptedPolicy(p_right=0.5, seed=0)
    async with orchard.Client(client_config(backend)) as client:
        t0 = time.monotonic()
        results = await orchard.rollout.run(
            client, toys, agent=policy, reward=otasks.swe_reward, n=n, concurrency=concurrency, progress=False
        )
        wall = time.monotonic() - t0
    ran = [r for r in results.records if r["kind"] != "skipped"]
    in_flight = sum(r["ended_at"] - r["started_at"] for r in ran)
    expected = {t.id: sum(policy.chooses_right(t, a) for a in range(n)) / n for t in toys}

    def mean(phase: str) -> float | None:
        values = [r["durations"][phase] for r in ran if r["durations"].get(phase) is not None]
        return statistics.mean(values) if values else None

    return {
        "backend": backend,
        "concurrency": concurrency,
        "tasks": len(toys),
        "n": n,
        "attempts": len(ran),
        "counts": results.counts,
        "wall_s": wall,
        "attempts_per_s": len(ran) / wall,
        "utilisation": in_flight / (concurrency * wall),
        "mean_s": {phase: mean(phase) for phase in ("start", "setup", "agent", "reward")},
        "pass_rates_as_the_policy_drew": results.pass_rate == expected,
    }


# -- adaptive ------------------------------------------------------------------------------------------------------

ADAPTIVE_TASKS, ADAPTIVE_N = 30, 8


def solve_rates(seed: int = 1) -> dict[str, float]:
    """Task id -> solve rate: 40% never solved, 20% always, 40% between 0.1 and 0.9."""
    rng = random.Random(seed)
    rates = {}
    for i in range(ADAPTIVE_TASKS):
        kind = i % 5
        rates[f"t{i:02d}"] = 0.0 if kind in (0, 1) else 1.0 if kind == 2 else rng.uniform(0.1, 0.9)
    return rates


async def adaptive_run(adaptive: bool) -> dict[str, Any]:
    rates = solve_rates()
    tasks = [Task(id=tid, image="local", instruction="answer 42") for tid in rates]

    async def agent(sb: orchard.Sandbox, task: Task, *, attempt: int) -> str:
        right = random.Random(f"{task.id}:{attempt}").random() < rates[task.id]
        return (await sb.exec(f"echo {42 if right else 41}")).stdout.strip()

    async def reward(client: orchard.Client, task: Task, answer: Any) -> Reward:
        return Reward(value=float(answer == "42"), solved=answer == "42")

    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings():
        warnings.simplefilter("ignore", UnisolatedWarning)
        async with orchard.Client(orchard.LocalConfig(root=root, isolation="none")) as client:
            results = await orchard.rollout.run(
                client,
                tasks,
                agent=agent,
                reward=reward,
                n=ADAPTIVE_N,
                concurrency=8,
                adaptive=adaptive,
                progress=False,
            )
    counted = sorted((r for r in results.records if r["kind"] in ("ok", "agent_error")), key=lambda r: r["ended_at"])
    seen: dict[str, set[bool]] = {}
    mixed_after: list[int] = []  # mixed groups after each attempt, in the order attempts ended
    for r in counted:
        seen.setdefault(r["task"], set()).add(bool(r["solved"]))
        mixed_after.append(sum(1 for outcomes in seen.values() if len(outcomes) == 2))
    mixed = {tid for tid, outcomes in seen.items() if len(outcomes) == 2}
    return {
        "adaptive": adaptive,
        "attempts": len(counted),
        "attempts_in_mixed_groups": sum(1 for r in counted if r["task"] in mixed),
        "skipped": results.counts["skipped"],
        "mixed_groups": mixed_after[-1] if mixed_after else 0,
        "mixed_after": mixed_after,
    }


def attempts_to_reach(mixed_after: list[int], target: int) -> int | None:
    for i, mixed in enumerate(mixed_after, 1):
        if mixed >= target:
            return i
    return None


async def adaptive_figures() -> dict[str, Any]:
    plain = await adaptive_run(False)
    adaptive = await adaptive_run(True)
    target = min(plain["mixed_groups"], adaptive["mixed_groups"])
    out: dict[str, Any] = {"tasks": ADAPTIVE_TASKS, "n": ADAPTIVE_N, "budget": ADAPTIVE_TASKS * ADAPTIVE_N}
    out["target_mixed_groups"] = target
    for name, run in (("without", plain), ("adaptive", adaptive)):
        out[name] = {
            "attempts": run["attempts"],
            "attempts_in_mixed_groups": run["attempts_in_mixed_groups"],
            "skipped": run["skipped"],
            "mixed_groups": run["mixed_groups"],
            "attempts_to_target": attempts_to_reach(run["mixed_after"], target),
        }
    return out


def show(runs: list[dict[str, Any]], adaptive: dict[str, Any] | None) -> None:
    if runs:
        print(
            f"{'backend':<11}{'conc':>5}{'attempts':>9}{'wall s':>8}{'att/s':>7}{'util':>6}  mean s: start agent reward"
        )
        for r in runs:
            m = r["mean_s"]
            print(
                f"{r['backend']:<11}{r['concurrency']:>5}{r['attempts']:>9}{r['wall_s']:>8.1f}"
                f"{r['attempts_per_s']:>7.2f}{r['utilisation']:>6.2f}  "
                f"{m['start'] or 0:.2f} {m['agent'] or 0:.2f} {m['reward'] or 0:.2f}"
                + ("" if r["pass_rates_as_the_policy_drew"] else "  (pass rates differ from the policy's draws!)")
                + ("" if r["counts"]["ok"] == r["attempts"] else f"  {r['counts']}")
            )
    if adaptive:
        print(
            f"adaptive ({adaptive['tasks']} tasks x {adaptive['n']}): to reach "
            f"{adaptive['target_mixed_groups']} mixed groups"
        )
        for name in ("without", "adaptive"):
            a = adaptive[name]
            print(
                f"  {name:<9} {a['attempts_to_target']} attempts (ran {a['attempts']}, skipped {a['skipped']}, "
                f"mixed groups at the end {a['mixed_groups']}, attempts in them {a['attempts_in_mixed_groups']})"
            )


async def main(args: argparse.Namespace) -> dict[str, Any]:
    load_before = os.getloadavg()
    runs = []
    for backend in args.backend:
        if backend == "kubernetes":
            await ensure_namespace("orchard-bench-rollout")
        for concurrency in args.concurrency:
            r = await throughput(backend, concurrency, args.quick)
            show([r], None)
            runs.append(r)
    adaptive = None if args.no_adaptive else await adaptive_figures()
    return {"throughput": runs, "adaptive": adaptive, "load_before": load_before, "load_after": os.getloadavg()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", nargs="+", default=["docker", "kubernetes"])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[8, 32, 128])
    parser.add_argument("--quick", action="store_true", help="one attempt per slot, at least 2 per task")
    parser.add_argument("--no-adaptive", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    figures = asyncio.run(main(args))
    figures["machine"] = {
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "quick": args.quick,
        "load_before": figures.pop("load_before"),
        "load_after": figures.pop("load_after"),
    }
    print()
    show(figures["throughput"], figures["adaptive"])
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
