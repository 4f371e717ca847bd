"""The ``docker`` backend: one container per sandbox, from the task image as it is.

The executor is injected, never built in: a volume is filled once (per
injector image) from the image built by ``Dockerfile.executor``, mounted
read-only at ``/.orchard`` in every sandbox container, and the container's
command is replaced by the bundled launcher, which needs nothing from the
image. The executor port is published on 127.0.0.1 only; exec and files go
straight to it. Everything else goes through the Docker Engine API on its
socket, with aiohttp (never the docker CLI).

Every container carries labels (sandbox, session, owning process, expiry),
so ``collect_garbage`` (``orchard gc --backend docker``) can remove what a
dead client left behind without any server.

Enforced from the spec: image (and its pull policy), cpu, memory (no swap
on top), env, workdir, labels and annotations (both as labels), ttl and
idle_timeout. Not yet: ``network=False`` (containers join the engine's
bridge, or ``DockerConfig.network``, and can reach out), and the Kubernetes
scheduling fields. The engine must run on this machine: the executor is
reached through its port published on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import time
from typing import Any
from urllib.parse import quote

import aiohttp
import msgspec

from .. import _retry
from .._spec import SandboxSpec
from ..errors import ConfigError, OrchardError, SandboxLost, SandboxStartError, SandboxTimeout
from . import DockerConfig
from .bundle import MOUNT, install, launcher

#: The Engine API version spoken: Docker 20.10's, which later engines serve too.
API_VERSION = "1.41"
ROLE_LABEL = "orchard.dev/role"
SANDBOX_LABEL = "orchard.dev/sandbox"
SESSION_LABEL = "orchard.dev/session"
OWNER_LABEL = "orchard.dev/owner"
IMAGE_LABEL = "orchard.dev/image"
EXPIRES_LABEL = "orchard.dev/expires-at"
INJECTOR_LABEL = "orchard.dev/injector-image"
#: How long an unreachable executor's container may take to be seen as stopped.
DIAGNOSE_GRACE = 5.0
#: Runtime volumes this process has filled, by (engine, injector image id):
#: every Client after the first one skips the installer.
_FILLED: dict[tuple[str, str], str] = {}
_LOG_TAIL = 2000


class DockerError(OrchardError):
    """The Docker Engine API answered with an error, or could not be reached (status 0)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"Docker Engine API: {status}: {message}" if status else message)
        self.status = status
        self.message = message


# -- What the Engine API returns (only the fields read) --


class _State(msgspec.Struct, rename="pascal", frozen=True):
    status: str = ""
    running: bool = False
    oom_killed: bool = msgspec.field(default=False, name="OOMKilled")
    exit_code: int = 0
    error: str = ""


class _Binding(msgspec.Struct, frozen=True):
    host_ip: str = msgspec.field(default="", name="HostIp")
    host_port: str = msgspec.field(default="", name="HostPort")


class _Network(msgspec.Struct, rename="pascal", frozen=True):
    ports: dict[str, list[_Binding] | None] | None = None


class _Config(msgspec.Struct, rename="pascal", frozen=True):
    labels: dict[str, str] | None = None


class Container(msgspec.Struct, rename="pascal", frozen=True):
    """A container, as much of ``GET /containers/{id}/json`` as is read."""

    id: str = ""
    name: str = ""
    state: _State = _State()
    network_settings: _Network = _Network()
    config: _Config = _Config()


class ContainerSummary(msgspec.Struct, rename="pascal", frozen=True):
    """One entry of ``GET /containers/json``."""

    id: str = ""
    names: list[str] = []
    state: str = ""
    status: str = ""
    created: int = 0
    labels: dict[str, str] | None = None


class _Image(msgspec.Struct, rename="pascal", frozen=True):
    id: str = ""


class _Wait(msgspec.Struct, rename="pascal", frozen=True):
    status_code: int = 0


_CONTAINER = msgspec.json.Decoder(Container)
_SUMMARIES = msgspec.json.Decoder(list[ContainerSummary])
_IMAGE = msgspec.json.Decoder(_Image)
_WAIT = msgspec.json.Decoder(_Wait)


