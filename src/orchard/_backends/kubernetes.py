"""The ``kubernetes`` backend: one pod per sandbox, one shared watch per client.

The Kubernetes API is used for three things only: create a pod, delete it,
and one label-selected watch over all of this client's pods, which resolves
every sandbox's readiness and notices every loss (no per-pod polling); with
``injection="auto"``, one dry-run create per client as well, asking whether
the cluster takes image volumes. Exec and files go straight to the executor
at the pod IP.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import msgspec
from tenacity import AsyncRetrying, retry_if_exception, stop_after_delay, wait_random_exponential

from .. import _retry
from .._finish import finish
from .._handle import HandleFields
from .._spec import SandboxSpec
from .._tls import Identity, pin
from ..errors import (
    AccessDenied,
    ClusterUnavailable,
    ConfigError,
    InvalidHandle,
    OrchardError,
    SandboxLost,
    SandboxStartError,
    SandboxTimeout,
)
from . import KubernetesConfig, bundle
from .k8s_pod import (
    IMAGE_ANNOTATION,
    MANAGED_BY,
    SESSION_LABEL,
    Lease,
    LeaseList,
    Phase,
    Pod,
    PodList,
    WatchEvent,
    classify,
    client_role,
    egress_exceptions,
    garbage_reason,
    lease_manifest,
    network_policies,
    pod_manifest,
    pod_security_labels,
    role_binding,
)
from .k8s_portforward import PortForward

log = logging.getLogger("orchard.kubernetes")

_EVENT = msgspec.json.Decoder(WatchEvent)
_POD = msgspec.json.Decoder(Pod)
#: Start failures of a sandbox container that could not be made or started (as where the runtime has no image
#: volumes: the mount fails, or nothing is mounted and the launcher is missing).
_CONTAINER_FAULTS = frozenset(
    {"CreateContainerError", "CreateContainerConfigError", "RunContainerError", "StartError", "ContainerCannotRun"}
)
_POD_LIST = msgspec.json.Decoder(PodList)


def _status_message(body: Any) -> str:
    """The message of an API server's Status body, or the body itself."""
    try:
        return str(msgspec.json.decode(body)["message"])[:500]
    except Exception:
        return f"{body!s:.500}"


#: Waiting reasons that mean the node neither has the image nor can pull it.
_IMAGE_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull", "InvalidImageName"})


def _start_failed(name: str, phase: Any) -> SandboxStartError:
    """The error of a pod that will not start, with how to get the image where that is the reason."""
    hint = ""
    if phase.reason in _IMAGE_REASONS:
        hint = (
            "; load the image into the nodes' container runtime (the dev cluster's up imports the images "
            "scripts/docker-setup.sh builds) or push it to a registry the nodes reach"
        )
    return SandboxStartError(
        f"sandbox {name} failed to start: {phase.reason}: {phase.message}{hint}", sandbox_id=name, reason=phase.reason
    )


def _grant(namespace: str) -> str:
    return (
        "a cluster admin grants a client its rights with "
        f"orchard k8s setup -n {namespace} --service-account NAME (the client Role, bound to NAME)"
    )


def refusal(exc: Any, namespace: str, doing: str) -> Exception:
    """A typed error for an API call the server refused: a missing namespace, a lack of RBAC, bad credentials.

    Anything else is ``exc`` itself, the API client's ``ApiException``.
    """
    try:
        status = msgspec.json.decode(exc.body)
        details = status.get("details") or {}
    except Exception:
        status, details = {}, {}
    if exc.status == 404 and details.get("kind") == "namespaces":
        return ConfigError(
            f'namespace "{details.get("name", namespace)}" not found: create it '
            f"(kubectl create namespace {details.get('name', namespace)}, or orchard k8s setup --create-namespace), "
            "or pass an existing one"
        )
    if exc.status == 403:
        return AccessDenied(
            f"the API server denied this client the right to {doing} in namespace {namespace!r}: "
            f"{_status_message(exc.body)}; {_grant(namespace)}"
        )
    if exc.status == 401:
        return AccessDenied(
            "the API server refused the kubeconfig's credentials (401 Unauthorized): they are expired or wrong; "
            "renew them, or pick others with kubeconfig= and context="
        )
    return exc  # type: ignore[no-any-return]


def _micro_time() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _transient(exc: BaseException) -> bool:
    """API failures worth retrying: throttling, server errors, broken connections."""
    from kubernetes_asyncio.client.exceptions import ApiException

    if isinstance(exc, ApiException):
        return exc.status in (429, 500, 502, 503, 504)
    return isinstance(exc, aiohttp.ClientConnectionError | asyncio.TimeoutError)


#: Seconds an API call is retried while the API server does not answer: long enough to ride out its
#: restart (an upgrade, etcd failing over), short enough that a start fails typed well within its timeout.
API_RETRY_SECONDS = 30.0


def _api_retry() -> AsyncRetrying:
    return AsyncRetrying(
        retry=retry_if_exception(_transient),
        wait=wait_random_exponential(multiplier=0.1, max=5.0),
        stop=stop_after_delay(API_RETRY_SECONDS),
        reraise=True,
    )


def pod_options(config: KubernetesConfig) -> dict[str, Any]:
    """The hardening keywords of ``pod_manifest`` that a config sets."""
    return {
        "run_as_user": config.run_as_user,
        "cap_add": config.cap_add,
        "ephemeral_storage": config.ephemeral_storage,
        "runtime_volume_limit": config.runtime_volume_limit,
        "user_namespaces": config.user_namespaces,
    }


class _Tracked:
    """A sandbox pod as the watch sees it."""

    def __init__(self, name: str) -> None:
        loop = asyncio.get_running_loop()
        self.name = name
        self.t0 = time.monotonic()
        self.timings: dict[str, float] = {}
        self.running: asyncio.Future[str] = loop.create_future()
        self.failed: asyncio.Future[Phase] = loop.create_future()
        #: Whether the start's phases are timed (not for a pod claimed from a pool, started long before).
        self.timed = True
        #: The pod's uid, once created (None: not known, e.g. a create retried after it had gone through).
        self.uid: str | None = None
        #: The uid of an earlier pod of this name, deleted, whose last events the watch may still bring.
        self.stale_uid: str | None = None
        #: Whether the watch or a list has shown the pod: missing from a later list, it was deleted.
        self.seen = False

    def mark(self, phase: str) -> None:
        self.timings.setdefault(phase, time.monotonic() - self.t0)

    def update(self, phase: Phase) -> None:
        if phase.scheduled and self.timed:
            self.mark("scheduled")
        if phase.initialized and self.timed:
            self.mark("initialized")
        if phase.state == "running" and phase.pod_ip and not self.running.done():
            self.mark("running")
            self.running.set_result(phase.pod_ip)
        elif phase.state == "failed" and not self.failed.done():
            self.failed.set_result(phase)


