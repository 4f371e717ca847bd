"""Under faults: N sandboxes at work while faults fire at the cluster on a schedule, every outcome accounted for.

N workers share one Client. Each holds a busybox sandbox and, in a loop,
writes random bytes to a fresh path (a ledger keeps the path and sha256 of
every write that returned), runs a short command, and now and then reads a
file back and checks its sha256. After about ``--lifetime`` seconds it reads
every file of the sandbox back, closes it and starts another, so that creates
and deletes meet the faults too. Every call is wrapped in an outer deadline
(``--outer-timeout``, past any of the library's own): a call that reaches it
is HUNG. A typed error (``orchard.errors.OrchardError``) is recorded with its
type, reason, how long the call took and the fault window it ended in;
``SandboxLost`` (or ``SandboxClosed``) makes the worker leave the sandbox and
start a new one. Anything else is an untyped error: a finding.

Faults fire one after another, from the dev cluster's fault harness
(hack/devcluster/faults.py): restarts of kube-apiserver, etcd, the kubelet
and containerd, a partition of the host from the pods, an executor killed,
a pod deleted, a pod evicted, a drain, a spot reclaim of the node's pods, and
a client process SIGKILLed (its pods must be collected once its Lease
expires). A fault's window runs from its firing to the next one's; after
the fault the run waits until every worker works again (bounded).

At the end every file of every sandbox still alive is read back: a file whose
write returned but whose content is missing or different is LOST. Files in
sandboxes reported lost are counted apart. Then the Client closes and the
Orchard pods left in the namespace are counted.

    python benchmarks/bench_chaos.py --json benchmarks/results/chaos.json [-n 12] [--quick]

Run as root on the machine of the dev cluster (hack/devcluster), with nothing
else using the cluster: the faults hit all of it.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import random
import re
import secrets
import signal
import sys
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _stats import pct

import orchard
from orchard.errors import OrchardError, PathNotFound, SandboxClosed, SandboxLost

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "hack/devcluster"))
import faults  # noqa: E402 - the dev cluster's fault harness, a script directory

IMAGE = "orchard-test/busybox:latest"
#: A call slower than this (ms-scale calls on busybox) counts its sandbox as affected by the window.
DELAYED_S = 3.0
#: The calls of a sandbox at work (not its create or close, nor the read-back at the end).
WORK = ("write", "exec", "read")
#: A worker gives a sandbox up after this many failed calls in a row spanning this long with no success.
GIVE_UP = (6, 60.0)
#: The client that is SIGKILLed: starts K sandboxes, says their names, waits to be killed.
KILLED_CLIENT = """
import asyncio, sys, orchard
async def main():
    kubeconfig, namespace, k, lease = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    client = orchard.Client(orchard.KubernetesConfig(namespace=namespace, kubeconfig=kubeconfig, lease_seconds=lease))
    for _ in range(k):
        sb = await client.create("orchard-test/busybox:latest")
        await sb.exec("true")
        print(sb.id, flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""
KILLED_LEASE_S = 5


@dataclass
class Call:
    worker: int
    sandbox: str | None
    op: str
    start: float
    end: float
    #: "ok", "typed", "untyped", "hung" or "bad" (returned, but not what the command prints).
    outcome: str
    error: str | None = None
    reason: str | None = None
    message: str = ""

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class Window:
    name: str
    start: float
    end: float = float("inf")
    fault: dict[str, Any] = field(default_factory=dict)


def reason_of(exc: BaseException) -> str:
    """An error's short reason: the backend's, the executor's code, or the deadline its message names."""
    for attr in ("reason", "code", "rule"):
        value = getattr(exc, attr, None)
        if value:
            return str(value)
    found = re.findall(r"\b(\w+_timeout)=", str(exc))
    return found[-1] if found else ""


async def pods_in(kubeconfig: str, namespace: str) -> dict[str, str]:
    """Orchard's pods in a namespace: name to phase (deleting ones too)."""
    from kubernetes_asyncio import client
    from kubernetes_asyncio import config as kconfig

    cfg = client.Configuration()
    await kconfig.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    async with client.ApiClient(cfg) as api:
        pods = await client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=faults.ORCHARD_PODS)
    return {p.metadata.name: p.status.phase for p in pods.items}


