"""Backends, chosen by a tagged config; each is imported only when built."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from ..errors import ConfigError
from .base import Backend, Instance


class LocalConfig(msgspec.Struct, kw_only=True, frozen=True, tag="local"):
    """The embedded default: each sandbox is an executor process on this machine."""

    #: Directory under which each sandbox gets its private directory.
    root: str | None = None
    #: Python interpreter that runs the executors (default: this one).
    python: str | None = None
    #: "bwrap": run each sandbox under bubblewrap (read-only host, private /tmp,
    #: its own user, pid, ipc and uts namespaces); "none": plain child processes;
    #: "auto": bwrap when it is installed and works.
    isolation: Literal["auto", "bwrap", "none"] = "none"


BackendConfig = LocalConfig
BACKENDS = ("local",)


def make_config(backend: str | BackendConfig, options: dict[str, Any]) -> BackendConfig:
    """A backend config from a name plus options, or a config as given."""
    if not isinstance(backend, str):
        if options:
            raise ConfigError("pass backend options inside the config object, not as keyword arguments")
        return backend
    if backend not in BACKENDS:
        raise ConfigError(f"backend={backend!r} is not one of {', '.join(BACKENDS)}")
    try:
        return msgspec.convert({"type": backend, **options}, BackendConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid option for the {backend} backend: {exc}") from None


def build_backend(config: BackendConfig) -> Backend:
    """Instantiate the backend a config names."""
    from .local import LocalBackend

    return LocalBackend(config)


__all__ = ["BACKENDS", "Backend", "BackendConfig", "Instance", "LocalConfig", "build_backend", "make_config"]
