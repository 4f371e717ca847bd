"""README promises that pure logic proves: the error hierarchy as the README names it.

Each test names the sentence it proves; docs/promises.md lists them.
"""

from __future__ import annotations

import inspect

import pytest

import orchard
import orchard.gateway
import orchard.gui
import orchard.rollout
import orchard.tasks
from orchard import errors

pytestmark = pytest.mark.unit

PUBLIC_MODULES = [orchard, errors, orchard.gateway, orchard.gui, orchard.rollout, orchard.tasks]


def public_exceptions() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for module in PUBLIC_MODULES:
        for name, value in vars(module).items():
            if inspect.isclass(value) and issubclass(value, BaseException) and not name.startswith("_"):
                if value.__module__.startswith("orchard"):
                    found[f"{module.__name__}.{name}"] = value
    return found


def test_every_error_orchard_defines_derives_from_orchard_error() -> None:
    """README: "Errors all derive from `orchard.OrchardError`" (a warning is not an error)."""
    found = public_exceptions()
    assert "orchard.errors.SandboxTimeout" in found
    assert len(found) > 30
    outside = [name for name, cls in found.items() if not issubclass(cls, (errors.OrchardError, Warning))]
    assert outside == []
    assert issubclass(errors.UnisolatedWarning, UserWarning)
    # The one base is importable from the package itself.
    assert orchard.OrchardError is errors.OrchardError


@pytest.mark.parametrize(
    ("error", "builtin"),
    [
        (errors.PathNotFound, FileNotFoundError),
        (errors.SandboxTimeout, TimeoutError),
        (errors.SandboxLost, ConnectionError),
        (errors.InvalidRequest, ValueError),
        (errors.AccessDenied, PermissionError),
        (errors.PortClosed, ConnectionRefusedError),
        (errors.ConfigError, ValueError),
        (errors.InvalidHandle, ValueError),
        (errors.ClusterUnavailable, ConnectionError),
        (errors.CommandNotFound, FileNotFoundError),
        (errors.NoSpace, OSError),
        (errors.AuthError, PermissionError),
        (errors.UnsafeArchive, ValueError),
        (errors.ProtocolError, ConnectionError),
        (errors.TraceError, OSError),
        (errors.TaskError, errors.ConfigError),
        (errors.UnsafeUpload, errors.UnsafeArchive),
        (errors.SnapshotTooLarge, errors.OrchardError),
        (errors.SyncLoopError, RuntimeError),
        (errors.BrowserCrashed, errors.OrchardError),
        (errors.GuiUnavailable, errors.OrchardError),
        (errors.NoDisplay, errors.OrchardError),
    ],
)
def test_each_error_is_also_the_builtin_the_readme_names(error: type[BaseException], builtin: type) -> None:
    """README: "each also inherits the builtin it means"."""
    assert issubclass(error, builtin)
    assert issubclass(error, errors.OrchardError)


def test_sandbox_lost_carries_its_reason() -> None:
    """README: "`SandboxLost` (the sandbox died, with a `reason`)"."""
    lost = errors.SandboxLost("gone", sandbox_id="sb-1", reason="OOMKilled")
    assert (lost.reason, lost.sandbox_id) == ("OOMKilled", "sb-1")


def default(function: object, name: str) -> object:
    return inspect.signature(function).parameters[name].default  # type: ignore[arg-type]


def test_the_defaults_the_readme_states_are_the_apis() -> None:
    """README's stated defaults, as the public signatures have them.

    `Client(read_timeout=60)`, `Client(liveness_timeout=20)`, `forward(wait=0,
    check=True)`, `attach(timeout=10)`, a tree's `max_bytes` (4 GiB) and
    `max_members` (100,000), a snapshot's `max_bytes` (1 GiB); the behaviour
    behind each is tested with smaller values in the modules docs/promises.md names.
    """
    assert default(orchard.Client, "read_timeout") == 60
    assert default(orchard.Client, "liveness_timeout") == 20
    assert default(orchard.Client.attach, "timeout") == 10
    assert default(orchard.Sandbox.forward, "wait") == 0
    assert default(orchard.Sandbox.forward, "check") is True
    for method in (orchard.Sandbox.upload, orchard.Sandbox.download):
        assert default(method, "max_bytes") == 4 * 1024**3
        assert default(method, "max_members") == 100_000
    assert default(orchard.Sandbox.snapshot, "max_bytes") == 1024**3
    assert orchard.SandboxSpec().idle_timeout == 600


def test_the_bounds_the_readme_states_are_the_executors() -> None:
    """README's figures for the executor's bounds, as the code the behaviour tests exercise has them.

    The tests that prove each bound holds (tests/test_forward.py,
    tests/test_reverse_forward.py, tests/test_client_deadlines.py) count up to
    these names; this one checks that the numbers are the README's.
    """
    from orchard import _rpc
    from orchard_executor import ports, protocol

    mib = 1024 * 1024
    assert ports.MAX_TUNNELS == 256  # forward: "at most 256 at once"
    assert ports.MAX_LISTENERS == 4  # reverse_forward: "4 listening ports"
    assert ports.MAX_REVERSE == 128  # "per port 128 connections at once"
    assert ports.MAX_UNCLAIMED == 32  # "32 announced but not yet claimed"
    assert ports.CLAIM_TIMEOUT == 10  # "a connection not claimed within 10 s is reset"
    assert protocol.HEARTBEAT == 1  # "Streams carry a heartbeat every second"
    assert _rpc.STREAM_IDLE_TIMEOUT == 30  # "and give up after 30 s of silence"
    assert _rpc.MAX_REPLY == protocol.MAX_BODY == 64 * mib  # "Replies are read with caps (64 MiB ...)"
    assert protocol.DEFAULT_MAX_OUTPUT == 10 * mib
