"""Warm pools shared by every client of a namespace, with no server: ``orchard pool keep`` and the claim.

A keeper (any process running ``orchard pool keep NAME``; a Lease elects one
at a time) keeps ``size`` started, never-used pods of one image and spec. Its
pods carry the pool's labels, are owned by the pool's Lease, and accept the
pool's key, kept in the Secret ``orchard-pool-NAME``.

A client with ``KubernetesConfig(pool=NAME)`` claims one in three steps:
1. A JSON patch of the pod that tests its state label is still ``ready`` and
   sets it to ``claimed``, moves it to the claimer's session and hands its
   ownership to the claimer's Lease. The API server applies a patch
   atomically, so of many claimers racing for one pod exactly one passes the
   test; the others get 422 and take the next pod. (The test is on the label,
   not on the resourceVersion: the kubelet's status updates change that, and
   would fail claims that nobody else made.)
2. A re-key of the executor (``POST /v1/rekey``, authenticated with the pool's
   key) to the claimer's own token: from then on the pool's key, which every
   client of the namespace may read, no longer opens it.
3. The pod is now one of the claimer's session: its watch sees it, its Lease
   owns it, and it is deleted like any sandbox the claimer started.

With no keeper, no Secret or no ready pod, a claim returns None and the
client starts the sandbox cold.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import hashlib
import logging
import re
import secrets
import time
from typing import Any

import aiohttp
import msgspec

from .._finish import finish
from .._spec import SandboxSpec
from .._tls import make_identity
from ..errors import ConfigError
from . import KubernetesConfig
from .k8s_pod import MANAGED_BY, SESSION_LABEL, Lease, PodList, classify

log = logging.getLogger("orchard.pool")

POOL_LABEL = "orchard.dev/pool"
#: A hash of the spec the pool's pods were started with: a claim takes only a pod of its own spec.
POOL_SPEC_LABEL = "orchard.dev/pool-spec"
#: "starting", "ready" (claimable) or "claimed".
POOL_STATE_LABEL = "orchard.dev/pool-state"
#: The SHA-256 of the executor's TLS certificate, which a claimer pins.
FINGERPRINT_ANNOTATION = "orchard.dev/tls-sha256"
SECRET_KEY = "key"
BACKOFF_FIRST, BACKOFF_MAX = 0.5, 30.0
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?")


def check_name(pool: str) -> str:
    """A pool name: a DNS label of at most 40 characters (it goes into pod, Lease and Secret names)."""
    if not isinstance(pool, str) or not _NAME.fullmatch(pool):
        raise ConfigError(
            f"pool={pool!r}: a pool name is 1 to 40 lowercase letters, digits and '-', "
            "starting and ending with a letter or digit"
        )
    return pool


def session(pool: str) -> str:
    """The session label of a pool's pods and Lease (so ``orchard gc`` knows them alive while kept)."""
    return f"pool-{pool}"


def lease_name(pool: str) -> str:
    return f"orchard-pool-{pool}"


def secret_name(pool: str) -> str:
    return f"orchard-pool-{pool}"


def spec_hash(spec: SandboxSpec) -> str:
    """A label value naming the spec (the image included), the same in every process."""
    return hashlib.sha256(msgspec.json.encode(msgspec.to_builtins(spec), order="sorted")).hexdigest()[:32]


def ready_selector(pool: str, spec: SandboxSpec) -> str:
    return f"{POOL_LABEL}={pool},{POOL_SPEC_LABEL}={spec_hash(spec)},{POOL_STATE_LABEL}=ready"


def claim_patch(*, session_id: str, owner: dict[str, str]) -> list[dict[str, Any]]:
    """The compare-and-swap that makes a ready pool pod the claimer's: it fails (422) if another claimed it."""
    state = "/metadata/labels/" + POOL_STATE_LABEL.replace("~", "~0").replace("/", "~1")
    return [
        {"op": "test", "path": state, "value": "ready"},
        {"op": "replace", "path": state, "value": "claimed"},
        {"op": "replace", "path": "/metadata/labels/" + SESSION_LABEL.replace("/", "~1"), "value": session_id},
        {"op": "replace", "path": "/metadata/ownerReferences", "value": [owner]},
    ]


def pool_secret(namespace: str, pool: str) -> dict[str, Any]:
    """The Secret holding a pool's key (written by ``orchard k8s setup --pool`` or the first keeper)."""
    key = base64.b64encode(secrets.token_urlsafe(32).encode()).decode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": secret_name(pool),
            "namespace": namespace,
            "labels": {MANAGED_BY: "orchard", POOL_LABEL: pool},
        },
        "type": "Opaque",
        "data": {SECRET_KEY: key},
    }