# -- Pure functions of the spec --

_MEMORY = re.compile(r"^([0-9]+(?:\.[0-9]+)?(?:[eE][0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|K|M|G|T|P|E)?$")
_MEMORY_UNITS = {
    None: 1,
    "k": 1000,
    "K": 1000,
    "M": 1000**2,
    "G": 1000**3,
    "T": 1000**4,
    "P": 1000**5,
    "E": 1000**6,
    "Ki": 1024,
    "Mi": 1024**2,
    "Gi": 1024**3,
    "Ti": 1024**4,
    "Pi": 1024**5,
    "Ei": 1024**6,
}


def memory_bytes(quantity: str) -> int:
    """Bytes in a Kubernetes memory quantity: ``"512Mi"``, ``"2G"``, ``"1.5Gi"``, ``"1048576"``."""
    m = _MEMORY.match(quantity.strip())
    if not m:
        raise ConfigError(f"memory={quantity!r} is not a quantity such as '512Mi' or '2Gi'")
    value = int(float(m.group(1)) * _MEMORY_UNITS[m.group(2)])
    if value <= 0:
        raise ConfigError(f"memory={quantity!r} must be positive")
    return value


def nano_cpus(quantity: str | float) -> int:
    """Billionths of a CPU in a Kubernetes CPU quantity: ``"500m"``, ``"2"``, ``1.5``."""
    try:
        if isinstance(quantity, str) and quantity.strip().endswith("m"):
            cores = float(quantity.strip()[:-1]) / 1000
        else:
            cores = float(quantity)
    except ValueError:
        raise ConfigError(f"cpu={quantity!r} is not a quantity such as '500m', '2' or 1.5") from None
    if cores <= 0:
        raise ConfigError(f"cpu={quantity!r} must be positive")
    return int(cores * 1e9)


def image_reference(image: str) -> tuple[str, str]:
    """Split an image into (repository, tag or digest) for a pull; the tag defaults to ``latest``."""
    if "@" in image:
        repo, digest = image.split("@", 1)
        return repo, digest
    last = image.rsplit("/", 1)[-1]
    if ":" in last:
        repo, tag = image.rsplit(":", 1)
        return repo, tag
    return image, "latest"


def container_config(
    spec: SandboxSpec,
    *,
    name: str,
    session_id: str,
    token_sha256: str,
    volume: str,
    port: int,
    owner: str,
    created_at: float,
    network: str | None = None,
) -> dict[str, Any]:
    """The ``POST /containers/create`` body for one sandbox.

    The image's own entrypoint and command are replaced by the launcher; its
    environment, user and working directory stay (``env`` and ``workdir``
    add to and override them). Only the token's SHA-256 is in the container.
    """
    if spec.workdir and not spec.workdir.startswith("/"):
        raise ConfigError(f"workdir={spec.workdir!r} must be an absolute path")
    labels = {
        **spec.annotations,
        **spec.labels,
        ROLE_LABEL: "sandbox",
        SANDBOX_LABEL: name,
        SESSION_LABEL: session_id,
        OWNER_LABEL: owner,
        IMAGE_LABEL: spec.image,
    }
    if spec.ttl is not None:
        labels[EXPIRES_LABEL] = f"{created_at + spec.ttl:.0f}"
    args = ["--host=0.0.0.0", f"--port={port}", f"--token-sha256={token_sha256}"]
    if spec.idle_timeout is not None:
        args.append(f"--idle-timeout={spec.idle_timeout:g}")
    if spec.workdir:
        args.append(f"--workdir={spec.workdir}")
    host: dict[str, Any] = {
        "Mounts": [
            {"Type": "volume", "Source": volume, "Target": MOUNT, "ReadOnly": True, "VolumeOptions": {"NoCopy": True}}
        ],
        "PortBindings": {f"{port}/tcp": [{"HostIp": "127.0.0.1", "HostPort": ""}]},
    }
    if network:
        host["NetworkMode"] = network
    if spec.cpu is not None:
        host["NanoCpus"] = nano_cpus(spec.cpu)
    if spec.memory is not None:
        # No swap on top: a sandbox over its memory is OOM-killed, as on Kubernetes.
        host["Memory"] = host["MemorySwap"] = memory_bytes(spec.memory)
    body: dict[str, Any] = {
        "Image": spec.image,
        "Entrypoint": launcher(),
        "Cmd": args,
        "Env": [f"{k}={v}" for k, v in spec.env.items()],
        "Labels": labels,
        "ExposedPorts": {f"{port}/tcp": {}},
        "StopTimeout": 1,
        # The image's own health check would probe a service the sandbox does not run.
        "Healthcheck": {"Test": ["NONE"]},
        "HostConfig": host,
    }
    if spec.workdir:
        body["WorkingDir"] = spec.workdir
    return body


