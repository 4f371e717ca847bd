"""What a sandbox should be, and which backend runs it: plain, validated data."""

from __future__ import annotations

from typing import Any

import msgspec

from .errors import ConfigError


class SandboxSpec(msgspec.Struct, kw_only=True, frozen=True):
    """Everything a backend needs to start one sandbox.

    Each backend documents which fields it enforces; the ``local`` backend
    runs on the host and enforces env, workdir, ttl and idle_timeout only.
    """

    #: The container image (recorded but not used by the ``local`` backend).
    image: str = "local"
    #: CPU request and limit, in Kubernetes notation ("1", "500m") or cores.
    cpu: str | float | None = None
    #: Memory request and limit, in Kubernetes notation ("2Gi").
    memory: str | None = None
    #: Environment variables for every command, on top of the image's.
    env: dict[str, str] = {}
    #: Default working directory of commands and base of relative paths.
    workdir: str | None = None
    #: Extra labels recorded on the sandbox (and its pod or container).
    labels: dict[str, str] = {}
    #: Seconds after which the sandbox is ended whatever it is doing.
    ttl: float | None = None
    #: The executor exits after this many seconds without a request.
    idle_timeout: float | None = 600.0
    #: Seconds to wait for the sandbox to become ready.
    start_timeout: float = 120.0


def make_spec(image: str, options: dict[str, Any]) -> SandboxSpec:
    """Build a spec from keyword options, naming a bad option in the error."""
    try:
        spec = msgspec.convert({"image": image, **options}, SandboxSpec)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid sandbox option: {exc}") from None
    for name in ("ttl", "idle_timeout", "start_timeout"):
        value = getattr(spec, name)
        if value is not None and value <= 0:
            raise ConfigError(f"sandbox option {name}={value!r} must be positive")
    return spec
