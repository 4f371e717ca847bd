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
import contextlib
import contextvars
import hashlib
import json
import math
import os
import random
import re
import secrets
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _stats import pct

import orchard
import orchard.rollout
from orchard.errors import OrchardError, PathNotFound, SandboxClosed, SandboxLost
from orchard.tasks import Reward, Task

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


Fire = Callable[[], Awaitable[Any]]
#: The faults of the first phase, in order (then a client SIGKILLed), and the shorter schedule of the rollout phase.
FULL_SCHEDULE = (
    "kube-apiserver restart",
    "etcd restart",
    "kubelet restart",
    "containerd restart",
    "partition 10 s",
    "kill executor",
    "delete pod",
    "evict pod",
    "drain 5 s",
    "reclaim node",
)
ROLLOUT_SCHEDULE = (
    "kube-apiserver restart",
    "etcd restart",
    "partition 10 s",
    "kill executor",
    "delete pod",
    "drain 5 s",
    "reclaim node",
)


def fault_schedule(
    quick: bool, one_pod: Callable[[Callable[[str, str], None]], Awaitable[str]], names: tuple[str, ...]
) -> list[tuple[str, Fire]]:
    """The named faults of the dev cluster's harness; ``one_pod(fire)`` fires at the pod of one sandbox at work."""
    down = 3.0 if quick else 5.0
    node = faults.dc.NODE_NAME
    every: dict[str, Fire] = {
        "kube-apiserver restart": lambda: asyncio.to_thread(faults.restart, "kube-apiserver", down=down),
        "etcd restart": lambda: asyncio.to_thread(faults.restart, "etcd", down=down),
        "kubelet restart": lambda: asyncio.to_thread(faults.restart, "kubelet"),
        "containerd restart": lambda: asyncio.to_thread(faults.restart, "containerd"),
        "partition 10 s": lambda: asyncio.to_thread(faults.partition, 10.0),
        "kill executor": lambda: one_pod(faults.kill_executor),
        "delete pod": lambda: one_pod(faults.delete),
        "evict pod": lambda: one_pod(faults.evict),
        "drain 5 s": lambda: asyncio.to_thread(faults.drain, 5.0),
        "reclaim node": lambda: asyncio.to_thread(faults.reclaim, node),
    }
    return [(name, every[name]) for name in names]


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


