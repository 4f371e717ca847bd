"""Faults fired on purpose at the dev cluster while clients use it: the harness of the chaos run.

Usage (as root, with the cluster up)::

    hack/devcluster/devcluster fault restart COMPONENT [--down SECONDS] [--kill]
    hack/devcluster/devcluster fault partition SECONDS [--reset]
    hack/devcluster/devcluster fault kill-executor NAMESPACE POD
    hack/devcluster/devcluster fault delete|evict NAMESPACE POD
    hack/devcluster/devcluster fault drain SECONDS
    hack/devcluster/devcluster fault reclaim NODE
    hack/devcluster/devcluster fault heal

* ``restart``: stop one component (SIGTERM, an upgrade; ``--kill``: SIGKILL, a
  crash), keep it down for ``--down`` seconds, start it again with the command
  line ``up`` gave it, and wait until it serves again. COMPONENT is one of
  etcd, kube-apiserver, kube-controller-manager, kube-scheduler, containerd,
  kubelet, kube-router. Running pods outlive a kubelet or containerd restart.
* ``partition``: drop every packet between this host and the pods, both ways,
  on the bridge (the pods still reach each other), for SECONDS; then restore.
  A dropped packet is silence, not a refusal: what waits on the pods waits.
  ``--reset`` also aborts the host's open connections to the pods at the cut
  (a NAT or middlebox that lost its state): the client sees them break.
* ``kill-executor``: SIGKILL a pod's container (the executor is its PID 1).
* ``delete`` (grace 0) and ``evict`` (the Eviction API) one pod.
* ``drain``: cordon the dev node, evict every Orchard pod on it, uncordon after
  SECONDS (new pods wait for the node meanwhile).
* ``reclaim``: a spot reclaim. The node's Orchard pods vanish at once (their
  containers killed, the pods force-deleted, as the cloud and the pod garbage
  collector would do), and a node that is not the dev node's own kubelet (a
  KWOK node) is deleted with them.
* ``heal``: undo a partition or a cordon left by an interrupted run.

Every fault undoes itself (``finally``), and ``devcluster down`` removes the
partition's chain too (its name starts with ``KUBE-``). Each function returns
what it did, for the chaos run to account for. Only the standard library.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import devcluster as dc  # noqa: E402 - the script beside this one, not a package

#: Pods Orchard made (every sandbox pod carries this label).
ORCHARD_PODS = "app.kubernetes.io/managed-by=orchard"
#: The chain a partition adds, in the raw table: before kube-router's filter chains, which accept pod traffic
#: its policies allow and keep their jumps first in INPUT and OUTPUT. ``KUBE-``: ``devcluster down`` removes it.
CUT_CHAIN = "KUBE-ORCHARD-CUT"
#: Where the host meets the pods: (raw chain, its match) pairs a partition hooks. Packets from the pods to
#: the host only: bridged traffic between pods passes PREROUTING too (br_netfilter), and is left alone.
CUT_HOOKS = (
    ("OUTPUT", ("-o", dc.BRIDGE)),
    ("PREROUTING", ("-i", dc.BRIDGE, "-m", "addrtype", "--dst-type", "LOCAL")),
)


class FaultError(dc.ClusterError):
    """A fault could not be fired or undone."""


def _serving(component: str) -> bool:
    """Whether a component does its job again after a restart (not just runs)."""
    if component == "etcd":
        return dc.http_ok(f"http://127.0.0.1:{dc.ETCD_CLIENT_PORT}/health")
    if component == "kube-apiserver":
        return dc.apiserver_ready()
    if component == "kubelet":
        return dc.http_ok(f"http://127.0.0.1:{dc.KUBELET_HEALTHZ_PORT}/healthz") and dc.node_ready()
    if component == "containerd":
        return dc.ctr("version", check=False, quiet=True).returncode == 0
    return dc.alive(component)


def restart(
    component: str,
    *,
    down: float = 0.0,
    kill: bool = False,
    grace: float = 10.0,
    timeout: float = 120.0,
    meanwhile: Callable[[], object] | None = None,
) -> float:
    """Stop ``component``, keep it down ``down`` seconds, start it as ``up`` did; seconds until it serves.

    A SIGTERM is followed by SIGKILL after ``grace`` seconds: kube-apiserver 1.34 can take more than 30 s
    to exit after its graceful shutdown finished (measured here). ``meanwhile`` is called while it is down.
    """
    if component not in dc.COMPONENTS:
        raise FaultError(f"no component {component!r}: one of {', '.join(dc.COMPONENTS)}")
    try:
        started = json.loads((dc.PIDS / f"{component}.cmd").read_text())
    except (OSError, ValueError) as exc:
        raise FaultError(f"{component} was not started by this devcluster's `up` ({exc}): restart it with up") from exc
    pid = dc.pid_of(component)
    if pid is None:
        raise FaultError(f"{component} is not running", component)
    t0 = time.monotonic()
    dc.log(f"fault: {'killing' if kill else 'stopping'} {component} (pid {pid}) for {down:g}s")
    dc.stop_pid(pid, timeout=grace, sig=signal.SIGKILL if kill else signal.SIGTERM)
    time.sleep(down)
    if meanwhile is not None:
        meanwhile()
    dc.start(component, started["argv"], env=started["env"])
    dc.wait_for(f"{component} serving again", lambda: _serving(component), timeout, component, interval=0.1)
    return time.monotonic() - t0


def _iptables(*args: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
    return dc.run(["iptables", "-w", "5", "-t", "raw", *args], check=check, quiet=not check)


def cut() -> None:
    """Drop every packet between this host and the pods on the bridge, both ways (idempotent)."""
    _iptables("-N", CUT_CHAIN, check=False)  # fails when it exists: then it is emptied and filled again
    _iptables("-F", CUT_CHAIN)
    _iptables("-A", CUT_CHAIN, "-j", "DROP")
    for chain, match in CUT_HOOKS:
        rule = [chain, *match, "-j", CUT_CHAIN]
        if _iptables("-C", *rule, check=False).returncode != 0:
            _iptables("-I", *rule)
    dc.log(f"fault: host and pods on {dc.BRIDGE} cut apart")


def restore() -> None:
    """Undo ``cut`` (idempotent)."""
    for chain, match in CUT_HOOKS:
        while _iptables("-D", chain, *match, "-j", CUT_CHAIN, check=False).returncode == 0:
            pass
    _iptables("-F", CUT_CHAIN, check=False)
    _iptables("-X", CUT_CHAIN, check=False)
    dc.log(f"fault: host and pods on {dc.BRIDGE} joined again")


def reset() -> int:
    """Abort every TCP connection between this host and the pods (as a NAT or middlebox losing its state does).

    The host's end sees the connection reset; the pod's end hears nothing while a cut lasts. Returns how many
    connections were aborted.
    """
    listed = dc.run(["ss", "-Htn", "state", "connected", "dst", dc.POD_CIDR], check=False, quiet=True)
    count = len(listed.stdout.splitlines())
    dc.run(["ss", "-HtnK", "state", "connected", "dst", dc.POD_CIDR], check=False, quiet=True)
    dc.log(f"fault: {count} connections to the pods reset")
    return count


@contextlib.contextmanager
def partitioned(*, reset_connections: bool = False) -> Iterator[None]:
    """The host cut from the pods for the ``with`` block; ``reset_connections``: its open connections aborted too."""
    cut()
    try:
        if reset_connections:
            reset()
        yield
    finally:
        restore()


def partition(seconds: float, *, reset_connections: bool = False) -> None:
    """Cut the host from the pods for ``seconds`` (see ``partitioned``)."""
    with partitioned(reset_connections=reset_connections):
        time.sleep(seconds)


def _etcd(call: str, body: dict[str, Any]) -> dict[str, Any]:
    """One call of etcd's v3 JSON gateway (keys base64)."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{dc.ETCD_CLIENT_PORT}/v3/{call}", data=json.dumps(body).encode(), method="POST"
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return dict(json.loads(r.read()))


