"""Backends, chosen by a tagged config; each is imported only when built."""

from __future__ import annotations

from typing import Any, Literal

import aiohttp
import msgspec

from ..errors import ConfigError
from .base import Backend, Instance


class LocalConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True, tag="local"):
    """The embedded default: each sandbox is an executor process on this machine."""

    #: Directory under which each sandbox gets its private directory.
    root: str | None = None
    #: Python interpreter that runs the executors (default: this one).
    python: str | None = None
    #: "bwrap": each sandbox under bubblewrap (a root from an allowlist of system
    #: directories, its own pid, mount, ipc, uts and network namespaces with loopback
    #: only, an unprivileged uid); "none": plain child processes on the host,
    #: unisolated (warns); "auto": "bwrap", or a ConfigError where it does not work.
    isolation: Literal["auto", "bwrap", "none"] = "auto"
    #: The uid (and gid) isolated sandboxes run as when the client runs as root;
    #: a non-root client's sandboxes run as that user, in a user namespace.
    uid: int = 65534
    #: Fork each executor from one interpreter that imported it once (a fork server, started with the
    #: first sandbox) instead of starting a fresh interpreter per sandbox, whose import of the executor
    #: is most of a start. Under bubblewrap the fork joins the sandbox's namespaces and drops every
    #: privilege, as bubblewrap's own process would. It needs Linux 5.3+ (pidfds); elsewhere, and with
    #: False, each sandbox's executor is a fresh ``python``.
    fork: bool = True


class KubernetesConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True, tag="kubernetes"):
    """A pod per sandbox on a Kubernetes cluster, exec straight to the pod IP."""

    #: Namespace the sandbox pods go in.
    namespace: str = "default"
    #: Path of the kubeconfig (default: $KUBECONFIG or ~/.kube/config).
    kubeconfig: str | None = None
    #: Context in the kubeconfig (default: its current context).
    context: str | None = None
    #: Use the pod's service account instead of a kubeconfig (inside the cluster).
    in_cluster: bool = False
    #: The image built from Dockerfile.executor, run as the init container.
    injector_image: str = "orchard-executor:latest"
    #: The harness tools image (images/tools); a second init container copies the harnesses a
    #: sandbox's ``tools=[...]`` chose from it.
    tools_image: str = "orchard-tools:latest"
    #: How the executor runtime (and the harnesses of ``tools=[...]``) get into a pod. "image-volume": mounted
    #: read-only from the node's copy of the injector and tools images (Kubernetes' ImageVolume: 1.33+ with its
    #: gate, on by default from 1.35, and a runtime that has it: containerd 2.1+, CRI-O 1.31+).
    #: "init-container": init containers copy them into emptyDirs (any cluster; about a second more per start).
    #: "auto": image volumes where the API server accepts them (a dry-run create, once), falling back to the copy
    #: for good when they do not (refused, or the first pod with them failing to start its container).
    injection: Literal["auto", "image-volume", "init-container"] = "auto"
    #: Port the executor listens on inside the pod.
    executor_port: int = 8750
    #: "direct" to the pod IP, "port-forward" through the API server (for clients
    #: outside the cluster network), or "auto": direct if the pod IP answers.
    transport: Literal["auto", "direct", "port-forward"] = "auto"
    #: The client session's Lease (owner of its pods) expires this long after its
    #: last renewal; ``orchard gc`` then treats the session's pods as orphans.
    lease_seconds: int = 60
    #: Run the sandbox container as this non-root uid (and gid) with no
    #: capabilities: the whole pod then passes Pod Security "restricted". None:
    #: the image's user (often root) keeping only ``k8s_pod.DEFAULT_CAPABILITIES``.
    run_as_user: int | None = None
    #: Capabilities added to the sandbox container, e.g. ["NET_RAW"] (any
    #: beyond baseline's list fails a "baseline"-enforced namespace).
    cap_add: list[str] = []
    #: ephemeral-storage limit of the sandbox container (its writable layer and
    #: logs): the kubelet evicts a sandbox that writes more. None: no limit.
    ephemeral_storage: str | None = "8Gi"
    #: sizeLimit of the emptyDir holding the injected runtime (about 40 MB).
    runtime_volume_limit: str = "256Mi"
    #: ``hostUsers: false``: root in the pod is an unprivileged uid on the node.
    #: Needs Kubernetes >= 1.33 (or the gate) and a runtime that supports it
    #: (containerd >= 2.0, CRI-O >= 1.25, kernel >= 6.3); pods fail to start
    #: elsewhere, e.g. on the dev cluster (containerd 2.2 on Debian's runc 1.1).
    user_namespaces: bool = False
    #: A shared warm pool (kept by ``orchard pool keep NAME``) to claim sandboxes from: a sandbox of the pool's
    #: image and spec is claimed from it when one is ready, and started cold otherwise.
    pool: str | None = None

    def __post_init__(self) -> None:
        """Validate the hardening options; capability names are normalised to NET_RAW form."""
        if self.pool is not None:
            from .k8s_pool import check_name

            check_name(self.pool)
        if self.run_as_user is not None and self.run_as_user <= 0:
            raise ConfigError(f"run_as_user={self.run_as_user!r} must be a positive (non-root) uid")
        caps = [c.upper().removeprefix("CAP_") for c in self.cap_add]
        bad = [c for c in caps if c == "ALL" or not c.replace("_", "").isalnum() or not c.isascii()]
        if bad:
            raise ConfigError(f"cap_add: {bad!r} are not capability names (e.g. 'NET_RAW')")
        msgspec.structs.force_setattr(self, "cap_add", caps)


