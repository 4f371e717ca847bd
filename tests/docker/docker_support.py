"""Helpers and names shared by the docker backend's tests (fixtures live in conftest.py)."""

from __future__ import annotations

import http.client
import importlib.util
import json
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import orchard

SOCKET = "/var/run/docker.sock"
INJECTOR = "orchard-executor:latest"
TOOLS = "orchard-tools:latest"
SWE = "orchard-test/swe:latest"
BUSYBOX = "orchard-test/busybox:latest"
NOSHELL = "orchard-test/noshell:latest"
NONROOT = "orchard-test/nonroot:latest"
#: Chromium, Xvfb, openbox and xterm (images/tasks/browser), for the GUI tests.
BROWSER = "orchard-test/browser:latest"
IMAGES = (INJECTOR, SWE, BUSYBOX, NOSHELL, NONROOT, BROWSER)
#: The empty working directory the generic tests start in.
WORKDIR = "/work"

SandboxFactory = Callable[..., Awaitable[orchard.Sandbox]]


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=10)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(self._path)


def engine(method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """A synchronous Engine API call (for checks and test set-up outside the code under test)."""
    conn = _UnixHTTPConnection(SOCKET)
    try:
        data = None if body is None else json.dumps(body)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
    finally:
        conn.close()
    try:
        return resp.status, json.loads(raw) if raw else None
    except ValueError:
        return resp.status, raw


def containers(label: str) -> list[dict[str, Any]]:
    """Containers (running or not) carrying a label."""
    filters = quote(json.dumps({"label": [label]}))
    status, found = engine("GET", f"/containers/json?all=1&filters={filters}")
    assert status == 200, found
    return list(found)


def inspect(container: str) -> dict[str, Any] | None:
    """``docker inspect`` of a container, or None if it does not exist."""
    status, info = engine("GET", f"/containers/{container}/json")
    if status == 404:
        return None
    assert status == 200, info
    return dict(info)


def live_processes(stat_lines: str) -> list[tuple[int, str, str, int]]:
    """(pid, name, state, parent pid) of each process in ``cat /proc/[0-9]*/stat`` output, zombies included."""
    found = []
    for line in stat_lines.splitlines():
        pid, rest = line.split(" ", 1)
        name = rest[rest.index("(") + 1 : rest.rindex(")")]
        state, ppid = rest[rest.rindex(")") + 2 :].split()[:2]
        found.append((int(pid), name, state, int(ppid)))
    return found


def events(since: int, until: int, **filters: list[str]) -> list[dict[str, Any]]:
    """Engine events between two Unix times, matching ``filters`` (``label=[...]``, ``event=[...]``)."""
    conn = _UnixHTTPConnection(SOCKET)
    try:
        conn.request("GET", f"/events?since={since}&until={until}&filters={quote(json.dumps(filters))}")
        resp = conn.getresponse()
        raw = resp.read()
    finally:
        conn.close()
    assert resp.status == 200, raw
    return [json.loads(line) for line in raw.splitlines() if line.strip()]


REPO = Path(__file__).resolve().parents[2]


def executor_source_hash() -> str:
    """The digest scripts/docker-setup.sh labels the injector image with, for this tree's executor."""
    spec = importlib.util.spec_from_file_location("build_bundle", REPO / "images" / "executor" / "build_bundle.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    digest: str = module.source_hash(str(REPO / "executor" / "orchard_executor"))
    return digest


def networks_of(sandbox_id: str) -> dict[str, bool]:
    """The Docker networks a sandbox's container is on, each with whether the engine made it internal (no route out).

    ``{"none": False}``: no network at all, only the container's loopback.

    Asked of the engine rather than tried from inside: a test sends no traffic beyond this machine.
    """
    (found,) = containers(f"orchard.dev/sandbox={sandbox_id}")
    info = inspect(found["Id"])
    assert info is not None
    out = {}
    for name in info["NetworkSettings"]["Networks"]:
        status, net = engine("GET", f"/networks/{name}")
        assert status == 200, net
        out[name] = bool(net["Internal"])
    return out