async def fire_fault(windows: list[Window], now: Callable[[], float], name: str, fault: Fire, note: str = "") -> Window:
    """Close the current window, open the fault's and fire it; the result, or why it could not fire, goes in it."""
    t = now()
    windows[-1].end = t
    window = Window(name, t)
    windows.append(window)
    print(f"-- {t:6.1f}s fault: {name}{note}", flush=True)
    try:
        window.fault["result"] = await fault()
    except Exception as exc:
        window.fault["error"] = repr(exc)
        print(f"!! firing {name} failed: {exc!r}", flush=True)
    window.fault["fault_s"] = round(now() - t, 1)
    return window


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

    def faults(self) -> list[tuple[str, Fire]]:
        every = [
            *fault_schedule(self.args.quick, self.one_pod, FULL_SCHEDULE),
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
        for name, fault in self.faults():
            window = await fire_fault(self.windows, self.now, name, fault)
            t = window.start
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


# -- The rollout phase --

#: Attempts in flight at once in the rollout phase.
ROLLOUT_CONCURRENCY = 8
#: The toy agent's steps: each an exec that appends to a log and sleeps, so an attempt is at work a few seconds.
AGENT_STEPS, AGENT_STEP_S = 4, 0.5
#: The runner's ``timeout`` for the agent and the reward: past it the attempt is an agent (reward) error.
ATTEMPT_TIMEOUT_S = 120.0


#: Set while a reward runs: its sandbox's start is told apart from the agent's.
grading: contextvars.ContextVar[bool] = contextvars.ContextVar("grading", default=False)


def answer_of(task_id: str) -> str:
    """The token the agent of a task writes and its reward checks."""
    return hashlib.sha256(task_id.encode()).hexdigest()[:16]


class Rollout:
    """``orchard.rollout.run`` over toy tasks at a fixed concurrency while a shorter schedule of faults fires.

    Each task's agent execs a few commands in its busybox sandbox (one made ready by the task's setup command),
    writes its answer to a file and reads it back; the reward writes the answer in a sandbox of its own and
    checks it there. Every try that fails (a sandbox that did not start, an agent's or a reward's call) is
    recorded with its time, so each fault's window shows what it cost.
    """

    def __init__(self, args: argparse.Namespace, client: orchard.Client, namespace: str) -> None:
        self.args = args
        self.client = client
        self.namespace = namespace
        self.t0 = time.time()
        self.windows = [Window("baseline", 0.0)]
        #: Sandboxes whose agent runs now: a fault at "one pod" picks one of them.
        self.at_work: dict[str, orchard.Sandbox] = {}
        #: (start, end) of every agent that did all its work.
        self.agents_done: list[tuple[float, float]] = []
        #: Every failed try: when, in which phase, the error.
        self.failed: list[dict[str, Any]] = []
        self.hung = False
        self.run_error: str | None = None
        self.records: list[dict[str, Any]] = []
        self.watch_starts()

    def now(self) -> float:
        return time.time() - self.t0

    def fail(self, phase: str, exc: BaseException, sandbox: str | None = None) -> None:
        if getattr(exc, "_chaos_recorded", False):
            return  # the reward's sandbox that did not start: recorded as such already
        exc._chaos_recorded = True  # type: ignore[attr-defined]
        at = self.now()
        failure = {
            "at_s": at,
            "phase": phase,
            "error": type(exc).__name__,
            "reason": reason_of(exc),
            "sandbox": sandbox,
        }
        if isinstance(exc, asyncio.CancelledError) and not self.hung:
            failure["traceback"] = "".join(traceback.format_exception(exc))[-3000:]
            print(f"!! {phase} of {sandbox} cancelled at {at:.1f}s:\n{failure['traceback']}", flush=True)
        self.failed.append(failure)

    def check_cancelling(self, phase: str, sandbox: str | None) -> None:
        """Record a cancellation left pending on the attempt's task by the library (none of ours is): a finding.

        The runner stops an attempt whose task is cancelling before each try and before the reward, and an
        attempt stopped that way leaves no record.
        """
        task = asyncio.current_task()
        if task is not None and task.cancelling() and not self.hung:
            self.failed.append(
                {"at_s": self.now(), "phase": phase, "error": "left cancelling", "reason": "", "sandbox": sandbox}
            )
            print(f"!! {phase} of {sandbox} left its task cancelling at {self.now():.1f}s", flush=True)

    def watch_starts(self) -> None:
        """Record the sandboxes that fail to start (the agent's, after its setup, and the reward's)."""
        sandbox = self.client.sandbox

        @contextlib.asynccontextmanager
        async def watched(*args: Any, **kwargs: Any) -> AsyncIterator[orchard.Sandbox]:
            entered = False
            try:
                async with sandbox(*args, **kwargs) as sb:
                    entered = True
                    self.check_cancelling("start", sb.id)
                    yield sb
            except BaseException as exc:
                if not entered:
                    self.fail("reward start" if grading.get() else "start", exc)
                    self.check_cancelling("start", None)
                raise
            finally:
                if entered:
                    self.check_cancelling("close", None)

        self.client.sandbox = watched  # type: ignore[method-assign]

    async def agent(self, sb: orchard.Sandbox, task: Task, *, attempt: int) -> str:
        start = self.now()
        self.at_work[sb.id] = sb
        try:
            for step in range(AGENT_STEPS):
                await sb.exec(f"echo step {step} >> /tmp/work/log && sleep {AGENT_STEP_S}")
            await sb.write_file("/tmp/work/answer", answer_of(task.id).encode())
            answer = (await sb.exec("cat /tmp/work/answer")).stdout
        except BaseException as exc:  # a CancelledError too: an attempt cancelled under the runner is a finding
            self.fail("agent", exc, sb.id)
            raise
        finally:
            self.at_work.pop(sb.id, None)
            self.check_cancelling("agent", sb.id)
        self.agents_done.append((start, self.now()))
        return answer

    async def reward(self, client: orchard.Client, task: Task, answer: Any) -> Reward:
        graded = grading.set(True)
        try:
            async with client.sandbox(IMAGE) as sb:
                await sb.write_file("/tmp/answer", str(answer).encode())
                check = await sb.exec(f'test "$(cat /tmp/answer)" = {answer_of(task.id)}')
        except BaseException as exc:
            self.fail("reward", exc)
            raise
        finally:
            self.check_cancelling("reward", None)
            grading.reset(graded)
        solved = check.exit_code == 0
        return Reward(value=float(solved), solved=solved, reason=None if solved else f"answer {answer!r}")

    async def run(self, tasks: list[Task]) -> None:
        """The rollout under its outer deadline (past it: hung); its records, read back from its ``out``."""
        with tempfile.TemporaryDirectory() as out:
            deadline = asyncio.timeout(self.args.rollout_deadline)
            try:
                async with deadline:
                    await orchard.rollout.run(
                        self.client,
                        tasks,
                        agent=self.agent,
                        reward=self.reward,
                        concurrency=ROLLOUT_CONCURRENCY,
                        out=out,
                        timeout=ATTEMPT_TIMEOUT_S,
                        sandbox={"trace": None},
                        progress=False,
                    )
            except Exception as exc:
                if deadline.expired():
                    self.hung = True
                    print(f"!! HUNG: the rollout did not end within {self.args.rollout_deadline:g}s", flush=True)
                else:
                    self.run_error = "".join(traceback.format_exception(exc))
                    print(f"!! the rollout raised:\n{self.run_error}", flush=True)
            try:
                self.records = orchard.rollout.Results.load(out).records
            except OrchardError as exc:  # not one record written
                print(f"!! no records: {exc}", flush=True)
        print(f"-- {self.now():6.1f}s rollout ended: {len(self.records)} records", flush=True)

    async def one_pod(self, fire: Callable[[str, str], None]) -> str:
        """Fire at the pod of one sandbox whose agent runs now (waiting a little for one)."""
        for _ in range(100):
            if self.at_work:
                break
            await asyncio.sleep(0.1)
        sid = random.choice(list(self.at_work))
        await asyncio.to_thread(fire, self.namespace, sid)
        return sid

    async def back_at_work(self, since: float, timeout: float) -> float | None:
        """Seconds from ``since`` until an agent that started after it did all its work; None if none in time."""
        t_end = self.now() + timeout
        while self.now() < t_end:
            done = [end for start, end in self.agents_done if start >= since]
            if done:
                return min(done) - since
            await asyncio.sleep(0.5)
        return None

    async def schedule(self, run: asyncio.Task[None]) -> None:
        after, before = (6.0, 3.0) if self.args.quick else (8.0, 4.0)
        for _ in range(240):  # until a round of attempts has done its work (bounded)
            if len(self.agents_done) >= ROLLOUT_CONCURRENCY or run.done():
                break
            await asyncio.sleep(0.5)
        await asyncio.sleep(2 * before)
        for name, fault in fault_schedule(self.args.quick, self.one_pod, ROLLOUT_SCHEDULE):
            if run.done():
                print(f"!! the rollout ended before {name}: raise --tasks", flush=True)
                self.windows[-1].fault.setdefault("not fired", []).append(name)
                continue
            window = await fire_fault(self.windows, self.now, name, fault, f" ({len(self.at_work)} agents at work)")
            await asyncio.sleep(after)
            back = await self.back_at_work(window.start + window.fault["fault_s"], 60.0)
            window.fault["back_at_work_s"] = None if back is None else round(back + window.fault["fault_s"], 1)
            await asyncio.sleep(before)
        self.windows[-1].end = self.now()
        self.windows.append(Window("after the faults", self.now()))


def attempt_end(r: dict[str, Any]) -> str:
    """How an attempt ended: ok at the first try, ok after retries, or its kind."""
    if r["kind"] == "ok":
        return "ok" if r["tries"] == 1 else "ok after retries"
    return str(r["kind"])


def error_type(r: dict[str, Any]) -> str:
    """An agent or reward error's type (the record's error is ``Type: message``)."""
    return (r.get("error") or "?").split(":", 1)[0]


def rollout_figures(ro: Rollout, tasks: list[Task], left: dict[str, str], waited: float) -> dict[str, Any]:
    records = ro.records
    ends = Counter(attempt_end(r) for r in records)
    retried = [r for r in records if r["tries"] > 1]
    windows = []
    for w in ro.windows:
        start, end = ro.t0 + w.start, ro.t0 + w.end
        fired = start if w.name not in ("baseline", "after the faults") else None
        failed = [f for f in ro.failed if w.start <= f["at_s"] < w.end]
        in_flight = [r for r in records if fired is not None and r["started_at"] <= fired < r["ended_at"]]
        windows.append(
            {
                "window": w.name,
                "start_s": round(w.start, 1),
                "end_s": round(w.end, 1) if w.end != float("inf") else None,
                "fault": w.fault,
                "attempts_in_flight": len(in_flight) if fired is not None else None,
                "in_flight_ended": dict(Counter(attempt_end(r) for r in in_flight)),
                "attempts_ended": dict(Counter(attempt_end(r) for r in records if start <= r["ended_at"] < end)),
                "tries_failed": len(failed),
                "tries_failed_by_type": dict(
                    Counter(f"{f['phase']}: {f['error']}" + (f"({f['reason']})" if f["reason"] else "") for f in failed)
                ),
            }
        )
    return {
        "tasks": len(tasks),
        "concurrency": ROLLOUT_CONCURRENCY,
        "retries": 2,
        "agent_steps": AGENT_STEPS,
        "attempt_timeout_s": ATTEMPT_TIMEOUT_S,
        "outer_deadline_s": ro.args.rollout_deadline,
        "wall_s": round(max((r["ended_at"] for r in records), default=ro.t0) - ro.t0, 1),
        "windows": windows,
        "totals": {
            "records": len(records),
            "no_record": len(tasks) - len(records),
            "no_record_tasks": sorted({t.id for t in tasks} - {r["task"] for r in records}),
            "cancelled_under_the_runner": [f for f in ro.failed if f["error"] in ("CancelledError", "left cancelling")],
            "ok_first_try": ends["ok"],
            "ok_after_retries": ends["ok after retries"],
            "tries_of_ok_after_retries": dict(Counter(r["tries"] for r in retried if r["kind"] == "ok")),
            "infra_error": ends["infra_error"],
            "infra_error_types": dict(
                Counter(
                    f"{r['infra'][-1]['error']}({r['infra'][-1]['reason']})"
                    for r in records
                    if r["kind"] == "infra_error"
                )
            ),
            "agent_error": ends["agent_error"],
            "agent_error_types": dict(Counter(error_type(r) for r in records if r["kind"] == "agent_error")),
            "reward_error": ends["reward_error"],
            "reward_error_types": dict(Counter(error_type(r) for r in records if r["kind"] == "reward_error")),
            "unsolved": sum(1 for r in records if r["kind"] == "ok" and not r["solved"]),
            "tries_failed": len(ro.failed),
            "tries_failed_by_phase": dict(Counter(f["phase"] for f in ro.failed)),
            "hung": ro.hung,
            "run_error": ro.run_error,
            "pods_left_over": len(left),
            "pods_left_over_names": sorted(left),
            "pods_gone_after_close_s": round(waited, 1),
        },
        "findings": [
            {k: r.get(k) for k in ("task", "kind", "tries", "error", "infra", "traceback", "sandbox_id")}
            for r in records
            if r["kind"] != "ok" or not r["solved"]
        ],
    }


async def rollout_phase(args: argparse.Namespace) -> dict[str, Any]:
    """The rollout runner under a shorter schedule of faults; every task accounted for, then the pods left."""
    namespace = args.namespace + "-rollout"
    await namespaces(args.kubeconfig, [namespace], create=True)
    config = orchard.KubernetesConfig(namespace=namespace, kubeconfig=args.kubeconfig)
    client = orchard.Client(config, read_timeout=args.read_timeout, liveness_timeout=args.liveness_timeout)
    tasks = [
        Task(
            id=f"chaos-{i:03d}",
            image=IMAGE,
            instruction="write the task's token to /tmp/work/answer",
            setup=("mkdir -p /tmp/work",),
        )
        for i in range(args.tasks)
    ]
    ro = Rollout(args, client, namespace)
    print(f"-- rollout: {len(tasks)} tasks at concurrency {ROLLOUT_CONCURRENCY}", flush=True)
    try:
        async with client:
            run = asyncio.create_task(ro.run(tasks))
            try:
                await ro.schedule(run)
            finally:
                await run  # bounded by its outer deadline
    finally:
        await asyncio.to_thread(faults.heal)
    left, waited = await until_no_pods(args.kubeconfig, namespace, 60.0)
    ro.windows[-1].end = float("inf")
    if not left:
        await namespaces(args.kubeconfig, [namespace], create=False)
    return rollout_figures(ro, tasks, left, waited)


def rollout_table(r: dict[str, Any]) -> str:
    rows = [f"{'window':<24} {'fault s':>7} {'in flight':>9} {'back s':>6}  {'ended':<40} tries failed"]
    for x in r["windows"]:
        f = x["fault"]
        ended = ", ".join(f"{k} {v}" for k, v in x["attempts_ended"].items())
        failed = ", ".join(f"{k} x{v}" for k, v in x["tries_failed_by_type"].items())
        flight = "-" if x["attempts_in_flight"] is None else str(x["attempts_in_flight"])
        rows.append(
            f"{x['window']:<24} {seconds(f.get('fault_s')):>7} {flight:>9} {seconds(f.get('back_at_work_s')):>6}  "
            f"{ended:<40} {failed}"
        )
        if "error" in f:
            rows.append(f"   firing failed: {f['error']}")
    t = r["totals"]
    rows += [
        "",
        f"rollout: {r['tasks']} tasks, {t['records']} records ({t['no_record']} without), {r['wall_s']}s; "
        f"ok {t['ok_first_try']} at the first try, {t['ok_after_retries']} after retries; "
        f"infra_error {t['infra_error']} {t['infra_error_types']}; agent_error {t['agent_error']} "
        f"{t['agent_error_types']}; reward_error {t['reward_error']} {t['reward_error_types']}; "
        f"unsolved {t['unsolved']}; hung {t['hung']}; pods left {t['pods_left_over']}",
    ]
    return "\n".join(rows)


async def workers_phase(args: argparse.Namespace) -> dict[str, Any]:
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


async def main(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {} if args.rollout_only else await workers_phase(args)
    if not args.no_rollout:
        load_before = os.getloadavg()
        result["rollout"] = await rollout_phase(args)
        result["rollout"]["machine"] = {"load_before": load_before, "load_after": os.getloadavg()}
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
    parser.add_argument("--no-rollout", action="store_true", help="skip the rollout phase")
    parser.add_argument("--rollout-only", action="store_true", help="only the rollout phase")
    parser.add_argument("--tasks", type=int, default=None, help="tasks of the rollout phase (default 260, quick 120)")
    parser.add_argument(
        "--rollout-deadline", type=float, default=None, help="the rollout past this is HUNG (600 s; quick 300)"
    )
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--json", default=None)
    parser.add_argument("--calls", default=None, help="also write every call here, one JSON object a line")
    args = parser.parse_args()
    args.n = args.n or (4 if args.quick else 12)
    args.lifetime = args.lifetime or (15.0 if args.quick else 30.0)
    args.tasks = args.tasks or (120 if args.quick else 260)
    args.rollout_deadline = args.rollout_deadline or (300.0 if args.quick else 600.0)
    if os.geteuid() != 0:
        raise SystemExit("bench_chaos.py fires faults at the dev cluster: run it as root")
    random.seed(args.seed)
    out = asyncio.run(main(args))
    if "windows" in out:
        print(table(out))
    if "rollout" in out:
        print(rollout_table(out["rollout"]))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
