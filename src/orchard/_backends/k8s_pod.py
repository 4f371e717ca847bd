"""The pod a sandbox runs as: a pure manifest builder and the pod status it reads.

Nothing here does I/O; ``pod_manifest`` is a function of the sandbox spec and
is unit-tested without a cluster. ``classify`` turns a pod's status, as the
shared watch sees it, into what the client needs: still starting, running at
an IP, or failed with a reason.
"""

from __future__ import annotations

import datetime
from typing import Any

import msgspec

from .._spec import SandboxSpec

MANAGED_BY = "app.kubernetes.io/managed-by"
SANDBOX_LABEL = "orchard.dev/sandbox"
SESSION_LABEL = "orchard.dev/session"
IMAGE_ANNOTATION = "orchard.dev/image"
EXPIRES_ANNOTATION = "orchard.dev/expires-at"
NETWORK_LABEL = "orchard.dev/network"
CONTAINER = "sandbox"
INIT_CONTAINER = "orchard-inject"
BUNDLE_VOLUME = "orchard-runtime"

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
                why = t.reason or f"exit code {t.exit_code}"
                return failed(why, t.message or f"the sandbox container ended ({why}, exit code {t.exit_code})")
        return failed(status.reason or status.phase, status.message or f"the pod is {status.phase}")
    if scheduled_c is not None and scheduled_c.status == "False" and scheduled_c.reason == "Unschedulable":
        return failed("Unschedulable", scheduled_c.message or "no node can run this pod")
    for cs in status.init_container_statuses:
        w, t = cs.state.waiting, cs.state.terminated
        if w is not None and w.reason in FATAL_WAITING:
            return failed(w.reason or "", f"injector init container: {w.message or w.reason}")
        if t is not None and t.exit_code != 0:
            return failed("InitFailed", f"injector init container exited {t.exit_code}: {t.message or t.reason or ''}")
    for cs in status.container_statuses:
        w, t = cs.state.waiting, cs.state.terminated
        if w is not None and w.reason in FATAL_WAITING:
            return failed(w.reason or "", w.message or w.reason or "")
        if t is not None:
            why = t.reason or f"exit code {t.exit_code}"
            return failed(why, t.message or f"the sandbox container ended ({why}, exit code {t.exit_code})")
        if cs.state.running is not None and status.pod_ip:
            return Phase("running", pod_ip=status.pod_ip, scheduled=scheduled, initialized=initialized)
    return Phase("pending", scheduled=scheduled, initialized=initialized)


# -- Building the manifest --


def _quantity(value: str | float) -> str:
    return value if isinstance(value, str) else f"{value:g}"


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
) -> dict[str, Any]:
    """The Pod for one sandbox.

    An init container from the injector image copies the executor runtime
    into an emptyDir (``install``); the task image's command is replaced by
    ``launcher``, which needs nothing from the image. The pod carries only
    the token's SHA-256, never the token, and no service-account token.
    ``owner`` (the client session's Lease) makes Kubernetes delete the pod
    when the session's Lease goes.
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
    env += [{"name": k, "value": v} for k, v in spec.env.items()]
    args = [f"--port={port}"]
    if spec.idle_timeout is not None:
        args.append(f"--idle-timeout={spec.idle_timeout:g}")
    if spec.workdir:
        args.append(f"--workdir={spec.workdir}")
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": launcher,
        "args": args,
        "env": env,
        "ports": [{"name": "executor", "containerPort": port, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": port}, "periodSeconds": 2, "failureThreshold": 1},
        "volumeMounts": [{"name": BUNDLE_VOLUME, "mountPath": bundle_path, "readOnly": True}],
    }
    if spec.workdir:
        container["workingDir"] = spec.workdir
    if resources:
        container["resources"] = resources
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 1,
        "initContainers": [
            {
                "name": INIT_CONTAINER,
                "image": injector_image,
                "imagePullPolicy": spec.image_pull_policy,
                "command": install,
                "volumeMounts": [{"name": BUNDLE_VOLUME, "mountPath": bundle_path}],
                "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}},
            }
        ],
        "containers": [container],
        "volumes": [{"name": BUNDLE_VOLUME, "emptyDir": {}}],
    }
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


def client_role(namespace: str) -> dict[str, Any]:
    """The RBAC Role an Orchard client needs in its namespace, and nothing more."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "orchard-client", "namespace": namespace, "labels": {MANAGED_BY: "orchard"}},
        "rules": [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "delete", "get", "list", "watch"]},
            {"apiGroups": [""], "resources": ["pods/portforward"], "verbs": ["create", "get"]},
            {
                "apiGroups": ["coordination.k8s.io"],
                "resources": ["leases"],
                "verbs": ["create", "delete", "get", "list", "patch"],
            },
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


def network_policies(namespace: str, *, port: int) -> list[dict[str, Any]]:
    """Sandboxes: ingress only to the executor port; egress only for ``network=True`` sandboxes."""
    meta = {"namespace": namespace, "labels": {MANAGED_BY: "orchard"}}
    return [
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "orchard-sandboxes", **meta},
            "spec": {
                "podSelector": {"matchLabels": {MANAGED_BY: "orchard"}},
                "policyTypes": ["Ingress", "Egress"],
                "ingress": [{"ports": [{"protocol": "TCP", "port": port}]}],
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
                "egress": [{}],
            },
        },
    ]