async def namespaces(kubeconfig: str, names: list[str], *, create: bool) -> None:
    from kubernetes_asyncio import client
    from kubernetes_asyncio import config as kconfig
    from kubernetes_asyncio.client.exceptions import ApiException

    cfg = client.Configuration()
    await kconfig.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    async with client.ApiClient(cfg) as api:
        core = client.CoreV1Api(api)
        for name in names:
            try:
                if create:
                    await core.create_namespace({"metadata": {"name": name}})
                    # A pod created before the namespace's default ServiceAccount exists is refused (403).
                    for _ in range(100):
                        found = await core.list_namespaced_service_account(name, field_selector="metadata.name=default")
                        if found.items:
                            break
                        await asyncio.sleep(0.1)
                else:
                    await core.delete_namespace(name)
            except ApiException as exc:
                if exc.status not in (404, 409):
                    raise


async def until_no_pods(kubeconfig: str, namespace: str, timeout: float) -> tuple[dict[str, str], float]:
    """Wait (bounded) until the namespace holds no Orchard pod; those still there, and the seconds waited."""
    t0 = time.monotonic()
    left: dict[str, str] = {}
    while time.monotonic() - t0 < timeout:
        try:
            left = await pods_in(kubeconfig, namespace)
        except Exception as exc:  # the API server between restarts: ask again
            left = {"?": repr(exc)}
        if not left:
            break
        await asyncio.sleep(1.0)
    return left, time.monotonic() - t0


