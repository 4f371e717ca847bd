"""The ``docker`` backend: one container per sandbox, from the task image as it is.

The executor is injected, never built in: a volume is filled once (per
injector image) from the image built by ``Dockerfile.executor``, mounted
read-only at ``/.orchard`` in every sandbox container, and the container's
command is replaced by the bundled launcher, which needs nothing from the
image. Exec and files go straight to the executor; everything else goes
through the Docker Engine API on its socket (``docker_engine``, aiohttp,
never the docker CLI).

The executor is reached (``DockerConfig.transport``) on a unix socket in a
directory of the client's bind-mounted into the container (``unix``, where
the engine is on this machine): a sandbox with ``network=False`` then has no
network at all. Or over TLS at the container's address on Orchard's bridge
(``tcp``), or through its port published on 127.0.0.1 with
``DockerConfig.network``.

Every container is hardened (``DockerConfig`` documents each default): all
capabilities dropped but the few a root task needs (``CAPABILITIES``),
``no-new-privileges``, pids, nofile and memory limits, a private IPC
namespace, and no network or Orchard's own with inter-container traffic
off: ``orchard-internal`` (no route out; transport tcp) for
``network=False``, ``orchard-egress`` for ``network=True``. Docker leaves
one door open: a container on a bridge reaches this host at the bridge's
address, where services listening on every interface answer. The host's
firewall closes it for ``orchard-int``, the internal network's bridge
(``scripts/docker-setup.sh`` adds the rules).

Every container carries labels (sandbox, session, owning process, expiry),
so ``collect_garbage`` (``orchard gc --backend docker``) can remove what a
dead client left behind without any server, its socket directories too.

Enforced from the spec: image (and its pull policy), cpu, memory (no swap
on top), shm (the size of /dev/shm), env, workdir, labels and annotations
(both as labels), ttl, idle_timeout and network. Not: the Kubernetes scheduling fields. The engine
must run on this machine: the executor is reached on its socket, its bridge
or its port published on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import socket
import tempfile
import time
from typing import Any

import aiohttp

from .. import _retry, _tools
from .._finish import finish
from .._handle import HandleFields
from .._spec import SandboxSpec, quantity_bytes
from .._tls import ENV as TLS_ENV
from .._tls import Identity, pin
from ..errors import ConfigError, InvalidHandle, OrchardError, SandboxLost, SandboxStartError, SandboxTimeout
from . import DockerConfig, _unix
from .bundle import MOUNT, install, launcher
from .docker_engine import ContainerSummary, DockerError, Engine, Network

ROLE_LABEL = "orchard.dev/role"
SANDBOX_LABEL = "orchard.dev/sandbox"
SESSION_LABEL = "orchard.dev/session"
OWNER_LABEL = "orchard.dev/owner"
IMAGE_LABEL = "orchard.dev/image"
EXPIRES_LABEL = "orchard.dev/expires-at"
INJECTOR_LABEL = "orchard.dev/injector-image"
#: How long an unreachable executor's container may take to be seen as stopped.
DIAGNOSE_GRACE = 5.0
#: Where a unix-transport sandbox's socket directory is mounted, and its executor's socket in it.
SOCKET_MOUNT = "/.orchard-socket"
SOCKET = "executor.sock"
#: Runtime volumes this process has filled, by (engine, injector image id):
#: every Client after the first one skips the installer.
_FILLED: dict[tuple[str, str], str] = {}
#: Orchard's own networks, by the spec's ``network``: (network name, bridge interface).
#: Both have inter-container traffic off; the one for ``network=False`` is internal
#: (no route out). The bridge names are fixed so that two clients creating a network
#: at once conflict (the engine allows two networks of one name, never two with one
#: bridge), and so that the host's firewall can name them: ``scripts/docker-setup.sh``
#: refuses connections from ``orchard-int`` to the host itself.
NETWORKS = {False: ("orchard-internal", "orchard-int"), True: ("orchard-egress", "orchard-egress")}
_ICC = "com.docker.network.bridge.enable_icc"
_BRIDGE = "com.docker.network.bridge.name"


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


#: The capabilities every sandbox keeps, of Docker's default set. A task image runs
#: as root and must still install packages, add users and run things as them:
#: CHOWN, DAC_OVERRIDE, FOWNER and FSETID for files owned by others (dpkg, pip,
#: git, chown -R), SETUID and SETGID to switch users (su, setpriv, apt's _apt
#: sandbox), KILL to signal their processes (the executor ends every process of
#: a sandbox), NET_BIND_SERVICE for servers on low ports. Dropped from Docker's
#: default: MKNOD (device nodes), NET_RAW (raw sockets: spoofing and sniffing on
#: the bridge), SYS_CHROOT, SETFCAP and SETPCAP (building privileged binaries
#: and capability sets) and AUDIT_WRITE; ``DockerConfig.cap_add`` adds more.
CAPABILITIES = ("CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID", "NET_BIND_SERVICE")
_CAPABILITY = re.compile(r"^[A-Z][A-Z0-9_]*$")


def capabilities(cap_add: list[str]) -> list[str]:
    """The ``CapAdd`` of a sandbox: the kept set plus ``cap_add`` (``"sys_ptrace"`` or ``"CAP_SYS_PTRACE"``)."""
    added = []
    for cap in cap_add:
        name = cap.strip().upper().removeprefix("CAP_")
        if not _CAPABILITY.match(name):
            raise ConfigError(f"DockerConfig(cap_add=...): {cap!r} is not a capability name such as 'SYS_PTRACE'")
        if name not in CAPABILITIES and name not in added:
            added.append(name)
    return [*CAPABILITIES, *added]


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
    config: DockerConfig | None = None,
    network: str | None = None,
    tls_pem: str | None = None,
    socket_dir: str | None = None,
) -> dict[str, Any]:
    """The ``POST /containers/create`` body for one sandbox.

    The image's own entrypoint and command are replaced by the launcher; its
    environment, user and working directory stay (``env`` and ``workdir``
    add to and override them). Only the token's SHA-256 is in the container,
    and the executor's TLS key and certificate (``tls_pem``), for its own use.
    The container is hardened as ``config`` says (see ``DockerConfig``); it
    joins ``network``, or ``config.network`` with its port published on
    127.0.0.1. With ``socket_dir`` (transport unix) the executor listens on a
    socket in that host directory, mounted at ``SOCKET_MOUNT``, instead.
    """
    config = config or DockerConfig()
    if spec.workdir and not spec.workdir.startswith("/"):
        raise ConfigError(f"workdir={spec.workdir!r} must be an absolute path")
    if config.pids_limit is not None and config.pids_limit <= 0:
        raise ConfigError(f"DockerConfig(pids_limit={config.pids_limit}) must be positive, or None for no limit")
    if config.nofile <= 0:
        raise ConfigError(f"DockerConfig(nofile={config.nofile}) must be positive")
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
    listen = [f"--unix={SOCKET_MOUNT}/{SOCKET}"] if socket_dir is not None else ["--host=0.0.0.0", f"--port={port}"]
    args = [*listen, f"--token-sha256={token_sha256}"]
    if spec.idle_timeout is not None:
        args.append(f"--idle-timeout={spec.idle_timeout:g}")
    if spec.workdir:
        args.append(f"--workdir={spec.workdir}")
    mounts = [
        {"Type": "volume", "Source": volume, "Target": MOUNT, "ReadOnly": True, "VolumeOptions": {"NoCopy": True}}
    ]
    if spec.tools:
        args.append(f"--path-append={_tools.path_dirs(spec.tools)}")
        # The source is set by the backend, once the tools volume is filled.
        mounts.append({"Type": "volume", "Source": "", "Target": _tools.ROOT, "ReadOnly": True})
    if socket_dir is not None:
        mounts.append({"Type": "bind", "Source": socket_dir, "Target": SOCKET_MOUNT})
    host: dict[str, Any] = {
        "Mounts": mounts,
        "CapDrop": ["ALL"],
        "CapAdd": capabilities(config.cap_add),
        "SecurityOpt": ["no-new-privileges:true"] if config.no_new_privileges else [],
        "Ulimits": [{"Name": "nofile", "Soft": config.nofile, "Hard": config.nofile}],
        "IpcMode": "private",
    }
    if config.pids_limit is not None:
        host["PidsLimit"] = config.pids_limit
    if config.runtime:
        host["Runtime"] = config.runtime
    if config.network:
        host["NetworkMode"] = config.network
    if config.network and socket_dir is None:
        host["PortBindings"] = {f"{port}/tcp": [{"HostIp": "127.0.0.1", "HostPort": ""}]}
    if network and not config.network:
        host["NetworkMode"] = network
    if spec.cpu is not None:
        host["NanoCpus"] = nano_cpus(spec.cpu)
    if spec.memory is not None or config.default_memory is not None:
        try:
            memory = memory_bytes(spec.memory or config.default_memory or "")
        except ConfigError as exc:
            raise ConfigError(f"{exc} (DockerConfig(default_memory=...) applies when the spec gives none)") from None
        # No swap on top: a sandbox over its memory is OOM-killed, as on Kubernetes.
        host["Memory"] = host["MemorySwap"] = memory
    if spec.shm is not None:
        host["ShmSize"] = quantity_bytes("shm", spec.shm)
    body: dict[str, Any] = {
        "Image": spec.image,
        "Entrypoint": launcher(),
        "Cmd": args,
        "Env": [f"{k}={v}" for k, v in spec.env.items()] + ([f"{TLS_ENV}={tls_pem}"] if tls_pem else []),
        "Labels": labels,
        **({} if socket_dir is not None else {"ExposedPorts": {f"{port}/tcp": {}}}),
        "StopTimeout": 1,
        # The image's own health check would probe a service the sandbox does not run.
        "Healthcheck": {"Test": ["NONE"]},
        "HostConfig": host,
    }
    if spec.workdir:
        body["WorkingDir"] = spec.workdir
    return body


def transport(config: DockerConfig, engine: str) -> str:
    """``"unix"`` or ``"tcp"``: how a client of ``engine`` (its address) reaches its executors."""
    local = engine.startswith("unix://")
    if config.transport == "unix" and not local:
        raise ConfigError(
            f"DockerConfig(transport='unix') needs an engine on this machine's unix socket, not {engine!r}: "
            "the engine bind-mounts the executors' socket directories; use transport='tcp'"
        )
    if config.transport == "auto":
        return "unix" if local and not config.network else "tcp"
    return config.transport


def socket_root(config: DockerConfig) -> str:
    """The directory of the clients' socket directories (``DockerConfig.socket_dir``)."""
    if config.socket_dir:
        return os.path.abspath(config.socket_dir)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "orchard", "docker")


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