def forget_pod(namespace: str, name: str) -> None:
    """Delete a pod from etcd behind the API server's back, then compact etcd's history past the deletion.

    With the API server down, a watch that comes back from before can no longer be told of the
    deletion (410 Gone: its resource version is compacted away) and learns of it only by listing again.
    The kubelet, seeing the pod gone, ends its containers.
    """
    key = base64.b64encode(f"/registry/pods/{namespace}/{name}".encode()).decode()
    deleted = _etcd("kv/deleterange", {"key": key})
    if deleted.get("deleted") != "1":
        raise FaultError(f"pod {namespace}/{name} is not in etcd")
    _etcd("kv/compaction", {"revision": deleted["header"]["revision"], "physical": True})
    dc.log(f"fault: pod {namespace}/{name} deleted in etcd and its history compacted")


def pod(namespace: str, name: str) -> dict[str, Any]:
    """A pod as the API server has it."""
    return dc.api(f"/api/v1/namespaces/{namespace}/pods/{name}")


def orchard_pods(node: str = dc.NODE_NAME) -> list[dict[str, Any]]:
    """Every Orchard pod bound to ``node``, in any namespace."""
    path = f"/api/v1/pods?labelSelector={ORCHARD_PODS}&fieldSelector=spec.nodeName%3D{node}"
    return list(dc.api(path, timeout=10).get("items", []))


