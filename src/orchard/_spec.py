"""What a sandbox should be, and which backend runs it: plain, validated data."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from . import _tools
from .errors import ConfigError


class SandboxSpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
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
    #: Extra annotations on the pod or container (kubernetes, docker).
    annotations: dict[str, str] = {}
    #: Node labels the pod must match (kubernetes).
    node_selector: dict[str, str] = {}
    #: Pod tolerations, as Kubernetes writes them (kubernetes).
    tolerations: list[dict[str, Any]] = []
    #: RuntimeClass for stronger isolation, e.g. "gvisor" or "kata" (kubernetes).
    runtime_class: str | None = None
    #: Names of Secrets to pull the image with (kubernetes).
    image_pull_secrets: list[str] = []
    #: Outbound network access. On kubernetes, the NetworkPolicies written by
    #: ``orchard k8s setup`` deny egress unless this is True; the local backend
    #: cannot enforce it.
    network: bool = False
    #: "IfNotPresent", "Always" or "Never" (kubernetes, docker).
    image_pull_policy: Literal["IfNotPresent", "Always", "Never"] = "IfNotPresent"
    #: Agent-harness CLIs to put on PATH, from the tools bundle (``orchard._tools.KNOWN``: "codex",
    #: "claude", "opencode", "pi", "openclaw", "mini"): read-only, after the image's own PATH (docker, kubernetes).
    tools: list[str] = []


def make_spec(image: str, options: dict[str, Any]) -> SandboxSpec:
    """Build a spec from keyword options, naming a bad option in the error."""
    try:
        spec = msgspec.convert({"image": image, **options}, SandboxSpec)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid sandbox option: {exc}") from None
    if spec.tools:
        msgspec.structs.force_setattr(spec, "tools", _tools.check(spec.tools))
    for name in ("ttl", "idle_timeout", "start_timeout"):
        value = getattr(spec, name)
        if value is not None and value <= 0:
            raise ConfigError(f"sandbox option {name}={value!r} must be positive")
    return spec