# -- Networks --


#: How long a client refused while creating Orchard's network waits for, and retries, the one that won.
NETWORK_RACE_SECONDS = 10.0


async def ensure_network(engine: Engine, name: str, bridge: str, *, egress: bool) -> str:
    """The id of a network for sandboxes with (or without) egress, ICC off, created if missing.

    Safe to race: of clients creating it at once, those refused on the name or the bridge
    take the network that won. The engine may refuse one before the winner is listed, or
    refuse every one of them (each conflicting with another still being made): a refused
    client lists again, and tries again, for a few seconds.
    """
    found = await engine.networks(name)
    deadline = time.monotonic() + NETWORK_RACE_SECONDS
    refused: DockerError | None = None
    while not found:
        body = {
            "Name": name,
            "Driver": "bridge",
            "Internal": not egress,
            "CheckDuplicate": True,
            "Options": {_ICC: "false", _BRIDGE: bridge},
            "Labels": {ROLE_LABEL: "network"},
        }
        try:
            await engine.request("POST", "/networks/create", body=body)
        except DockerError as exc:
            if exc.status == 0:
                raise
            refused = exc  # most likely another client is making it (same name or bridge): use theirs
        found = await engine.networks(name)
        if not found and (refused is None or time.monotonic() > deadline):
            message = refused.message if refused else "it is not listed after its creation"
            raise SandboxStartError(f"cannot create the Docker network {name!r}: {message}", reason="NetworkError")
        if not found:
            await asyncio.sleep(random.uniform(0.05, 0.2))
            found = await engine.networks(name)
    network: Network = min(found, key=lambda n: (n.created, n.id))
    if network.internal == egress or (network.options or {}).get(_ICC) != "false":
        raise SandboxStartError(
            f"the Docker network {name!r} exists without the settings Orchard gives it (internal={not egress}, "
            f"{_ICC}=false): remove it (docker network rm {name}) or choose one with DockerConfig(network=...)",
            reason="NetworkMismatch",
        )
    return network.id


