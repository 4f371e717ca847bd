"""Exec latency and file throughput on Kubernetes, every path measured in the same run.

Exec paths, each running the same argv (``true``, ``echo hello``, 1 MiB of
output) sequentially and with 16 and 64 commands in flight:

- ``bare``: ``asyncio.create_subprocess_exec`` of the argv on this host, output
  read fully: the floor (no network, no pod).
- ``pod_ip``: ``sb.exec(argv)`` with ``transport="direct"``, straight to the
  executor at the pod IP.
- ``port_forward``: ``sb.exec(argv)`` with ``transport="port-forward"``,
  tunnelled through the API server (a second Client with its own pods).
- ``api_exec``: the API server's exec (kubernetes_asyncio ``WsApiClient``,
  ``connect_get_namespaced_pod_exec``) on the pods of ``pod_ip``.
- ``kubectl``: ``kubectl exec``, sequential ``true`` only (it is slow).

Each client gets a fixed set of pods, created once and reused; commands go
round-robin over them. Every cell (command, concurrency) is measured in
``--rounds`` rounds; in each round every path gets one time slice of
``--slice`` seconds, in an order rotated every round, so noise on this
shared machine hits all paths alike. A slice ends when its time is up and
the commands in flight have finished; throughput is completed commands over
the wall time of the slices. A command still running after
``--command-timeout`` seconds is abandoned and counted apart (and at that
value in the percentiles, which are then lower bounds), so one stuck path
cannot stall the run. Paths with pooled connections get an unmeasured
burst of ``true`` (as many as the concurrency) before each slice, so idle
connections the pool closed in between are not counted.

Then a file (100 MiB) is written with ``sb.write_file`` from a streamed
source and read back with ``sb.stream_file``, through the pod IP and through
the port-forward, checked by size; afterwards (untimed) the sha256 of the
file read back once more and of ``sha256sum`` in the pod are checked.

    python benchmarks/bench_exec.py --kubeconfig PATH [--json PATH] [--plots DIR] [--quick]
    python benchmarks/bench_exec.py --load benchmarks/results/exec.json --plots benchmarks/results
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import hashlib
import itertools
import json
import os
import platform
import random
import shutil
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from _stats import pct

import orchard

IMAGE = "orchard-test/busybox:latest"
MIB = 1024 * 1024
#: name -> (argv, bytes of stdout it must produce)
COMMANDS: dict[str, tuple[list[str], int]] = {
    "true": (["true"], 0),
    "echo": (["echo", "hello"], 6),
    "1mib": (["head", "-c", str(MIB), "/dev/zero"], MIB),
}
CONCURRENCY = (1, 16, 64)
PATHS = ("bare", "pod_ip", "port_forward", "api_exec", "kubectl")
LABELS = {
    "bare": "bare spawn on the host (floor)",
    "pod_ip": "orchard, pod IP",
    "port_forward": "orchard, port-forward",
    "api_exec": "API-server exec",
    "kubectl": "kubectl exec",
}
COLORS = {
    "bare": "#7f7f7f",
    "pod_ip": "#1f77b4",
    "port_forward": "#2ca02c",
    "api_exec": "#d62728",
    "kubectl": "#ff7f0e",
}
FILE_PATH = "/tmp/orchard-bench-file.bin"
SHA_KEYS = ("sha256_read_back_ok", "sha256_in_pod_ok")

#: Runs ``argv`` on slot ``slot`` (a pod index) and returns the bytes of stdout.
Run = Callable[[int, list[str]], Awaitable[int]]


@dataclass
class ExecPath:
    name: str
    run: Run
    slots: int
    #: Has pooled connections worth opening before a measured slice.
    pooled: bool


@dataclass
class Cell:
    timeout: float
    samples: list[float] = field(default_factory=list)
    wall: float = 0.0
    timeouts: int = 0
    errors: int = 0
    first_error: str | None = None


def summarize(cell: Cell) -> dict[str, Any]:
    """Percentiles count an abandoned command at the timeout (a lower bound); n and throughput count completed ones."""
    s = cell.samples
    out: dict[str, Any] = {"n": len(s), "timeouts": cell.timeouts, "errors": cell.errors, "wall_s": cell.wall}
    if s:
        censored = s + [cell.timeout] * cell.timeouts
        out |= {f"p{q}_ms": pct(censored, q) * 1000 for q in (50, 95, 99)}
        out["throughput_per_s"] = len(s) / cell.wall
    if cell.first_error:
        out["first_error"] = cell.first_error
    return out


def kubectl() -> str:
    found = shutil.which("kubectl") or next(iter(sorted(glob.glob("/var/cache/orchard/k8s/v*/bin/kubectl"))), None)
    if not found:
        raise SystemExit("kubectl not found (bring the dev cluster up first)")
    return found


# The paths


async def bare_run(slot: int, argv: list[str]) -> int:
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{argv} exited {proc.returncode}")
    return len(out)


def orchard_run(sandboxes: list[orchard.Sandbox]) -> Run:
    async def run(slot: int, argv: list[str]) -> int:
        r = await sandboxes[slot].exec(argv)
        if r.exit_code != 0 or r.stdout_truncated:
            raise RuntimeError(f"{argv}: exit {r.exit_code}, truncated {r.stdout_truncated}: {r.stderr[:200]}")
        return len(r.stdout_bytes)

    return run


def api_exec_run(core: Any, namespace: str, pods: list[str]) -> Run:
    async def run(slot: int, argv: list[str]) -> int:
        # The client library's exec as a caller would use it: stdout and stderr come back as one str.
        out = await core.connect_get_namespaced_pod_exec(
            pods[slot], namespace, container="sandbox", command=argv, stderr=True, stdout=True
        )
        return len(out.encode())

    return run


def kubectl_run(kubeconfig: str, namespace: str, pods: list[str]) -> Run:
    binary = kubectl()

    async def run(slot: int, argv: list[str]) -> int:
        cmd = [binary, f"--kubeconfig={kubeconfig}", "-n", namespace, "exec", pods[slot], "-c", "sandbox", "--", *argv]
        return await bare_run(slot, cmd)

    return run


# Measuring


async def burst(path: ExecPath, argv: list[str], concurrency: int) -> None:
    await asyncio.gather(*(path.run(k % path.slots, argv) for k in range(concurrency)))


async def measure_slice(path: ExecPath, command: str, concurrency: int, seconds: float, cell: Cell) -> None:
    """Keep ``concurrency`` commands in flight for ``seconds``, then let them finish (or time out)."""
    argv, expected = COMMANDS[command]
    counter = itertools.count()

    async def worker() -> None:
        while time.perf_counter() < deadline:
            k = next(counter)
            t0 = time.perf_counter()
            scope = asyncio.timeout(cell.timeout)
            try:
                async with scope:
                    got = await path.run(k % path.slots, argv)
                if got != expected:
                    raise RuntimeError(f"{got} bytes of output, expected {expected}")
            except Exception as exc:
                if isinstance(exc, TimeoutError) and scope.expired():
                    cell.timeouts += 1
                else:
                    cell.errors += 1
                    cell.first_error = cell.first_error or f"{type(exc).__name__}: {exc}"[:300]
                continue
            cell.samples.append(time.perf_counter() - t0)

    if path.pooled:
        await burst(path, ["true"], concurrency)
    t0 = time.perf_counter()
    deadline = t0 + seconds
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    cell.wall += time.perf_counter() - t0


def cells_to_run(path: str) -> Iterator[tuple[str, int]]:
    if path == "kubectl":
        yield "true", 1
        return
    for command in COMMANDS:
        for concurrency in CONCURRENCY:
            yield command, concurrency


async def measure_exec(paths: list[ExecPath], rounds: int, seconds: float, timeout: float) -> dict[str, Any]:
    for path in paths:  # warm up: one unmeasured burst per cell (API-server exec: at most 16 at once)
        for command, concurrency in cells_to_run(path.name):
            await burst(path, COMMANDS[command][0], min(concurrency, 16 if path.name == "api_exec" else 64))
    cells: dict[tuple[str, int, str], Cell] = {}
    for r in range(rounds):
        order = paths[r % len(paths) :] + paths[: r % len(paths)]
        print(f"round {r + 1}/{rounds}: path order {[p.name for p in order]}", file=sys.stderr)
        for command in COMMANDS:
            for concurrency in CONCURRENCY:
                for path in order:
                    if (command, concurrency) in cells_to_run(path.name):
                        cell = cells.setdefault((command, concurrency, path.name), Cell(timeout))
                        await measure_slice(path, command, concurrency, seconds, cell)
    out: dict[str, Any] = {}
    for (command, concurrency, name), cell in cells.items():
        out.setdefault(command, {}).setdefault(str(concurrency), {})[name] = summarize(cell)
    return out


# Files


def file_chunks(size: int) -> Iterator[bytes]:
    """Distinct 1 MiB chunks: one random block, each stamped with its index."""
    block = random.Random(0).randbytes(MIB)
    for i in range(size // MIB):
        yield i.to_bytes(8, "little") + block[8:]


async def stream_chunks(size: int) -> AsyncIterator[bytes]:
    for chunk in file_chunks(size):
        yield chunk


async def transfer_once(sb: orchard.Sandbox, size: int) -> tuple[float, float]:
    """Write the file, then read it back (counting bytes only); seconds for each."""
    t0 = time.perf_counter()
    stat = await sb.write_file(FILE_PATH, stream_chunks(size))
    write_s = time.perf_counter() - t0
    if stat.size != size:
        raise RuntimeError(f"wrote {stat.size} bytes, expected {size}")
    t0 = time.perf_counter()
    got = 0
    async for chunk in sb.stream_file(FILE_PATH):
        got += len(chunk)
    read_s = time.perf_counter() - t0
    if got != size:
        raise RuntimeError(f"read {got} bytes, expected {size}")
    return write_s, read_s


async def checksums_ok(sb: orchard.Sandbox, sha256: str) -> dict[str, bool]:
    """Untimed: the sha256 of the file read back once more, and as ``sha256sum`` in the pod sees it."""
    sha = hashlib.sha256()
    async for chunk in sb.stream_file(FILE_PATH):
        sha.update(chunk)
    in_pod = (await sb.exec(["sha256sum", FILE_PATH])).stdout.split()[0]
    return {"sha256_read_back_ok": sha.hexdigest() == sha256, "sha256_in_pod_ok": in_pod == sha256}


async def measure_files(sandboxes: dict[str, orchard.Sandbox], size: int, reps: int) -> dict[str, Any]:
    sha = hashlib.sha256()
    for chunk in file_chunks(size):
        sha.update(chunk)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in sandboxes}
    errors: dict[str, str] = {}
    for _ in range(reps):  # alternate the transports
        for name, sb in sandboxes.items():
            try:
                times[name].append(await transfer_once(sb, size))
            except Exception as exc:
                errors.setdefault(name, f"{type(exc).__name__}: {exc}"[:300])
    out: dict[str, Any] = {"size_bytes": size, "reps": reps, "sha256": sha.hexdigest()}
    for name, sb in sandboxes.items():
        if not times[name]:
            out[name] = {"error": errors[name]}
            continue
        write = [size / MIB / w for w, _ in times[name]]
        read = [size / MIB / r for _, r in times[name]]
        out[name] = {
            "write_mib_s": write,
            "read_mib_s": read,
            "write_mib_s_median": statistics.median(write),
            "read_mib_s_median": statistics.median(read),
            **await checksums_ok(sb, sha.hexdigest()),
        }
        await sb.remove(FILE_PATH)
        if name in errors:
            out[name]["error"] = errors[name]
    return out


# The run


async def cluster_version(kubeconfig: str) -> str | None:
    from kubernetes_asyncio import client, config

    kcfg = client.Configuration()
    await config.load_kube_config(config_file=kubeconfig, client_configuration=kcfg)
    async with client.ApiClient(configuration=kcfg) as api:
        with contextlib.suppress(Exception):
            return str((await client.VersionApi(api).get_code()).git_version)
    return None


async def start_pods(client: orchard.Client, n: int, memory: str) -> list[orchard.Sandbox]:
    return list(await asyncio.gather(*(client.create(IMAGE, memory=memory, ttl=3600) for _ in range(n))))


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from kubernetes_asyncio import client, config
    from kubernetes_asyncio.stream import WsApiClient

    started = time.perf_counter()
    machine: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "load_before": os.getloadavg(),
        "kernel": platform.release(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "kubernetes": await cluster_version(args.kubeconfig),
    }

    def cfg(transport: Literal["direct", "port-forward"]) -> orchard.KubernetesConfig:
        return orchard.KubernetesConfig(namespace=args.namespace, kubeconfig=args.kubeconfig, transport=transport)

    kcfg = client.Configuration()
    await config.load_kube_config(config_file=args.kubeconfig, client_configuration=kcfg)
    async with (
        orchard.Client(cfg("direct")) as direct,
        orchard.Client(cfg("port-forward")) as forwarded,
        WsApiClient(configuration=kcfg) as ws,
    ):
        t0 = time.perf_counter()
        pods, fwd_pods = await asyncio.gather(
            start_pods(direct, args.pods, args.memory), start_pods(forwarded, args.pods, args.memory)
        )
        print(f"{2 * args.pods} pods ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        names = [sb.id for sb in pods]
        paths = [
            ExecPath("bare", bare_run, 1, pooled=False),
            ExecPath("pod_ip", orchard_run(pods), len(pods), pooled=True),
            ExecPath("port_forward", orchard_run(fwd_pods), len(fwd_pods), pooled=True),
            ExecPath("api_exec", api_exec_run(client.CoreV1Api(ws), args.namespace, names), len(names), pooled=False),
            ExecPath("kubectl", kubectl_run(args.kubeconfig, args.namespace, names), len(names), pooled=False),
        ]
        t0 = time.perf_counter()
        exec_results = await measure_exec(paths, args.rounds, args.slice, args.command_timeout)
        exec_s = time.perf_counter() - t0
        print(f"exec measured in {exec_s:.1f}s; now files", file=sys.stderr)
        t0 = time.perf_counter()
        files = await measure_files(
            {"pod_ip": pods[0], "port_forward": fwd_pods[0]}, args.file_mib * MIB, args.file_reps
        )
        files_s = time.perf_counter() - t0
    machine["load_after"] = os.getloadavg()
    return {
        "machine": machine,
        "config": {
            "quick": args.quick,
            "rounds": args.rounds,
            "slice_s": args.slice,
            "command_timeout_s": args.command_timeout,
            "concurrency": list(CONCURRENCY),
            "commands": {name: argv for name, (argv, _) in COMMANDS.items()},
            "image": IMAGE,
            "pod_memory": args.memory,
            "layout": (
                f"{args.pods} pods per Client, created once and reused, commands round-robin over them: "
                f"pod_ip, api_exec and kubectl share the {args.pods} pods of a transport='direct' Client; "
                f"port_forward uses the {args.pods} pods of its own transport='port-forward' Client; "
                "bare runs on this host"
            ),
        },
        "exec": exec_results,
        "files": files,
        "timing_s": {"exec": exec_s, "files": files_s, "total": time.perf_counter() - started},
    }


# Reporting


def cell(r: dict[str, Any], command: str, concurrency: int, path: str) -> dict[str, Any] | None:
    return r["exec"].get(command, {}).get(str(concurrency), {}).get(path)


def p50(r: dict[str, Any], command: str, concurrency: int, path: str) -> float | None:
    c = cell(r, command, concurrency, path)
    return c.get("p50_ms") if c else None


def report(r: dict[str, Any]) -> str:
    m = r["machine"]
    lines = [
        f"{m['cpus']} cpus, {m['platform']}, Python {m['python']}, Kubernetes {m['kubernetes']}, "
        f"load {m['load_before'][0]:.2f} -> {m['load_after'][0]:.2f}",
        f"layout: {r['config']['layout']}",
        f"{'command':<6} {'c':>3}  {'path':<31} {'n':>6} {'p50 ms':>9} {'p95 ms':>9} {'p99 ms':>9} "
        f"{'cmd/s':>8} {'x floor':>8}",
    ]
    for command in COMMANDS:
        for concurrency in CONCURRENCY:
            floor = p50(r, command, concurrency, "bare")
            for path in PATHS:
                c = cell(r, command, concurrency, path)
                if c is None:
                    continue
                if "p50_ms" not in c:
                    lines.append(f"{command:<6} {concurrency:>3}  {LABELS[path]:<31} all {c['errors']} failed")
                    continue
                ratio = f"{c['p50_ms'] / floor:8.1f}" if floor else f"{'':>8}"
                err = f"  ({c['errors']} errors: {c.get('first_error')})" if c["errors"] else ""
                if c.get("timeouts"):
                    err += f"  ({c['timeouts']} abandoned after {r['config']['command_timeout_s']:g} s)"
                lines.append(
                    f"{command:<6} {concurrency:>3}  {LABELS[path]:<31} {c['n']:>6} {c['p50_ms']:>9.2f} "
                    f"{c['p95_ms']:>9.2f} {c['p99_ms']:>9.2f} {c['throughput_per_s']:>8.1f} {ratio}{err}"
                )
            speedup = speedup_p50(r, command, concurrency)
            if speedup:
                lines.append(f"{'':<12}pod IP is {speedup:.1f}x faster than API-server exec at p50")
    f = r["files"]
    lines.append(f"files: {f['size_bytes'] / MIB:.0f} MiB written then read back, {f['reps']} reps, MiB/s (median):")
    for name, v in transfers(f):
        lines.append(
            f"  {LABELS[name]:<24} write {v['write_mib_s_median']:7.1f}  read {v['read_mib_s_median']:7.1f}  "
            f"sha256 ok: read back {v['sha256_read_back_ok']}, in the pod {v['sha256_in_pod_ok']}"
        )
    lines += [f"  {LABELS[name]}: {v['error']}" for name, v in f.items() if isinstance(v, dict) and "error" in v]
    return "\n".join(lines)


def transfers(f: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The transports whose file transfer produced figures."""
    return [(n, f[n]) for n in ("pod_ip", "port_forward") if "write_mib_s_median" in f.get(n, {})]