class DockerConfig(msgspec.Struct, kw_only=True, frozen=True, tag="docker", forbid_unknown_fields=True):
    """A container per sandbox on a Docker engine, the executor injected from a shared volume."""

    #: Engine API address, unix:///PATH or tcp://HOST:PORT (default: $DOCKER_HOST, else the local socket).
    host: str | None = None
    #: The image built from Dockerfile.executor; a volume is filled from it once.
    injector_image: str = "orchard-executor:latest"
    #: The harness tools image (images/tools, built by scripts/docker-setup.sh); a volume is filled
    #: from it once, for sandboxes with ``tools=[...]``.
    tools_image: str = "orchard-tools:latest"
    #: How the client reaches each executor. ``"unix"``: a unix socket in a directory of
    #: ``socket_dir`` bind-mounted into the container, no TLS, and a sandbox with ``network=False``
    #: has no network at all (only its loopback). ``"tcp"``: TLS to the container's address on
    #: Orchard's bridge network (or to its port published on 127.0.0.1, with ``network``), which
    #: costs about 100 ms more per start. ``"auto"``: unix where the engine is reached on a local
    #: unix socket and no ``network`` is set, else tcp.
    transport: Literal["auto", "unix", "tcp"] = "auto"
    #: The directory of the executors' socket directories (default: ~/.cache/orchard/docker).
    #: The engine bind-mounts them, so it must see this path as the client does (an engine in
    #: another machine or container cannot: use transport="tcp"). Each sandbox can write into
    #: its own, as into its container's filesystem: keep it on a disk, not on a tmpfs.
    socket_dir: str | None = None
    #: Port the executor listens on inside the container (transport tcp), reached at the container's address.
    executor_port: int = 8750
    #: A Docker network to join instead of Orchard's own (the executor port is then published on
    #: 127.0.0.1): the spec's ``network=False`` and the isolation between sandboxes are then yours.
    network: str | None = None
    #: Capabilities added to the few every sandbox keeps (CHOWN, DAC_OVERRIDE, FOWNER, FSETID, KILL,
    #: SETGID, SETUID, NET_BIND_SERVICE), e.g. ``["SYS_PTRACE"]`` for gdb or strace.
    cap_add: list[str] = []
    #: Refuse privileges gained by exec (setuid binaries, file capabilities); False lets ``sudo`` work.
    no_new_privileges: bool = True
    #: Most processes and threads a sandbox may have at once (None: no limit).
    pids_limit: int | None = 2048
    #: Open file limit (soft and hard) of every process in a sandbox; at most the engine's own.
    nofile: int = 16384
    #: Memory of a sandbox whose spec gives none, as a Kubernetes quantity (None: no limit).
    default_memory: str | None = "8Gi"
    #: OCI runtime of the containers, e.g. "runsc" for gVisor where installed (default: the engine's).
    runtime: str | None = None


BackendConfig = LocalConfig | KubernetesConfig | DockerConfig
BACKENDS = ("local", "kubernetes", "docker")


def make_config(backend: str | BackendConfig, options: dict[str, Any]) -> BackendConfig:
    """A backend config from a name plus options, or a config as given."""
    if not isinstance(backend, str):
        if options:
            raise ConfigError("pass backend options inside the config object, not as keyword arguments")
        return backend
    if backend not in BACKENDS:
        raise ConfigError(f"backend={backend!r} is not one of {', '.join(BACKENDS)}")
    try:
        config: BackendConfig = msgspec.convert({"type": backend, **options}, BackendConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid option for the {backend} backend: {exc}") from None
    return config


def build_backend(config: BackendConfig, *, session_id: str, http: aiohttp.ClientSession) -> Backend:
    """Instantiate the backend a config names (importing only that backend)."""
    if isinstance(config, KubernetesConfig):
        from .kubernetes import KubernetesBackend

        return KubernetesBackend(config, session_id=session_id, http=http)
    if isinstance(config, DockerConfig):
        from .docker import DockerBackend

        return DockerBackend(config, session_id=session_id, http=http)
    from .local import LocalBackend

    return LocalBackend(config)


__all__ = [
    "BACKENDS",
    "Backend",
    "BackendConfig",
    "DockerConfig",
    "Instance",
    "KubernetesConfig",
    "LocalConfig",
    "build_backend",
    "make_config",
]