# -- Sandboxes --


class DockerInstance:
    """A sandbox container."""

    def __init__(
        self,
        engine: Engine,
        sandbox_id: str,
        container_id: str,
        t0: float,
        fingerprint: bytes | None = None,
        directory: str | None = None,
    ) -> None:
        self._engine = engine
        self.id = sandbox_id
        self.container_id = container_id
        self.base_url = ""
        #: SHA-256 of the executor's TLS certificate (it speaks https when set).
        self.fingerprint = fingerprint
        #: Transport unix: the socket directory this client made for it (removed with it).
        self.directory = directory
        #: Transport unix: its executor's socket, once connected.
        self.held: _unix.Held | None = None
        self.timings: dict[str, float] = {}
        self._t0 = t0
        #: False for a sandbox attached without ``owner``: ``delete`` then leaves the container be.
        self.owned = True
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

    def connect(self, held: _unix.Held) -> None:
        """Talk to the executor over its unix socket, held by inode (``_unix``)."""
        self.held = held
        self.base_url = "http://sandbox"

    @property
    def http(self) -> aiohttp.ClientSession | None:
        """The HTTP session for its executor's socket (None: the Client's shared one)."""
        return self.held.http if self.held is not None else None

    def describe(self) -> dict[str, Any]:
        """Its executor's address, or its socket's path and inode (``HandleFields``)."""
        return self.held.describe() if self.held is not None else {"url": self.base_url}

    async def delete(self) -> None:
        """Remove the container (killing everything in it); safe to call twice."""
        if self._deleted:
            return
        self._deleted = True
        if self._ttl is not None:
            self._ttl.cancel()
        try:
            if self.owned:
                await self._engine.remove(self.container_id)
        finally:
            if self.held is not None:
                await self.held.close()
                self.held = None
            if self.directory is not None:
                await asyncio.to_thread(_unix.remove_tree, self.directory)