def _process_identity(pid: int) -> str | None:
    """A process's start time since boot, which tells it from a later one with the same pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2 :].split()[19].decode()


def owner_label() -> str:
    """This process, as ``host/pid/start-time``: the owner recorded on its containers."""
    return f"{socket.gethostname()}/{os.getpid()}/{_process_identity(os.getpid()) or '?'}"


def owner_alive(owner: str, hostname: str) -> bool | None:
    """Whether the process an owner label names is alive (None: it ran on another host)."""
    parts = owner.split("/")
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    host, pid, started = parts
    if host != hostname:
        return None
    return _process_identity(int(pid)) == started


def garbage_reason(container: ContainerSummary, now: float, hostname: str) -> str | None:
    """Why ``orchard gc`` should remove this container, or None to keep it."""
    labels = container.labels or {}
    if container.state in ("exited", "dead"):
        return "finished"
    expires = labels.get(EXPIRES_LABEL)
    if expires is not None and float(expires) < now:
        return "expired"
    if owner_alive(labels.get(OWNER_LABEL, ""), hostname) is False:
        return "orphaned"
    return None


def _demux(raw: bytes) -> str:
    """Container logs without the stream headers the Engine API frames them with."""
    out = bytearray()
    while len(raw) >= 8 and raw[0] in (0, 1, 2) and raw[1:4] == b"\0\0\0":
        size = int.from_bytes(raw[4:8], "big")
        out += raw[8 : 8 + size]
        raw = raw[8 + size :]
    out += raw
    return out.decode("utf-8", "replace").strip()


# -- The Engine API --


class Engine:
    """A minimal async Docker Engine API client over one aiohttp session."""

    def __init__(self, host: str | None) -> None:
        address = host or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
        if address.startswith("unix://"):
            self._socket: str | None = address.removeprefix("unix://")
            self._base = f"http://docker/v{API_VERSION}"
        elif address.startswith(("tcp://", "http://")):
            self._socket = None
            self._base = "http://" + address.split("://", 1)[1].rstrip("/") + f"/v{API_VERSION}"
        else:
            raise ConfigError(
                f"docker host {address!r} is not unix://PATH or tcp://HOST:PORT; set DockerConfig(host=...)"
            )
        self.address = address
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector: aiohttp.BaseConnector = (
                aiohttp.UnixConnector(path=self._socket, limit=0)
                if self._socket is not None
                else aiohttp.TCPConnector(limit=0)
            )
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, str] | None = None,
        body: Any = None,
        timeout: float | None = 60.0,
    ) -> bytes:
        """One API call; raises ``DockerError`` on an error status or if the engine is unreachable."""
        data = None if body is None else msgspec.json.encode(body)
        headers = {"Content-Type": "application/json"} if data is not None else None
        try:
            async with self._http().request(
                method,
                self._base + path,
                params=params,
                data=data,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as resp:
                raw = await resp.read()
                if resp.status >= 400:
                    try:
                        message = str(json.loads(raw)["message"])
                    except (ValueError, KeyError, TypeError):
                        message = raw.decode("utf-8", "replace")[:500]
                    raise DockerError(resp.status, message)
                return raw
        except aiohttp.ClientConnectionError as exc:
            raise DockerError(
                0,
                f"cannot reach the Docker engine at {self.address}: {exc}; is dockerd running "
                "(scripts/docker-setup.sh starts one)? Otherwise set DockerConfig(host=...) or DOCKER_HOST",
            ) from exc

    async def inspect(self, container: str) -> Container:
        """A container's state, or ``DockerError`` 404 if it is gone."""
        return _CONTAINER.decode(await self.request("GET", f"/containers/{container}/json"))

    async def wait(self, container: str) -> int:
        """Wait until the container is not running; its exit status."""
        raw = await self.request(
            "POST", f"/containers/{container}/wait", params={"condition": "not-running"}, timeout=None
        )
        return _WAIT.decode(raw).status_code

    async def logs(self, container: str, tail: int = 30) -> str:
        """The last lines the container wrote (stdout and stderr)."""
        with contextlib.suppress(DockerError):
            raw = await self.request(
                "GET", f"/containers/{container}/logs", params={"stdout": "1", "stderr": "1", "tail": str(tail)}
            )
            return _demux(raw)[-_LOG_TAIL:]
        return ""

    async def remove(self, container: str) -> None:
        """Kill and remove a container and its anonymous volumes; gone already is fine."""
        try:
            await self.request("DELETE", f"/containers/{container}", params={"force": "1", "v": "1"})
        except DockerError as exc:
            if exc.status not in (404, 409):  # 409: its removal is already in progress
                raise

    async def containers(self, label: str) -> list[ContainerSummary]:
        """Every container (running or not) with a label (``key=value``)."""
        filters = json.dumps({"label": [label]})
        return _SUMMARIES.decode(await self.request("GET", "/containers/json", params={"all": "1", "filters": filters}))

    async def image_id(self, image: str) -> str | None:
        """The image's id, or None if the engine does not have it."""
        try:
            return _IMAGE.decode(await self.request("GET", f"/images/{quote(image, safe='')}/json")).id
        except DockerError as exc:
            if exc.status == 404:
                return None
            raise

    async def pull(self, image: str) -> None:
        """Pull an image; ``DockerError`` with the registry's message if it fails."""
        repo, tag = image_reference(image)
        raw = await self.request("POST", "/images/create", params={"fromImage": repo, "tag": tag}, timeout=None)
        # Failures after the transfer began arrive as an "error" line in a 200 stream.
        for line in raw.splitlines():
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if isinstance(event, dict) and event.get("error"):
                    raise DockerError(500, str(event["error"]))

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()