class Chaos:
    def __init__(self, args: argparse.Namespace, client: orchard.Client) -> None:
        self.args = args
        self.client = client
        self.t0 = time.monotonic()
        self.stop = asyncio.Event()
        self.calls: list[Call] = []
        self.windows = [Window("warm-up", 0.0)]
        #: Every sandbox started: id to worker, times, how it ended, its files' fate.
        self.sandboxes: dict[str, dict[str, Any]] = {}
        self.ledger: dict[str, dict[str, str]] = defaultdict(dict)
        self.held: dict[int, orchard.Sandbox] = {}
        self.last_ok: dict[int, float] = {}
        self.write_failed: Counter[str] = Counter()
        self.bad_results: list[dict[str, Any]] = []
        self.lost_files: list[dict[str, Any]] = []
        self.untyped: list[dict[str, Any]] = []
        self.files = Counter[str]()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def window_at(self, t: float) -> Window:
        return next(w for w in reversed(self.windows) if w.start <= t)

    async def call(self, worker: int, sandbox: str | None, op: str, coro: Awaitable[Any]) -> tuple[str, Any]:
        """Run one call under the outer deadline; record how it went."""
        start = self.now()
        deadline = asyncio.timeout(self.args.outer_timeout)
        try:
            async with deadline:
                value = await coro
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            end = self.now()
            if deadline.expired():
                outcome = "hung"
                print(f"!! HUNG: worker {worker} {op} on {sandbox} from {start:.1f}s", flush=True)
            elif isinstance(exc, OrchardError):
                outcome = "typed"
            else:
                outcome = "untyped"
                tb = "".join(traceback.format_exception(exc))
                self.untyped.append(
                    {"op": op, "sandbox": sandbox, "at_s": end, "window": self.window_at(end).name, "error": repr(exc)}
                )
                print(f"!! UNTYPED {type(exc).__name__} from {op} on {sandbox} at {end:.1f}s:\n{tb}", flush=True)
            error = "HUNG" if outcome == "hung" else type(exc).__name__
            self.calls.append(Call(worker, sandbox, op, start, end, outcome, error, reason_of(exc), str(exc)[:300]))
            return outcome, exc
        self.calls.append(Call(worker, sandbox, op, start, self.now(), "ok"))
        if op in WORK:
            self.last_ok[worker] = self.now()
        return "ok", value

    async def worker(self, w: int) -> None:
        rng = random.Random(self.args.seed * 1000 + w)
        while not self.stop.is_set():
            outcome, sb = await self.call(w, None, "create", self.client.create(IMAGE))
            if outcome != "ok":
                await asyncio.sleep(1.0)
                continue
            self.sandboxes[sb.id] = {"worker": w, "created_s": self.now(), "end": None}
            self.held[w] = sb
            end = "cancelled"
            try:
                end = await self.use(w, sb, rng)
                if end == "retired":
                    end = await self.verify(w, sb)
            finally:
                self.held.pop(w, None)
                self.sandboxes[sb.id].update(end=end, ended_s=self.now())
                await self.call(w, sb.id, "close", sb.aclose())

    async def use(self, w: int, sb: orchard.Sandbox, rng: random.Random) -> str:
        """Work in the sandbox until its lifetime or the run ends ("retired"), it is lost ("lost") or given up."""
        ledger = self.ledger[sb.id]
        failures, seq = 0, 0
        last_ok = self.now()
        retire = self.now() + rng.uniform(0.5, 1.5) * self.args.lifetime
        while not self.stop.is_set() and self.now() < retire:
            seq += 1
            path = f"/tmp/chaos/{seq}.bin"
            data = rng.randbytes(rng.randint(1, 32) * 1024)
            steps: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
                ("write", lambda path=path, data=data: sb.write_file(path, data)),
                ("exec", lambda: sb.exec("echo ok")),
            ]
            if seq % 4 == 0 and ledger:
                back = rng.choice(sorted(ledger))
                steps.append(("read", lambda back=back: sb.read_file(back)))
            for op, make in steps:
                outcome, value = await self.call(w, sb.id, op, make())
                if outcome == "ok":
                    failures, last_ok = 0, self.now()
                    if op == "write":
                        ledger[path] = hashlib.sha256(data).hexdigest()
                        self.files["written"] += 1
                    elif op == "exec" and (value.exit_code != 0 or value.stdout != "ok\n"):
                        self.calls[-1].outcome = "bad"
                        self.bad_results.append({"sandbox": sb.id, "at_s": self.now(), "result": repr(value)[:300]})
                    elif op == "read" and hashlib.sha256(value).hexdigest() != ledger[back]:
                        self.lose(sb.id, back, "content differs")
                    continue
                if op == "write":
                    self.write_failed[self.calls[-1].error or "?"] += 1
                    if outcome == "typed" and self.calls[-1].seconds > DELAYED_S:
                        self.files["writes that raised late"] += 1
                if op == "read" and isinstance(value, PathNotFound):
                    self.lose(sb.id, back, "missing")
                    continue
                if isinstance(value, SandboxLost | SandboxClosed):
                    return "lost"
                failures += 1
                if failures >= GIVE_UP[0] and self.now() - last_ok > GIVE_UP[1]:
                    print(f"!! worker {w} gives {sb.id} up: {failures} failed calls, never SandboxLost", flush=True)
                    return "abandoned"
            await asyncio.sleep(rng.uniform(0.05, 0.25))
        return "retired"

    def lose(self, sandbox: str, path: str, how: str) -> None:
        del self.ledger[sandbox][path]
        self.files["LOST"] += 1
        at = self.now()
        self.lost_files.append(
            {"sandbox": sandbox, "path": path, "how": how, "at_s": at, "window": self.window_at(at).name}
        )
        print(f"!! LOST {sandbox}:{path} ({how}) at {at:.1f}s", flush=True)

    async def verify(self, w: int, sb: orchard.Sandbox) -> str:
        """Read back every file the ledger has for a sandbox still alive: "verified", or how it was lost."""
        files = sorted(self.ledger[sb.id].items())
        for checked, (path, digest) in enumerate(files):
            outcome, value = await self.call(w, sb.id, "verify", sb.read_file(path))
            if outcome == "ok":
                if hashlib.sha256(value).hexdigest() == digest:
                    self.files["verified"] += 1
                else:
                    self.lose(sb.id, path, "content differs")
            elif isinstance(value, PathNotFound):
                self.lose(sb.id, path, "missing")
            elif isinstance(value, SandboxLost | SandboxClosed):
                self.files["lost with a reported sandbox"] += len(files) - checked
                return "lost at its read-back"
            else:
                self.files["unverified (read failed)"] += 1
        return "verified"

    # -- The schedule --

    def faults(self) -> list[tuple[str, Callable[[], Awaitable[Any]]]]:
        q = self.args.quick
        down = 3.0 if q else 5.0
        node = faults.dc.NODE_NAME
        every: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
            ("kube-apiserver restart", lambda: asyncio.to_thread(faults.restart, "kube-apiserver", down=down)),
            ("etcd restart", lambda: asyncio.to_thread(faults.restart, "etcd", down=down)),
            ("kubelet restart", lambda: asyncio.to_thread(faults.restart, "kubelet")),
            ("containerd restart", lambda: asyncio.to_thread(faults.restart, "containerd")),
            ("partition 10 s", lambda: asyncio.to_thread(faults.partition, 10.0)),
            ("kill executor", lambda: self.one_pod(faults.kill_executor)),
            ("delete pod", lambda: self.one_pod(faults.delete)),
            ("evict pod", lambda: self.one_pod(faults.evict)),
            ("drain 5 s", lambda: asyncio.to_thread(faults.drain, 5.0)),
            ("reclaim node", lambda: asyncio.to_thread(faults.reclaim, node)),
            ("SIGKILL a client", self.sigkill_client),
        ]
        if self.args.faults:
            wanted = [s.strip().lower() for s in self.args.faults.split(",")]
            every = [f for f in every if any(s in f[0].lower() for s in wanted)]
        return every

    async def one_pod(self, fire: Callable[[str, str], None]) -> str:
        """Fire at the pod of one sandbox at work (a random one)."""
        sb = random.choice(list(self.held.values()))
        await asyncio.to_thread(fire, self.args.namespace, sb.id)
        return sb.id

    async def sigkill_client(self) -> dict[str, Any]:
        """A client process starts sandboxes and is SIGKILLed; its Lease expires and gc collects its pods."""
        ns = self.args.namespace + "-killed"
        k = 2 if self.args.quick else 3
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            KILLED_CLIENT,
            self.args.kubeconfig,
            ns,
            str(k),
            str(KILLED_LEASE_S),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        names = []
        try:
            async with asyncio.timeout(120):
                for _ in range(k):
                    names.append((await proc.stdout.readline()).decode().strip())  # type: ignore[union-attr]
        finally:
            proc.send_signal(signal.SIGKILL)
            _, stderr = await proc.communicate()
        before = await pods_in(self.args.kubeconfig, ns)
        await asyncio.sleep(KILLED_LEASE_S + 2)  # its Lease is now expired
        from orchard._backends.kubernetes import collect_garbage

        collected = await collect_garbage(orchard.KubernetesConfig(namespace=ns, kubeconfig=self.args.kubeconfig))
        pods = [f"{name}: {why}" for name, why in collected if name in before]
        left, waited = await until_no_pods(self.args.kubeconfig, ns, 60.0)
        return {
            "started": [n for n in names if n],
            "lease_s": KILLED_LEASE_S,
            "pods_after_kill": len(before),
            "pods_collected": pods,
            "leases_collected": len(collected) - len(pods),
            "pods_left_over": sorted(left),
            "gone_after_gc_s": round(waited, 1),
            "stderr": stderr.decode(errors="replace")[-500:] if len(names) < k or not all(names) else "",
        }

    async def settle(self, since: float, timeout: float) -> float | None:
        """Seconds from ``since`` until every worker has done work again (a call succeeded); None if not in time."""
        t_end = self.now() + timeout
        while self.now() < t_end:
            if all(self.last_ok.get(w, -1) > since for w in range(self.args.n)):
                return max(self.last_ok.values()) - since
            await asyncio.sleep(0.5)
        return None

    async def schedule(self) -> None:
        q = self.args.quick
        after, before = (6.0, 3.0) if q else (10.0, 5.0)
        ready = await self.settle(0.0, 180.0)
        print(f"all {self.args.n} workers at work after {self.now():.1f}s (ready {ready})", flush=True)
        self.windows[-1].end = self.now()
        self.windows.append(Window("baseline", self.now()))
        await asyncio.sleep(before * 2)
        for name, fire in self.faults():
            t = self.now()
            self.windows[-1].end = t
            window = Window(name, t)
            self.windows.append(window)
            print(f"-- {t:6.1f}s fault: {name}", flush=True)
            try:
                window.fault["result"] = await fire()
            except Exception as exc:
                window.fault["error"] = repr(exc)
                print(f"!! firing {name} failed: {exc!r}", flush=True)
            window.fault["fault_s"] = round(self.now() - t, 1)
            await asyncio.sleep(after)
            window.fault["settled"] = await self.settle(t, 60.0) is not None
            await asyncio.sleep(before)
            window.fault["pods_left_over"] = await self.closed_pods_present()
        self.windows[-1].end = self.now()
        self.windows.append(Window("verify and close", self.now()))

    async def closed_pods_present(self) -> list[str]:
        """Pods of sandboxes whose worker closed them that the namespace still holds."""
        try:
            present = await pods_in(self.args.kubeconfig, self.args.namespace)
        except Exception as exc:
            return [f"? {exc!r}"]
        closed = {sid for sid, s in self.sandboxes.items() if s["end"] is not None}
        return sorted(closed & set(present))