class DockerBackend:
    """Runs each sandbox as a container of its task image on a Docker engine."""

    name = "docker"
    tools = True
    changes_root: str | None = "/"

    def __init__(self, config: DockerConfig, *, session_id: str, http: aiohttp.ClientSession) -> None:
        self.config = config
        self.session_id = session_id
        self._http = http
        self._engine = Engine(config.host)
        self._owner = owner_label()
        self._volume: str | None = None
        self._tools_volume: str | None = None
        self._volume_lock = asyncio.Lock()
        self._networks: dict[bool, str] = {}
        self._network_lock = asyncio.Lock()
        self.unix = transport(config, self._engine.address) == "unix"
        #: Its executors are reached over TLS on a network (transport tcp), or on unix sockets.
        self.tls = not self.unix
        #: Transport unix: this client's directory of socket directories, made with the first sandbox.
        self._sockets: str | None = None

    async def runtime_volume(self) -> str:
        """The volume holding the executor runtime, filled from the injector image once."""
        async with self._volume_lock:
            if self._volume is None:
                self._volume = await self._fill_volume()
            return self._volume

    async def tools_volume(self) -> str:
        """The volume holding the tools bundle, filled from the tools image once."""
        async with self._volume_lock:
            if self._tools_volume is None:
                self._tools_volume = await self._fill_tools()
            return self._tools_volume

    async def sandbox_network(self, egress: bool) -> str:
        """The network a sandbox joins: ``DockerConfig.network``, else Orchard's own (by id)."""
        if self.config.network:
            return self.config.network
        async with self._network_lock:
            if egress not in self._networks:
                name, bridge = NETWORKS[egress]
                self._networks[egress] = await ensure_network(self._engine, name, bridge, egress=egress)
            return self._networks[egress]

    def _socket_directory(self, sandbox_id: str) -> str:
        """A new directory for a sandbox's executor socket, which the image's user can write."""
        if self._sockets is None:
            root = socket_root(self.config)
            try:
                _unix.private_dir(root, "DockerConfig(socket_dir=...)")
                # Named after this process (``owner_label``), so that ``orchard gc`` knows when it is orphaned.
                owner = self._owner.split("/", 1)[1].replace("/", "-")
                self._sockets = tempfile.mkdtemp(prefix=f"{owner}-", dir=root)
            except OSError as exc:
                raise ConfigError(
                    f"cannot make the executors' socket directory in {root} ({exc.strerror}): set "
                    "DockerConfig(socket_dir=...) to a directory this user may write"
                ) from None
        directory = os.path.join(self._sockets, sandbox_id)
        os.mkdir(directory)
        os.chmod(directory, 0o777)  # noqa: S103 (the executor runs as the image's user; the parent is 0700)
        return directory

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
        # The installer does nothing if the runtime is already there, and is safe to race.
        return await self._fill(injector, image_id, "runtime", install("/target"), "the executor injector")

    async def _fill_tools(self) -> str:
        image = self.config.tools_image
        image_id = await self._engine.image_id(image)
        if image_id is None:
            raise SandboxStartError(
                f"tools=[...] needs the tools image {image!r}, which is not on the Docker host: build it with "
                "scripts/docker-setup.sh (no registry needed), or set DockerConfig(tools_image=...)",
                reason="ToolsImageNotFound",
            )
        return await self._fill(image, image_id, "tools", _tools.fill(), "the tools image")

    async def _fill(self, image: str, image_id: str, role: str, entrypoint: list[str], what: str) -> str:
        """A volume named after ``image_id``, filled once by running ``entrypoint`` in ``image``."""
        volume = f"orchard-{role}-{image_id.removeprefix('sha256:')[:12]}"
        if _FILLED.get((self._engine.address, image_id)) == volume:
            return volume
        labels = {ROLE_LABEL: role, INJECTOR_LABEL: image}
        await self._engine.request("POST", "/volumes/create", body={"Name": volume, "Labels": labels})
        body = {
            "Image": image,
            "Entrypoint": entrypoint,
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
                    f"{what} {image!r} failed to fill volume {volume} (exit {status}): {logs}",
                    reason="InjectorFailed" if role == "runtime" else "ToolsFillFailed",
                )
        finally:
            await finish(self._engine.remove(container))
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
                f"{exc.message}; build or load it there (scripts/docker-setup.sh builds orchard-test/*), "
                "or name an image it has",
                sandbox_id=sandbox_id,
                reason="ErrImagePull",
            ) from exc

    async def start(
        self, spec: SandboxSpec, *, sandbox_id: str, token_sha256: str, tls: Identity | None = None
    ) -> DockerInstance:
        """Create and start the container; return once its executor answers."""
        t0 = time.monotonic()
        directory = self._socket_directory(sandbox_id) if self.unix else None
        try:
            return await self._start(spec, sandbox_id, token_sha256, tls, t0, directory)
        except BaseException:
            if directory is not None:
                await finish(asyncio.to_thread(_unix.remove_tree, directory))
            raise

    async def _start(
        self,
        spec: SandboxSpec,
        sandbox_id: str,
        token_sha256: str,
        tls: Identity | None,
        t0: float,
        directory: str | None,
    ) -> DockerInstance:
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
            config=self.config,
            tls_pem=tls.pem if tls is not None else None,
            socket_dir=directory,
        )
        try:
            async with asyncio.timeout(spec.start_timeout):
                body["HostConfig"]["Mounts"][0]["Source"] = await self.runtime_volume()
                if spec.tools:
                    body["HostConfig"]["Mounts"][1]["Source"] = await self.tools_volume()
                if directory is not None and not spec.network and not self.config.network:
                    body["HostConfig"]["NetworkMode"] = "none"  # only its loopback: nothing to reach it by
                else:
                    body["HostConfig"]["NetworkMode"] = await self.sandbox_network(spec.network)
                await self._ensure_image(spec, sandbox_id)
                return await self._create_and_start(spec, sandbox_id, body, t0, tls, directory)
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
        self,
        spec: SandboxSpec,
        sandbox_id: str,
        body: dict[str, Any],
        t0: float,
        tls: Identity | None,
        directory: str | None,
    ) -> DockerInstance:
        create = asyncio.ensure_future(
            self._engine.request("POST", "/containers/create", params={"name": sandbox_id}, body=body)
        )
        try:
            created = json.loads(await asyncio.shield(create))
        except DockerError as exc:
            if exc.status == 0:
                raise
            raise SandboxStartError(
                f"sandbox {sandbox_id}: the Docker engine refused the container: {exc.message}{self._hint(exc)}",
                sandbox_id=sandbox_id,
                reason="ImageNotFound"
                if exc.status == 404
                else "UnknownRuntime"
                if "runtime" in exc.message.lower()
                else "CreateContainerError",
            ) from exc
        except BaseException:
            # Interrupted (a timeout): the container may exist without our knowing its id.
            await finish(self._discard(create, sandbox_id))
            raise
        instance = DockerInstance(
            self._engine, sandbox_id, created["Id"], t0, tls.fingerprint if tls is not None else None, directory
        )
        instance.mark("created")
        try:
            try:
                await self._engine.request("POST", f"/containers/{instance.container_id}/start")
            except DockerError as exc:
                raise SandboxStartError(
                    f"sandbox {sandbox_id}: the container did not start: {exc.message}{self._hint(exc)}",
                    sandbox_id=sandbox_id,
                    reason="RunContainerError",
                ) from exc
            instance.mark("started")
            await self._wait_ready(instance)
            instance.mark("executor_ready")
        except BaseException:
            await finish(instance.delete())
            raise
        if spec.ttl is not None:
            instance.expire_after(spec.ttl)
        return instance

    async def _discard(self, create: asyncio.Future[bytes], sandbox_id: str) -> None:
        """Remove a container whose create call was interrupted, once the engine has answered it.

        Removed before the engine is done creating it, it would be created after.
        """
        with contextlib.suppress(Exception):
            await create
        await self._engine.remove(sandbox_id)

    def _hint(self, refusal: DockerError) -> str:
        """The option to fix when the engine refuses a container for one of ours."""
        message = refusal.message.lower()
        if "runtime" in message:
            return f"; DockerConfig(runtime={self.config.runtime!r}) names a runtime this engine does not have"
        if "capadd" in message or "capability" in message:
            return f"; check DockerConfig(cap_add={self.config.cap_add!r})"
        if "bind source path does not exist" in message:
            return (
                f"; the engine does not see {socket_root(self.config)} (it runs in another container or machine): "
                "set DockerConfig(socket_dir=...) to a directory it shares, or transport='tcp'"
            )
        if "rlimit" in message:
            return f"; DockerConfig(nofile={self.config.nofile}) may be above the engine's own open file limit"
        return ""

    async def _died(self, instance: DockerInstance) -> SandboxStartError:
        fate = await instance.fate()
        reason, message = fate if fate is not None else ("exited", "the container stopped")
        return SandboxStartError(
            f"sandbox {instance.id}: the executor did not come up: {message}", sandbox_id=instance.id, reason=reason
        )

    async def _wait_ready(self, instance: DockerInstance) -> None:
        """Poll /healthz on its socket or address, failing as soon as the container stops."""
        if instance.directory is not None:
            await self._poll(instance, os.path.join(instance.directory, SOCKET))
            return
        info = await self._engine.inspect(instance.container_id)
        scheme = "http" if instance.fingerprint is None else "https"
        if self.config.network:
            bindings = (info.network_settings.ports or {}).get(f"{self.config.executor_port}/tcp") or []
            port = next((b.host_port for b in bindings if b.host_port), None)
            if port is None:
                raise await self._died(instance)
            instance.base_url = f"{scheme}://127.0.0.1:{port}"
        else:
            # Nothing is published on an internal network: the executor is reached on the
            # bridge, an interface of this host that only its sandboxes share, at the
            # container's own address.
            endpoints = (info.network_settings.networks or {}).values()
            address = next((e.ip_address for e in endpoints if e.ip_address), None)
            if address is None:
                raise await self._died(instance)
            instance.base_url = f"{scheme}://{address}:{self.config.executor_port}"
        await self._poll(instance, None)

    async def _poll(self, instance: DockerInstance, socket_path: str | None) -> None:
        stopped = asyncio.ensure_future(self._engine.wait(instance.container_id))
        try:
            for delay in _retry.poll_delays():
                if stopped.done():
                    raise await self._died(instance)
                # The first socket at the path is the executor's: nothing else has run in the container yet.
                if socket_path is not None and instance.held is None and os.path.lexists(socket_path):
                    instance.connect(_unix.hold(socket_path, instance.id))
                # Until the executor listens, the port proxy accepts and then hangs up.
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    if socket_path is None or instance.http is not None:
                        async with (instance.http or self._http).get(
                            f"{instance.base_url}/healthz",
                            timeout=aiohttp.ClientTimeout(total=2.0),
                            ssl=pin(instance.fingerprint),
                        ) as resp:
                            if resp.status == 200:
                                return
                await asyncio.wait([stopped], timeout=delay)
        finally:
            stopped.cancel()
            await asyncio.wait([stopped])
            if not stopped.cancelled():
                stopped.exception()  # retrieved: a wait that failed is not an error here

    async def attach(self, handle: HandleFields, *, owner: bool) -> DockerInstance:
        """The running sandbox container the handle names, on this Client's engine."""
        sid = handle.sandbox_id
        try:
            info = await self._engine.inspect(sid)
        except DockerError as exc:
            if exc.status != 404:
                raise
            raise SandboxLost(
                f"sandbox {sid}: no such container: it was deleted", sandbox_id=sid, reason="removed"
            ) from None
        labels = info.config.labels or {}
        if labels.get(ROLE_LABEL) != "sandbox" or labels.get(SANDBOX_LABEL) != sid:
            raise InvalidHandle(f"container {sid} on this Docker engine is not an Orchard sandbox", sandbox_id=sid)
        instance = DockerInstance(self._engine, sid, info.id, time.monotonic(), handle.fingerprint)
        instance.base_url = handle.url
        instance.owned = owner
        if not info.state.running:
            raise await instance.diagnose() or SandboxLost(f"sandbox {sid} has ended", sandbox_id=sid)
        if handle.socket is not None:
            instance.connect(_unix.open_handle(handle, "a docker sandbox's socket is its creating client's"))
        return instance

    async def aclose(self) -> None:
        """Close the Engine API session (sandboxes are deleted by the client) and remove the empty socket directory."""
        await self._engine.close()
        if self._sockets is not None:
            with contextlib.suppress(OSError):  # not empty: a sandbox handed to another owner (``orchard gc``)
                os.rmdir(self._sockets)