# -- Sandboxes --


class DockerInstance:
    """A sandbox container."""

    def __init__(self, engine: Engine, sandbox_id: str, container_id: str, t0: float) -> None:
        self._engine = engine
        self.id = sandbox_id
        self.container_id = container_id
        self.base_url = ""
        self.timings: dict[str, float] = {}
        self._t0 = t0
        self._deleted = False
        self._expired = False
        self._ttl: asyncio.TimerHandle | None = None
        self._expiring: asyncio.Future[None] | None = None

    def mark(self, phase: str) -> None:
        """Record how long after the start request a phase was reached."""
        self.timings[phase] = time.monotonic() - self._t0

    def expire_after(self, ttl: float) -> None:
        """Kill the container after ``ttl`` seconds, whatever it is doing."""
        self._ttl = asyncio.get_running_loop().call_later(ttl, self._expire)

    def _expire(self) -> None:
        self._expired = True
        self._expiring = asyncio.ensure_future(self._kill())

    async def _kill(self) -> None:
        with contextlib.suppress(DockerError):
            await self._engine.request("POST", f"/containers/{self.container_id}/kill")

    async def fate(self) -> tuple[str, str] | None:
        """(reason, message) if the container is no longer running, else None."""
        try:
            info = await self._engine.inspect(self.container_id)
        except DockerError as exc:
            if exc.status == 404:
                return "removed", "the container was removed"
            raise
        state = info.state
        if state.running:
            return None
        if self._expired:
            reason = "ttl"
        elif state.oom_killed:
            reason = "OOMKilled"
        else:
            reason = f"exited({state.exit_code})"
        message = f"the container ended ({reason}, status {state.status})"
        if state.error:
            message += f": {state.error}"
        logs = await self._engine.logs(self.container_id)
        if logs:
            message += f"; its last output:\n{logs}"
        return reason, message

    async def diagnose(self) -> OrchardError | None:
        """Why the executor stopped answering: the container's state, exit, OOM kill or removal."""
        if self._deleted:
            return SandboxLost(f"sandbox {self.id} was deleted", sandbox_id=self.id, reason="deleted")
        try:
            fate = await self.fate()
            if fate is None:
                # The executor is gone but the engine may not have noticed the container's
                # end yet (an OOM kill of PID 1 takes a moment to be recorded): wait a little.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(DIAGNOSE_GRACE):
                        await self._engine.wait(self.container_id)
                fate = await self.fate()
        except DockerError:
            return None
        if fate is None:
            return None
        reason, message = fate
        return SandboxLost(f"sandbox {self.id}: {message}", sandbox_id=self.id, reason=reason)

    async def delete(self) -> None:
        """Remove the container (killing everything in it); safe to call twice."""
        if self._deleted:
            return
        self._deleted = True
        if self._ttl is not None:
            self._ttl.cancel()
        await self._engine.remove(self.container_id)


