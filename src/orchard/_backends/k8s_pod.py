"""The pod a sandbox runs as: a pure manifest builder and the pod status it reads.

Nothing here does I/O; ``pod_manifest`` is a function of the sandbox spec and
is unit-tested without a cluster. ``classify`` turns a pod's status, as the
shared watch sees it, into what the client needs: still starting, running at
an IP, or failed with a reason.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from .. import _tools
from .._spec import SandboxSpec, quantity_bytes
from .._tls import ENV as TLS_ENV

MANAGED_BY = "app.kubernetes.io/managed-by"
SANDBOX_LABEL = "orchard.dev/sandbox"
SESSION_LABEL = "orchard.dev/session"
IMAGE_ANNOTATION = "orchard.dev/image"
EXPIRES_ANNOTATION = "orchard.dev/expires-at"
NETWORK_LABEL = "orchard.dev/network"
CONTAINER = "sandbox"
INIT_CONTAINER = "orchard-inject"
BUNDLE_VOLUME = "orchard-runtime"
TOOLS_CONTAINER = "orchard-tools"
TOOLS_VOLUME = "orchard-tools"
#: The tmpfs at /dev/shm when the spec sets shm.
SHM_VOLUME = "orchard-shm"
#: Label an in-cluster client pod carries to reach sandbox executors once
#: ``orchard k8s setup`` has written the NetworkPolicies (value "true").
CLIENT_LABEL = "orchard.dev/client"

#: Capabilities a root sandbox container keeps (every other one is dropped):
#: what package managers, build tools and test suites of typical root task
#: images use to own, chmod and write files of other users, switch to an
#: unprivileged user, signal their own processes and bind ports below 1024.
#: Dropped from the runtime's defaults: NET_RAW (raw sockets, ARP/ICMP spoofing),
#: MKNOD (device nodes), SYS_CHROOT, SETPCAP, SETFCAP, AUDIT_WRITE. All of these
#: are in Pod Security "baseline"; ``KubernetesConfig.cap_add`` adds more.
DEFAULT_CAPABILITIES = ("CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID", "NET_BIND_SERVICE")
#: The uid and gid the injector init container runs as (no image user needed:
#: the emptyDir it fills is world-writable, 0777, as the kubelet creates it).
INJECTOR_UID = 65532
#: Link-local (cloud metadata services, 169.254.169.254, and their kin) and
#: AWS's IPv6 metadata address: never a destination of ``network=True`` egress
#: unless ``orchard k8s setup --allow-metadata``.
METADATA_CIDRS = ("169.254.0.0/16", "fd00:ec2::254/128")
PSA = "pod-security.kubernetes.io"

#: Waiting reasons that will not resolve by themselves: fail the start now.
FATAL_WAITING = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "ErrImageNeverPull",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
        "CrashLoopBackOff",
        "PreCreateHookError",
        "PreStartHookError",
    }
)


# -- What the watch decodes (only the fields used; msgspec skips the rest) --


class _Meta(msgspec.Struct, rename="camel", frozen=True):
    name: str = ""
    uid: str = ""
    resource_version: str = ""
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}
    deletion_timestamp: str | None = None
    creation_timestamp: str | None = None


class _Condition(msgspec.Struct, rename="camel", frozen=True):
    type: str = ""
    status: str = ""
    reason: str | None = None
    message: str | None = None


class _Waiting(msgspec.Struct, frozen=True):
    reason: str | None = None
    message: str | None = None


class _Terminated(msgspec.Struct, rename="camel", frozen=True):
    exit_code: int = 0
    reason: str | None = None
    message: str | None = None
    signal: int | None = None


class _Running(msgspec.Struct, rename="camel", frozen=True):
    started_at: str | None = None


class _State(msgspec.Struct, frozen=True):
    waiting: _Waiting | None = None
    running: _Running | None = None
    terminated: _Terminated | None = None


class _ContainerStatus(msgspec.Struct, rename="camel", frozen=True):
    name: str = ""
    ready: bool = False
    state: _State = _State()
    last_state: _State = _State()


class _Status(msgspec.Struct, rename="camel", frozen=True):
    phase: str = "Pending"
    reason: str | None = None
    message: str | None = None
    pod_ip: str | None = msgspec.field(default=None, name="podIP")
    conditions: list[_Condition] = []
    init_container_statuses: list[_ContainerStatus] = []
    container_statuses: list[_ContainerStatus] = []


class _PodSpec(msgspec.Struct, rename="camel", frozen=True):
    node_name: str | None = None


class Pod(msgspec.Struct, frozen=True):
    """A pod, as much of it as the client reads."""

    metadata: _Meta = _Meta()
    spec: _PodSpec = _PodSpec()
    status: _Status = _Status()


class WatchEvent(msgspec.Struct):
    """One line of a watch stream."""

    type: str
    object: msgspec.Raw


class PodList(msgspec.Struct):
    """A LIST response."""

    metadata: _Meta
    items: list[Pod]


class _LeaseSpec(msgspec.Struct, rename="camel", frozen=True):
    holder_identity: str | None = None
    renew_time: str | None = None
    lease_duration_seconds: int = 0


class Lease(msgspec.Struct, frozen=True):
    """A client session's Lease, as much of it as gc reads."""

    metadata: _Meta = _Meta()
    spec: _LeaseSpec = _LeaseSpec()

    def alive(self, now: float) -> bool:
        """Whether the session renewed it recently enough."""
        if not self.spec.renew_time:
            return False
        renewed = datetime.datetime.fromisoformat(self.spec.renew_time).timestamp()
        return renewed + self.spec.lease_duration_seconds >= now


