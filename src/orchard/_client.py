"""The Client: one per process, owning the HTTP pool, the backend and its sandboxes."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import secrets
import time
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

import aiohttp

from orchard_executor.protocol import Info

from . import _handle, _tls, _trace, _warm
from ._backends import BackendConfig, build_backend, make_config
from ._backends.base import Backend, Instance
from ._finish import finish
from ._rpc import LIVENESS_TIMEOUT, READ_TIMEOUT, ExecutorClient
from ._sandbox import Sandbox
from ._spec import SandboxSpec, make_spec
from .errors import ConfigError, InvalidHandle, OrchardError, SandboxClosed, SandboxTimeout

if TYPE_CHECKING:
    from ._snapshot import Snapshot
    from .gateway import ModelGateway
    from .gateway._wiring import Wiring


class Client:
    """Starts sandboxes on a backend and talks to them.

    Example::

        async with orchard.Client() as client:              # backend="local"
            async with client.sandbox("python:3.12") as sb:
                print((await sb.exec("echo hi")).stdout)

    Args:
        backend: a backend name (``"local"``) or a backend config object.
        max_concurrent_starts: sandboxes being started at once; a burst of
            thousands waits its turn instead of flattening the backend.
        read_timeout: seconds an executor may take to answer a call that runs
            no command (stat, info, a file write once its data is sent), and
            to send any whole reply once it has begun; a command with a
            ``timeout`` gets that timeout plus this. Past it the call raises
            ``SandboxTimeout``. Default 60.
        liveness_timeout: calls without a deadline of their own (``exec``
            without ``timeout``, ``Process.wait()``) may run for hours, so
            instead the executor is watched: after this many seconds of
            silence while a call waits, the client probes its ``/healthz`` on
            another connection, and if no answer comes within this many
            seconds the waiting calls raise ``SandboxTimeout``. A frozen or
            unreachable executor is so detected within twice this (on
            kubernetes, plus up to 3 s waiting for the pod's watch to say
            why). Default 20.
        http_session: an aiohttp session to use instead of the Client's own
            (the caller then closes it).
        warm: warm pools, ``{image: size}`` or ``{image: {"size": n,
            **spec}}``: that many started, never-used sandboxes of the image
            are kept ready (refilled in the background from when the Client
            opens) and ``create`` with that image and the same spec claims
            one at once instead of starting it. An empty pool, another spec,
            or a pooled sandbox that stopped answering means a cold start,
            never an error. ``await client.wait_warm()`` waits until the
            pools are full; ``client.warm_status()`` tells how they are.
        **backend_options: options of the named backend's config.
    """

    def __init__(
        self,
        backend: str | BackendConfig = "local",
        *,
        max_concurrent_starts: int = 64,
        read_timeout: float = READ_TIMEOUT,
        liveness_timeout: float = LIVENESS_TIMEOUT,
        http_session: aiohttp.ClientSession | None = None,
        warm: Mapping[str, int | Mapping[str, Any]] | None = None,
        **backend_options: Any,
    ) -> None:
        if max_concurrent_starts < 1:
            raise ConfigError("max_concurrent_starts must be at least 1")
        for name, value in (("read_timeout", read_timeout), ("liveness_timeout", liveness_timeout)):
            if not 0 < value < float("inf"):
                raise ConfigError(f"{name}={value!r} must be a positive number of seconds")
        self._read_timeout = read_timeout
        self._liveness_timeout = liveness_timeout
        self.config = make_config(backend, backend_options)
        #: Identifies this client's sandboxes (labels, names).
        self.session_id = secrets.token_hex(4)
        self._backend: Backend | None = None
        self._http = http_session
        self._owns_http = http_session is None
        self._starts = asyncio.Semaphore(max_concurrent_starts)
        self._live: dict[str, Sandbox] = {}
        #: Cold starts in flight: closing the Client cancels them and waits until they have unwound.
        self._starting: set[asyncio.Task[Sandbox]] = set()
        self._closed = False
        self._pools = {
            image: _warm.Pool(spec, size, functools.partial(self._start_cold, spec))
            for image, (size, spec) in _warm.parse(warm).items()
        }

    async def __aenter__(self) -> Client:
        await self._ensure_open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()  # it finishes whatever cancels come

    async def _ensure_open(self) -> tuple[Backend, aiohttp.ClientSession]:
        if self._closed:
            raise SandboxClosed("this Client is closed")
        if self._http is None:
            self._http = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
                cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=False,
            )
        if self._backend is None:
            try:
                self._backend = build_backend(self.config, session_id=self.session_id, http=self._http)
            except BaseException:
                if self._owns_http:  # a backend that cannot be built leaves no session open behind it
                    http, self._http = self._http, None
                    await http.close()
                raise
            for pool in self._pools.values():
                pool.open()
        return self._backend, self._http

    def warm_status(self) -> dict[str, dict[str, Any]]:
        """Image -> its warm pool now: ``size``, ``ready``, ``starts`` (attempted) and ``last_error`` (or None)."""
        return {image: pool.status() for image, pool in self._pools.items()}

    async def wait_warm(self, timeout: float = 300.0) -> None:
        """Return once every warm pool is full; ``SandboxTimeout`` (with the last start's error) if not in time."""
        await self._ensure_open()
        await _warm.wait_full(self._pools, timeout)

    async def create(
        self,
        image: str = "local",
        *,
        trace: _trace.Trace | None = None,
        model: ModelGateway | None = None,
        restore: Snapshot | None = None,
        **spec: Any,
    ) -> Sandbox:
        """Start a sandbox and return it once ready; ``await sb.aclose()`` ends it.

        Prefer ``async with client.sandbox(...)``, which always deletes it.
        Options are the fields of ``SandboxSpec`` (cpu, memory, env, workdir,
        labels, ttl, idle_timeout, start_timeout).

        ``trace`` records every call to the sandbox as it ends, one JSON
        object a line (docs/trace.md): a file path, appended to with one
        write per record, or a function called with each record (a dict).
        A file that cannot be written raises ``TraceError`` before any
        sandbox starts. Records hold env names, never their values.

        ``model`` (an open ``orchard.ModelGateway``) points the sandbox's
        harnesses at that gateway: the sandbox gets its own key and the
        variables and config files each bundled harness reads, and the gateway
        answers inside it at ``http://127.0.0.1:4319`` through a reverse tunnel
        over the executor's connection (no egress is opened), until it closes;
        then its key is revoked. ``spec``'s own ``env`` wins over those variables.

        ``restore`` (a ``Sandbox.snapshot()``) starts the sandbox from it: its
        files are written in before this returns (a warm sandbox may be the one
        they go into); if they cannot be, the sandbox is deleted and the typed
        error naming the path is raised.
        """
        sandbox_id = f"sb-{self.session_id}-{secrets.token_hex(4)}"
        wiring = None
        if model is not None:
            from .gateway._wiring import Wiring

            wiring = Wiring(model, sandbox_id)
            spec = {**spec, "env": {**wiring.env, **(spec.get("env") or {})}}
        if trace is None:
            return await self._create(image, spec, sandbox_id, wiring, restore)
        try:
            recorder = _trace.Recorder.open(trace)  # fails before any sandbox starts
        except BaseException:
            if wiring is not None:
                wiring.forget()
            raise
        fields = _trace.describe_create(image, str(type(self.config).__struct_config__.tag), spec)
        return await recorder.record_create(self._create(image, spec, sandbox_id, wiring, restore), fields)

    async def _create(
        self, image: str, spec: dict[str, Any], sandbox_id: str, wiring: Wiring | None, restore: Snapshot | None
    ) -> Sandbox:
        try:
            sb = await self._start(image, spec, sandbox_id)
        except BaseException:
            if wiring is not None:
                wiring.forget()
            raise
        if restore is not None:
            t0 = time.monotonic()
            try:
                await sb.restore(restore)
            except BaseException:
                if wiring is not None:
                    wiring.forget()
                await sb.aclose()
                raise
            sb.timings["restore"] = time.monotonic() - t0
        if wiring is not None:
            try:
                await wiring.connect(sb)
            except BaseException:
                await sb.aclose()
                raise
        return sb

    async def _start(self, image: str, spec: dict[str, Any], sandbox_id: str) -> Sandbox:
        sandbox_spec = make_spec(image, spec)
        backend_name = type(self.config).__struct_config__.tag
        if sandbox_spec.image == "local" and backend_name != "local":
            # "local" is only the local backend's default; a container engine would look for it in a registry.
            raise ConfigError(
                f"image 'local' is not a container image: the {backend_name} backend needs one, such as "
                "'orchard-test/swe' (scripts/docker-setup.sh builds the test images)"
            )
        await self._ensure_open()
        pool = self._pools.get(sandbox_spec.image)
        if pool is not None and pool.spec == sandbox_spec:
            t0 = time.monotonic()
            sb = await pool.claim()
            if sb is not None:
                sb.timings = {"claim": time.monotonic() - t0}
                return sb
        if getattr(self.config, "pool", None) is not None:
            sb = await self._claim_shared(sandbox_spec)
            if sb is not None:
                return sb
        return await self._start_cold(sandbox_spec, sandbox_id)

    async def _claim_shared(self, sandbox_spec: SandboxSpec) -> Sandbox | None:
        """A sandbox claimed from the shared kubernetes pool ``config.pool``, or None to start one cold."""
        backend, http = await self._ensure_open()
        token = secrets.token_urlsafe(32)
        t0 = time.monotonic()
        claimed = await backend.claim(sandbox_spec, token_sha256=hashlib.sha256(token.encode()).hexdigest())  # type: ignore[attr-defined]
        if claimed is None:
            return None
        instance, fingerprint = claimed
        timings = instance.timings | {"claim": time.monotonic() - t0}  # the claim's steps, then its whole
        if self._closed:  # closed while this one was claimed: nobody would delete it
            await instance.delete()
            raise SandboxClosed("this Client was closed while the sandbox started", sandbox_id=instance.name)
        return self._open(backend, http, instance, instance.name, token, sandbox_spec, fingerprint, timings)

    async def _start_cold(self, sandbox_spec: SandboxSpec, sandbox_id: str | None = None) -> Sandbox:
        backend, http = await self._ensure_open()
        sandbox_id = sandbox_id or f"sb-{self.session_id}-{secrets.token_hex(4)}"
        if sandbox_spec.tools and not backend.tools:
            raise ConfigError(
                f"tools={sandbox_spec.tools!r}: the {backend.name} backend cannot mount the harness tools bundle; "
                "the docker and kubernetes backends can"
            )
        token = secrets.token_urlsafe(32)
        t0 = time.monotonic()
        tls = _tls.make_identity(sandbox_id) if backend.tls else None
        async with self._starts:
            if self._closed:
                raise SandboxClosed("this Client was closed while the sandbox waited to start", sandbox_id=sandbox_id)
            waited = time.monotonic() - t0

            async def start() -> Sandbox:
                instance = await backend.start(
                    sandbox_spec,
                    sandbox_id=sandbox_id,
                    token_sha256=hashlib.sha256(token.encode()).hexdigest(),
                    tls=tls,
                )
                timings = {"queued": waited} | {k: v + waited for k, v in instance.timings.items()}
                fingerprint = tls.fingerprint if tls is not None else None
                # Open in this Client even if it is closing: its aclose waits for this task, then closes it.
                return self._open(backend, http, instance, sandbox_id, token, sandbox_spec, fingerprint, timings)

            return await self._closing_cancels(asyncio.ensure_future(start()), sandbox_id)

    async def _closing_cancels(self, start: asyncio.Task[Sandbox], sandbox_id: str) -> Sandbox:
        """Await a start that ``aclose`` cancels, and raise ``SandboxClosed`` once it has unwound if it does.

        The start runs in a task of its own, so that closing the Client can
        cancel it, and wait while the backend deletes what it had begun, before
        the backend and the HTTP session it needs for that are closed.
        """
        caller = asyncio.current_task()
        cancelling = caller.cancelling() if caller is not None else 0
        self._starting.add(start)
        start.add_done_callback(self._starting.discard)
        closed = SandboxClosed("this Client was closed while the sandbox started", sandbox_id=sandbox_id)
        try:
            sb = await start
        except asyncio.CancelledError:
            if start.cancelled() and self._closed and (caller is None or caller.cancelling() == cancelling):
                raise closed from None
            if start.done() and not start.cancelled() and start.exception() is None:
                # Cancelled as its start ended: the caller never gets the sandbox, so nobody else would close it.
                await start.result().aclose()
            raise  # the caller's own cancel
        if self._closed:  # started as the Client closed, which closes it
            raise closed
        return sb

    def _open(
        self,
        backend: Backend,
        http: aiohttp.ClientSession,
        instance: Instance,
        sandbox_id: str,
        token: str,
        spec: SandboxSpec,
        fingerprint: bytes | None,
        timings: dict[str, float],
    ) -> Sandbox:
        """The Sandbox of an instance just started or claimed, open in this Client, with its new token."""
        fields = _handle.HandleFields(
            backend=backend.name,
            sandbox_id=sandbox_id,
            token=token,
            image=spec.image,
            fingerprint=fingerprint,
            **instance.describe(),
        )
        return self._adopt(backend, instance, self._rpc(instance, fields, http), fields, spec, timings)

    def _rpc(self, instance: Instance, fields: _handle.HandleFields, http: aiohttp.ClientSession) -> ExecutorClient:
        """The client of a sandbox's executor, as its handle's fields say to reach it."""
        rpc = ExecutorClient(
            # A backend may give a sandbox its own session (the local backend's unix sockets).
            getattr(instance, "http", None) or http,
            instance.base_url,
            fields.token,
            sandbox_id=fields.sandbox_id,
            fingerprint=fields.fingerprint,
            diagnose=instance.diagnose,
            read_timeout=self._read_timeout,
            liveness_timeout=self._liveness_timeout,
        )
        # A backend that watches its sandboxes (kubernetes) fails their requests as soon as it sees one end.
        on_end = getattr(instance, "on_end", None)
        if on_end is not None:
            on_end(rpc.ended)
        return rpc

    def _adopt(
        self,
        backend: Backend,
        instance: Instance,
        rpc: ExecutorClient,
        fields: _handle.HandleFields,
        spec: SandboxSpec,
        timings: dict[str, float],
    ) -> Sandbox:
        """The Sandbox of a started or attached instance, open in this Client until it closes."""
        sandbox_id = fields.sandbox_id

        async def close() -> None:
            self._live.pop(sandbox_id, None)
            await instance.delete()

        sb = Sandbox(
            sandbox_id=sandbox_id,
            spec=spec,
            rpc=rpc,
            timings=timings,
            close=close,
            handle=lambda: _handle.encode(fields),
            changes_root=backend.changes_root,
        )
        self._live[sandbox_id] = sb
        return sb

    async def attach(
        self, handle: str, *, owner: bool = False, timeout: float = 10.0, trace: _trace.Trace | None = None
    ) -> Sandbox:
        """Use a sandbox another client (another process or host) started, from its ``sb.handle()``.

        No sandbox is created. The executor must answer with the handle's
        token before this returns, so a malformed handle (``InvalidHandle``),
        a deleted sandbox (``SandboxLost``) or a wrong token (``AuthError``)
        fails at once, and nothing waits more than ``timeout`` seconds
        (``SandboxTimeout``).

        The sandbox stays its creator's: the creating client still deletes it
        when it closes (or, on the local backend, when its process exits).
        Without ``owner``, closing the attached Sandbox or this Client only
        lets go of it. With ``owner=True`` this client deletes it too, when
        the Sandbox or the Client closes (docker: the container; kubernetes:
        the pod, in this Client's namespace). A local sandbox lives in the
        process that created it, so ``owner=True`` on one is a ``ConfigError``.

        ``trace`` records this client's calls to the sandbox, as on
        ``create`` (docs/trace.md), starting with a ``sandbox_attach`` record.

        Example::

            handle = str(sb.handle())                  # in the creating process
            sb2 = await client.attach(handle)          # in another process
            print((await sb2.exec("hostname")).stdout)
        """
        if not 0 < timeout < float("inf"):
            raise ConfigError(f"timeout={timeout!r} must be a positive number of seconds")
        if trace is None:
            return await self._attach(handle, owner, timeout)
        recorder = _trace.Recorder.open(trace)  # fails before anything is attached
        fields = {"backend": str(type(self.config).__struct_config__.tag), "owner": owner}
        return await recorder.record_create(self._attach(handle, owner, timeout), fields, "sandbox_attach")

    async def _attach(self, handle: str, owner: bool, timeout: float) -> Sandbox:
        backend, http = await self._ensure_open()
        fields = _handle.parse(handle)
        if fields.backend != backend.name:
            raise InvalidHandle(
                f"the handle is for a sandbox on the {fields.backend} backend, and this Client's backend is "
                f"{backend.name}: attach it with a Client({fields.backend!r}, ...)",
                sandbox_id=fields.sandbox_id,
            )
        if fields.sandbox_id in self._live:
            raise ConfigError(f"sandbox {fields.sandbox_id} is already open in this Client: use that Sandbox")
        sandbox_id = fields.sandbox_id
        try:
            async with asyncio.timeout(timeout):
                instance = await backend.attach(fields, owner=owner)
                rpc = self._rpc(instance, fields, http)
                try:
                    await rpc.call("GET", "/v1/info", Info)  # the token is right and the executor alive
                except BaseException:
                    rpc.close("attach failed")
                    await finish(instance.delete())  # lets go (deletes nothing unless owner)
                    raise
        except TimeoutError as exc:
            if isinstance(exc, OrchardError):
                raise
            raise SandboxTimeout(
                f"sandbox {sandbox_id}: attach did not complete within timeout={timeout:g}s", sandbox_id=sandbox_id
            ) from None
        if self._closed:
            await instance.delete()
            raise SandboxClosed("this Client was closed while the sandbox was being attached", sandbox_id=sandbox_id)
        return self._adopt(backend, instance, rpc, fields, make_spec(fields.image or "local", {}), {})

    @contextlib.asynccontextmanager
    async def sandbox(self, image: str = "local", **spec: Any) -> AsyncIterator[Sandbox]:
        """Start a sandbox for the duration of an ``async with`` block."""
        sb = await self.create(image, **spec)
        try:
            yield sb
        finally:
            # A cancel that comes while the sandbox closes waits for the close: none outlives its block.
            await finish(sb.aclose())

    async def aclose(self) -> None:
        """Delete every sandbox still open, then release the pool and backend.

        Calls in flight on those sandboxes fail at once with ``SandboxClosed``;
        so do creates in flight, once what they had begun is deleted. A task
        cancelled while this runs is cancelled once the close is done.
        """
        if self._closed:
            return
        self._closed = True
        await finish(self._closing())

    async def _closing(self) -> None:
        starting = list(self._starting)
        for start in starting:
            start.cancel()
        await asyncio.gather(*(pool.aclose() for pool in self._pools.values()))
        # Before the live ones are listed: a start that ended meanwhile put its sandbox among them.
        await asyncio.gather(*starting, return_exceptions=True)
        live, self._live = list(self._live.values()), {}
        await asyncio.gather(*(sb.aclose() for sb in live), return_exceptions=True)
        if self._backend is not None:
            await self._backend.aclose()
        if self._http is not None and self._owns_http:
            await self._http.close()


@contextlib.asynccontextmanager
async def sandbox(
    image: str = "local", *, backend: str | BackendConfig = "local", **spec: Any
) -> AsyncIterator[Sandbox]:
    """One sandbox with a Client of its own, for scripts that need just one.

    Example::

        async with orchard.sandbox() as sb:
            await sb.exec("echo hi")
    """
    async with Client(backend) as client, client.sandbox(image, **spec) as sb:
        yield sb