def kill_executor(namespace: str, name: str) -> None:
    """SIGKILL the pod's executor (its container's PID 1) through containerd, as a crash would."""
    statuses = pod(namespace, name).get("status", {}).get("containerStatuses") or []
    ids = [s["containerID"].split("://", 1)[-1] for s in statuses if s.get("containerID")]
    if not ids:
        raise FaultError(f"pod {namespace}/{name} has no running container to kill")
    for cid in ids:
        dc.ctr("tasks", "kill", "--signal", "SIGKILL", cid)
    dc.log(f"fault: killed the executor of {namespace}/{name}")


def delete(namespace: str, name: str) -> None:
    """Delete a pod at once (grace 0)."""
    dc.api(f"/api/v1/namespaces/{namespace}/pods/{name}", method="DELETE", body={"gracePeriodSeconds": 0})
    dc.log(f"fault: deleted {namespace}/{name}")


def evict(namespace: str, name: str) -> None:
    """Evict a pod through the Eviction API, as a drain or a node-pressure eviction does."""
    body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": namespace}}
    dc.api(f"/api/v1/namespaces/{namespace}/pods/{name}/eviction", method="POST", body=body)
    dc.log(f"fault: evicted {namespace}/{name}")


def cordon(node: str = dc.NODE_NAME, *, on: bool = True) -> None:
    """Mark ``node`` unschedulable (``on=False``: schedulable again)."""
    dc.api(f"/api/v1/nodes/{node}", method="PATCH", body={"spec": {"unschedulable": on or None}})
    dc.log(f"fault: node {node} {'cordoned' if on else 'uncordoned'}")


def drain(seconds: float, node: str = dc.NODE_NAME) -> list[str]:
    """Cordon ``node``, evict its Orchard pods, uncordon after ``seconds``; the evicted pods' names."""
    cordon(node)
    try:
        evicted = []
        for p in orchard_pods(node):
            md = p["metadata"]
            with contextlib.suppress(urllib.error.HTTPError):  # already gone: nothing to evict
                evict(md["namespace"], md["name"])
                evicted.append(md["name"])
        time.sleep(seconds)
        return evicted
    finally:
        cordon(node, on=False)