class KubernetesInstance:
    """A running sandbox pod."""

    def __init__(
        self,
        backend: KubernetesBackend,
        tracked: _Tracked,
        base_url: str,
        forward: PortForward | None,
        *,
        attached: bool = False,
        owned: bool = True,
    ) -> None:
        self._backend = backend
        self._tracked = tracked
        self._forward = forward
        self.name = tracked.name
        self.base_url = base_url
        self.timings = tracked.timings
        #: Another client's pod, which this client's watch does not see; deleted only if ``owned``.
        self._attached = attached
        self._owned = owned
        self._deleted = False

    def describe(self) -> dict[str, Any]:
        """The executor at the pod IP, whatever this client's transport (``HandleFields``)."""
        port = self._backend.config.executor_port
        return {
            "url": f"https://{self._tracked.running.result()}:{port}",
            "namespace": self._backend.config.namespace,
            "port": port,
        }

    async def diagnose(self) -> OrchardError | None:
        """What the watch saw happen to the pod, waiting briefly for it to arrive."""
        if self._deleted:
            return SandboxLost(f"sandbox {self.name} was deleted", sandbox_id=self.name, reason="Deleted")
        if self._attached:  # not in this client's watch: ask the API server
            try:
                phase = await self._backend.pod_phase(self.name)
            except Exception:  # the API server is no help now: the caller reports the executor's silence
                return None
            if phase.state == "failed":
                return SandboxLost(
                    f"sandbox {self.name}: {phase.reason}: {phase.message}", sandbox_id=self.name, reason=phase.reason
                )
            return None
        with contextlib.suppress(TimeoutError):
            # Not asyncio.wait_for: on Python 3.11 it drops a cancel that comes in the step the pod's end does,
            # and the watch's end fails this very request with a cancel (ExecutorClient.ended).
            async with asyncio.timeout(3.0):
                return self._lost(await asyncio.shield(self._tracked.failed))
        return None

    def _lost(self, phase: Phase) -> SandboxLost:
        return SandboxLost(
            f"sandbox {self.name}: {phase.reason}: {phase.message}", sandbox_id=self.name, reason=phase.reason
        )

    def on_end(self, callback: Callable[[Callable[[], OrchardError]], None]) -> None:
        """Have ``callback`` called once the watch sees the pod end, with a maker of the error saying why.

        Never for an attached pod: this client's watch does not see it.
        """

        def done(failed: asyncio.Future[Phase]) -> None:
            if not failed.cancelled():
                callback(lambda: self._lost(failed.result()))

        if not self._attached:
            self._tracked.failed.add_done_callback(done)

    async def delete(self) -> None:
        """Delete the pod (grace period 0); safe to call twice."""
        if self._deleted:
            return
        self._deleted = True
        if self._forward is not None:
            await self._forward.close()
        if self._owned:
            try:
                await self._backend.delete_pod(self.name)
            except ClusterUnavailable as exc:
                # Not lost: the pod belongs to the session's Lease, whose deletion (the client's close) or
                # expiry (`orchard gc`) removes it, and its executor's idle_timeout ends it meanwhile.
                log.warning(
                    "sandbox %s: its pod could not be deleted now (%s); its session's Lease will", self.name, exc
                )