class LeaseList(msgspec.Struct):
    """A LIST of Leases."""

    items: list[Lease]


def garbage_reason(pod: Pod, now: float, live_sessions: set[str]) -> str | None:
    """Why ``orchard gc`` should delete this sandbox pod, or None to keep it."""
    if pod.status.phase in ("Succeeded", "Failed"):
        return "finished"
    expires = pod.metadata.annotations.get(EXPIRES_ANNOTATION)
    if expires is not None and float(expires) < now:
        return "expired"
    if pod.metadata.labels.get(SESSION_LABEL) not in live_sessions:
        return "orphaned"
    return None


# -- Reading a pod's state --


class Phase(msgspec.Struct, frozen=True):
    """Where a sandbox pod stands, for the client."""

    #: "pending", "running" (the container runs and has an IP) or "failed".
    state: str
    reason: str = ""
    message: str = ""
    pod_ip: str | None = msgspec.field(default=None, name="podIP")
    scheduled: bool = False
    initialized: bool = False


def _condition(pod: Pod, kind: str) -> _Condition | None:
    for c in pod.status.conditions:
        if c.type == kind:
            return c
    return None


def _ended(t: Any) -> tuple[str, str]:
    """The reason and message of a sandbox container that ended (a V1ContainerStateTerminated)."""
    if t.reason:
        return t.reason, t.message or f"the sandbox container ended ({t.reason}, exit code {t.exit_code})"
    return f"exit code {t.exit_code}", t.message or f"the sandbox container ended (exit code {t.exit_code})"


