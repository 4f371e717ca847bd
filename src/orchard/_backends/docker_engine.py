"""A minimal async client of the Docker Engine API: only the calls the docker backend makes.

Spoken with aiohttp over the engine's socket (never the docker CLI); each
response is decoded into a msgspec Struct holding only the fields read.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any
from urllib.parse import quote

import aiohttp
import msgspec

from ..errors import ConfigError, OrchardError

#: The Engine API version spoken: Docker 20.10's, which later engines serve too.
API_VERSION = "1.41"
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


class _Endpoint(msgspec.Struct, rename="pascal", frozen=True):
    network_id: str = msgspec.field(default="", name="NetworkID")
    ip_address: str = msgspec.field(default="", name="IPAddress")
    gateway: str = ""


class _Network(msgspec.Struct, rename="pascal", frozen=True):
    ports: dict[str, list[_Binding] | None] | None = None
    networks: dict[str, _Endpoint] | None = None


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


class Network(msgspec.Struct, rename="pascal", frozen=True):
    """One entry of ``GET /networks``."""

    id: str = ""
    name: str = ""
    created: str = ""
    internal: bool = False
    options: dict[str, str] | None = None
    labels: dict[str, str] | None = None


class _Image(msgspec.Struct, rename="pascal", frozen=True):
    id: str = ""


class _Wait(msgspec.Struct, rename="pascal", frozen=True):
    status_code: int = 0


_CONTAINER = msgspec.json.Decoder(Container)
_SUMMARIES = msgspec.json.Decoder(list[ContainerSummary])
_NETWORKS = msgspec.json.Decoder(list[Network])
_IMAGE = msgspec.json.Decoder(_Image)
_WAIT = msgspec.json.Decoder(_Wait)


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


def _demux(raw: bytes) -> str:
    """Container logs without the stream headers the Engine API frames them with."""
    out = bytearray()
    while len(raw) >= 8 and raw[0] in (0, 1, 2) and raw[1:4] == b"\0\0\0":
        size = int.from_bytes(raw[4:8], "big")
        out += raw[8 : 8 + size]
        raw = raw[8 + size :]
    out += raw
    return out.decode("utf-8", "replace").strip()


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

    async def networks(self, name: str) -> list[Network]:
        """The networks named exactly ``name`` (the engine lets a race make two)."""
        filters = json.dumps({"name": [name]})
        found = _NETWORKS.decode(await self.request("GET", "/networks", params={"filters": filters}))
        return [n for n in found if n.name == name]  # the filter also matches substrings

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