# -- Inventory and garbage collection (``orchard ls`` / ``orchard gc``) --


def _orphaned_sockets(root: str, hostname: str, dry_run: bool) -> list[tuple[str, str]]:
    """Remove the socket directories (``DockerBackend._socket_directory``) of clients that are gone."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    removed = []
    for name in names:
        pid, _, rest = name.partition("-")
        started = rest.rpartition("-")[0]
        if owner_alive(f"{hostname}/{pid}/{started}", hostname) is False:
            if not dry_run:
                _unix.remove_tree(os.path.join(root, name))
            removed.append((name, "orphaned socket directory"))
    return removed


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
        removed += await asyncio.to_thread(_orphaned_sockets, socket_root(config), hostname, dry_run)
        # Runtime and tools volumes of images that are gone; one in use stays (409).
        for role in ("runtime", "tools"):
            volumes = json.loads(
                await engine.request(
                    "GET", "/volumes", params={"filters": json.dumps({"label": [f"{ROLE_LABEL}={role}"]})}
                )
            )
            for volume in volumes.get("Volumes") or []:
                injector = (volume.get("Labels") or {}).get(INJECTOR_LABEL, "")
                image_id = await engine.image_id(injector) if injector else None
                if image_id is not None and volume["Name"] == f"orchard-{role}-{image_id.removeprefix('sha256:')[:12]}":
                    continue
                if dry_run:
                    removed.append((volume["Name"], f"stale {role} volume"))
                    continue
                with contextlib.suppress(DockerError):
                    await engine.request("DELETE", f"/volumes/{volume['Name']}")
                    removed.append((volume["Name"], f"stale {role} volume"))
        return removed
    finally:
        await engine.close()
