#!/usr/bin/env python3
"""A real single-node Kubernetes for Orchard's tests, benchmarks and CI.

Usage::

    hack/devcluster/devcluster up       # install, build (cached), start, import images, wait for Ready
    hack/devcluster/devcluster status   # what runs, is the node Ready (exit 1 if not healthy)
    hack/devcluster/devcluster env      # shell exports: KUBECONFIG, PATH (kubectl)
    hack/devcluster/devcluster down     # stop everything it started, undo every change [--keep-logs DIR]
    hack/devcluster/devcluster build    # only build/refresh the Kubernetes, etcd and kube-router binaries
    hack/devcluster/devcluster fault .. # fire a fault at the running cluster (faults.py: restart, partition, drain, ...)

What ``up`` does:

* installs the Debian packages it needs (runc, CNI plugins, iptables, ipset,
  openssl, busybox-static, docker.io and its containerd) without starting their services;
* builds kube-apiserver, kube-scheduler, kube-controller-manager, kubelet and
  kubectl of one pinned Kubernetes (``K8S_VERSION``) from the ``k8s.io/kubernetes``
  Go module into ``/var/cache/orchard/k8s/<version>/bin`` (reused while the
  version, the Go toolchain and the recipe are unchanged), and etcd (``ETCD_VERSION``)
  kube-router (``KUBE_ROUTER_VERSION``) and containerd 2 (``CONTAINERD_VERSION``,
  for image volumes) from the Go module proxy into ``/var/cache/orchard/k8s/etcd-<version>``,
  ``kube-router-<version>`` and ``containerd-<version>``;
* starts etcd, the control plane (with the ImageVolume gate), a private containerd
  (own socket, root and state dirs, so it never touches dockerd's), a CNI bridge network
  and the kubelet, writes a kubeconfig and waits until the node is Ready, then
  starts kube-router's NetworkPolicy controller (alone: no routing, no service
  proxy) and waits for its first sync;
* builds the pause image and a small busybox httpd test image without docker
  and imports them into that containerd's ``k8s.io`` namespace; then, if
  ``scripts/docker-setup.sh`` exists, runs it and imports the injector and task
  images it built (``up`` on a running cluster only refreshes those images).

The cluster: node ``orchard-dev`` (its IP is the host's), pods on the bridge
``orchard0`` in 10.234.0.0/16, reachable from the host; pods cannot send
traffic beyond the node (set ORCHARD_DEVCLUSTER_POD_EGRESS=1 to allow it).
NetworkPolicy is enforced (kube-router: iptables and ipsets); the node itself
always reaches its pods. There is no kube-proxy and no cluster DNS.
Pods must use ``imagePullPolicy: Never`` or ``IfNotPresent``: no registry.

Every process is started in its own session and in the tracking cgroup
``/sys/fs/cgroup/pids/orchard-devcluster``, with its pid recorded; ``down``
stops them by pid (checking the pid still is the process started), kills the
pods' processes and what is left in the tracking cgroup (containerd shims),
unmounts, removes the cgroups, CNI state, the bridge, the iptables chains and
ipsets that appeared with the cluster, restores the sysctls it changed, and
deletes the cluster state.  Logs of every component are in
``/var/lib/orchard-devcluster/logs`` while the cluster exists
(``down --keep-logs DIR`` copies them out first).

A failure prints the reason and the tail of the failing component's log and
exits non-zero.  Only the Python standard library is used.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import io
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import ssl
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

# --------------------------------------------------------------------------- configuration

K8S_VERSION = os.environ.get("ORCHARD_K8S_VERSION", "v1.34.4")
CACHE = Path(os.environ.get("ORCHARD_K8S_CACHE", "/var/cache/orchard/k8s"))
STATE = Path("/var/lib/orchard-devcluster")
RUN = Path("/run/orchard-devcluster")
REPO = Path(__file__).resolve().parents[2]

NODE_NAME = "orchard-dev"
POD_CIDR = "10.234.0.0/16"
POD_GATEWAY = "10.234.0.1"
SERVICE_CIDR = "10.235.0.0/16"
SERVICE_IP = "10.235.0.1"
BRIDGE = "orchard0"
CNI_NETWORK = "orchard-devcluster"
APISERVER_PORT = 6443
ETCD_CLIENT_PORT = 23790
ETCD_PEER_PORT = 23800
KUBELET_PORT = 10250
KUBELET_HEALTHZ_PORT = 10248
MAX_PODS = int(os.environ.get("ORCHARD_DEVCLUSTER_MAX_PODS", "250"))
# Pods reach the host, each other and nothing else unless this is set: test traffic must stay on this machine.
POD_EGRESS = os.environ.get("ORCHARD_DEVCLUSTER_POD_EGRESS", "") == "1"
# Local ports the cluster listens on (kubelet's 10250 on the node IP); `up` refuses to start if one is taken.
PORTS = {
    APISERVER_PORT: "kube-apiserver",
    ETCD_CLIENT_PORT: "etcd",
    ETCD_PEER_PORT: "etcd",
    KUBELET_PORT: "kubelet",
    KUBELET_HEALTHZ_PORT: "kubelet",
    10257: "kube-controller-manager",
    10259: "kube-scheduler",
}

PAUSE_IMAGE = "registry.k8s.io/pause:3.6"  # the sandbox image containerd.toml names (built locally)
HTTPD_IMAGE = "orchard.local/devcluster/httpd:1"  # busybox httpd serving /www on :8080

# scripts/docker-setup.sh builds these (injector: orchard-executor:latest and :VERSION; task images
# orchard-test/{busybox,swe,noshell,nonroot}; the harness tools, orchard-tools:latest); Debian's
# docker CLI, as that script uses.
DOCKER = "/usr/bin/docker"
DOCKER_IMAGE_PREFIXES = ("orchard-executor:", "orchard-test/", "orchard-tools:")

PACKAGES = [
    "containerd",
    "runc",
    "containernetworking-plugins",
    "iptables",
    "iproute2",
    "openssl",
    "busybox-static",
    "docker.io",
    "ca-certificates",
    "ipset",  # kube-router's NetworkPolicy controller keeps its peer sets in ipsets
]
BINARIES = ["kube-apiserver", "kube-scheduler", "kube-controller-manager", "kubelet", "kubectl"]

# Paths inside the state dirs.
PKI = STATE / "pki"
LOGS = STATE / "logs"
PIDS = RUN / "pids"
KUBECONFIG = STATE / "kubeconfig"
CONTAINERD_SOCK = RUN / "containerd.sock"
CONTAINERD_ROOT = STATE / "containerd"
CONTAINERD_STATE = RUN / "containerd"
KUBELET_ROOT = STATE / "kubelet"
CNI_CONF_DIR = STATE / "cni" / "net.d"
CNI_IPAM_DIR = STATE / "cni" / "ipam"
CNI_BIN_DIR = Path("/usr/lib/cni")
CNI_CACHE_RESULTS = Path("/var/lib/cni/results")  # libcni's default cache dir, which containerd uses
CONTAINER_LOG_LINKS = Path("/var/log/containers")  # hard-coded in the kubelet
KUBELET_DEVICE_PLUGINS = Path("/var/lib/kubelet/device-plugins")  # hard-coded in the kubelet, whatever --root-dir
RUNC_ROOT = RUN / "runc"  # runc state; the shim's default would be /run/containerd/runc
# Every process `up` starts runs in this cgroup, and so do their descendants (containerd's shims, which
# are reparented to init): `down` kills what is left in it, by pid. Containers move to kubepods/.
TRACK_CGROUP = Path("/sys/fs/cgroup/pids/orchard-devcluster")
SNAPSHOT = STATE / "host-snapshot.json"
CLUSTER_LOCK = Path(__file__).resolve()  # flock this script itself: no lock file left behind

KUBELET_SYSCTLS = [
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
]
# Pods on the bridge must pass the host's iptables for NetworkPolicy between them (br_netfilter).
NETPOL_SYSCTLS = ["net/bridge/bridge-nf-call-iptables"]
# Chains the cluster may create (CNI bridge/firewall plugins, kubelet canaries, kube-router).
OWNED_CHAIN_PREFIXES = ("CNI-", "KUBE-")
# kube-router's filter chains and ipsets (TMP- sets live only while it swaps one in: ours only per the snapshot).
NETPOL_CHAIN_PREFIXES = ("KUBE-ROUTER-", "KUBE-POD-FW-", "KUBE-NWPLCY-")
NETPOL_IPSET_PREFIXES = ("KUBE-SRC-", "KUBE-DST-")

# Host paths the components may create outside our dirs; `down` removes those that did not exist before `up`
# (children before parents).
CREATED_OUTSIDE_STATE = [
    CONTAINER_LOG_LINKS,
    CNI_CACHE_RESULTS,
    CNI_CACHE_RESULTS.parent,
    KUBELET_DEVICE_PLUGINS,
    KUBELET_DEVICE_PLUGINS.parent,
]

# The NetworkPolicy agent: kube-router's policy controller alone (iptables + ipset). kube-network-policies
# needs nfqueue, which these kernels lack.
NETPOL_AGENT = "kube-router"
# Order matters: `down` stops them in reverse.
COMPONENTS = [
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "containerd",
    "kubelet",
    NETPOL_AGENT,
]

ENV = dict(os.environ)
ENV["PATH"] = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:" + ENV.get("PATH", "")
# The cluster's own processes talk only to local addresses: no proxy, whatever apt and go may need.
COMPONENT_ENV = {k: v for k, v in ENV.items() if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}


class ClusterError(Exception):
    """The cluster could not be brought up or down; carries the component whose log explains why."""

    def __init__(self, message: str, component: str | None = None) -> None:
        super().__init__(message)
        self.component = component


def log(msg: str) -> None:
    """Print a progress line with the elapsed time."""
    print(f"[devcluster {time.monotonic() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


_T0 = time.monotonic()


def run(
    cmd: list[str], *, check: bool = True, input: bytes | None = None, quiet: bool = False, **kw: object
) -> subprocess.CompletedProcess[bytes]:
    """Run a command, capturing output; raise ClusterError with its output on failure."""
    p = subprocess.run(cmd, input=input, capture_output=True, env=kw.pop("env", ENV), **kw)  # type: ignore[call-overload]
    if check and p.returncode != 0:
        out = (p.stdout + p.stderr).decode(errors="replace")[-4000:]
        raise ClusterError(f"command failed ({p.returncode}): {shlex.join(cmd)}\n{out}")
    if not quiet and p.returncode != 0:
        log(f"(ignored) {shlex.join(cmd)}: {p.stderr.decode(errors='replace').strip()[-300:]}")
    return p


def tail(path: Path, lines: int = 40) -> str:
    """The last lines of a log file."""
    try:
        data = path.read_bytes()[-64 * 1024 :].decode(errors="replace").splitlines()
    except FileNotFoundError:
        return f"(no log at {path})"
    return "\n".join(data[-lines:])


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on an existing file so two `up`/`down`/`build` never interleave."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a" if path.parent == CACHE else "r") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# --------------------------------------------------------------------------- packages


def install_packages() -> None:
    """Install the missing Debian packages without letting their postinst scripts start services."""
    q = run(["dpkg-query", "-W", "-f", "${Package} ${db:Status-Status}\n", *PACKAGES], check=False, quiet=True)
    installed = {ln.split()[0] for ln in q.stdout.decode().splitlines() if ln.endswith(" installed")}
    missing = [p for p in PACKAGES if p not in installed]
    if not missing:
        return
    log(f"apt-get install {' '.join(missing)}")
    policy = Path("/usr/sbin/policy-rc.d")
    added_policy = False
    if not policy.exists():
        # No daemon may start from a postinst: a containerd on the default socket would be
        # picked up by dockerd, an etcd on :2379 would be a process nobody stops.
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
        added_policy = True
    try:
        apt = ["apt-get", "-o", "DPkg::Lock::Timeout=600", "-q"]
        env = dict(ENV, DEBIAN_FRONTEND="noninteractive")
        run([*apt, "update"], env=env)
        run([*apt, "install", "-y", "--no-install-recommends", *missing], env=env)
    finally:
        if added_policy:
            policy.unlink()


# --------------------------------------------------------------------------- building Kubernetes

# The wrapper module: k8s.io/kubernetes requires its staging modules at v0.0.0 with ./staging
# replaces that only apply inside its own repo, so map each one to its published v0.N.M.
_PAUSE_GO = """package main