def classify(pod: Pod) -> Phase:
    """Read a pod's status: pending, running at an IP, or failed and why."""
    status = pod.status
    scheduled_c = _condition(pod, "PodScheduled")
    initialized_c = _condition(pod, "Initialized")
    scheduled = bool(pod.spec.node_name) or (scheduled_c is not None and scheduled_c.status == "True")
    initialized = initialized_c is not None and initialized_c.status == "True"

    def failed(reason: str, message: str) -> Phase:
        return Phase("failed", reason, message, status.pod_ip, scheduled, initialized)

    if pod.metadata.deletion_timestamp:
        disruption = _condition(pod, "DisruptionTarget")
        if disruption is not None and disruption.status == "True":
            # Evicted by the Eviction API, by node pressure or preempted: not deleted by its owner.
            return failed("Evicted", f"{disruption.reason}: {disruption.message or 'the pod was evicted'}")
        return failed("Deleted", "the pod is being deleted")
    if status.phase in ("Failed", "Succeeded"):
        if status.reason:  # the pod's own reason (Evicted, DeadlineExceeded) says more than its container's
            return failed(status.reason, status.message or f"the pod is {status.phase}")
        for cs in status.container_statuses:
            t = cs.state.terminated
            if t is not None:
                return failed(*_ended(t))
        return failed(status.reason or status.phase, status.message or f"the pod is {status.phase}")
    if scheduled_c is not None and scheduled_c.status == "False" and scheduled_c.reason == "Unschedulable":
        return failed("Unschedulable", scheduled_c.message or "no node can run this pod")
    for cs in status.init_container_statuses:
        w, t = cs.state.waiting, cs.state.terminated
        which = "tools init container (tools=[...])" if cs.name == TOOLS_CONTAINER else "injector init container"
        if w is not None and w.reason in FATAL_WAITING:
            return failed(w.reason or "", f"{which}: {w.message or w.reason}")
        if t is not None and t.exit_code != 0:
            said = t.message or t.reason
            return failed("InitFailed", f"{which} exited {t.exit_code}" + (f": {said}" if said else ""))
    for cs in status.container_statuses:
        w, t = cs.state.waiting, cs.state.terminated
        if w is not None and w.reason in FATAL_WAITING:
            return failed(w.reason or "", w.message or w.reason or "")
        if t is not None:
            return failed(*_ended(t))
        if cs.state.running is not None and status.pod_ip:
            return Phase("running", pod_ip=status.pod_ip, scheduled=scheduled, initialized=initialized)
    return Phase("pending", scheduled=scheduled, initialized=initialized)


# -- Building the manifest --


def _quantity(value: str | float) -> str:
    return value if isinstance(value, str) else f"{value:g}"


def _task_security(run_as_user: int | None, cap_add: Sequence[str]) -> dict[str, Any]:
    """The sandbox container's securityContext: root with a few capabilities, or a non-root uid with none."""
    ctx: dict[str, Any] = {"allowPrivilegeEscalation": False}
    if run_as_user is None:
        ctx["capabilities"] = {"drop": ["ALL"], "add": list(dict.fromkeys([*DEFAULT_CAPABILITIES, *cap_add]))}
    else:
        # A non-root process gets no capabilities at exec anyway; dropping them all
        # (and adding only what was asked) is what Pod Security "restricted" checks.
        ctx.update(runAsNonRoot=True, runAsUser=run_as_user, runAsGroup=run_as_user)
        ctx["capabilities"] = {"drop": ["ALL"], **({"add": list(cap_add)} if cap_add else {})}
    return ctx