def speedup_p50(r: dict[str, Any], command: str, concurrency: int) -> float | None:
    lib, api = p50(r, command, concurrency, "pod_ip"), p50(r, command, concurrency, "api_exec")
    return api / lib if lib and api else None


def _ms(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:.2f}" if value < 100 else f"{value:.0f}"


def _tail(c: dict[str, Any], q: int) -> str:
    """A percentile, marked as a lower bound when it reaches into the abandoned commands."""
    total, abandoned = c["n"] + c.get("timeouts", 0), c.get("timeouts", 0)
    bound = "≥ " if abandoned and q / 100 * (total - 1) > total - abandoned - 1 else ""
    return bound + _ms(c[f"p{q}_ms"])


def markdown(result: dict[str, Any]) -> str:
    """README tables: p50 with ratio to the bare floor, tails, throughput, file transfer."""
    r, m = result, result["machine"]
    cmds = {"true": "`true`", "echo": "`echo hello`", "1mib": "1 MiB of output"}
    main_paths = ("bare", "pod_ip", "port_forward", "api_exec")
    header = "| command | in flight | " + " | ".join(LABELS[p] for p in main_paths)
    rows = [
        f"Measured by `python benchmarks/bench_exec.py{' --quick' if r['config']['quick'] else ''} "
        "--json benchmarks/results/exec.json` on the dev cluster "
        f"({m['cpus']} cores shared by the client and the whole cluster, Kubernetes {m['kubernetes']}, "
        f"load average {m['load_before'][0]:.2f} at start, {m['load_after'][0]:.2f} at the end); "
        f"every path in the same run, interleaved in {r['config']['rounds']} rounds of "
        f"{r['config']['slice_s']:g} s slices. {r['config']['layout']}.",
        "",
        "p50 latency in ms, and in brackets its ratio to the bare spawn on the host:",
        "",
        header + " | pod IP vs API exec |",
        "| --- | ---: |" + " ---: |" * (len(main_paths) + 1),
    ]
    for command in COMMANDS:
        for concurrency in CONCURRENCY:
            floor = p50(r, command, concurrency, "bare")
            values = []
            for path in main_paths:
                v = p50(r, command, concurrency, path)
                ratio = f" ({v / floor:.1f}x)" if v and floor and path != "bare" else ""
                values.append(_ms(v) + ratio)
            speedup = speedup_p50(r, command, concurrency)
            rows.append(
                f"| {cmds[command]} | {concurrency} | "
                + " | ".join(values)
                + (f" | **{speedup:.0f}x** |" if speedup else " | – |")
            )
    rows += [
        "",
        "With 16 or 64 in flight the floor is this one Python process spawning that many children from its event "
        "loop, while the executors of the pods share the spawning between them, so a pod path can come out below 1x.",
    ]
    kc = cell(r, "true", 1, "kubectl")
    if kc and "p50_ms" in kc:
        lib = p50(r, "true", 1, "pod_ip") or float("nan")
        rows += [
            "",
            f"`kubectl exec` of `true`, sequential: p50 {kc['p50_ms']:.0f} ms, p99 {kc['p99_ms']:.0f} ms "
            f"(n = {kc['n']}), {kc['p50_ms'] / lib:.0f}x the pod IP path.",
        ]
    for title, show in (
        ("p95 / p99 latency in ms, and n:", lambda c: f"{_tail(c, 95)} / {_tail(c, 99)} (n={c['n']})"),
        ("Throughput, commands/s:", lambda c: f"{c['throughput_per_s']:.0f}"),
    ):
        rows += ["", title, "", header + " |", "| --- | ---: |" + " ---: |" * len(main_paths)]
        for command in COMMANDS:
            for concurrency in CONCURRENCY:
                values = []
                for path in main_paths:
                    c = cell(r, command, concurrency, path)
                    values.append(show(c) if c and c.get("n") else "–")
                rows.append(f"| {cmds[command]} | {concurrency} | " + " | ".join(values) + " |")
    f = r["files"]
    rows += [
        "",
        f"A {f['size_bytes'] / MIB:.0f} MiB file written with `sb.write_file` from a streamed source, then read "
        f"back with `sb.stream_file` (size checked; sha256 of a further read and in the pod checked untimed), "
        f"{f['reps']} times:",
        "",
        "| transport | write MiB/s, median (all) | read MiB/s, median (all) |",
        "| --- | ---: | ---: |",
    ]
    for name, v in transfers(f):
        each_w = ", ".join(f"{x:.0f}" for x in v["write_mib_s"])
        each_r = ", ".join(f"{x:.0f}" for x in v["read_mib_s"])
        rows.append(
            f"| {LABELS[name]} | {v['write_mib_s_median']:.0f} ({each_w}) | {v['read_mib_s_median']:.0f} ({each_r}) |"
        )
    errors = [f"file transfer, {LABELS[n]}: {v['error']}" for n, v in f.items() if isinstance(v, dict) and "error" in v]
    errors += [f"{LABELS[n]}: sha256 mismatch" for n, v in transfers(f) if not all(v.get(k, True) for k in SHA_KEYS)]
    timeouts = []
    for cmd, by_c in r["exec"].items():
        for c, by_p in by_c.items():
            for p, v in by_p.items():
                where = f"{LABELS[p]}, {cmds[cmd]} with {c} in flight"
                if v.get("errors"):
                    errors.append(f"{where}: {v['errors']} errors ({v.get('first_error')})")
                if v.get("timeouts"):
                    timeouts.append(f"{where}: {v['timeouts']} of {v['n'] + v['timeouts']}")
    if timeouts:
        rows += [
            "",
            f"Commands abandoned after {r['config']['command_timeout_s']:g} s (counted at that value in the "
            "percentiles, so a percentile marked ≥ is a lower bound; not counted in n or throughput): "
            + "; ".join(timeouts)
            + ".",
        ]
    if errors:
        rows += ["", "Errors: " + "; ".join(errors) + "."]
    return "\n".join(rows)