import (
\t"os"
\t"os/signal"
\t"syscall"
)

// A pause container: sleep until SIGINT/SIGTERM, reap orphans meanwhile.
func main() {
\tc := make(chan os.Signal, 8)
\tsignal.Notify(c, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
\tfor s := range c {
\t\tif s != syscall.SIGCHLD {
\t\t\tos.Exit(0)
\t\t}
\t\tfor {
\t\t\tvar ws syscall.WaitStatus
\t\t\tif pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil); pid <= 0 || err != nil {
\t\t\t\tbreak
\t\t\t}
\t\t}
\t}
}
"""
BUILD_RECIPE_VERSION = "1"  # bump when the way binaries are built changes
# The etcd Kubernetes 1.34 is tested with. Debian's 3.4.23 lacks watch progress
# requests, so the API server refuses streaming list-watch (sendInitialEvents),
# which client-go >= 1.35 reflectors (KWOK's among them) then retry with backoff.
ETCD_VERSION = os.environ.get("ORCHARD_ETCD_VERSION", "v3.6.16")
# The newest kube-router the module proxy serves here; its go.mod (go 1.21) builds with newer toolchains.
KUBE_ROUTER_VERSION = os.environ.get("ORCHARD_KUBE_ROUTER_VERSION", "v2.1.0")
KUBE_ROUTER_MODULE = "github.com/cloudnativelabs/kube-router/v2"
# containerd 2 for its CRI's image volumes (KEP-4639), which Debian's 1.6 lacks; 2.2 still runs on cgroup v1
# (deprecated, supported on a maintained branch until 2029). Its go.mod has no replace directives.
CONTAINERD_VERSION = os.environ.get("ORCHARD_CONTAINERD_VERSION", "v2.2.9")
CONTAINERD_MODULE = "github.com/containerd/containerd/v2"
CONTAINERD_BINARIES = ["containerd", "containerd-shim-runc-v2", "ctr"]
# Beta and off by default in 1.34: image volumes need the gate on the API server and the kubelet.
FEATURE_GATES = "ImageVolume=true"


def bin_dir() -> Path:
    """Where the binaries of the pinned version live."""
    return CACHE / K8S_VERSION / "bin"


def go_env() -> dict[str, str]:
    """Environment for go builds: static, trimmed, caches in their default (or inherited) places."""
    env = dict(ENV, CGO_ENABLED="0", GOFLAGS="-mod=mod -trimpath -buildvcs=false")
    env.setdefault("GOTOOLCHAIN", "local")
    return env


def build_stamp() -> str:
    """The cache key: Kubernetes version, Go toolchain and build recipe."""
    gov = run(["go", "version"], env=go_env()).stdout.decode().strip()
    h = hashlib.sha256(f"{K8S_VERSION}\n{gov}\n{BUILD_RECIPE_VERSION}\n{_PAUSE_GO}".encode()).hexdigest()[:16]
    return f"{K8S_VERSION} {h}"


def build(force: bool = False) -> None:
    """Build the pinned Kubernetes binaries (and pause) into the cache unless already there."""
    if shutil.which("go") is None:
        raise ClusterError("the Go toolchain is needed to build Kubernetes (`go` not on PATH)")
    out = bin_dir()
    stamp_file = out / ".stamp"
    stamp = build_stamp()
    if (
        not force
        and stamp_file.exists()
        and stamp_file.read_text().strip() == stamp
        and all((out / b).exists() for b in [*BINARIES, "pause"])
    ):
        log(f"Kubernetes {K8S_VERSION} binaries cached in {out}")
        return
    with locked(CACHE / ".build.lock"):
        t0 = time.monotonic()
        log(f"building Kubernetes {K8S_VERSION} into {out} (cold: tens of minutes on 2 cores)")
        env = go_env()
        src = CACHE / K8S_VERSION / "src"
        src.mkdir(parents=True, exist_ok=True)
        out.mkdir(parents=True, exist_ok=True)
        info = json.loads(
            run(["go", "mod", "download", "-json", f"k8s.io/kubernetes@{K8S_VERSION}"], env=env, cwd=src).stdout
        )
        gomod = Path(info["GoMod"]).read_text()
        staging = sorted(set(re.findall(r"^\s*(k8s\.io/[A-Za-z0-9._-]+)\s+=>\s+\./staging/", gomod, re.M)))
        if not staging:
            raise ClusterError(f"no staging replaces found in {info['GoMod']}")
        major, minor, patch = K8S_VERSION.lstrip("v").split(".")[:3]
        staging_version = f"v0.{minor}.{patch}"
        godebug = "\n".join(ln for ln in gomod.splitlines() if ln.startswith("godebug"))
        gomod_go = re.search(r"^go\s+(\S+)", gomod, re.M)
        lines = [
            "module orchard.local/k8sbuild",
            "",
            f"go {gomod_go.group(1) if gomod_go else '1.24.0'}",
            "",
            godebug,
            "",
            f"require k8s.io/kubernetes {K8S_VERSION}",
            "",
            "replace (",
            *[f"\t{m} => {m} {staging_version}" for m in staging],
            ")",
            "",
        ]
        new_mod = "\n".join(lines)
        if (
            not (src / "go.mod").exists()
            or (src / "go.mod").read_text().split("\nrequire")[0] != new_mod.split("\nrequire")[0]
        ):
            (src / "go.mod").write_text(new_mod)  # keep go.sum and the requirements `go build -mod=mod` added
        (src / "doc.go").write_text("package k8sbuild\n")
        ldflags = ["-s", "-w"]
        for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
            for k, v in (
                ("gitVersion", K8S_VERSION),
                ("gitMajor", major),
                ("gitMinor", minor),
                ("gitTreeState", "clean"),
                ("buildDate", "1970-01-01T00:00:00Z"),
            ):
                ldflags.append(f"-X {pkg}.{k}={v}")
        for b in BINARIES:
            log(f"go build k8s.io/kubernetes/cmd/{b}")
            cmd = [
                "nice",
                "-n",
                "10",
                "go",
                "build",
                "-ldflags",
                " ".join(ldflags),
                "-o",
                str(out / f".{b}.tmp"),
                f"k8s.io/kubernetes/cmd/{b}",
            ]
            run(cmd, env=env, cwd=src)
            (out / f".{b}.tmp").rename(out / b)
        pause_src = CACHE / "pause-src"
        pause_src.mkdir(parents=True, exist_ok=True)
        (pause_src / "go.mod").write_text("module orchard.local/pause\n\ngo 1.22\n")
        (pause_src / "main.go").write_text(_PAUSE_GO)
        run(["go", "build", "-ldflags", "-s -w", "-o", str(out / "pause"), "."], env=env, cwd=pause_src)
        stamp_file.write_text(stamp + "\n")
        log(f"built Kubernetes {K8S_VERSION} in {time.monotonic() - t0:.0f}s")


def etcd_binary() -> Path:
    """Where the etcd of the pinned version lives."""
    return CACHE / f"etcd-{ETCD_VERSION}" / "etcd"


def build_etcd() -> None:
    """Build the pinned etcd from the Go module proxy into the cache unless already there (~1 min)."""
    out = etcd_binary()
    if out.exists():
        return
    with locked(CACHE / ".build.lock"):
        t0 = time.monotonic()
        log(f"building etcd {ETCD_VERSION} into {out}")
        env = go_env()
        src = out.parent / "src"
        src.mkdir(parents=True, exist_ok=True)
        # etcd's own go.mod has replace directives, so `go install pkg@version` refuses it: build from a module of ours.
        (src / "go.mod").write_text("module orchard.local/etcdbuild\n\ngo 1.24\n")
        (src / "deps.go").write_text('package etcdbuild\n\nimport _ "go.etcd.io/etcd/server/v3/etcdmain"\n')
        run(["go", "get", f"go.etcd.io/etcd/server/v3@{ETCD_VERSION}"], env=env, cwd=src)
        tmp = out.with_name(".etcd.tmp")
        run(
            ["nice", "-n", "10", "go", "build", "-ldflags", "-s -w", "-o", str(tmp), "go.etcd.io/etcd/server/v3"],
            env=env,
            cwd=src,
        )
        tmp.rename(out)
        log(f"built etcd {ETCD_VERSION} in {time.monotonic() - t0:.0f}s")


def kube_router_binary() -> Path:
    """Where the kube-router of the pinned version lives."""
    return CACHE / f"kube-router-{KUBE_ROUTER_VERSION}" / "kube-router"


def build_kube_router() -> None:
    """Build the pinned kube-router from the Go module proxy into the cache unless already there (~5 min cold)."""
    out = kube_router_binary()
    if out.exists():
        return
    with locked(CACHE / ".build.lock"):
        t0 = time.monotonic()
        log(f"building kube-router {KUBE_ROUTER_VERSION} into {out}")
        gobin = out.parent / ".gobin"
        gobin.mkdir(parents=True, exist_ok=True)
        # Its go.mod has no replace directives, so `go install pkg@version` builds it as released.
        env = dict(go_env(), GOBIN=str(gobin), GOFLAGS="-trimpath -buildvcs=false")
        version = f"{KUBE_ROUTER_MODULE}/pkg/version"
        ldflags = f"-s -w -X {version}.Version={KUBE_ROUTER_VERSION} -X {version}.BuildDate=1970-01-01T00:00:00Z"
        pkg = f"{KUBE_ROUTER_MODULE}/cmd/kube-router@{KUBE_ROUTER_VERSION}"
        run(["nice", "-n", "10", "go", "install", "-ldflags", ldflags, pkg], env=env, cwd=out.parent)
        (gobin / "kube-router").rename(out)
        gobin.rmdir()
        log(f"built kube-router {KUBE_ROUTER_VERSION} in {time.monotonic() - t0:.0f}s")


def containerd_dir() -> Path:
    """Where the containerd of the pinned version lives (containerd, its runc shim and ctr)."""
    return CACHE / f"containerd-{CONTAINERD_VERSION}"


def build_containerd() -> None:
    """Build the pinned containerd from the Go module proxy into the cache unless already there (~3 min cold)."""
    out = containerd_dir()
    if all((out / b).exists() for b in CONTAINERD_BINARIES):
        return
    with locked(CACHE / ".build.lock"):
        t0 = time.monotonic()
        log(f"building containerd {CONTAINERD_VERSION} into {out}")
        gobin = out / ".gobin"
        gobin.mkdir(parents=True, exist_ok=True)
        # Static, without the snapshotters that need cgo or kernel features these nodes do not use (overlayfs is in).
        env = dict(go_env(), GOBIN=str(gobin), GOFLAGS="-trimpath -buildvcs=false")
        version = f"{CONTAINERD_MODULE}/version"
        ldflags = f"-s -w -X {version}.Version={CONTAINERD_VERSION} -X {version}.Package={CONTAINERD_MODULE}"
        pkgs = [f"{CONTAINERD_MODULE}/cmd/{b}@{CONTAINERD_VERSION}" for b in CONTAINERD_BINARIES]
        tags = "no_btrfs no_devmapper no_zfs"
        run(["nice", "-n", "10", "go", "install", "-tags", tags, "-ldflags", ldflags, *pkgs], env=env, cwd=out)
        for b in CONTAINERD_BINARIES:
            (gobin / b).rename(out / b)
        gobin.rmdir()
        log(f"built containerd {CONTAINERD_VERSION} in {time.monotonic() - t0:.0f}s")


# --------------------------------------------------------------------------- processes


def _proc_stat(pid: int) -> tuple[str, str] | None:
    """(state, start time) of a pid, or None when there is no such process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], fields[19]