def pod_manifest(
    spec: SandboxSpec,
    *,
    name: str,
    namespace: str,
    session_id: str,
    token_sha256: str,
    injector_image: str,
    launcher: list[str],
    install: list[str],
    bundle_path: str,
    port: int,
    created_at: float,
    owner: dict[str, str] | None = None,
    run_as_user: int | None = None,
    cap_add: Sequence[str] = (),
    ephemeral_storage: str | None = None,
    runtime_volume_limit: str | None = None,
    user_namespaces: bool = False,
    tls_pem: str | None = None,
    tools_image: str = "orchard-tools:latest",
    image_volumes: bool = False,
    runtime_subpath: str = "orchard",
) -> dict[str, Any]:
    """The Pod for one sandbox.

    An init container from the injector image copies the executor runtime
    into an emptyDir (``install``); the task image's command is replaced by
    ``launcher``, which needs nothing from the image. The pod carries only
    the token's SHA-256, never the token, and no service-account token; with
    ``tls_pem``, the executor's own TLS key and certificate (see ``orchard._tls``).
    ``owner`` (the client session's Lease) makes Kubernetes delete the pod
    when the session's Lease goes. With ``spec.tools``, a second init
    container copies the chosen harnesses (and the runtimes they need) from
    ``tools_image`` into an emptyDir, mounted read-only at ``_tools.ROOT``,
    and the executor appends their ``bin`` directories to PATH.

    With ``image_volumes`` (Kubernetes' ImageVolume: 1.33+ with the gate, and a
    runtime that has it, e.g. containerd 2.1+), no init container copies
    anything: the injector image's ``runtime_subpath`` directory is mounted
    read-only as ``bundle_path``/runtime, and the tools image's bundle as
    ``_tools.BUNDLE``, straight from the node's image store.

    Always: seccomp RuntimeDefault, no privilege escalation, every capability
    dropped but ``DEFAULT_CAPABILITIES`` plus ``cap_add`` (none at all with
    ``run_as_user``), and an init container that passes Pod Security
    "restricted". The remaining keywords are ``KubernetesConfig``'s fields of
    the same names (None: not set).
    """
    labels = {
        **spec.labels,
        MANAGED_BY: "orchard",
        SANDBOX_LABEL: name,
        SESSION_LABEL: session_id,
        NETWORK_LABEL: "on" if spec.network else "off",
    }
    annotations = {**spec.annotations, IMAGE_ANNOTATION: spec.image}
    if spec.ttl is not None:
        annotations[EXPIRES_ANNOTATION] = f"{created_at + spec.ttl:.0f}"
    resources: dict[str, dict[str, str]] = {}
    for key, value in (("cpu", spec.cpu), ("memory", spec.memory)):
        if value is not None:
            resources.setdefault("requests", {})[key] = _quantity(value)
            resources.setdefault("limits", {})[key] = _quantity(value)
    env = [{"name": "ORCHARD_EXECUTOR_TOKEN_SHA256", "value": token_sha256}]
    if tls_pem:
        env.append({"name": TLS_ENV, "value": tls_pem})
    env += [{"name": k, "value": v} for k, v in spec.env.items()]
    args = [f"--port={port}"]
    if spec.idle_timeout is not None:
        args.append(f"--idle-timeout={spec.idle_timeout:g}")
    if spec.workdir:
        args.append(f"--workdir={spec.workdir}")
    if spec.tools:
        args.append(f"--path-append={_tools.path_dirs(spec.tools)}")
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": launcher,
        "args": args,
        "env": env,
        "ports": [{"name": "executor", "containerPort": port, "protocol": "TCP"}],
        # The kubelet does not verify an HTTPS probe's certificate: a TLS executor is probed over TLS.
        "readinessProbe": {
            "httpGet": {"path": "/healthz", "port": port, "scheme": "HTTPS" if tls_pem else "HTTP"},
            "periodSeconds": 2,
            "failureThreshold": 1,
        },
        "volumeMounts": [{"name": BUNDLE_VOLUME, "mountPath": bundle_path, "readOnly": True}],
    }
    if image_volumes:
        container["volumeMounts"] = [
            {"name": BUNDLE_VOLUME, "mountPath": f"{bundle_path}/runtime", "subPath": runtime_subpath, "readOnly": True}
        ]
    if spec.tools and image_volumes:
        tools_mount = {"mountPath": _tools.BUNDLE, "subPath": _tools.BUNDLE_IN_IMAGE.lstrip("/")}
        container["volumeMounts"].append({"name": TOOLS_VOLUME, **tools_mount, "readOnly": True})
    elif spec.tools:
        container["volumeMounts"].append({"name": TOOLS_VOLUME, "mountPath": _tools.ROOT, "readOnly": True})
    if spec.workdir:
        container["workingDir"] = spec.workdir
    if spec.shm is not None:
        # A tmpfs the kubelet sizes to sizeLimit (or to the pod's memory limit, if that is less).
        container["volumeMounts"].append({"name": SHM_VOLUME, "mountPath": "/dev/shm"})
    if ephemeral_storage is not None:
        # An explicit zero request: left out, it would default to the limit and
        # reserve the whole limit of node disk for every sandbox at scheduling.
        resources.setdefault("requests", {})["ephemeral-storage"] = "0"
        resources.setdefault("limits", {})["ephemeral-storage"] = ephemeral_storage
    if resources:
        container["resources"] = resources
    container["securityContext"] = _task_security(run_as_user, cap_add)
    volume: dict[str, Any] = {"name": BUNDLE_VOLUME, "emptyDir": {}}
    if runtime_volume_limit is not None:
        volume["emptyDir"]["sizeLimit"] = runtime_volume_limit
    init_security = {
        "runAsNonRoot": True,
        "runAsUser": INJECTOR_UID,
        "runAsGroup": INJECTOR_UID,
        "readOnlyRootFilesystem": True,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 1,
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        "initContainers": [
            {
                "name": INIT_CONTAINER,
                "image": injector_image,
                "imagePullPolicy": spec.image_pull_policy,
                "command": install,
                "volumeMounts": [{"name": BUNDLE_VOLUME, "mountPath": bundle_path}],
                "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "256Mi"}},
                "securityContext": init_security,
            }
        ],
        "containers": [container],
        "volumes": [volume],
    }
    if spec.tools:
        pod_spec["initContainers"].append(
            {
                "name": TOOLS_CONTAINER,
                "image": tools_image,
                "imagePullPolicy": spec.image_pull_policy,
                "command": _tools.copy(spec.tools),
                "volumeMounts": [{"name": TOOLS_VOLUME, "mountPath": "/target"}],
                "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "256Mi"}},
                "securityContext": init_security,
            }
        )
        pod_spec["volumes"].append({"name": TOOLS_VOLUME, "emptyDir": {}})
    if image_volumes:
        # The node's copy of each image, mounted read-only in place of the init containers and their emptyDirs.
        del pod_spec["initContainers"]
        pull = spec.image_pull_policy
        pod_spec["volumes"] = [{"name": BUNDLE_VOLUME, "image": {"reference": injector_image, "pullPolicy": pull}}]
        if spec.tools:
            pod_spec["volumes"].append({"name": TOOLS_VOLUME, "image": {"reference": tools_image, "pullPolicy": pull}})
    if spec.shm is not None:
        shm = {"medium": "Memory", "sizeLimit": str(quantity_bytes("shm", spec.shm))}
        pod_spec["volumes"].append({"name": SHM_VOLUME, "emptyDir": shm})
    if user_namespaces:
        pod_spec["hostUsers"] = False
    if spec.ttl is not None:
        pod_spec["activeDeadlineSeconds"] = max(1, int(spec.ttl))
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in spec.tolerations]
    if spec.runtime_class:
        pod_spec["runtimeClassName"] = spec.runtime_class
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in spec.image_pull_secrets]
    metadata: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels, "annotations": annotations}
    if owner is not None:
        metadata["ownerReferences"] = [{**owner, "blockOwnerDeletion": False}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


def lease_manifest(*, session_id: str, namespace: str, duration: int, now: str) -> dict[str, Any]:
    """The Lease a client session holds while alive; its sandbox pods are owned by it."""
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": f"orchard-session-{session_id}",
            "namespace": namespace,
            "labels": {MANAGED_BY: "orchard", SESSION_LABEL: session_id},
        },
        "spec": {"holderIdentity": session_id, "leaseDurationSeconds": duration, "acquireTime": now, "renewTime": now},
    }


