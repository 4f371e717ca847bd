"""What a sandbox should be, and which backend runs it: plain, validated data."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any, Literal

import msgspec

from . import _tools
from .errors import ConfigError


class SandboxSpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Everything a backend needs to start one sandbox.

    Each backend documents which fields it enforces; the ``local`` backend
    runs on the host and enforces env, workdir, ttl and idle_timeout only
    (and shm, under bubblewrap).
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
    #: Size of the sandbox's own /dev/shm, a tmpfs, in Kubernetes notation ("1Gi"): docker, kubernetes,
    #: local under bubblewrap (unisolated local refuses it). What is written there is held in memory
    #: (and counts against ``memory``). None: the backend's default (docker's is 64 MB).
    shm: str | None = None


#: Kubernetes quantity suffixes, as multipliers.
_SUFFIXES = {
    "": 1,
    **{s: 1024 ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{s: 1000 ** (i + 1) for i, s in enumerate(("k", "M", "G", "T", "P", "E"))},
}
_QUANTITY = re.compile(
    r"([+-]?[0-9]+(?:\.[0-9]*)?|[+-]?\.[0-9]+)(?:[eE]([+-]?[0-9]+))?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?"
)
#: The most any backend takes: Docker's ShmSize and Kubernetes' quantities are int64, and so is bwrap's --size.
MAX_BYTES = 2**63 - 1


def quantity_bytes(name: str, value: str) -> int:
    """Bytes in a Kubernetes quantity (``"96Mi"``, ``"1G"``, ``"1.5Gi"``), rounded up; a ConfigError naming ``name``.

    The result is positive and fits in int64 (a tmpfs of size 0 would be unbounded).
    """
    match = _QUANTITY.fullmatch(value.strip()) if isinstance(value, str) else None
    if match is None:
        raise ConfigError(f"sandbox option {name}={value!r} is not a quantity such as '64Mi' or '1Gi'")
    number, exponent, suffix = match.groups()
    if exponent is not None and int(exponent) > 30:
        raise ConfigError(f"sandbox option {name}={value!r} is too large (at most {MAX_BYTES} bytes)")
    try:
        exact = Decimal(number).scaleb(int(exponent or 0)) * _SUFFIXES[suffix or ""]
    except InvalidOperation:
        raise ConfigError(f"sandbox option {name}={value!r} is not a quantity such as '64Mi' or '1Gi'") from None
    size = int(exact.to_integral_value(rounding="ROUND_CEILING"))
    if size <= 0:
        raise ConfigError(f"sandbox option {name}={value!r} must be positive")
    if size > MAX_BYTES:
        raise ConfigError(f"sandbox option {name}={value!r} is too large (at most {MAX_BYTES} bytes)")
    return size


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
    if spec.shm is not None:
        quantity_bytes("shm", spec.shm)
    return spec