def _starttime(pid: int) -> str | None:
    st = _proc_stat(pid)
    return st[1] if st else None


def start(name: str, cmd: list[str], env: dict[str, str] | None = None) -> int:
    """Start a component detached, logging to LOGS/<name>.log, and record its pid and start time."""
    LOGS.mkdir(parents=True, exist_ok=True)
    PIDS.mkdir(parents=True, exist_ok=True)
    logf = open(LOGS / f"{name}.log", "ab")  # noqa: SIM115 - handed to the child
    p = subprocess.Popen(  # noqa: PLW1509 - preexec_fn only writes a cgroup file; we are single-threaded
        cmd,
        preexec_fn=_enter_tracking_cgroup,
        stdin=subprocess.DEVNULL,
        stdout=logf,
        stderr=subprocess.STDOUT,
        env=env or COMPONENT_ENV,
        start_new_session=True,
        cwd="/",
    )
    logf.close()
    (PIDS / f"{name}.pid").write_text(f"{p.pid} {_starttime(p.pid)}\n")
    # How it was started, for `devcluster fault restart` (the environment may hold secrets: root only).
    fd = os.open(PIDS / f"{name}.cmd", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with open(fd, "w") as f:
        json.dump({"argv": cmd, "env": env}, f)
    log(f"started {name} (pid {p.pid})")
    return p.pid


def pid_of(name: str) -> int | None:
    """The pid of a component we started, if that very process still runs."""
    try:
        pid_s, st = (PIDS / f"{name}.pid").read_text().split()
    except (OSError, ValueError):
        return None
    pid = int(pid_s)
    cur = _proc_stat(pid)
    if cur is None or cur[1] != st or cur[0] == "Z":
        return None
    return pid


def alive(name: str) -> bool:
    """Whether the component we started is still running."""
    return pid_of(name) is not None


def stop_pid(pid: int, timeout: float = 15.0, sig: int = signal.SIGTERM) -> None:
    """Signal one pid and wait for it to go away; SIGKILL after the timeout."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = _proc_stat(pid)
        if st is None or st[0] == "Z":  # a zombie is dead; init reaps it
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    for _ in range(50):
        st = _proc_stat(pid)
        if st is None or st[0] == "Z":
            return
        time.sleep(0.1)


def stop(name: str, timeout: float = 15.0) -> None:
    """Stop a component we started (by recorded pid, verified by its start time)."""
    pid = pid_of(name)
    if pid is not None:
        log(f"stopping {name} (pid {pid})")
        stop_pid(pid, timeout)
    (PIDS / f"{name}.pid").unlink(missing_ok=True)
    (PIDS / f"{name}.cmd").unlink(missing_ok=True)


def wait_for(what: str, check: object, timeout: float, component: str | None = None, interval: float = 0.25) -> None:
    """Poll `check()` until truthy; fail early if `component` died, with its log tail."""
    deadline = time.monotonic() + timeout
    last_err: str = ""
    while time.monotonic() < deadline:
        if component and not alive(component):
            raise ClusterError(f"{component} exited while waiting for {what}", component)
        try:
            if check():  # type: ignore[operator]
                return
        except Exception as e:  # noqa: BLE001 - we report the last one
            last_err = f"{type(e).__name__}: {e}"
        time.sleep(interval)
    raise ClusterError(
        f"timed out after {timeout:.0f}s waiting for {what}" + (f" ({last_err})" if last_err else ""), component
    )


# --------------------------------------------------------------------------- API access


def _tokens() -> dict[str, str]:
    return json.loads((PKI / "tokens.json").read_text())


def api(path: str, method: str = "GET", body: object | None = None, timeout: float = 5.0) -> dict:  # type: ignore[type-arg]
    """Call the apiserver as admin and return the decoded JSON."""
    ctx = ssl.create_default_context(cafile=str(PKI / "ca.crt"))
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        f"https://127.0.0.1:{APISERVER_PORT}{path}",
        data=data,
        method=method,
        headers={
            "Authorization": f"Bearer {_tokens()['admin']}",
            "Content-Type": "application/merge-patch+json" if method == "PATCH" else "application/json",
            "Accept": "application/json",
        },
    )
    with urllib.request.urlopen(req, context=ctx, timeout=timeout) as r:
        raw = r.read()
    try:
        return json.loads(raw)
    except ValueError:
        return {"raw": raw.decode(errors="replace")}


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """Whether a plain local HTTP health endpoint answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


def apiserver_ready() -> bool:
    """Whether /readyz says ok."""
    return api("/readyz").get("raw", "") == "ok"


def node_ready() -> bool:
    """Whether the node's Ready condition is True."""
    node = api(f"/api/v1/nodes/{NODE_NAME}")
    conds = {c["type"]: c["status"] for c in node.get("status", {}).get("conditions", [])}
    taints = [t for t in node.get("spec", {}).get("taints", []) or [] if t.get("effect") == "NoSchedule"]
    return conds.get("Ready") == "True" and not taints


# --------------------------------------------------------------------------- host facts and snapshots


def host_ip() -> str:
    """The node IP: the source address of the default route (nothing is sent)."""
    out = run(["ip", "-j", "route", "show", "default"]).stdout
    routes = json.loads(out or b"[]")
    dev = routes[0].get("dev") if routes else None
    addrs = json.loads(run(["ip", "-j", "-4", "addr", "show"] + (["dev", dev] if dev else [])).stdout)
    for a in addrs:
        for info in a.get("addr_info", []):
            if info.get("scope") == "global":
                return str(info["local"])
    raise ClusterError("no global IPv4 address for the node IP")


def iptables_chains() -> dict[str, dict[str, list[str]]]:
    """Chains per table for iptables and ip6tables, from *-save."""
    result: dict[str, dict[str, list[str]]] = {}
    for tool in ("iptables", "ip6tables"):
        p = run([f"{tool}-save"], check=False, quiet=True)
        tables: dict[str, list[str]] = {}
        table = None
        for ln in p.stdout.decode(errors="replace").splitlines():
            if ln.startswith("*"):
                table = ln[1:].strip()
                tables[table] = []
            elif ln.startswith(":") and table:
                tables[table].append(ln[1:].split()[0])
        result[tool] = tables
    return result


def ipset_names() -> list[str]:
    """Names of the host's ipsets (none when the ipset tool is missing)."""
    p = run(["ipset", "list", "-n"], check=False, quiet=True)
    return p.stdout.decode(errors="replace").split() if p.returncode == 0 else []


def take_snapshot() -> None:
    """Record what `down` must restore or must not remove: sysctls, chains, ipsets, dirs that pre-existed."""
    sysctls = {}
    for s in [*KUBELET_SYSCTLS, *NETPOL_SYSCTLS]:
        with contextlib.suppress(OSError):
            sysctls[s] = Path("/proc/sys", s).read_text().strip()
    snap = {
        "sysctls": sysctls,
        "chains": iptables_chains(),
        "ipsets": ipset_names(),
        "existed": {str(p): p.exists() for p in CREATED_OUTSIDE_STATE},
    }
    SNAPSHOT.write_text(json.dumps(snap, indent=1))


# --------------------------------------------------------------------------- PKI and configs


def openssl(*args: str) -> None:
    """Run openssl in the PKI dir."""
    run(["openssl", *args], cwd=PKI)


def make_pki(node_ip: str) -> None:
    """A CA, the apiserver's serving cert, the apiserver→kubelet client cert, the SA key and static tokens."""
    PKI.mkdir(parents=True, exist_ok=True)
    os.chmod(PKI, 0o700)
    openssl(
        "req",
        "-x509",
        "-new",
        "-nodes",
        "-newkey",
        "rsa:2048",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "3650",
        "-subj",
        "/CN=orchard-devcluster-ca",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    )

    def leaf(name: str, subj: str, usage: str, san: str | None = None) -> None:
        openssl(
            "req",
            "-new",
            "-nodes",
            "-newkey",
            "rsa:2048",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            subj,
        )
        ext = (
            f"basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage={usage}\n"
        )
        if san:
            ext += f"subjectAltName={san}\n"
        (PKI / f"{name}.ext").write_text(ext)
        openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "3650",
            "-out",
            f"{name}.crt",
            "-extfile",
            f"{name}.ext",
        )

    sans = [
        "DNS:localhost",
        "DNS:kubernetes",
        "DNS:kubernetes.default",
        "DNS:kubernetes.default.svc",
        "DNS:kubernetes.default.svc.cluster.local",
        "IP:127.0.0.1",
        f"IP:{SERVICE_IP}",
        f"IP:{node_ip}",
    ]
    leaf("apiserver", "/CN=kube-apiserver", "serverAuth", ",".join(sans))
    leaf("apiserver-kubelet-client", "/O=system:masters/CN=kube-apiserver-kubelet-client", "clientAuth")
    run(["openssl", "genrsa", "-out", "sa.key", "2048"], cwd=PKI)
    run(["openssl", "rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub"], cwd=PKI)

    users = {
        "admin": ("admin", "system:masters"),
        "kubelet": (f"system:node:{NODE_NAME}", "system:nodes"),
        "scheduler": ("system:kube-scheduler", ""),
        "controller-manager": ("system:kube-controller-manager", ""),
    }
    tokens = {k: secrets.token_hex(24) for k in users}
    (PKI / "tokens.json").write_text(json.dumps(tokens))
    (PKI / "tokens.csv").write_text(
        "".join(f'{tokens[k]},{user},{user},"{groups}"\n' for k, (user, groups) in users.items())
    )


