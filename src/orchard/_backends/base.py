"""The backend interface: where a sandbox runs, not how we talk to it."""

from __future__ import annotations

from typing import Any, Protocol

from .._handle import HandleFields
from .._spec import SandboxSpec
from .._tls import Identity
from ..errors import OrchardError


class Instance(Protocol):
    """A started sandbox as its backend sees it: an executor at ``base_url``."""

    @property
    def base_url(self) -> str:
        """Where the executor answers, e.g. ``http://10.0.0.7:8750``."""
        ...

    @property
    def timings(self) -> dict[str, float]:
        """Seconds from the start request to each startup phase, in order."""
        ...

    async def diagnose(self) -> OrchardError | None:
        """Why the executor stopped answering, if the backend knows (None if it looks alive)."""
        ...

    async def delete(self) -> None:
        """End the sandbox and free everything it held; safe to call twice.

        For a sandbox attached without ``owner``, only let go of it: free what
        this process holds (sessions, a port-forward) and leave it running.
        """
        ...

    def describe(self) -> dict[str, Any]:
        """How another process reaches its executor: ``HandleFields`` values (url, socket, namespace, ...)."""
        ...


class Backend(Protocol):
    """Starts sandboxes; one per Client."""

    name: str
    #: Whether its executors are reached over a network, and so speak TLS (``start`` gets ``tls``).
    tls: bool
    #: Whether it mounts the harness tools bundle (``SandboxSpec.tools``).
    tools: bool
    #: Where ``Sandbox.snapshot()`` looks for changes: "/" (the sandbox's own root), or
    #: None, the working directory, where sandboxes share the host's root (local).
    changes_root: str | None

    async def start(
        self, spec: SandboxSpec, *, sandbox_id: str, token_sha256: str, tls: Identity | None = None
    ) -> Instance:
        """Start a sandbox and return once its executor is ready.

        ``tls`` is the sandbox's TLS identity when the backend's ``tls`` is true:
        its executor serves with that key and certificate, at an ``https`` URL.

        Raises:
            SandboxStartError: it cannot start (the reason says why).
            SandboxTimeout: it was not ready within ``spec.start_timeout``.
        """
        ...

    async def attach(self, handle: HandleFields, *, owner: bool) -> Instance:
        """Reach a sandbox another client started, from its handle; create nothing.

        Checks that the sandbox exists and that what answers at its address
        is its executor (pinned certificate, socket inode), but sends no
        request with the token: the Client does that.

        Raises:
            SandboxLost: the sandbox was deleted or has ended.
            ConfigError: the handle needs options this Client lacks.
            ProtocolError: something else took the executor's place.
        """
        ...

    async def aclose(self) -> None:
        """Release the backend's own resources (not the sandboxes)."""
        ...