def reclaim(node: str) -> list[str]:
    """The node is gone with its pods (a spot reclaim): their containers killed, the pods force-deleted."""
    gone = orchard_pods(node)
    for p in gone:
        md = p["metadata"]
        if node == dc.NODE_NAME:  # a real kubelet's pods: their processes die with the machine
            with contextlib.suppress(dc.ClusterError, urllib.error.HTTPError):  # gone meanwhile: nothing to kill
                kill_executor(md["namespace"], md["name"])
        with contextlib.suppress(urllib.error.HTTPError):
            delete(md["namespace"], md["name"])
    if node != dc.NODE_NAME:  # never the dev node's own Node object: its kubelet would not register again
        dc.api(f"/api/v1/nodes/{node}", method="DELETE")
        dc.log(f"fault: node {node} deleted")
    return [p["metadata"]["name"] for p in gone]


def settle(timeout: float = 60.0) -> None:
    """After a control-plane outage: restart the controller manager and the scheduler, and wait for them to work.

    Their informers back off for up to 30 s after losing the API server (client-go's reflector), so new
    namespaces lack a ServiceAccount and new pods wait to be scheduled meanwhile: the next user of the
    cluster would pay for the last fault. A canary namespace proves the controller manager works again.
    """
    for component in ("kube-controller-manager", "kube-scheduler"):
        restart(component)
    name = f"orchard-settle-{secrets.token_hex(4)}"
    dc.api("/api/v1/namespaces", method="POST", body={"metadata": {"name": name}})
    try:
        dc.wait_for(
            "the controller manager to give a new namespace its ServiceAccount",
            lambda: dc.api(f"/api/v1/namespaces/{name}/serviceaccounts/default"),
            timeout,
            "kube-controller-manager",
            interval=0.2,
        )
    finally:
        dc.api(f"/api/v1/namespaces/{name}", method="DELETE")


def heal() -> None:
    """Undo what an interrupted fault may have left: the partition and the cordon."""
    restore()
    cordon(on=False)


def main(argv: list[str] | None = None) -> int:
    """``devcluster fault ...``."""
    ap = argparse.ArgumentParser(prog="devcluster fault", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="fault", required=True)
    p = sub.add_parser("restart", help="stop a component and start it again")
    p.add_argument("component", choices=dc.COMPONENTS)
    p.add_argument("--down", type=float, default=0.0, metavar="SECONDS", help="how long it stays down")
    p.add_argument("--kill", action="store_true", help="SIGKILL (a crash) instead of SIGTERM")
    p = sub.add_parser("partition", help="cut the host from the pods for a time")
    p.add_argument("seconds", type=float)
    p.add_argument("--reset", action="store_true", help="also abort the open connections (a middlebox lost them)")
    for name, what in (
        ("kill-executor", "SIGKILL a pod's executor"),
        ("delete", "delete a pod (grace 0)"),
        ("evict", "evict a pod"),
    ):
        p = sub.add_parser(name, help=what)
        p.add_argument("namespace")
        p.add_argument("pod")
    sub.add_parser("drain", help="cordon, evict, uncordon after a time").add_argument("seconds", type=float)
    sub.add_parser("reclaim", help="a node's pods vanish (and a KWOK node itself)").add_argument("node")
    sub.add_parser("heal", help="undo a partition or cordon left behind")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("devcluster fault: must run as root", file=sys.stderr)
        return 2
    try:
        if args.fault == "restart":
            print(
                f"{args.component} serving again after {restart(args.component, down=args.down, kill=args.kill):.1f}s"
            )
        elif args.fault == "partition":
            partition(args.seconds, reset_connections=args.reset)
        elif args.fault in ("kill-executor", "delete", "evict"):
            {"kill-executor": kill_executor, "delete": delete, "evict": evict}[args.fault](args.namespace, args.pod)
        elif args.fault == "drain":
            print("\n".join(drain(args.seconds)))
        elif args.fault == "reclaim":
            print("\n".join(reclaim(args.node)))
        else:
            heal()
    except (dc.ClusterError, urllib.error.URLError, OSError) as exc:
        print(f"devcluster fault {args.fault} FAILED: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