class KubernetesBackend:
    """Pods on a Kubernetes cluster, created and watched through the API server."""

    name = "kubernetes"
    tls = True
    tools = True
    changes_root: str | None = "/"

    def __init__(self, config: KubernetesConfig, *, session_id: str, http: aiohttp.ClientSession | None = None) -> None:
        self.config = config
        self.session_id = session_id
        self._http = http
        self._api: Any = None
        self._core: Any = None
        self._ws_core: Any = None
        #: "direct" or "port-forward" once decided ("auto" decides on the first sandbox).
        self.transport: str = config.transport
        self._tracked: dict[str, _Tracked] = {}
        self._watch_task: asyncio.Task[None] | None = None
        self._renew_task: asyncio.Task[None] | None = None
        self._coord: Any = None
        self._owner: dict[str, str] | None = None
        self._watch_ready: asyncio.Event | None = None
        self._lock = asyncio.Lock()
        #: API requests made, by verb (create, delete, list, watch).
        self.api_requests: dict[str, int] = {
            "create": 0, "delete": 0, "list": 0, "watch": 0, "lease": 0, "get": 0, "patch": 0, "dry-run": 0
        }  # fmt: skip
        #: Watch streams open now, and the most ever open at once (the one watch: never above 1).
        self.watch_streams = self.watch_streams_max = 0
        #: Whether pods mount the runtime as image volumes (``config.injection``; None: not yet asked, for "auto").
        self.image_volumes: bool | None = None if config.injection == "auto" else config.injection == "image-volume"
        self._image_volumes_probe: asyncio.Task[bool | None] | None = None
        #: Whether a pod with image volumes has started here (after that, "auto" no longer falls back).
        self._image_volumes_work = config.injection == "image-volume"
        self._runtime_subpath = bundle.IMAGE_RUNTIME.lstrip("/")
        #: A pool keeper's: takes a contested Lease (instead of creating the session's own) and returns its owner
        #: reference; renewals then check ``holder`` still holds it, and set ``lost`` when another does.
        self.elect: Callable[[KubernetesBackend], Awaitable[dict[str, str]]] | None = None
        self.holder: str | None = None
        self.lost: str | None = None
        #: The shared pool's key (``config.pool``), read from its Secret on the first claim.
        self._pool_key: str | None = None
        self._pool_warned = False

    async def _load(self) -> None:
        """Load credentials and build the API clients."""
        from kubernetes_asyncio import client, config
        from kubernetes_asyncio.stream import WsApiClient

        cfg = client.Configuration()
        if not self.config.in_cluster:
            paths = self.config.kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
            if not any(os.path.exists(os.path.expanduser(p)) for p in paths.split(os.pathsep) if p):
                where = (
                    "kubeconfig=" if self.config.kubeconfig else "$KUBECONFIG" if os.environ.get("KUBECONFIG") else ""
                )
                raise ConfigError(
                    f"no kubeconfig: {paths} does not exist{f' ({where})' if where else ''}: pass kubeconfig=PATH "
                    "(orchard's commands: --kubeconfig PATH) or set KUBECONFIG; inside a cluster, in_cluster=True"
                )
        try:
            if self.config.kubeconfig is None and self.config.in_cluster:
                config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
            else:
                await config.load_kube_config(
                    config_file=self.config.kubeconfig, context=self.config.context, client_configuration=cfg
                )
        except Exception as exc:
            why = " ".join(str(exc).split())  # one line: a YAML error spans three
            raise ConfigError(
                f"cannot load Kubernetes credentials (kubeconfig={self.config.kubeconfig!r}, "
                f"context={self.config.context!r}): {why}"
            ) from exc
        self._api = client.ApiClient(configuration=cfg)
        self._core = client.CoreV1Api(self._api)
        self._coord = client.CoordinationV1Api(self._api)
        # Each port-forwarded connection holds one websocket for its whole life, so a
        # pool limit (the library's default is 100) would stall the next connection
        # until an idle one closes. Plain API calls keep the limit.
        ws_cfg = copy.copy(cfg)
        ws_cfg.connection_pool_maxsize = 0
        self._ws_api = WsApiClient(configuration=ws_cfg)
        self._ws_core = client.CoreV1Api(self._ws_api)

    @property
    def _pool(self) -> aiohttp.ClientSession:
        """The client's HTTP pool (maintenance commands like gc are built without one)."""
        assert self._http is not None, "starting sandboxes needs the Client's HTTP session"
        return self._http

    async def _connect(self) -> None:
        async with self._lock:
            if self._core is not None:
                return
            await self._load()
            await self._take_lease()
            self._watch_ready = asyncio.Event()
            self._watch_task = asyncio.create_task(self._watch(), name="orchard-pod-watch")
            self._renew_task = asyncio.create_task(self._renew(), name="orchard-lease-renew")

    async def _take_lease(self) -> None:
        """Create this session's Lease: it owns the session's pods and shows the client is alive."""
        if self.elect is not None:
            self._owner = await self.elect(self)
            return
        body = lease_manifest(
            session_id=self.session_id,
            namespace=self.config.namespace,
            duration=self.config.lease_seconds,
            now=_micro_time(),
        )
        from kubernetes_asyncio.client.exceptions import ApiException

        try:
            resp = await self._call("lease", self._coord.create_namespaced_lease, self.config.namespace, body)
        except ApiException as exc:
            raise refusal(exc, self.config.namespace, "create the session's Lease") from exc
        lease = msgspec.json.decode(await resp.read())
        meta = lease["metadata"]
        self._owner = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "name": meta["name"],
            "uid": meta["uid"],
        }

    async def _renew(self) -> None:
        from kubernetes_asyncio.client.exceptions import ApiException

        assert self._owner is not None
        renewed = time.monotonic()
        while True:
            await asyncio.sleep(self.config.lease_seconds / 3)
            body: Any = {"spec": {"renewTime": _micro_time()}}
            if self.holder is not None:  # a contested Lease: renew only while still its holder
                body = [
                    {"op": "test", "path": "/spec/holderIdentity", "value": self.holder},
                    {"op": "replace", "path": "/spec/renewTime", "value": body["spec"]["renewTime"]},
                ]
            try:
                resp = await self._call(
                    "lease", self._coord.patch_namespaced_lease, self._owner["name"], self.config.namespace, body
                )
                resp.release()
                renewed = time.monotonic()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("renewing the lease %s failed: %r", self._owner["name"], exc)
                if self.holder is not None and (
                    (isinstance(exc, ApiException) and exc.status in (404, 422))
                    or time.monotonic() - renewed > self.config.lease_seconds
                ):
                    self.lost = f"the Lease {self._owner['name']} is no longer held by {self.holder}"
                    return

    async def _call(self, verb: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """One API call, retried when transient; the raw response, or ApiException for a non-2xx status."""
        from kubernetes_asyncio.client.exceptions import ApiException

        try:
            async for attempt in _api_retry():
                with attempt:
                    self.api_requests[verb] += 1
                    resp = await fn(*args, _preload_content=False, **kwargs)
                    # Without preloading, the library returns error responses as they are: a refused
                    # create (403 from admission, 422) would pass for a success and the start would
                    # wait out its whole timeout for a pod that does not exist.
                    if not 200 <= resp.status <= 299:
                        async with resp:
                            exc = ApiException(status=resp.status, reason=resp.reason)
                            exc.body = (await resp.read()).decode(errors="replace")
                            exc.headers = resp.headers
                        raise exc
                    return resp
        except Exception as exc:
            if not _transient(exc):
                raise
            why = f"HTTP {exc.status}: {_status_message(exc.body)}" if isinstance(exc, ApiException) else repr(exc)
            raise ClusterUnavailable(
                f"the Kubernetes API server did not answer ({verb}) for {API_RETRY_SECONDS:g}s of retries: {why}"
            ) from exc
        raise AssertionError("unreachable")

    async def _watch(self) -> None:
        """The one watch: every pod of this client session, for the client's lifetime."""
        selector = f"{SESSION_LABEL}={self.session_id}"
        resource_version: str | None = None
        failures = 0
        assert self._watch_ready is not None
        while True:
            try:
                if resource_version is None:
                    resp = await self._call(
                        "list", self._core.list_namespaced_pod, self.config.namespace, label_selector=selector
                    )
                    listing = _POD_LIST.decode(await resp.read())
                    resource_version = listing.metadata.resource_version
                    self._relisted(listing.items)
                resp = await self._call(
                    "watch",
                    self._core.list_namespaced_pod,
                    self.config.namespace,
                    label_selector=selector,
                    watch=True,
                    resource_version=resource_version,
                    allow_watch_bookmarks=True,
                    timeout_seconds=300,
                )
                self._watch_ready.set()
                self.watch_streams += 1
                self.watch_streams_max = max(self.watch_streams_max, self.watch_streams)
                try:
                    async with resp:
                        async for line in resp.content:
                            event = _EVENT.decode(line)
                            if event.type == "ERROR":
                                # Usually 410 Gone: our resource version is too old. List again.
                                log.info("pod watch from resource version %s refused; listing again", resource_version)
                                resource_version = None
                                break
                            pod = _POD.decode(event.object)
                            resource_version = pod.metadata.resource_version or resource_version
                            if event.type == "DELETED":
                                self._gone(pod)
                            elif event.type != "BOOKMARK":
                                self._observe(pod)
                finally:
                    self.watch_streams -= 1
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep watching whatever happens; the next loop relists if needed
                failures += 1
                if failures == 1:
                    log.warning("pod watch interrupted (%r); reconnecting", exc)
                if getattr(exc, "status", None) == 410:
                    # The resource version is older than the API server keeps (it restarted, or etcd
                    # compacted): watching from it again would be refused forever. List again.
                    resource_version = None
                await asyncio.sleep(min(5.0, 0.2 * 2**failures))
            else:
                failures = 0

    def _observe(self, pod: Pod) -> None:
        tracked = self._tracked.get(pod.metadata.name)
        if tracked is not None and pod.metadata.uid != tracked.stale_uid:
            tracked.seen = True
            tracked.update(classify(pod))

    def _relisted(self, pods: list[Pod]) -> None:
        """A fresh list after the watch broke: also a pod seen before and missing now was deleted meanwhile."""
        for pod in pods:
            self._observe(pod)
        listed = {pod.metadata.name for pod in pods}
        for name, tracked in self._tracked.items():
            if tracked.seen and name not in listed:
                log.info("pod %s is gone from a new list: deleted while the watch reconnected", name)
                tracked.update(Phase("failed", "Deleted", "the pod was deleted while the watch was reconnecting"))

    def _gone(self, pod: Pod) -> None:
        tracked = self._tracked.get(pod.metadata.name)
        if tracked is not None and pod.metadata.uid != tracked.stale_uid:
            tracked.update(Phase("failed", "Deleted", "the pod was deleted"))

    async def start(
        self, spec: SandboxSpec, *, sandbox_id: str, token_sha256: str, tls: Identity | None = None
    ) -> KubernetesInstance:
        """Create the pod and return when its executor answers at the pod IP."""
        await self._connect()
        assert self._watch_ready is not None
        await self._watch_ready.wait()
        image_volumes = await self._use_image_volumes(spec, sandbox_id, token_sha256)
        tracked = _Tracked(sandbox_id)
        try:
            return await self._start(spec, tracked, token_sha256, tls, image_volumes=image_volumes)
        except SandboxStartError as exc:
            if not image_volumes:
                raise
            if not self._image_volumes_failed(exc):
                raise self._name_the_volume(exc, spec) from exc
            log.warning(
                "sandbox %s: its container did not start with the runtime mounted as an image volume (%s); "
                "using init containers from now on (KubernetesConfig.injection='init-container' says so up front)",
                sandbox_id,
                exc,
            )
            self.image_volumes = False
            # The same name again (the first pod is gone: deleted with no grace period); its late events ignored.
            retry = _Tracked(sandbox_id)
            retry.t0, retry.stale_uid = tracked.t0, tracked.uid
            return await self._start(spec, retry, token_sha256, tls, image_volumes=False)

    def _manifest(
        self, spec: SandboxSpec, sandbox_id: str, token_sha256: str, tls: Identity | None, *, image_volumes: bool
    ) -> dict[str, Any]:
        return pod_manifest(
            spec,
            name=sandbox_id,
            namespace=self.config.namespace,
            session_id=self.session_id,
            token_sha256=token_sha256,
            injector_image=self.config.injector_image,
            launcher=bundle.launcher(),
            install=bundle.install(),
            bundle_path=bundle.MOUNT,
            port=self.config.executor_port,
            created_at=time.time(),
            owner=self._owner,
            tls_pem=tls.pem if tls is not None else None,
            tools_image=self.config.tools_image,
            image_volumes=image_volumes,
            runtime_subpath=self._runtime_subpath,
            **pod_options(self.config),
        )

    async def _use_image_volumes(self, spec: SandboxSpec, sandbox_id: str, token_sha256: str) -> bool:
        """Whether this start mounts the runtime as an image volume; for "auto", the API server is asked once."""
        if self.image_volumes is None:
            probe = self._image_volumes_probe
            if probe is None:
                manifest = self._manifest(spec, sandbox_id, token_sha256, None, image_volumes=True)
                probe = self._image_volumes_probe = asyncio.create_task(self._dry_run(manifest))
            try:
                accepted = await asyncio.shield(probe)
            except BaseException:
                if self._image_volumes_probe is probe:  # a transient failure: the next start asks again
                    self._image_volumes_probe = None
                raise
            if accepted is None:  # this pod is refused for another reason, which its create will report
                if self._image_volumes_probe is probe:
                    self._image_volumes_probe = None
                return False
            if self.image_volumes is None:
                self.image_volumes = accepted
        return self.image_volumes

    async def _dry_run(self, manifest: dict[str, Any]) -> bool | None:
        """Whether the API server accepts this pod (a dry-run create: validated, admitted, not stored).

        An API server without the ImageVolume gate drops the volumes' ``image`` source and refuses the pod
        as having a volume of no type (422); Pod Security "restricted" may refuse the volume type (403). A
        refusal for anything else is the real create's to report: it does not depend on the volumes.
        """
        from kubernetes_asyncio.client.exceptions import ApiException

        try:
            resp = await self._call(
                "dry-run", self._core.create_namespaced_pod, self.config.namespace, manifest, dry_run="All"
            )
            resp.release()
        except ApiException as exc:
            body = str(exc.body)
            refused = (exc.status in (400, 422) and "volumes" in body) or (
                exc.status == 403 and "restricted volume type" in body
            )
            if not refused:
                if exc.status in (400, 403, 422):
                    return None
                raise
            log.info("the API server refuses image volumes (%s): using init containers", _status_message(exc.body))
            return False
        return True

    def _name_the_volume(self, exc: SandboxStartError, spec: SandboxSpec) -> SandboxStartError:
        """``exc``, saying which image volume it is about where the kubelet's message only names an image."""
        images = {self.config.injector_image: "the injector image, KubernetesConfig.injector_image,"}
        if spec.tools:
            images[self.config.tools_image] = "the tools image of tools=[...], KubernetesConfig.tools_image,"
        message = str(exc)
        which = [what for image, what in images.items() if f'"{image}"' in message]
        if which:
            message += f" ({which[0]} mounted as an image volume)"
        return SandboxStartError(message, sandbox_id=exc.sandbox_id, reason=exc.reason)

    def _image_volumes_failed(self, exc: SandboxStartError) -> bool:
        """Whether "auto" should retry a failed start with init containers.

        That is when the sandbox container could not be made or started before any pod with image volumes
        has started here: a runtime without them.
        """
        return self.config.injection == "auto" and not self._image_volumes_work and exc.reason in _CONTAINER_FAULTS

    async def _start(
        self, spec: SandboxSpec, tracked: _Tracked, token_sha256: str, tls: Identity | None, *, image_volumes: bool
    ) -> KubernetesInstance:
        sandbox_id = tracked.name
        manifest = self._manifest(spec, sandbox_id, token_sha256, tls, image_volumes=image_volumes)
        ssl = pin(tls.fingerprint if tls is not None else None)
        scheme = "http" if tls is None else "https"
        self._tracked[sandbox_id] = tracked
        forward: PortForward | None = None
        try:
            tracked.uid = await self._create(manifest)
            tracked.mark("created")
            ip = await self._wait_running(tracked, spec.start_timeout)
            base_url, forward = await self._route(
                sandbox_id, f"{scheme}://{ip}:{self.config.executor_port}", ssl, min(3.0, spec.start_timeout)
            )
            await self._wait_executor(tracked, base_url, spec.start_timeout, ssl)
        except BaseException:
            if forward is not None:
                await forward.close()
            await finish(self.delete_pod(sandbox_id))
            raise
        if image_volumes:
            self._image_volumes_work = True
        return KubernetesInstance(self, tracked, base_url, forward)

    async def _route(
        self, name: str, base_url: str, ssl: aiohttp.Fingerprint | bool, within: float
    ) -> tuple[str, PortForward | None]:
        """Where this client reaches a pod's executor at ``base_url``: directly, or through a port-forward.

        With ``transport="auto"`` the first pod settles it: pod IPs answer from
        inside the cluster network; from elsewhere, tunnel.
        """
        if self.transport == "auto":
            if await self._answers(base_url, within, ssl):
                self.transport = "direct"
            else:
                self.transport = "port-forward"
                log.info("pod IPs are not reachable from here: using port-forward through the API server")
        if self.transport != "port-forward":
            return base_url, None
        scheme, _, address = base_url.partition("://")
        forward = PortForward(self._ws_core, self.config.namespace, name, int(address.rsplit(":", 1)[1]))
        try:
            return scheme + (await forward.start()).removeprefix("http"), forward
        except BaseException:
            await forward.close()
            raise

    async def pod_phase(self, name: str) -> Phase:
        """A pod's phase read from the API server (``Deleted`` if it is gone)."""
        from kubernetes_asyncio.client.exceptions import ApiException

        try:
            resp = await self._call("get", self._core.read_namespaced_pod, name, self.config.namespace)
            async with resp:
                pod = _POD.decode(await resp.read())
        except ApiException as exc:
            if exc.status != 404:
                raise
            return Phase("failed", "Deleted", "the pod does not exist")
        if pod.metadata.labels.get(MANAGED_BY) != "orchard" or pod.metadata.name != name:
            raise InvalidHandle(f"pod {name} in namespace {self.config.namespace} is not an Orchard sandbox")
        return classify(pod)

    async def attach(self, handle: HandleFields, *, owner: bool) -> KubernetesInstance:
        """The running sandbox pod the handle names, reached by this client's own transport."""
        name = handle.sandbox_id
        if handle.namespace != self.config.namespace:
            raise ConfigError(
                f"sandbox {name} is in namespace {handle.namespace!r} and this Client's is "
                f"{self.config.namespace!r}: attach it with Client('kubernetes', namespace={handle.namespace!r})"
            )
        await self._connect()
        phase = await self.pod_phase(name)
        if phase.state != "running" or not phase.pod_ip:
            raise SandboxLost(
                f"sandbox {name}: {phase.reason or phase.state}: {phase.message or 'the pod is not running'}",
                sandbox_id=name,
                reason=phase.reason or phase.state,
            )
        assert handle.port is not None
        ssl = pin(handle.fingerprint)
        base_url = f"https://{phase.pod_ip}:{handle.port}"
        tracked = _Tracked(name)
        tracked.running.set_result(phase.pod_ip)
        # The creator's port-forward is a listener in its own process: this client routes on its own.
        base_url, forward = await self._route(name, base_url, ssl, 3.0)
        return KubernetesInstance(self, tracked, base_url, forward, attached=True, owned=owner)

    async def claim(self, spec: SandboxSpec, *, token_sha256: str) -> tuple[KubernetesInstance, bytes] | None:
        """A ready pod of the shared pool ``config.pool`` made this session's, and its TLS fingerprint.

        None when there is none to take (no keeper, no Secret, an empty pool,
        no pod of this spec): the caller starts one cold. See ``k8s_pool``.
        """
        from kubernetes_asyncio.client.exceptions import ApiException

        from . import k8s_pool

        pool = self.config.pool
        assert pool is not None
        t0 = time.monotonic()
        await self._connect()
        assert self._owner is not None
        key = await self._read_pool_key()
        if key is None:
            return None
        resp = await self._call(
            "list",
            self._core.list_namespaced_pod,
            self.config.namespace,
            label_selector=k8s_pool.ready_selector(pool, spec),
        )
        pods = _POD_LIST.decode(await resp.read()).items
        listed = time.monotonic() - t0
        random.shuffle(pods)  # claimers racing for the same pod would all but one lose a round trip
        patch = k8s_pool.claim_patch(session_id=self.session_id, owner=self._owner)
        for pod in pods:
            name, phase = pod.metadata.name, classify(pod)
            try:
                fingerprint = bytes.fromhex(pod.metadata.annotations.get(k8s_pool.FINGERPRINT_ANNOTATION, ""))
            except ValueError:
                continue
            if (
                phase.state != "running"
                or not phase.pod_ip
                or len(fingerprint) != 32
                or pod.metadata.deletion_timestamp
            ):
                continue
            tracked = _Tracked(name)
            tracked.t0, tracked.timed = t0, False
            tracked.timings["listed"] = listed
            tracked.running.set_result(phase.pod_ip)
            self._tracked[name] = tracked
            try:
                resp = await self._call("patch", self._core.patch_namespaced_pod, name, self.config.namespace, patch)
                resp.release()
                tracked.mark("won")
            except ApiException as exc:
                self._tracked.pop(name, None)
                if exc.status in (404, 409, 422):  # another claimer won it, or it is gone
                    continue
                raise
            # Ours now (our session's label, our Lease): whatever goes wrong from here deletes it.
            forward: PortForward | None = None
            try:
                ssl = pin(fingerprint)
                base_url, forward = await self._route(
                    name, f"https://{phase.pod_ip}:{self.config.executor_port}", ssl, 3.0
                )
                await self._rekey(base_url, ssl, key, token_sha256)
                tracked.mark("rekeyed")
            except BaseException as exc:
                if forward is not None:
                    await forward.close()
                await finish(self.delete_pod(name))
                if not isinstance(exc, Exception):
                    raise
                # Never the exception's repr: a ClientResponseError's holds the request's headers, the key among them.
                why = f"HTTP {exc.status}" if isinstance(exc, aiohttp.ClientResponseError) else type(exc).__name__
                log.info("pool %s: claimed %s but could not re-key it (%s); trying the next", pool, name, why)
                if isinstance(exc, aiohttp.ClientResponseError) and exc.status == 401:
                    key = await self._read_pool_key(again=True)
                    if key is None:
                        return None
                continue
            return KubernetesInstance(self, tracked, base_url, forward), fingerprint
        return None

    async def _read_pool_key(self, *, again: bool = False) -> str | None:
        """The shared pool's key from its Secret (cached), or None if it cannot be read."""
        from kubernetes_asyncio.client.exceptions import ApiException

        from . import k8s_pool

        if self._pool_key is not None and not again:
            return self._pool_key
        assert self.config.pool is not None
        name = k8s_pool.secret_name(self.config.pool)
        try:
            self._pool_key = await k8s_pool.read_key(self, self.config.pool)
        except (ApiException, KeyError, ValueError) as exc:
            if self._pool_key is None and self._pool_warned:  # said once; a keeper may write it later
                return None
            self._pool_warned = True
            log.warning(
                "pool %s: cannot read the Secret %s (%s); starting sandboxes cold (`orchard pool keep %s` writes it)",
                self.config.pool,
                name,
                getattr(exc, "status", exc),
                self.config.pool,
            )
            self._pool_key = None
        return self._pool_key

    async def _rekey(self, base_url: str, ssl: aiohttp.Fingerprint | bool, key: str, token_sha256: str) -> None:
        """Swap a pooled executor's token from the pool's key to the claimer's."""
        async with self._pool.post(
            f"{base_url}/v1/rekey",
            data=msgspec.json.encode({"token_sha256": token_sha256}),
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=5.0),
            ssl=ssl,
        ) as resp:
            resp.raise_for_status()

    async def _answers(self, base_url: str, within: float, ssl: aiohttp.Fingerprint | bool) -> bool:
        """Whether the pod IP is routable from here (refused counts: the executor is still starting)."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            try:
                async with self._pool.get(
                    f"{base_url}/healthz", timeout=aiohttp.ClientTimeout(total=0.5), ssl=ssl
                ) as resp:
                    return resp.status == 200
            except aiohttp.ClientConnectorError as exc:
                if isinstance(exc.os_error, ConnectionRefusedError):
                    return True
            except (TimeoutError, aiohttp.ClientError):
                pass
            await asyncio.sleep(0.05)
        return False

    async def _create(self, manifest: dict[str, Any]) -> str | None:
        """Create the pod; its uid (None when a retried create had gone through)."""
        from kubernetes_asyncio.client.exceptions import ApiException

        name = manifest["metadata"]["name"]
        try:
            resp = await self._call("create", self._core.create_namespaced_pod, self.config.namespace, manifest)
            async with resp:
                return _POD.decode(await resp.read()).metadata.uid or None
        except ApiException as exc:
            if exc.status == 409:  # a retried create that had gone through
                return None
            if exc.status == 403 and "violates PodSecurity" in str(exc.body):
                raise SandboxStartError(
                    f"sandbox {name}: the namespace's Pod Security admission refused the pod "
                    f"({_status_message(exc.body)}); the default pod, root with a few capabilities, passes "
                    "'baseline'; KubernetesConfig(run_as_user=<uid>) makes it pass 'restricted'",
                    sandbox_id=name,
                    reason="PodSecurity",
                ) from exc
            hint = f"; {_grant(self.config.namespace)}" if exc.status == 403 else ""
            raise SandboxStartError(
                f"sandbox {name}: the API server refused the pod: {exc.status} {exc.reason}: "
                f"{_status_message(exc.body)}{hint}",
                sandbox_id=name,
                reason=f"HTTP{exc.status}",
            ) from exc

    async def _wait_running(self, tracked: _Tracked, timeout: float) -> str:
        waiters: list[asyncio.Future[Any]] = [tracked.running, tracked.failed]
        done, _ = await asyncio.wait(
            waiters,
            timeout=max(0.0, timeout - (time.monotonic() - tracked.t0)),
            return_when=asyncio.FIRST_COMPLETED,
        )
        if tracked.failed in done and not tracked.running.done():
            raise _start_failed(tracked.name, tracked.failed.result())
        if not done:
            stage = "scheduled" if "scheduled" not in tracked.timings else "running"
            # A runtime without user namespaces fails only in the kubelet's events, retried forever.
            hint = (
                " (user_namespaces=True: does the node's runtime support them?)" if self.config.user_namespaces else ""
            )
            raise SandboxTimeout(
                f"sandbox {tracked.name} was not {stage} within start_timeout={timeout:g}s{hint}",
                sandbox_id=tracked.name,
            )
        return tracked.running.result()

    async def _wait_executor(
        self, tracked: _Tracked, base_url: str, timeout: float, ssl: aiohttp.Fingerprint | bool
    ) -> None:
        """Poll the executor's /healthz at the pod IP (milliseconds, no API server)."""
        deadline = tracked.t0 + timeout
        for delay in _retry.poll_delays():
            if tracked.failed.done():
                raise _start_failed(tracked.name, tracked.failed.result())
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with self._pool.get(
                    f"{base_url}/healthz", timeout=aiohttp.ClientTimeout(total=1.0), ssl=ssl
                ) as resp:
                    if resp.status == 200:
                        tracked.mark("executor_ready")
                        return
            if time.monotonic() > deadline:
                raise SandboxTimeout(
                    f"sandbox {tracked.name}: the executor at {base_url} did not answer within "
                    f"start_timeout={timeout:g}s (is the pod network reachable from here?)",
                    sandbox_id=tracked.name,
                )
            await asyncio.sleep(delay)

    async def delete_pod(self, name: str) -> None:
        """Delete a pod now; a pod already gone is fine."""
        from kubernetes_asyncio.client.exceptions import ApiException

        self._tracked.pop(name, None)
        if self._core is None:
            return
        try:
            resp = await self._call(
                "delete", self._core.delete_namespaced_pod, name, self.config.namespace, grace_period_seconds=0
            )
            resp.release()
        except ApiException as exc:
            if exc.status != 404:
                raise

    async def aclose(self) -> None:
        """Stop the watch, give up the session's Lease, close the API clients."""
        for task in (self._watch_task, self._renew_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._owner is not None and self.lost is None:
            # Deleting the Lease lets Kubernetes collect any pod of ours still standing.
            with contextlib.suppress(Exception):
                resp = await self._call(
                    "lease", self._coord.delete_namespaced_lease, self._owner["name"], self.config.namespace
                )
                resp.release()
        await self._close_api()

    async def _close_api(self) -> None:
        if self._api is not None:
            await self._api.close()
            await self._ws_api.close()
            self._api = None


async def _inventory(config: KubernetesConfig) -> tuple[KubernetesBackend, list[Pod], list[Lease], set[str]]:
    """Every Orchard pod and session Lease in the namespace, and the sessions still alive."""
    backend = KubernetesBackend(config, session_id="gc")
    await backend._load()
    try:
        return backend, *await _listed(backend, config)
    except BaseException:
        await backend._close_api()
        raise


async def _listed(backend: KubernetesBackend, config: KubernetesConfig) -> tuple[list[Pod], list[Lease], set[str]]:
    selector = f"{MANAGED_BY}=orchard"
    pods = _POD_LIST.decode(
        await (
            await backend._call("list", backend._core.list_namespaced_pod, config.namespace, label_selector=selector)
        ).read()
    ).items
    leases = msgspec.json.decode(
        await (
            await backend._call(
                "lease", backend._coord.list_namespaced_lease, config.namespace, label_selector=selector
            )
        ).read(),
        type=LeaseList,
    ).items
    if not pods and not leases:  # a missing namespace lists as empty: say so rather than show nothing
        from kubernetes_asyncio.client.exceptions import ApiException

        try:
            (await backend._call("get", backend._core.read_namespace, config.namespace)).release()
        except ApiException as exc:
            if exc.status == 404:
                raise refusal(exc, config.namespace, "read the namespace") from exc
            if exc.status != 403:  # a client Role may not read namespaces: then it cannot tell
                raise
    now = time.time()
    live = {lease.metadata.labels.get(SESSION_LABEL, "") for lease in leases if lease.alive(now)}
    return pods, leases, live


async def list_sandboxes(config: KubernetesConfig) -> list[dict[str, str]]:
    """One row per Orchard pod in the namespace: name, session, phase, image, gc verdict."""
    backend, pods, _, live = await _inventory(config)
    try:
        now = time.time()
        return [
            {
                "name": pod.metadata.name,
                "session": pod.metadata.labels.get(SESSION_LABEL, ""),
                "phase": pod.status.phase,
                "image": pod.metadata.annotations.get(IMAGE_ANNOTATION, ""),
                "created": pod.metadata.creation_timestamp or "",
                "gc": garbage_reason(pod, now, live) or "",
            }
            for pod in pods
        ]
    finally:
        await backend._close_api()


async def collect_garbage(config: KubernetesConfig, *, dry_run: bool = False) -> list[tuple[str, str]]:
    """Delete finished, expired and orphaned sandbox pods and dead sessions' Leases.

    Returns (name, reason) for everything deleted (or that would be, with ``dry_run``).
    """
    backend, pods, leases, live = await _inventory(config)
    try:
        now = time.time()
        doomed = [(pod.metadata.name, why) for pod in pods if (why := garbage_reason(pod, now, live))]
        dead = [(lease.metadata.name, "session lease expired") for lease in leases if not lease.alive(now)]
        if not dry_run:
            for name, _ in doomed:
                await backend.delete_pod(name)
            for name, _ in dead:
                with contextlib.suppress(Exception):
                    resp = await backend._call("lease", backend._coord.delete_namespaced_lease, name, config.namespace)
                    resp.release()
        return doomed + dead
    finally:
        await backend._close_api()


async def _discover(api: Any) -> tuple[list[str], list[str], dict[str, str] | None, list[str]]:
    """The API server's addresses, the cluster's ranges, kube-dns's pod labels, and what was not found.

    Ranges: the nodes' pod CIDRs and addresses, the ServiceCIDRs (or, before
    Kubernetes 1.33, the ``kubernetes`` Service's IP). Each lookup the
    caller's credentials cannot do is reported, not fatal.
    """
    from kubernetes_asyncio import client
    from kubernetes_asyncio.client.exceptions import ApiException

    core, net = client.CoreV1Api(api), client.NetworkingV1Api(api)
    api_server: list[str] = []
    ranges: list[str] = []
    missing: list[str] = []
    try:
        service = await core.read_namespaced_service("kubernetes", "default")
        api_server += [ip for ip in service.spec.cluster_ips or [] if ip != "None"]
        slices = await client.DiscoveryV1Api(api).list_namespaced_endpoint_slice(
            "default", label_selector="kubernetes.io/service-name=kubernetes"
        )
        api_server += [a for s in slices.items for e in s.endpoints or [] for a in e.addresses or []]
    except ApiException as exc:
        missing.append(f"the API server's addresses ({exc.status} {exc.reason})")
    try:
        pod_ranges = []
        nodes = (await core.list_node()).items
        for node in nodes:
            pod_ranges += node.spec.pod_cidrs or ([node.spec.pod_cidr] if node.spec.pod_cidr else [])
            ranges += [a.address for a in node.status.addresses or [] if a.type in ("InternalIP", "ExternalIP")]
        userns = [
            n.metadata.name
            for n in nodes
            if any(h.features and h.features.user_namespaces for h in n.status.runtime_handlers or [])
        ]
        if len(userns) < len(nodes):
            log.warning(
                "orchard k8s setup: %d of %d nodes report user namespace support (KubernetesConfig.user_namespaces)",
                len(userns),
                len(nodes),
            )
        if not pod_ranges:  # the network plugin allocates pod addresses itself
            missing.append("the pod range (no node has a podCIDR)")
        ranges += pod_ranges
    except ApiException as exc:
        missing.append(f"the nodes' pod ranges and addresses ({exc.status} {exc.reason})")
    try:
        ranges += [c for sc in (await net.list_service_cidr()).items for c in sc.spec.cidrs or []]
    except ApiException as exc:
        if exc.status != 404:  # 404: a cluster older than 1.33; the kubernetes Service's IP stands in
            missing.append(f"the service ranges ({exc.status} {exc.reason})")
    dns: dict[str, str] | None = None
    try:
        dns = dict((await core.read_namespaced_service("kube-dns", "kube-system")).spec.selector or {}) or None
    except ApiException as exc:
        if exc.status != 404:
            missing.append(f"the kube-dns Service ({exc.status} {exc.reason})")
    return api_server, ranges, dns, missing


async def _setup_namespace(backend: KubernetesBackend, pod_security: str | None, create: bool) -> None:
    """Check that setup's namespace exists, or create it (labelled for ``pod_security``) when asked to."""
    from kubernetes_asyncio import client
    from kubernetes_asyncio.client.exceptions import ApiException

    core = client.CoreV1Api(backend._api)
    name = backend.config.namespace
    try:
        await core.read_namespace(name)
    except ApiException as exc:
        if exc.status != 404:
            raise refusal(exc, name, "read the namespace") from exc
        if not create:
            raise ConfigError(
                f'namespace "{name}" not found: create it (kubectl create namespace {name}), '
                "or pass --create-namespace (create_namespace=True)"
            ) from None
        labels = pod_security_labels(pod_security) if pod_security is not None else {}
        await core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels=labels)))