def kubeconfig(token: str) -> str:
    """A kubeconfig (JSON is YAML) for the local apiserver with an embedded CA."""
    import base64

    ca = base64.b64encode((PKI / "ca.crt").read_bytes()).decode()
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "orchard-dev",
                    "cluster": {"server": f"https://127.0.0.1:{APISERVER_PORT}", "certificate-authority-data": ca},
                }
            ],
            "users": [{"name": "orchard-dev", "user": {"token": token}}],
            "contexts": [{"name": "orchard-dev", "context": {"cluster": "orchard-dev", "user": "orchard-dev"}}],
            "current-context": "orchard-dev",
        },
        indent=1,
    )


def write_configs(node_ip: str) -> None:
    """Kubeconfigs, scheduler/kubelet configs, containerd config and the CNI conflist."""
    tokens = _tokens()
    KUBECONFIG.write_text(kubeconfig(tokens["admin"]))
    os.chmod(KUBECONFIG, 0o600)
    for k in ("kubelet", "scheduler", "controller-manager"):
        (PKI / f"{k}.kubeconfig").write_text(kubeconfig(tokens[k]))

    (STATE / "scheduler.json").write_text(
        json.dumps(
            {
                "apiVersion": "kubescheduler.config.k8s.io/v1",
                "kind": "KubeSchedulerConfiguration",
                "clientConnection": {"kubeconfig": str(PKI / "scheduler.kubeconfig"), "qps": 500, "burst": 1000},
                "leaderElection": {"leaderElect": False},
            }
        )
    )

    (STATE / "kubelet.json").write_text(
        json.dumps(
            {
                "apiVersion": "kubelet.config.k8s.io/v1beta1",
                "kind": "KubeletConfiguration",
                "featureGates": {k: v == "true" for k, v in (g.split("=") for g in FEATURE_GATES.split(","))},
                "address": node_ip,
                "port": KUBELET_PORT,
                "readOnlyPort": 0,
                "healthzBindAddress": "127.0.0.1",
                "healthzPort": KUBELET_HEALTHZ_PORT,
                "authentication": {
                    "anonymous": {"enabled": False},
                    "webhook": {"enabled": True},
                    "x509": {"clientCAFile": str(PKI / "ca.crt")},
                },
                "authorization": {"mode": "Webhook"},
                "cgroupDriver": "cgroupfs",
                "containerRuntimeEndpoint": f"unix://{CONTAINERD_SOCK}",
                "failSwapOn": False,
                "maxPods": MAX_PODS,
                "serializeImagePulls": False,
                "kubeAPIQPS": 200,
                "kubeAPIBurst": 400,
                "registryPullQPS": 0,
                "podLogsDir": str(STATE / "pod-logs"),
                "evictionHard": {
                    "memory.available": "100Mi",
                    "nodefs.available": "1%",
                    "nodefs.inodesFree": "1%",
                    "imagefs.available": "1%",
                },
                "imageGCHighThresholdPercent": 99,
                "imageGCLowThresholdPercent": 98,
                "makeIPTablesUtilChains": False,
                "oomScoreAdj": 0,  # no CAP_SYS_RESOURCE here: it could not lower its own score anyway
                "resolvConf": "/etc/resolv.conf",
                "rotateCertificates": False,
                "serverTLSBootstrap": False,
                "containerLogMaxSize": "10Mi",
                "nodeStatusReportFrequency": "1m",
                "volumeStatsAggPeriod": "0s",
            }
        )
    )

    (STATE / "containerd.toml").write_text(f"""version = 2
root = "{CONTAINERD_ROOT}"
state = "{CONTAINERD_STATE}"
disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.snapshotter.v1.aufs",
                    "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.devmapper"]

[grpc]
  address = "{CONTAINERD_SOCK}"

[ttrpc]
  address = "{RUN}/containerd.sock.ttrpc"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  netns_mounts_under_state_dir = true
  enable_unprivileged_ports = false
  # These VMs lack CAP_SYS_RESOURCE: a negative oom_score_adj (-998 for sandboxes) makes runc fail
  # with "can't get final child's PID from pipe"; clamp scores to containerd's own instead.
  restrict_oom_score_adj = true
  max_concurrent_downloads = 3
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{RUNC_ROOT}"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{CNI_CONF_DIR}"
    max_conf_num = 1
""")

    CNI_CONF_DIR.mkdir(parents=True, exist_ok=True)
    CNI_IPAM_DIR.mkdir(parents=True, exist_ok=True)
    (CNI_CONF_DIR / "10-orchard.conflist").write_text(
        json.dumps(
            {
                "cniVersion": "1.0.0",
                "name": CNI_NETWORK,
                "plugins": [
                    {
                        "type": "bridge",
                        "bridge": BRIDGE,
                        "isGateway": True,
                        "ipMasq": POD_EGRESS,
                        "hairpinMode": True,
                        "ipam": {
                            "type": "host-local",
                            "dataDir": str(CNI_IPAM_DIR),
                            "ranges": [[{"subnet": POD_CIDR, "gateway": POD_GATEWAY}]],
                            "routes": [{"dst": "0.0.0.0/0"}],
                        },
                    },
                    # dockerd sets the FORWARD policy to DROP; this plugin accepts the pods' traffic.
                    {"type": "firewall", "backend": "iptables"},
                ],
            },
            indent=1,
        )
    )