async def read_key(backend: Any, pool: str) -> str:
    """The pool's key from its Secret (``ApiException`` if it cannot be read; ``KeyError`` if it holds none)."""
    resp = await backend._call("get", backend._core.read_namespaced_secret, secret_name(pool), backend.config.namespace)
    async with resp:
        data = msgspec.json.decode(await resp.read())["data"]
    return base64.b64decode(data[SECRET_KEY]).decode()


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _pool_lease(namespace: str, pool: str, holder: str, duration: int, resource_version: str = "") -> dict[str, Any]:
    now = _now()
    meta: dict[str, Any] = {
        "name": lease_name(pool),
        "namespace": namespace,
        "labels": {MANAGED_BY: "orchard", SESSION_LABEL: session(pool), POOL_LABEL: pool},
    }
    if resource_version:
        meta["resourceVersion"] = resource_version
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": meta,
        "spec": {"holderIdentity": holder, "leaseDurationSeconds": duration, "acquireTime": now, "renewTime": now},
    }


class Keeper:
    """Keeps one pool at size while it holds the pool's Lease (``orchard pool keep``)."""

    def __init__(
        self, config: KubernetesConfig, pool: str, spec: SandboxSpec, size: int, *, max_starting: int = 4
    ) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ConfigError(f"size={size!r}: the pool size must be a whole number >= 0")
        if isinstance(max_starting, bool) or not isinstance(max_starting, int) or max_starting < 1:
            raise ConfigError(f"max_starting={max_starting!r} must be a whole number >= 1")
        #: Pods started at once: a refill after a burst of claims must not starve the claims' own calls.
        self.max_starting = max_starting
        self.config = config
        self.pool = check_name(pool)
        self.spec = spec
        self.size = size
        self.identity = f"{session(pool)}-{secrets.token_hex(4)}"
        self._spec_hash = spec_hash(spec)
        self._starting: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._delay = 0.0
        self._wake = asyncio.Event()
        limits = [t for t in (spec.idle_timeout, spec.ttl) if t is not None]
        #: A free pod is replaced at half its idle timeout or ttl, before its executor would end.
        self.max_age = min(limits) / 2 if limits else None
        #: Ready pods at the last round.
        self.free = 0
        self._delay_until = 0.0
        #: Pods started, and the last start's error (None once one succeeds).
        self.starts = 0
        self.last_error: BaseException | None = None

    async def run(self, *, ready: asyncio.Event | None = None) -> None:
        """Wait to be elected, then keep the pool until cancelled or the Lease is lost (``ConfigError``).

        ``ready`` is set each time the pool is full.
        """
        from .kubernetes import KubernetesBackend

        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), cookie_jar=aiohttp.DummyCookieJar()
        ) as http:
            backend = KubernetesBackend(self.config, session_id=session(self.pool), http=http)
            backend.elect = self._elect
            backend.holder = self.identity
            try:
                await backend._connect()
                key = await self._key(backend)
                log.info("keeping pool %s: %d of %s (as %s)", self.pool, self.size, self.spec.image, self.identity)
                while True:
                    if backend.lost is not None:
                        raise ConfigError(f"pool {self.pool}: {backend.lost}")
                    await self._tend(backend, key)
                    if ready is not None and self.free >= self.size and not self._starting:
                        ready.set()
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(1.0):
                            await self._wake.wait()
            finally:
                for task in self._tasks:
                    task.cancel()
                await asyncio.gather(*self._tasks, return_exceptions=True)
                # Deleting the Lease (if held) lets Kubernetes delete the free pods it owns.
                await finish(backend.aclose())

    async def _elect(self, backend: Any) -> dict[str, str]:
        """Hold the pool's Lease: create it, or take it over once its holder stops renewing it."""
        from kubernetes_asyncio.client.exceptions import ApiException

        ns, duration = self.config.namespace, self.config.lease_seconds
        waiting = False
        while True:
            try:
                try:
                    resp = await backend._call(
                        "lease",
                        backend._coord.create_namespaced_lease,
                        ns,
                        _pool_lease(ns, self.pool, self.identity, duration),
                    )
                except ApiException as exc:
                    if exc.status != 409:
                        raise
                    resp = await backend._call("lease", backend._coord.read_namespaced_lease, lease_name(self.pool), ns)
                    lease = msgspec.json.decode(await resp.read(), type=Lease)
                    if lease.spec.holder_identity != self.identity and lease.alive(time.time()):
                        if not waiting:
                            log.info("pool %s is kept by %s: standing by", self.pool, lease.spec.holder_identity)
                            waiting = True
                        await asyncio.sleep(max(1.0, duration / 4))
                        continue
                    body = _pool_lease(ns, self.pool, self.identity, duration, lease.metadata.resource_version)
                    resp = await backend._call(
                        "lease", backend._coord.replace_namespaced_lease, lease_name(self.pool), ns, body
                    )
                meta = msgspec.json.decode(await resp.read())["metadata"]
            except ApiException as exc:
                if exc.status == 409:  # another keeper took it over first
                    continue
                raise ConfigError(
                    f"pool {self.pool}: cannot hold the Lease {lease_name(self.pool)} in namespace {ns}: "
                    f"{exc.status} {exc.reason}"
                ) from exc
            return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "name": meta["name"], "uid": meta["uid"]}

    async def _key(self, backend: Any) -> str:
        """The pool's key from its Secret, written now if there is none."""
        from kubernetes_asyncio.client.exceptions import ApiException

        ns = self.config.namespace
        try:
            try:
                return await read_key(backend, self.pool)
            except ApiException as exc:
                if exc.status != 404:
                    raise
                with contextlib.suppress(ApiException):  # 409: another keeper wrote it first
                    resp = await backend._call(
                        "create", backend._core.create_namespaced_secret, ns, pool_secret(ns, self.pool)
                    )
                    resp.release()
                return await read_key(backend, self.pool)
        except (KeyError, ValueError) as exc:  # the Secret is there, but holds no key of ours
            raise ConfigError(
                f"pool {self.pool}: the Secret {secret_name(self.pool)} in namespace {ns} holds no valid "
                f"'{SECRET_KEY}' ({type(exc).__name__}): delete it, and `orchard k8s setup -n {ns} --pool "
                f"{self.pool}` writes a new one"
            ) from exc
        except ApiException as exc:
            raise ConfigError(
                f"pool {self.pool}: cannot read or write the Secret {secret_name(self.pool)} in namespace {ns} "
                f"({exc.status} {exc.reason}): write it with `orchard k8s setup -n {ns} --pool {self.pool}`"
            ) from exc

    async def _tend(self, backend: Any, key: str) -> None:
        """One round: delete dead, stale and orphaned pool pods, start what is missing."""
        # Taken before the list: a start that ends while the list is read shows there as "starting".
        starting = set(self._starting)
        resp = await backend._call(
            "list",
            backend._core.list_namespaced_pod,
            self.config.namespace,
            label_selector=f"{POOL_LABEL}={self.pool},{SESSION_LABEL}={session(self.pool)}",
        )
        pods = msgspec.json.decode(await resp.read(), type=PodList).items
        now = time.time()
        free = 0
        for pod in pods:
            name, labels = pod.metadata.name, pod.metadata.labels
            if pod.metadata.deletion_timestamp or name in starting or name in self._starting:
                continue
            why = None
            if labels.get(POOL_SPEC_LABEL) != self._spec_hash:
                why = "another spec"
            elif labels.get(POOL_STATE_LABEL) != "ready":
                why = "left starting by an earlier keeper"
            elif classify(pod).state == "failed":
                why = "failed"
            elif self.max_age is not None and pod.metadata.creation_timestamp:
                born = datetime.datetime.fromisoformat(pod.metadata.creation_timestamp).timestamp()
                if now - born > self.max_age:
                    why = "near its idle timeout or ttl"
            if why is None:
                free += 1
                continue
            log.info("pool %s: deleting %s (%s)", self.pool, name, why)
            await backend.delete_pod(name)
        self.free = free
        # A start that ended after the snapshot is ready but was skipped above: count it as in flight.
        in_flight = starting | self._starting
        missing = min(self.size - free - len(in_flight), self.max_starting - len(self._starting))
        if missing <= 0 or self._delay_until > time.monotonic():
            return
        for _ in range(missing):
            name = f"sb-{session(self.pool)}-{secrets.token_hex(4)}"
            self._starting.add(name)
            task = asyncio.get_running_loop().create_task(self._start(backend, name, key))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _start(self, backend: Any, name: str, key: str) -> None:
        tls = make_identity(name)
        spec = msgspec.structs.replace(
            self.spec,
            labels={**self.spec.labels, POOL_LABEL: self.pool, POOL_SPEC_LABEL: self._spec_hash},
            annotations={**self.spec.annotations, FINGERPRINT_ANNOTATION: tls.fingerprint.hex()},
        )
        self.starts += 1
        try:
            labels = spec.labels | {POOL_STATE_LABEL: "starting"}
            await backend.start(
                msgspec.structs.replace(spec, labels=labels),
                sandbox_id=name,
                token_sha256=hashlib.sha256(key.encode()).hexdigest(),
                tls=tls,
            )
            # Claimable only now that its executor answers.
            resp = await backend._call(
                "patch",
                backend._core.patch_namespaced_pod,
                name,
                self.config.namespace,
                {"metadata": {"labels": {POOL_STATE_LABEL: "ready"}}},
            )
            resp.release()
            backend._tracked.pop(name, None)
            self.last_error = None
            self._delay = 0.0
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.last_error = exc
            self._delay = min(max(2 * self._delay, BACKOFF_FIRST), BACKOFF_MAX)
            self._delay_until = time.monotonic() + self._delay
            log.warning("pool %s: a start failed (%s); next in %.1fs", self.pool, exc, self._delay)
            with contextlib.suppress(Exception):
                await backend.delete_pod(name)
        finally:
            self._starting.discard(name)
            self._wake.set()