def plot(result: dict[str, Any], outdir: Path) -> list[Path]:
    """PNG plots: p50 latency and throughput per path across concurrency, and file throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    outdir.mkdir(parents=True, exist_ok=True)
    figures = {
        "exec_latency.png": exec_figure(result, "p50_ms", "p50 latency, ms (log)"),
        "exec_throughput.png": exec_figure(result, "throughput_per_s", "commands/s (log)"),
        "exec_files.png": files_figure(result["files"]),
    }
    written = []
    for name, fig in figures.items():
        fig.savefig(outdir / name, dpi=110)
        plt.close(fig)
        written.append(outdir / name)
    return written


def exec_figure(result: dict[str, Any], metric: str, ylabel: str) -> Any:
    """One panel per command: ``metric`` of every path against the commands in flight."""
    import matplotlib.pyplot as plt

    titles = {"true": "true", "echo": "echo hello", "1mib": "1 MiB of output"}
    fig, axes = plt.subplots(1, len(COMMANDS), figsize=(15, 5), sharey=True)
    for ax, command in zip(axes, COMMANDS, strict=True):
        for path in PATHS:
            cells = [(c, v) for c in CONCURRENCY if (v := cell(result, command, c, path)) and v.get("n")]
            if not cells:
                continue
            xs = [c for c, _ in cells]
            ax.plot(xs, [v[metric] for _, v in cells], marker="o", color=COLORS[path], label=LABELS[path], lw=2)
            if metric == "p50_ms" and len(xs) > 1:
                tails = [v["p95_ms"] for _, v in cells]
                ax.plot(xs, tails, linestyle="--", color=COLORS[path], alpha=0.5, lw=1, label="_p95")
            if metric == "throughput_per_s":
                for c, v in cells:
                    if v.get("timeouts"):
                        label = f"{v['timeouts']} abandoned\nafter {result['config']['command_timeout_s']:g} s"
                        ax.annotate(
                            label,
                            (c, v[metric]),
                            xytext=(-8, -4),
                            textcoords="offset points",
                            ha="right",
                            va="top",
                            fontsize=8,
                            color=COLORS[path],
                        )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(list(CONCURRENCY), [str(c) for c in CONCURRENCY])
        ax.set_xlabel("commands in flight")
        ax.set_title(titles[command])
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel(ylabel)
    handles = {h.get_label(): h for ax in axes for h in ax.get_lines() if not h.get_label().startswith("_")}
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=len(handles), fontsize=10)
    note = ", dashed: p95" if metric == "p50_ms" else ""
    fig.suptitle(f"Exec on Kubernetes ({result['machine']['cpus']} cores shared by client and cluster{note})")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


def files_figure(f: dict[str, Any]) -> Any:
    """Write and read MiB/s (median) per transport."""
    import matplotlib.pyplot as plt

    names = [n for n, _ in transfers(f)]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    width = 0.38
    for i, (op, key) in enumerate((("write", "write_mib_s_median"), ("read", "read_mib_s_median"))):
        xs = [j + (i - 0.5) * width for j in range(len(names))]
        bars = ax.bar(xs, [f[n][key] for n in names], width, label=op, color=("#9467bd", "#17becf")[i])
        ax.bar_label(bars, fmt="%.0f")
    ax.set_xticks(range(len(names)), [LABELS[n] for n in names])
    ax.set_ylabel("MiB/s (median)")
    ax.set_title(f"{f['size_bytes'] / MIB:.0f} MiB file: write_file (streamed), stream_file, {f['reps']} reps")
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG", "/var/lib/orchard-devcluster/kubeconfig"))
    parser.add_argument("--namespace", default="default")
    parser.add_argument("--pods", type=int, default=8, help="pods per client")
    parser.add_argument("--memory", default="512Mi", help="memory of each pod")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--slice", type=float, default=1.2, help="seconds per path per cell per round")
    parser.add_argument(
        "--command-timeout", type=float, default=10.0, help="a command still running after this is abandoned"
    )
    parser.add_argument("--file-mib", type=int, default=100)
    parser.add_argument("--file-reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run")
    parser.add_argument("--json", default=None, help="write the results as JSON here")
    parser.add_argument("--plots", type=Path, default=None, help="write the PNG plots into this directory")
    parser.add_argument("--load", default=None, help="report (and plot) a JSON written earlier instead of measuring")
    args = parser.parse_args()
    if args.quick:
        args.pods, args.rounds, args.slice, args.file_mib, args.file_reps = 2, 1, 0.2, 8, 1
    if args.load:
        result = json.loads(Path(args.load).read_text())
    else:
        result = asyncio.run(run(args))
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if args.plots:
        for path in plot(result, args.plots):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