# --------------------------------------------------------------------------- images


def _tar_image(
    ref: str, files: dict[str, bytes | tuple[str, str] | None], cmd: list[str], env: list[str] | None = None
) -> bytes:
    """A docker-archive (`docker save` format) of one layer.

    `files` maps paths to bytes (a file; executable under /bin), ("symlink", target), or None (a directory).
    """
    layer_buf = io.BytesIO()
    with tarfile.open(fileobj=layer_buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for path in sorted(files):
            spec = files[path]
            ti = tarfile.TarInfo(path.lstrip("/"))
            ti.mtime = 0
            if spec is None:
                ti.type, ti.mode = tarfile.DIRTYPE, 0o1777 if path == "/tmp" else 0o755
                t.addfile(ti)
            elif isinstance(spec, tuple):
                ti.type, ti.linkname, ti.mode = tarfile.SYMTYPE, spec[1], 0o777
                t.addfile(ti)
            else:
                executable = path.startswith("/bin/") or path == "/pause"
                ti.size, ti.mode = len(spec), 0o755 if executable else 0o644
                t.addfile(ti, io.BytesIO(spec))
    layer = layer_buf.getvalue()
    layer_id = hashlib.sha256(layer).hexdigest()
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "created": "1970-01-01T00:00:00Z",
            "config": {
                "Cmd": cmd,
                "WorkingDir": "/",
                "Env": env or ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
            },
            "rootfs": {"type": "layers", "diff_ids": [f"sha256:{layer_id}"]},
            "history": [{"created": "1970-01-01T00:00:00Z", "created_by": "orchard hack/devcluster"}],
        }
    ).encode()
    config_id = hashlib.sha256(config).hexdigest()
    manifest = json.dumps([{"Config": f"{config_id}.json", "RepoTags": [ref], "Layers": [f"{layer_id}/layer.tar"]}])
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as t:
        for name, data in (
            (f"{layer_id}/layer.tar", layer),
            (f"{config_id}.json", config),
            ("manifest.json", manifest.encode()),
        ):
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode, ti.mtime = len(data), 0o644, 0
            t.addfile(ti, io.BytesIO(data))
    return out.getvalue()


def ctr(
    *args: str, input: bytes | None = None, check: bool = True, quiet: bool = False
) -> subprocess.CompletedProcess[bytes]:
    """Run ctr against the cluster's private containerd, namespace k8s.io."""
    own = containerd_dir() / "ctr"  # Debian's (docker.io's dependency) only to tear down a cluster built before
    cmd = [str(own) if own.exists() else "ctr", "--address", str(CONTAINERD_SOCK), "--namespace", "k8s.io", *args]
    return run(cmd, input=input, check=check, quiet=quiet)


def import_archive(data: bytes, what: str) -> None:
    """Import a docker-archive into containerd's k8s.io namespace."""
    with tempfile.NamedTemporaryFile(dir=STATE, suffix=".tar") as f:
        f.write(data)
        f.flush()
        ctr("images", "import", f.name)
    log(f"imported {what}")