def troubled(c: Call) -> bool:
    """A call that failed, or a call of a sandbox at work that was slow."""
    return c.outcome != "ok" or (c.op in WORK and c.seconds > DELAYED_S)


def window_figures(chaos: Chaos, w: Window) -> dict[str, Any]:
    calls = [c for c in chaos.calls if w.start <= c.end < w.end]
    ok = [c for c in calls if c.outcome == "ok"]
    hit: dict[str, Call] = {}  # each sandbox's first troubled call in the window
    for c in calls:
        if c.sandbox is not None and troubled(c):
            hit.setdefault(c.sandbox, c)
    at_work = [c for c in chaos.calls if c.outcome == "ok" and c.op in WORK]
    recovered = sum(
        1 for first in hit.values() if any(c.worker == first.worker and c.start >= first.end for c in at_work)
    )
    # From the fault until the last worker it troubled worked again: a success after its last troubled call.
    back: list[float] = []
    for worker in {c.worker for c in calls if troubled(c)}:
        last = max(c.end for c in calls if c.worker == worker and troubled(c))
        again = [c.end for c in at_work if c.worker == worker and c.start >= last]
        back.append(min(again) - w.start if again else float("nan"))
    typed = [c for c in calls if c.outcome == "typed"]
    by_type = Counter(f"{c.error}({c.reason})" if c.reason else str(c.error) for c in typed)
    to_error = [c.seconds for c in typed]
    result = w.fault.get("result")
    left = len(w.fault.get("pods_left_over", []))
    if isinstance(result, dict):  # the SIGKILLed client's pods, after gc
        left += len(result.get("pods_left_over", []))
    return {
        "window": w.name,
        "start_s": round(w.start, 1),
        "end_s": round(w.end, 1) if w.end != float("inf") else None,
        "fault": w.fault,
        "calls": len(calls),
        "calls_ok": len(ok),
        "calls_delayed": sum(1 for c in ok if troubled(c)),
        "calls_failed": len(calls) - len(ok),
        "creates": sum(1 for c in calls if c.op == "create"),
        "creates_failed": sum(1 for c in calls if c.op == "create" and c.outcome != "ok"),
        "sandboxes_affected": len(hit),
        "recovered_by_retry": recovered,
        "back_to_work_s": max(back) if back and not any(math.isnan(b) for b in back) else None,
        "workers_never_back": sum(1 for b in back if math.isnan(b)),
        "typed_errors": dict(by_type.most_common()),
        "to_typed_error_s": {"p50": pct(to_error, 50), "max": max(to_error)} if to_error else None,
        "slowest_work_s": max((c.seconds for c in ok if c.op in WORK), default=0.0),
        "slowest_create_s": max((c.seconds for c in ok if c.op == "create"), default=0.0),
        "hung": sum(1 for c in calls if c.outcome == "hung"),
        "untyped": sum(1 for c in calls if c.outcome == "untyped"),
        "bad_results": sum(1 for c in calls if c.outcome == "bad"),
        "files_lost": sum(1 for f in chaos.lost_files if f["window"] == w.name),
        "pods_left_over": left,
    }


