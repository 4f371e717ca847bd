"""Orchard: a sandbox per rollout, from any image, with millisecond exec.

Example::

    import asyncio
    import orchard

    async def main():
        async with orchard.Client() as client:  # the embedded "local" backend
            async with client.sandbox() as sb:
                await sb.write_file("hello.py", "print('hello')")
                result = await sb.exec("python3 hello.py", timeout=10)
                print(result.exit_code, result.stdout)

    asyncio.run(main())

Errors are in ``orchard.errors``; all derive from ``OrchardError``.
"""

import importlib
from typing import TYPE_CHECKING

from orchard_executor.protocol import ExecResult, ExitEvent, FileStat, OutputEvent, ProcessStatus

from . import errors
from ._backends import DockerConfig, KubernetesConfig, LocalConfig
from ._client import Client, sandbox
from ._handle import Handle
from ._sandbox import Process, Sandbox, Shell
from ._snapshot import Snapshot
from ._spec import SandboxSpec
from .errors import OrchardError

if TYPE_CHECKING:
    from . import harness as harness
    from . import rollout as rollout
    from . import sync as sync
    from . import tasks as tasks
    from .gateway import ModelGateway

#: Subpackages that ``orchard.NAME`` imports on first use, so ``import orchard`` stays light.
_LAZY_MODULES = ("harness", "rollout", "sync", "tasks")

__version__ = "0.1.0"

__all__ = [
    "Client",
    "DockerConfig",
    "ExecResult",
    "ExitEvent",
    "FileStat",
    "Handle",
    "KubernetesConfig",
    "LocalConfig",
    "ModelGateway",
    "OrchardError",
    "OutputEvent",
    "Process",
    "ProcessStatus",
    "Sandbox",
    "SandboxSpec",
    "Shell",
    "Snapshot",
    "errors",
    "sandbox",
]


def __getattr__(name: str) -> object:
    # The gateway is imported on first use, so `import orchard` stays light.
    if name == "ModelGateway":
        from .gateway import ModelGateway

        return ModelGateway
    if name in _LAZY_MODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'orchard' has no attribute {name!r}")