# -- One-time cluster setup: the client's Role and the sandbox NetworkPolicies --


def client_role(namespace: str, pool_secrets: Sequence[str] = ()) -> dict[str, Any]:
    """The RBAC Role an Orchard client needs in its namespace, and nothing more.

    ``pool_secrets``: the Secrets holding the keys of shared pools, which a
    claimer reads (only those, by name).
    """
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "orchard-client", "namespace": namespace, "labels": {MANAGED_BY: "orchard"}},
        "rules": [
            # patch: claiming a pod of a shared pool (a compare-and-swap on its labels).
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "delete", "get", "list", "patch", "watch"]},
            {"apiGroups": [""], "resources": ["pods/portforward"], "verbs": ["create", "get"]},
            {
                "apiGroups": ["coordination.k8s.io"],
                "resources": ["leases"],
                # update: a pool keeper taking over the pool's expired Lease.
                "verbs": ["create", "delete", "get", "list", "patch", "update"],
            },
            *(
                [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"], "resourceNames": list(pool_secrets)}]
                if pool_secrets
                else []
            ),
        ],
    }


def role_binding(namespace: str, *, service_account: str) -> dict[str, Any]:
    """Bind the client Role to a service account (a training job's)."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {
            "name": f"orchard-client-{service_account}",
            "namespace": namespace,
            "labels": {MANAGED_BY: "orchard"},
        },
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "orchard-client"},
        "subjects": [{"kind": "ServiceAccount", "name": service_account, "namespace": namespace}],
    }


def pod_security_labels(enforce: str) -> dict[str, str]:
    """Namespace labels for Pod Security admission: enforce ``enforce``, warn and audit "restricted"."""
    return {
        f"{PSA}/enforce": enforce,
        f"{PSA}/enforce-version": "latest",
        f"{PSA}/warn": "restricted",
        f"{PSA}/warn-version": "latest",
        f"{PSA}/audit": "restricted",
        f"{PSA}/audit-version": "latest",
    }


def egress_exceptions(
    *,
    api_server: Iterable[str],
    cluster_cidrs: Iterable[str],
    allow_metadata: bool = False,
    allow_api_server: bool = False,
    allow_cluster: bool = False,
) -> list[str]:
    """The ranges ``network=True`` sandboxes may not reach: metadata, the API server, the cluster."""
    ranges = [] if allow_metadata else list(METADATA_CIDRS)
    if not allow_api_server:
        ranges += [str(ipaddress.ip_network(a)) for a in api_server]  # an address becomes a /32 or /128
    if not allow_cluster:
        ranges += [str(ipaddress.ip_network(c, strict=False)) for c in cluster_cidrs]
    return list(dict.fromkeys(ranges))


def network_policies(
    namespace: str,
    *,
    port: int,
    client_cidrs: Sequence[str] = (),
    client_namespaces: Sequence[str] = (),
    egress_except: Sequence[str] = (),
    dns: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Sandboxes: ingress only from clients to the executor port; egress only for ``network=True`` sandboxes.

    Clients are pods labelled ``CLIENT_LABEL=true`` in the namespace or in
    ``client_namespaces``, and addresses in ``client_cidrs``. (The node a pod
    runs on always reaches it under NetworkPolicy: kubelet probes,
    port-forward and a client on that node need no rule.) ``network=True``
    egress goes anywhere but ``egress_except``, plus DNS to the pods ``dns``
    selects in kube-system when given.
    """
    meta = {"namespace": namespace, "labels": {MANAGED_BY: "orchard"}}
    client = {"matchLabels": {CLIENT_LABEL: "true"}}
    peers: list[dict[str, Any]] = [{"podSelector": client}]
    peers += [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}, "podSelector": client}
        for ns in client_namespaces
    ]
    peers += [{"ipBlock": {"cidr": str(ipaddress.ip_network(c, strict=False))}} for c in client_cidrs]
    blocks = []
    for everything in ("0.0.0.0/0", "::/0"):
        whole = ipaddress.ip_network(everything)
        excepts = [c for c in egress_except if ipaddress.ip_network(c).version == whole.version]
        blocks.append({"ipBlock": {"cidr": everything, **({"except": excepts} if excepts else {})}})
    egress: list[dict[str, Any]] = [{"to": blocks}]
    if dns:
        egress.append(
            {
                "to": [
                    {
                        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                        "podSelector": {"matchLabels": dict(dns)},
                    }
                ],
                "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
            }
        )
    return [
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "orchard-sandboxes", **meta},
            "spec": {
                "podSelector": {"matchLabels": {MANAGED_BY: "orchard"}},
                "policyTypes": ["Ingress", "Egress"],
                "ingress": [{"from": peers, "ports": [{"protocol": "TCP", "port": port}]}],
                "egress": [],
            },
        },
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "orchard-sandbox-egress", **meta},
            "spec": {
                "podSelector": {"matchLabels": {MANAGED_BY: "orchard", NETWORK_LABEL: "on"}},
                "policyTypes": ["Egress"],
                "egress": egress,
            },
        },
    ]