class DockerBackend:
    """Runs each sandbox as a container of its task image on a Docker engine."""

    name = "docker"

    def __init__(self, config: DockerConfig, *, session_id: str, http: aiohttp.ClientSession) -> None:
        self.config = config
        self.session_id = session_id
        self._http = http
        self._engine = Engine(config.host)
        self._owner = owner_label()
        self._volume: str | None = None
        self._volume_lock = asyncio.Lock()

    async def runtime_volume(self) -> str:
        """The volume holding the executor runtime, filled from the injector image once."""
        async with self._volume_lock:
            if self._volume is None:
                self._volume = await self._fill_volume()
            return self._volume

    async def _fill_volume(self) -> str:
        injector = self.config.injector_image
        image_id = await self._engine.image_id(injector)
        if image_id is None:
            raise SandboxStartError(
                f"the executor injector image {injector!r} is not on the Docker host: build it with "
                "scripts/docker-setup.sh (no registry needed) or `docker build -f Dockerfile.executor "
                f"-t {injector} .`, or set DockerConfig(injector_image=...)",
                reason="InjectorImageNotFound",
            )
        volume = f"orchard-runtime-{image_id.removeprefix('sha256:')[:12]}"
        if _FILLED.get((self._engine.address, image_id)) == volume:
            return volume
        labels = {ROLE_LABEL: "runtime", INJECTOR_LABEL: injector}
        await self._engine.request("POST", "/volumes/create", body={"Name": volume, "Labels": labels})
        # The installer does nothing if the runtime is already there, and is safe to race.
        body = {
            "Image": injector,
            "Entrypoint": install("/target"),
            "Cmd": [],
            "Labels": {ROLE_LABEL: "installer", OWNER_LABEL: self._owner},
            "HostConfig": {
                "Mounts": [{"Type": "volume", "Source": volume, "Target": "/target"}],
                "NetworkMode": "none",
            },
        }
        # Named, so that it can be removed even if its create call is interrupted.
        container = f"orchard-install-{self.session_id}-{os.urandom(3).hex()}"
        try:
            await self._engine.request("POST", "/containers/create", params={"name": container}, body=body)
            await self._engine.request("POST", f"/containers/{container}/start")
            status = await self._engine.wait(container)
            if status != 0:
                logs = await self._engine.logs(container)
                raise SandboxStartError(
                    f"the executor injector {injector!r} failed to fill volume {volume} (exit {status}): {logs}",
                    reason="InjectorFailed",
                )
        finally:
            await asyncio.shield(self._engine.remove(container))
        _FILLED[self._engine.address, image_id] = volume
        return volume

    async def _ensure_image(self, spec: SandboxSpec, sandbox_id: str) -> None:
        if spec.image_pull_policy != "Always" and await self._engine.image_id(spec.image) is not None:
            return
        if spec.image_pull_policy == "Never":
            raise SandboxStartError(
                f"sandbox {sandbox_id}: image {spec.image!r} is not on the Docker host and "
                "image_pull_policy='Never'; build or load it, or allow pulls with image_pull_policy='IfNotPresent'",
                sandbox_id=sandbox_id,
                reason="ErrImageNeverPull",
            )
        try:
            await self._engine.pull(spec.image)
        except DockerError as exc:
            raise SandboxStartError(
                f"sandbox {sandbox_id}: image {spec.image!r} is not on the Docker host and pulling it failed: "
                f"{exc.message}",
                sandbox_id=sandbox_id,
                reason="ErrImagePull",
            ) from exc

    async def start(self, spec: SandboxSpec, *, sandbox_id: str, token_sha256: str) -> DockerInstance:
        """Create and start the container; return once its executor answers."""
        t0 = time.monotonic()
        # Built first, so that a bad option fails before anything is done on the engine.
        body = container_config(
            spec,
            name=sandbox_id,
            session_id=self.session_id,
            token_sha256=token_sha256,
            volume="",  # set below, once the runtime volume is known
            port=self.config.executor_port,
            owner=self._owner,
            created_at=time.time(),
            network=self.config.network,
        )
        try:
            async with asyncio.timeout(spec.start_timeout):
                body["HostConfig"]["Mounts"][0]["Source"] = await self.runtime_volume()
                await self._ensure_image(spec, sandbox_id)
                return await self._create_and_start(spec, sandbox_id, body, t0)
        except TimeoutError:
            raise SandboxTimeout(
                f"sandbox {sandbox_id} was not ready within start_timeout={spec.start_timeout:g}s",
                sandbox_id=sandbox_id,
            ) from None
        except SandboxStartError as exc:
            if exc.sandbox_id is None:
                exc.sandbox_id = sandbox_id
            raise
        except DockerError as exc:
            raise SandboxStartError(
                f"sandbox {sandbox_id}: {exc}",
                sandbox_id=sandbox_id,
                reason="DockerUnavailable" if exc.status == 0 else "DockerError",
            ) from exc

    async def _create_and_start(
        self, spec: SandboxSpec, sandbox_id: str, body: dict[str, Any], t0: float
    ) -> DockerInstance:
        try:
            created = json.loads(
                await self._engine.request("POST", "/containers/create", params={"name": sandbox_id}, body=body)
            )
        except DockerError as exc:
            if exc.status == 0:
                raise
            raise SandboxStartError(
                f"sandbox {sandbox_id}: the Docker engine refused the container: {exc.message}",
                sandbox_id=sandbox_id,
                reason="ImageNotFound" if exc.status == 404 else "CreateContainerError",
            ) from exc
        except BaseException:
            # Interrupted (a timeout): the container may exist without our knowing its id.
            await asyncio.shield(self._engine.remove(sandbox_id))
            raise
        instance = DockerInstance(self._engine, sandbox_id, created["Id"], t0)
        instance.mark("created")
        try:
            try:
                await self._engine.request("POST", f"/containers/{instance.container_id}/start")
            except DockerError as exc:
                raise SandboxStartError(
                    f"sandbox {sandbox_id}: the container did not start: {exc.message}",
                    sandbox_id=sandbox_id,
                    reason="RunContainerError",
                ) from exc
            instance.mark("started")
            await self._wait_ready(instance)
            instance.mark("executor_ready")
        except BaseException:
            await asyncio.shield(instance.delete())
            raise
        if spec.ttl is not None:
            instance.expire_after(spec.ttl)
        return instance

    async def _died(self, instance: DockerInstance) -> SandboxStartError:
        fate = await instance.fate()
        reason, message = fate if fate is not None else ("exited", "the container stopped")
        return SandboxStartError(
            f"sandbox {instance.id}: the executor did not come up: {message}", sandbox_id=instance.id, reason=reason
        )

    async def _wait_ready(self, instance: DockerInstance) -> None:
        """Poll /healthz on the published port, failing as soon as the container stops."""
        info = await self._engine.inspect(instance.container_id)
        bindings = (info.network_settings.ports or {}).get(f"{self.config.executor_port}/tcp") or []
        port = next((b.host_port for b in bindings if b.host_port), None)
        if port is None:
            raise await self._died(instance)
        instance.base_url = f"http://127.0.0.1:{port}"
        stopped = asyncio.ensure_future(self._engine.wait(instance.container_id))
        try:
            for delay in _retry.poll_delays():
                if stopped.done():
                    raise await self._died(instance)
                # Until the executor listens, the port proxy accepts and then hangs up.
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with self._http.get(
                        f"{instance.base_url}/healthz", timeout=aiohttp.ClientTimeout(total=2.0)
                    ) as resp:
                        if resp.status == 200:
                            return
                await asyncio.wait([stopped], timeout=delay)
        finally:
            stopped.cancel()
            await asyncio.wait([stopped])
            if not stopped.cancelled():
                stopped.exception()  # retrieved: a wait that failed is not an error here

    async def aclose(self) -> None:
        """Close the Engine API session (sandboxes are deleted by the client)."""
        await self._engine.close()