def build_local_images() -> None:
    """The pause image (Go pause) and the busybox httpd test image, made without docker."""
    pause = (bin_dir() / "pause").read_bytes()
    import_archive(_tar_image(PAUSE_IMAGE, {"/pause": pause}, ["/pause"]), PAUSE_IMAGE)

    busybox = Path("/bin/busybox").read_bytes()
    files: dict[str, bytes | tuple[str, str] | None] = {
        "/bin": None,
        "/tmp": None,
        "/www": None,
        "/etc": None,
        "/root": None,
        "/bin/busybox": busybox,
        "/etc/passwd": b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n",
        "/etc/group": b"root:x:0:\nnogroup:x:65534:\n",
        "/www/index.html": b"orchard devcluster httpd\n",
    }
    applets = run(["/bin/busybox", "--list"]).stdout.decode().split()
    for a in applets:
        if a != "busybox":
            files[f"/bin/{a}"] = ("symlink", "busybox")
    archive = _tar_image(HTTPD_IMAGE, files, ["/bin/httpd", "-f", "-v", "-p", "8080", "-h", "/www"])
    import_archive(archive, HTTPD_IMAGE)


def docker_setup_images() -> None:
    """Run scripts/docker-setup.sh (owned by the docker backend) and import the images it built."""
    script = REPO / "scripts" / "docker-setup.sh"
    if not script.exists():
        log(f"{script.relative_to(REPO)} not present: skipping the injector and task images")
        return
    log(f"running {script.relative_to(REPO)} for the injector and task images")
    p = subprocess.run(["bash", str(script)], cwd=REPO, env=ENV, capture_output=True)
    (LOGS / "docker-setup.log").write_bytes(p.stdout + p.stderr)
    if p.returncode != 0:
        raise ClusterError(f"{script} failed ({p.returncode})", "docker-setup")
    refs = docker_setup_refs()
    if not refs:
        raise ClusterError(f"{script} ran but docker has none of the orchard images to import", "docker-setup")
    # One archive: the layers the images share are saved and imported once.
    with tempfile.NamedTemporaryFile(dir=STATE, suffix=".tar") as f:
        save = subprocess.run([DOCKER, "save", *refs], env=ENV, stdout=f, stderr=subprocess.PIPE)
        if save.returncode != 0:
            raise ClusterError(f"docker save {' '.join(refs)} failed: {save.stderr.decode(errors='replace')[-2000:]}")
        ctr("images", "import", f.name)
    log(f"imported {' '.join(refs)}")


def docker_setup_refs() -> list[str]:
    """The images to import: $ORCHARD_DEVCLUSTER_IMAGES if set, else the injector and test task images."""
    if os.environ.get("ORCHARD_DEVCLUSTER_IMAGES"):
        return os.environ["ORCHARD_DEVCLUSTER_IMAGES"].split()
    p = run([DOCKER, "images", "--format", "{{.Repository}}:{{.Tag}}"], check=False)
    return sorted({r for r in p.stdout.decode().split() if r.startswith(DOCKER_IMAGE_PREFIXES) and ":<none>" not in r})


# --------------------------------------------------------------------------- up


def up(skip_docker_images: bool = False) -> None:
    """Bring the whole cluster up and wait until the node is Ready."""
    with locked(CLUSTER_LOCK):
        _up(skip_docker_images)


def ports_in_use() -> list[str]:
    """The cluster's ports some other process already listens on (from /proc/net/tcp*)."""
    listening: set[int] = set()
    for f in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for ln in Path(f).read_text().splitlines()[1:]:
                parts = ln.split()
                if parts[3] == "0A":  # LISTEN
                    listening.add(int(parts[1].rsplit(":", 1)[1], 16))
    return [f"{port} ({name})" for port, name in sorted(PORTS.items()) if port in listening]


def block_pod_egress() -> None:
    """Drop forwarded traffic from pods to anywhere but other pods, in the mangle table's FORWARD chain.

    Mangle runs before filter, where kube-router ACCEPTs what NetworkPolicy allows (an egress rule to
    0.0.0.0/0 included) ahead of every other FORWARD rule. Host to pod and pod to host traffic is not
    forwarded; NetworkPolicy alone decides it.
    """
    if POD_EGRESS:
        return
    rule = ["-s", POD_CIDR, "!", "-d", POD_CIDR, "-m", "comment", "--comment", f"{CNI_NETWORK}: no pod egress"]
    ipt = ["iptables", "-w", "5", "-t", "mangle"]
    if run([*ipt, "-C", "FORWARD", *rule, "-j", "DROP"], check=False, quiet=True).returncode:
        run([*ipt, "-I", "FORWARD", "1", *rule, "-j", "DROP"])


def enable_bridge_netfilter() -> None:
    """Make bridged pod-to-pod traffic pass iptables, where the NetworkPolicy agent filters it."""
    if not Path("/proc/sys/net/bridge").is_dir():
        run(["modprobe", "br_netfilter"], check=False)
    for s in NETPOL_SYSCTLS:
        try:
            Path("/proc/sys", s).write_text("1\n")
        except OSError as e:
            raise ClusterError(f"cannot set {s} (br_netfilter): {e}; NetworkPolicy between pods needs it") from e


def netpol_synced() -> bool:
    """Whether kube-router has made its first full sync: FORWARD jumps to its chain, which ends in its ACCEPT."""
    rules = run(["iptables-save", "-t", "filter"], quiet=True).stdout.decode(errors="replace").splitlines()
    jumps = any(r.startswith("-A FORWARD ") and r.endswith("-j KUBE-ROUTER-FORWARD") for r in rules)
    accepts = any(r.startswith("-A KUBE-ROUTER-FORWARD ") and "0x20000/0x20000 -j ACCEPT" in r for r in rules)
    return jumps and accepts


def start_netpol_agent() -> None:
    """Start kube-router's NetworkPolicy controller alone (no routing, no service proxy) and wait for its sync."""
    enable_bridge_netfilter()
    start(
        NETPOL_AGENT,
        [
            str(kube_router_binary()),
            f"--kubeconfig={KUBECONFIG}",  # admin's: a test fixture; it reads nodes, pods, namespaces, policies
            f"--hostname-override={NODE_NAME}",
            "--run-firewall=true",
            "--run-router=false",
            "--run-service-proxy=false",
            "--enable-cni=false",
            "--health-port=0",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--v=0",  # at 1 it logs a dozen lines per sync, and it syncs on every pod change
        ],
    )
    wait_for("kube-router's first NetworkPolicy sync", netpol_synced, 60, NETPOL_AGENT, interval=0.5)