def seconds(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def table(r: dict[str, Any]) -> str:
    rows = [
        f"{'window':<24} {'fault s':>7} {'calls ok/fail':>13} {'slowest s':>9} {'creates':>7} {'affected':>8} "
        f"{'recov':>5} {'back s':>6} {'to err p50/max':>14} {'left':>4} {'lost':>4} {'hung':>4} {'untyp':>5}  "
        "typed errors"
    ]
    for x in r["windows"]:
        f = x["fault"]
        err = x["to_typed_error_s"]
        to_err = f"{err['p50']:.1f}/{err['max']:.1f}" if err else "-"
        typed = ", ".join(f"{k} x{v}" for k, v in x["typed_errors"].items())
        rows.append(
            f"{x['window']:<24} {seconds(f.get('fault_s')):>7} {x['calls_ok']:>6}/{x['calls_failed']:<6} "
            f"{x['slowest_work_s']:>9.1f} {x['creates']:>7} {x['sandboxes_affected']:>8} {x['recovered_by_retry']:>5} "
            f"{seconds(x['back_to_work_s']):>6} {to_err:>14} {x['pods_left_over']:>4} {x['files_lost']:>4} "
            f"{x['hung']:>4} {x['untyped']:>5}  {typed}"
        )
        if "error" in f:
            rows.append(f"   firing failed: {f['error']}")
        if isinstance(f.get("result"), dict):
            k = f["result"]
            rows.append(
                f"   killed client: {len(k['started'])} sandboxes, {k['pods_after_kill']} pods after the kill, "
                f"gc collected {len(k['pods_collected'])} pods and {k['leases_collected']} Lease, "
                f"{len(k['pods_left_over'])} pods left {k['gone_after_gc_s']}s later"
            )
    t = r["totals"]
    rows += [
        "",
        f"sandboxes: {t['sandboxes']} started, ended {t['sandbox_ends']}",
        f"files: {t['files']}; writes that raised: {t['write_failed']}",
        f"calls: {t['calls']} ({t['calls_ok']} ok), HUNG {t['hung']}, untyped {t['untyped']}, "
        f"bad results {t['bad_results']}",
        f"pods left after the client closed: {t['pods_left_over']} (waited {t['pods_gone_after_close_s']:.1f}s)",
    ]
    return "\n".join(rows)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    load_before = os.getloadavg()
    await namespaces(args.kubeconfig, [args.namespace, args.namespace + "-killed"], create=True)
    config = orchard.KubernetesConfig(namespace=args.namespace, kubeconfig=args.kubeconfig)
    client = orchard.Client(config, read_timeout=args.read_timeout, liveness_timeout=args.liveness_timeout)
    chaos = Chaos(args, client)
    try:
        async with client:
            workers = [asyncio.create_task(chaos.worker(w)) for w in range(args.n)]
            try:
                await chaos.schedule()
            finally:
                chaos.stop.set()
                await asyncio.wait(workers, timeout=2 * args.outer_timeout)
                for task in workers:
                    if not task.done():
                        print(f"!! a worker did not stop: {task!r}", flush=True)
                        task.cancel()
    finally:
        await asyncio.to_thread(faults.heal)
    closed_at = chaos.now()
    left, waited = await until_no_pods(args.kubeconfig, args.namespace, 60.0)
    chaos.windows[-1].end = float("inf")
    ends = Counter(s["end"] for s in chaos.sandboxes.values())
    files = chaos.files
    for sid, s in chaos.sandboxes.items():
        if s["end"] == "lost":
            files["lost with a reported sandbox"] += len(chaos.ledger[sid])
        elif s["end"] == "abandoned":
            files["unverified (sandbox given up)"] += len(chaos.ledger[sid])
    result = {
        "n": args.n,
        "image": IMAGE,
        "read_timeout_s": args.read_timeout,
        "liveness_timeout_s": args.liveness_timeout,
        "outer_timeout_s": args.outer_timeout,
        "delayed_s": DELAYED_S,
        "lifetime_s": args.lifetime,
        "quick": args.quick,
        "wall_s": round(closed_at, 1),
        "windows": [window_figures(chaos, w) for w in chaos.windows],
        "totals": {
            "sandboxes": len(chaos.sandboxes),
            "sandbox_ends": dict(ends),
            "files": dict(files),
            "write_failed": dict(chaos.write_failed),
            "calls": len(chaos.calls),
            "calls_ok": sum(1 for c in chaos.calls if c.outcome == "ok"),
            "hung": sum(1 for c in chaos.calls if c.outcome == "hung"),
            "untyped": len(chaos.untyped),
            "bad_results": len(chaos.bad_results),
            "files_lost": files["LOST"],
            "pods_left_over": len(left),
            "pods_left_over_names": sorted(left),
            "pods_gone_after_close_s": round(waited, 1),
        },
        "findings": {"untyped": chaos.untyped, "lost_files": chaos.lost_files, "bad_results": chaos.bad_results},
        "errors": [
            {"window": chaos.window_at(c.end).name, "op": c.op, "sandbox": c.sandbox, "error": c.error}
            | {"reason": c.reason, "start_s": round(c.start, 2), "seconds": round(c.seconds, 2), "message": c.message}
            for c in chaos.calls
            if c.outcome != "ok"
        ],
        "machine": {
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            "load_before": load_before,
            "load_after": os.getloadavg(),
        },
    }
    if args.calls:
        with open(args.calls, "w") as f:
            for c in chaos.calls:
                f.write(json.dumps(c.__dict__ | {"window": chaos.window_at(c.end).name}) + "\n")
    if not left:
        await namespaces(args.kubeconfig, [args.namespace, args.namespace + "-killed"], create=False)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=None, help="sandboxes at work at once (default 12, --quick 4)")
    parser.add_argument("--quick", action="store_true", help="4 sandboxes, shorter quiet times")
    parser.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG", "/var/lib/orchard-devcluster/kubeconfig"))
    parser.add_argument("--namespace", default=f"orchard-chaos-{secrets.token_hex(3)}")
    parser.add_argument("--read-timeout", type=float, default=15.0, help="the Client's read_timeout")
    parser.add_argument("--liveness-timeout", type=float, default=5.0, help="the Client's liveness_timeout")
    parser.add_argument("--outer-timeout", type=float, default=150.0, help="a call past this is HUNG")
    parser.add_argument(
        "--lifetime",
        type=float,
        default=None,
        help="mean seconds a sandbox is used before it is replaced (30; quick 15)",
    )
    parser.add_argument("--faults", default="", help="only the faults whose names contain these (comma-separated)")
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--json", default=None)
    parser.add_argument("--calls", default=None, help="also write every call here, one JSON object a line")
    args = parser.parse_args()
    args.n = args.n or (4 if args.quick else 12)
    args.lifetime = args.lifetime or (15.0 if args.quick else 30.0)
    if os.geteuid() != 0:
        raise SystemExit("bench_chaos.py fires faults at the dev cluster: run it as root")
    random.seed(args.seed)
    out = asyncio.run(main(args))
    print(table(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