# -- Inventory and garbage collection (``orchard ls`` / ``orchard gc``) --


async def list_sandboxes(config: DockerConfig) -> list[dict[str, str]]:
    """One row per Orchard container on the engine: name, session, phase, image, created, gc verdict."""
    engine = Engine(config.host)
    try:
        containers = await engine.containers(f"{ROLE_LABEL}=sandbox")
    finally:
        await engine.close()
    now, hostname = time.time(), socket.gethostname()
    return [
        {
            "name": (c.labels or {}).get(SANDBOX_LABEL, c.names[0].lstrip("/") if c.names else c.id[:12]),
            "session": (c.labels or {}).get(SESSION_LABEL, ""),
            "phase": c.state,
            "image": (c.labels or {}).get(IMAGE_LABEL, ""),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(c.created)),
            "gc": garbage_reason(c, now, hostname) or "",
        }
        for c in containers
    ]


async def collect_garbage(config: DockerConfig, *, dry_run: bool = False) -> list[tuple[str, str]]:
    """Remove finished, expired and orphaned sandbox containers, and stale runtime volumes.

    Returns (name, reason) for everything removed (or that would be, with ``dry_run``).
    """
    engine = Engine(config.host)
    try:
        now, hostname = time.time(), socket.gethostname()
        doomed: list[tuple[str, str, str]] = []
        for c in await engine.containers(f"{ROLE_LABEL}=sandbox"):
            why = garbage_reason(c, now, hostname)
            if why:
                doomed.append((c.id, (c.labels or {}).get(SANDBOX_LABEL, c.id[:12]), why))
        for c in await engine.containers(f"{ROLE_LABEL}=installer"):
            if (
                c.state in ("exited", "dead", "created")
                or owner_alive((c.labels or {}).get(OWNER_LABEL, ""), hostname) is False
            ):
                doomed.append((c.id, c.names[0].lstrip("/") if c.names else c.id[:12], "leftover installer"))
        if not dry_run:
            for container_id, _, _ in doomed:
                await engine.remove(container_id)
        removed = [(name, why) for _, name, why in doomed]
        # Runtime volumes of injector images that are gone; one in use stays (409).
        volumes = json.loads(
            await engine.request(
                "GET", "/volumes", params={"filters": json.dumps({"label": [f"{ROLE_LABEL}=runtime"]})}
            )
        )
        for volume in volumes.get("Volumes") or []:
            injector = (volume.get("Labels") or {}).get(INJECTOR_LABEL, "")
            image_id = await engine.image_id(injector) if injector else None
            if image_id is not None and volume["Name"] == f"orchard-runtime-{image_id.removeprefix('sha256:')[:12]}":
                continue
            if dry_run:
                removed.append((volume["Name"], "stale runtime volume"))
                continue
            with contextlib.suppress(DockerError):
                await engine.request("DELETE", f"/volumes/{volume['Name']}")
                removed.append((volume["Name"], "stale runtime volume"))
        return removed
    finally:
        await engine.close()