def _up(skip_docker_images: bool) -> None:
    if healthy([c for c in COMPONENTS if c != NETPOL_AGENT]):
        log("cluster already up and Ready")
        if not alive(NETPOL_AGENT):  # it died, or the cluster predates it: start it alone
            install_packages()
            build_kube_router()
            block_pod_egress()
            start_netpol_agent()
        if not skip_docker_images:
            docker_setup_images()  # picks up rebuilt injector/task images
        return
    if STATE.exists() or RUN.exists() or TRACK_CGROUP.exists():
        log("found state of a previous cluster: tearing it down first")
        _down()
    busy = ports_in_use()
    if busy:
        raise ClusterError(f"ports already in use by other processes: {', '.join(busy)}")
    install_packages()
    build()
    build_etcd()
    build_kube_router()
    build_containerd()
    bins = bin_dir()

    for d in (STATE, RUN, LOGS, PIDS):
        d.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):  # without a pids hierarchy, down still stops components by pid
        TRACK_CGROUP.mkdir(exist_ok=True)
    take_snapshot()
    block_pod_egress()
    node_ip = host_ip()
    make_pki(node_ip)
    write_configs(node_ip)

    start(
        "etcd",
        [
            str(etcd_binary()),
            "--name",
            "orchard-dev",
            "--data-dir",
            str(STATE / "etcd"),
            "--listen-client-urls",
            f"http://127.0.0.1:{ETCD_CLIENT_PORT}",
            "--advertise-client-urls",
            f"http://127.0.0.1:{ETCD_CLIENT_PORT}",
            "--listen-peer-urls",
            f"http://127.0.0.1:{ETCD_PEER_PORT}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{ETCD_PEER_PORT}",
            "--initial-cluster",
            f"orchard-dev=http://127.0.0.1:{ETCD_PEER_PORT}",
            "--listen-metrics-urls",
            "",
            "--quota-backend-bytes",
            str(8 * 1024**3),
            "--snapshot-count",
            "50000",
            "--log-level",
            "warn",
        ],
    )
    wait_for("etcd health", lambda: http_ok(f"http://127.0.0.1:{ETCD_CLIENT_PORT}/health"), 60, "etcd")

    start(
        "kube-apiserver",
        [
            str(bins / "kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{ETCD_CLIENT_PORT}",
            "--bind-address=127.0.0.1",
            f"--secure-port={APISERVER_PORT}",
            f"--advertise-address={node_ip}",
            f"--cert-dir={PKI}",
            f"--tls-cert-file={PKI / 'apiserver.crt'}",
            f"--tls-private-key-file={PKI / 'apiserver.key'}",
            f"--client-ca-file={PKI / 'ca.crt'}",
            f"--token-auth-file={PKI / 'tokens.csv'}",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={PKI / 'sa.pub'}",
            f"--service-account-signing-key-file={PKI / 'sa.key'}",
            f"--kubelet-client-certificate={PKI / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={PKI / 'apiserver-kubelet-client.key'}",
            "--kubelet-preferred-address-types=InternalIP",
            "--allow-privileged=true",
            "--profiling=false",
            "--event-ttl=1h",
            "--max-requests-inflight=1000",
            "--max-mutating-requests-inflight=500",
            "--endpoint-reconciler-type=none",
            f"--feature-gates={FEATURE_GATES}",
            "--v=1",
        ],
    )
    wait_for("kube-apiserver /readyz", apiserver_ready, 120, "kube-apiserver", interval=0.5)

    start(
        "kube-controller-manager",
        [
            str(bins / "kube-controller-manager"),
            f"--kubeconfig={PKI / 'controller-manager.kubeconfig'}",
            f"--authentication-kubeconfig={PKI / 'controller-manager.kubeconfig'}",
            f"--authorization-kubeconfig={PKI / 'controller-manager.kubeconfig'}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={PKI / 'sa.key'}",
            f"--root-ca-file={PKI / 'ca.crt'}",
            f"--cluster-signing-cert-file={PKI / 'ca.crt'}",
            f"--cluster-signing-key-file={PKI / 'ca.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--kube-api-qps=200",
            "--kube-api-burst=400",
            "--concurrent-gc-syncs=50",
            "--v=1",
        ],
    )
    start(
        "kube-scheduler",
        [
            str(bins / "kube-scheduler"),
            f"--config={STATE / 'scheduler.json'}",
            f"--authentication-kubeconfig={PKI / 'scheduler.kubeconfig'}",
            f"--authorization-kubeconfig={PKI / 'scheduler.kubeconfig'}",
            "--bind-address=127.0.0.1",
            "--v=1",
        ],
    )

    # The shim beside it first on PATH: containerd starts `containerd-shim-runc-v2` by name.
    containerd_env = dict(COMPONENT_ENV, PATH=f"{containerd_dir()}:{COMPONENT_ENV['PATH']}")
    containerd_cmd = [str(containerd_dir() / "containerd"), "--config", str(STATE / "containerd.toml")]
    start("containerd", [*containerd_cmd, "--log-level", "warn"], env=containerd_env)
    wait_for("containerd socket", lambda: ctr("version", check=False, quiet=True).returncode == 0, 60, "containerd")
    build_local_images()

    start(
        "kubelet",
        [
            str(bins / "kubelet"),
            f"--config={STATE / 'kubelet.json'}",
            f"--kubeconfig={PKI / 'kubelet.kubeconfig'}",
            f"--root-dir={KUBELET_ROOT}",
            f"--cert-dir={KUBELET_ROOT / 'pki'}",
            f"--hostname-override={NODE_NAME}",
            f"--node-ip={node_ip}",
            "--v=1",
        ],
    )
    wait_for(f"node {NODE_NAME} Ready", node_ready, 180, "kubelet", interval=1)
    wait_for(
        "default service account",
        lambda: api("/api/v1/namespaces/default/serviceaccounts/default"),
        120,
        "kube-controller-manager",
        interval=0.5,
    )
    start_netpol_agent()  # it reads the node's address from the API, so after the node registered
    for name in COMPONENTS:
        if not alive(name):
            raise ClusterError(f"{name} exited", name)
    if not skip_docker_images:
        docker_setup_images()
    log(f"cluster up: node {NODE_NAME} Ready; export KUBECONFIG={KUBECONFIG}")


# --------------------------------------------------------------------------- down


def mounts_under(*roots: Path) -> list[str]:
    """Mount points below the given dirs, deepest first."""
    found = []
    for ln in Path("/proc/self/mountinfo").read_text().splitlines():
        mp = ln.split()[4].encode().decode("unicode_escape")
        if any(mp == str(r) or mp.startswith(str(r) + "/") for r in roots):
            found.append(mp)
    return sorted(set(found), key=lambda m: (-m.count("/"), m))


def delete_all_pods() -> None:
    """Force-delete every pod so the kubelet tears down sandboxes (CNI DEL) while it still runs."""
    try:
        pods = api("/api/v1/pods?limit=5000", timeout=10).get("items", [])
    except Exception:  # noqa: BLE001 - the apiserver may be gone already
        return
    if not pods:
        return
    log(f"deleting {len(pods)} pods")
    for p in pods:
        md = p["metadata"]
        with contextlib.suppress(Exception):
            api(
                f"/api/v1/namespaces/{md['namespace']}/pods/{md['name']}",
                method="DELETE",
                body={"gracePeriodSeconds": 0},
                timeout=10,
            )


def running_sandboxes() -> int:
    """How many containerd tasks still run (sandboxes and containers)."""
    p = ctr("tasks", "ls", check=False, quiet=True)
    return sum(1 for ln in p.stdout.decode().splitlines()[1:] if "RUNNING" in ln)


def sandbox_ids() -> list[str]:
    """Ids of the pod sandboxes containerd's CRI plugin knows (running or not)."""
    d = CONTAINERD_ROOT / "io.containerd.grpc.v1.cri" / "sandboxes"
    return [p.name for p in d.iterdir()] if d.is_dir() else []


def _shim_bundles() -> list[Path]:
    base = CONTAINERD_STATE / "io.containerd.runtime.v2.task"
    return [d for d in base.glob("*/*") if d.is_dir()] if base.exists() else []


def kill_containers() -> None:
    """SIGKILL the pods' processes (init pids from the task bundles, checked to be in kubepods)."""
    for b in _shim_bundles():
        with contextlib.suppress(OSError, ValueError):
            pid = int((b / "init.pid").read_text())
            if "kubepods" in Path(f"/proc/{pid}/cgroup").read_text():
                os.kill(pid, signal.SIGKILL)


def tracked_pids() -> list[int]:
    """Pids in the tracking cgroup: what we started and its descendants (the shims outlive containerd)."""
    try:
        return [int(x) for x in (TRACK_CGROUP / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def kill_tracked() -> None:
    """SIGKILL whatever is left in the tracking cgroup (containerd shims), then remove it."""
    for _ in range(50):
        pids = tracked_pids()
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    with contextlib.suppress(OSError):
        TRACK_CGROUP.rmdir()


def _enter_tracking_cgroup() -> None:
    with contextlib.suppress(OSError):
        (TRACK_CGROUP / "cgroup.procs").write_text("0\n")


def remove_cgroups() -> None:
    """Remove the kubelet's cgroup tree in every v1 hierarchy (and the unified one)."""
    for hier in Path("/sys/fs/cgroup").iterdir():
        root = hier / "kubepods"
        if not root.is_dir():
            continue
        dirs = sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
        for d in [*dirs, root]:
            with contextlib.suppress(OSError):
                d.rmdir()


def cleanup_iptables(snap: dict) -> None:  # type: ignore[type-arg]
    """Remove the CNI-/KUBE- chains that appeared with the cluster and every rule that jumps to them.

    Also drops leftover per-pod rules for our pod CIDR in pre-existing CNI- chains. Without a snapshot
    (`up` died before taking it) only those rules go: no chain is known to be ours.
    """
    have_snapshot = "chains" in snap
    before = snap.get("chains", {})
    pod_prefix = POD_CIDR.split("0.0/")[0]
    for tool in ("iptables", "ip6tables"):
        p = run([f"{tool}-save"], check=False, quiet=True)
        table = None
        rules: dict[str, list[tuple[str, list[str]]]] = {}
        chains: dict[str, set[str]] = {}
        for ln in p.stdout.decode(errors="replace").splitlines():
            if ln.startswith("*"):
                table = ln[1:].strip()
                rules[table], chains[table] = [], set()
            elif ln.startswith(":") and table:
                chains[table].add(ln[1:].split()[0])
            elif ln.startswith("-A ") and table:
                args = shlex.split(ln)
                rules[table].append((args[1], args[2:]))
        for table, tchains in chains.items():
            old = set(before.get(tool, {}).get(table, []))
            ours = {c for c in tchains - old if c.startswith(OWNED_CHAIN_PREFIXES)} if have_snapshot else set()
            for chain, spec in rules[table]:
                target = None
                for flag in ("-j", "-g"):
                    if flag in spec:
                        target = spec[spec.index(flag) + 1]
                mine = target in ours or chain in ours
                ours_pod = chain.startswith("CNI-") and any(a.startswith(pod_prefix) for a in spec)
                named = any(CNI_NETWORK in a for a in spec)
                if (mine and chain not in ours) or ours_pod or named:
                    run([tool, "-w", "5", "-t", table, "-D", chain, *spec], check=False)
            for c in ours:
                run([tool, "-w", "5", "-t", table, "-F", c], check=False)
            for c in ours:
                run([tool, "-w", "5", "-t", table, "-X", c], check=False)


def flush_netpol_agent(snap: dict) -> None:  # type: ignore[type-arg]
    """Remove kube-router's filter chains, the rules jumping to them and its ipsets; keep what predates `up`.

    Its chains REJECT what policy denies, so they must go with the agent, also when `up` left no snapshot.
    """
    before = set(snap.get("chains", {}).get("iptables", {}).get("filter", []))
    lines = run(["iptables-save", "-t", "filter"], check=False, quiet=True).stdout.decode(errors="replace").splitlines()
    chains = {ln[1:].split()[0] for ln in lines if ln.startswith(":")}
    ours = {c for c in chains - before if c.startswith(NETPOL_CHAIN_PREFIXES)}
    for ln in lines:
        if ln.startswith("-A "):
            args = shlex.split(ln)
            chain, spec = args[1], args[2:]
            if chain not in ours and "-j" in spec and spec[spec.index("-j") + 1] in ours:
                run(["iptables", "-w", "5", "-t", "filter", "-D", chain, *spec], check=False)
    for flag in ("-F", "-X"):
        for c in ours:
            run(["iptables", "-w", "5", "-t", "filter", flag, c], check=False)
    kept = set(snap.get("ipsets", []))
    prefixes = (*NETPOL_IPSET_PREFIXES, "TMP-") if "ipsets" in snap else NETPOL_IPSET_PREFIXES
    for name in ipset_names():
        if name.startswith(prefixes) and name not in kept:
            run(["ipset", "destroy", name], check=False)


def down(keep_logs: str | None = None) -> None:
    """Tear the cluster down completely; optionally copy the component logs out first."""
    with locked(CLUSTER_LOCK):
        _down(keep_logs)


def _down(keep_logs: str | None = None) -> None:
    if not STATE.exists() and not RUN.exists() and not TRACK_CGROUP.exists():
        log("no cluster state: nothing to do")
        return
    snap = json.loads(SNAPSHOT.read_text()) if SNAPSHOT.exists() else {}
    # 1. Let the kubelet tear pod networks down through CNI while everything still runs.
    if alive("kube-apiserver") and alive("kubelet") and alive("containerd"):
        delete_all_pods()
        t0 = time.monotonic()
        while (n := running_sandboxes()) > 0 and time.monotonic() < t0 + 60:
            time.sleep(0.5)
        if time.monotonic() - t0 > 1:
            log(f"waited {time.monotonic() - t0:.0f}s for the kubelet to stop the pods ({n} tasks left)")
    sandboxes = sandbox_ids()
    # 2. Stop the components, kubelet first.
    for name in reversed(COMPONENTS):
        if name == "containerd":
            kill_containers()
            time.sleep(0.3)
        stop(name, timeout=20)
    kill_containers()
    kill_tracked()
    # 3. Unmount, remove cgroups, bridge, CNI cache, iptables chains; restore sysctls.
    for mp in mounts_under(STATE, RUN):
        if run(["umount", mp], check=False, quiet=True).returncode != 0:
            run(["umount", "-l", mp], check=False)
    remove_cgroups()
    if Path(f"/sys/class/net/{BRIDGE}").exists():
        run(["ip", "link", "del", BRIDGE], check=False)
    if CNI_CACHE_RESULTS.is_dir():  # libcni's cached results: <network>-<sandbox id>-<ifname>
        for f in CNI_CACHE_RESULTS.iterdir():
            if f.name.startswith(f"{CNI_NETWORK}-") or any(f"-{sid}-" in f.name for sid in sandboxes):
                f.unlink(missing_ok=True)
    existed = snap.get("existed", {})
    if CONTAINER_LOG_LINKS.is_dir():
        for link in CONTAINER_LOG_LINKS.iterdir():
            with contextlib.suppress(OSError):
                if link.is_symlink() and os.readlink(link).startswith(str(STATE)):
                    link.unlink()
    if KUBELET_DEVICE_PLUGINS.is_dir() and existed.get(str(KUBELET_DEVICE_PLUGINS)) is False:
        for f in KUBELET_DEVICE_PLUGINS.iterdir():  # kubelet.sock and its checkpoint
            with contextlib.suppress(OSError):
                f.unlink()
    for p in CREATED_OUTSIDE_STATE:
        if existed.get(str(p)) is False:
            with contextlib.suppress(OSError):
                p.rmdir()  # only if empty: never remove what someone else put there meanwhile
    flush_netpol_agent(snap)
    cleanup_iptables(snap)
    for key, value in snap.get("sysctls", {}).items():
        with contextlib.suppress(OSError):
            Path("/proc/sys", key).write_text(value + "\n")
    # 4. Remove the state, refusing to descend into anything still mounted.
    if keep_logs and LOGS.is_dir():
        shutil.copytree(LOGS, keep_logs, dirs_exist_ok=True)
        log(f"component logs copied to {keep_logs}")
    left = mounts_under(STATE, RUN)
    if left:
        raise ClusterError(f"still mounted, not removing state: {left[:5]}")
    for d in (STATE, RUN):
        shutil.rmtree(d, ignore_errors=True)
    log("cluster down")


# --------------------------------------------------------------------------- status / env


def healthy(components: list[str] = COMPONENTS) -> bool:
    """Every component runs, the apiserver is ready and the node is Ready."""
    if not all(alive(c) for c in components):
        return False
    try:
        return apiserver_ready() and node_ready()
    except Exception:  # noqa: BLE001
        return False


def status() -> int:
    """Print component and node state; 0 when healthy."""
    if not STATE.exists():
        print("cluster: down")
        return 1
    for c in COMPONENTS:
        pid = pid_of(c)
        print(f"{c:26s} {'running pid ' + str(pid) if pid else 'NOT RUNNING'}")
    ok = healthy()
    print(f"node {NODE_NAME}: {'Ready' if ok else 'NOT Ready'}")
    print(f"kubeconfig: {KUBECONFIG}")
    return 0 if ok else 1


def env() -> None:
    """Shell exports for using the cluster (eval "$(hack/devcluster/devcluster env)")."""
    print(f"export KUBECONFIG={shlex.quote(str(KUBECONFIG))}")
    print(f'export PATH={shlex.quote(str(bin_dir()))}:"$PATH"')
    print(f"export ORCHARD_DEVCLUSTER_NODE={NODE_NAME}")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    ap = argparse.ArgumentParser(prog="devcluster", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up", help="install, build, start and wait for a Ready node")
    p_up.add_argument(
        "--skip-docker-images", action="store_true", help="do not run scripts/docker-setup.sh nor import its images"
    )
    p_down = sub.add_parser("down", help="stop everything and undo every change")
    p_down.add_argument("--keep-logs", metavar="DIR", help="copy the component logs to DIR before removing them")
    sub.add_parser("status", help="component and node state (exit 1 unless healthy)")
    sub.add_parser("env", help="shell exports for KUBECONFIG and kubectl")
    p_build = sub.add_parser("build", help="only build the Kubernetes, etcd and kube-router binaries into the cache")
    p_build.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)
    if args.cmd in ("up", "down", "build") and os.geteuid() != 0:
        print("devcluster: must run as root", file=sys.stderr)
        return 2
    try:
        if args.cmd == "up":
            up(args.skip_docker_images)
        elif args.cmd == "down":
            down(args.keep_logs)
        elif args.cmd == "status":
            return status()
        elif args.cmd == "env":
            env()
        elif args.cmd == "build":
            install_packages()
            build(args.force)
            build_etcd()
            build_kube_router()
            build_containerd()
    except ClusterError as e:
        print(f"devcluster {args.cmd} FAILED: {e}", file=sys.stderr)
        if e.component:
            logf = LOGS / f"{e.component}.log"
            print(f"--- last lines of {logf} ---\n{tail(logf)}\n---", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