async def setup(
    config: KubernetesConfig,
    *,
    service_account: str | None = None,
    dry_run: bool = False,
    pod_security: str | None = "baseline",
    client_cidrs: list[str] | None = None,
    client_namespaces: list[str] | None = None,
    cluster_cidrs: list[str] | None = None,
    allow_metadata: bool = False,
    allow_api_server: bool = False,
    allow_cluster: bool = False,
    pools: list[str] | None = None,
    create_namespace: bool = False,
) -> list[dict[str, Any]]:
    """Label the namespace for Pod Security and write the client Role, a RoleBinding, the NetworkPolicies.

    Args:
        config: Names the cluster, the namespace and the executor port.
        service_account: Also bind the client Role to this service account.
        dry_run: Return the objects without writing them (nothing is discovered:
            pass the ranges to exclude in ``cluster_cidrs``).
        pod_security: The Pod Security level the namespace enforces ("baseline"
            admits the default pods; "restricted" needs ``run_as_user``), or None
            to leave its labels alone. Warnings and audit are always "restricted".
        client_cidrs: Addresses besides client pods that may reach executors.
        client_namespaces: Other namespaces whose pods labelled
            ``orchard.dev/client=true`` may reach executors.
        cluster_cidrs: Ranges ``network=True`` sandboxes may not reach, on top of
            those discovered (the API server, pod and service ranges, nodes).
        allow_metadata: Let ``network=True`` sandboxes reach link-local addresses
            (the cloud metadata service).
        allow_api_server: Let them reach the API server.
        allow_cluster: Let them reach the cluster's pods, services and nodes.
        pools: Shared pools (``orchard pool keep``): each gets the Secret with its
            key (kept if it exists), which the client Role may read.
        create_namespace: Create the namespace if it does not exist (else that is a ``ConfigError``).

    Returns:
        The objects written, the Namespace (its labels only) first.
    """
    from kubernetes_asyncio.client.exceptions import ApiException

    if pod_security not in (None, "privileged", "baseline", "restricted"):
        raise ConfigError(f"pod_security={pod_security!r} is not one of privileged, baseline, restricted")
    backend: KubernetesBackend | None = None
    api_server: list[str] = []
    discovered: list[str] = []
    dns: dict[str, str] | None = None
    if not dry_run:
        backend = KubernetesBackend(config, session_id="setup")
        await backend._load()
        try:
            await _setup_namespace(backend, pod_security, create_namespace)
        except BaseException:
            await backend._close_api()
            raise
        api_server, discovered, dns, missing = await _discover(backend._api)
        for what in missing:
            log.warning("orchard k8s setup: cannot find %s; pass the ranges to exclude in cluster_cidrs", what)
    try:
        excepts = egress_exceptions(
            api_server=api_server,
            cluster_cidrs=[*discovered, *(cluster_cidrs or [])],
            allow_metadata=allow_metadata,
            allow_api_server=allow_api_server,
            allow_cluster=allow_cluster,
        )
        policies = network_policies(
            config.namespace,
            port=config.executor_port,
            client_cidrs=client_cidrs or [],
            client_namespaces=client_namespaces or [],
            egress_except=excepts,
            dns=dns,
        )
    except ValueError as exc:  # a malformed CIDR or address
        if backend is not None:
            await backend._close_api()
        raise ConfigError(f"orchard k8s setup: {exc}") from None
    from . import k8s_pool

    pools = [k8s_pool.check_name(p) for p in pools or []]
    objects = [
        client_role(config.namespace, [k8s_pool.secret_name(p) for p in pools]),
        *policies,
        *(k8s_pool.pool_secret(config.namespace, p) for p in pools),
    ]
    if service_account:
        objects.insert(1, role_binding(config.namespace, service_account=service_account))
    if pod_security is not None:
        labels = pod_security_labels(pod_security)
        objects.insert(
            0, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": config.namespace, "labels": labels}}
        )
    if backend is None:
        return objects
    from kubernetes_asyncio import client

    core = client.CoreV1Api(backend._api)
    rbac = client.RbacAuthorizationV1Api(backend._api)
    net = client.NetworkingV1Api(backend._api)
    ops: dict[str, tuple[Any, Any]] = {
        "Role": (rbac.create_namespaced_role, rbac.replace_namespaced_role),
        "RoleBinding": (rbac.create_namespaced_role_binding, rbac.replace_namespaced_role_binding),
        "NetworkPolicy": (net.create_namespaced_network_policy, net.replace_namespaced_network_policy),
        "Secret": (core.create_namespaced_secret, None),  # an existing key stays: pods in the pool accept it
    }
    try:
        for obj in objects:
            if obj["kind"] == "Namespace":  # a merge patch: the namespace's other labels stay
                await core.patch_namespace(config.namespace, {"metadata": {"labels": obj["metadata"]["labels"]}})
                continue
            create, replace = ops[obj["kind"]]
            try:
                await create(config.namespace, obj)
            except ApiException as exc:
                if exc.status != 409:
                    raise
                if replace is not None:
                    await replace(obj["metadata"]["name"], config.namespace, obj)
    finally:
        await backend._close_api()
    return objects
