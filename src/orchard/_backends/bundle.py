"""The injected executor runtime: where it is mounted and how it is started.

``Dockerfile.executor`` builds the injector image, which holds the runtime at
``/orchard``: a CPython, its pruned stdlib, aiohttp, msgspec, the executor,
every shared library they load and the dynamic loader. Its entrypoint copies
the runtime to ``<target>/runtime`` (atomically, so a volume shared by many
sandboxes can be filled by whichever installer comes first). A sandbox
container mounts that directory and replaces its command with ``launcher()``:
the bundled loader starts the bundled Python, so nothing is needed from the
image (no libc, Python, shell or PATH) and no environment variable is set.
"""

from __future__ import annotations

#: Where sandbox containers mount the directory that holds ``runtime/``.
MOUNT = "/.orchard"
#: Where the runtime lives inside the injector image.
IMAGE_RUNTIME = "/orchard"


def _python(runtime: str) -> list[str]:
    # -OO: the bundle ships only .opt-2.pyc files (no docstrings: less memory).
    # Isolation (-I) is implied by bin/python3._pth, which also sets sys.path.
    return [
        f"{runtime}/lib/ld.so",
        "--library-path",
        f"{runtime}/lib",
        "--inhibit-cache",
        f"{runtime}/bin/python3",
        "-OO",
    ]


def launcher(mount: str = MOUNT) -> list[str]:
    """The sandbox container's command (executor arguments follow it)."""
    return [*_python(f"{mount}/runtime"), "-m", "orchard_executor"]


def install(target: str = MOUNT) -> list[str]:
    """The injector container's command: copy the runtime into ``target``/runtime."""
    return [*_python(IMAGE_RUNTIME), f"{IMAGE_RUNTIME}/install.py", target]
