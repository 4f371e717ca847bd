"""Agent-harness CLIs in any image: the tools bundle (images/tools) and what ``tools=[...]`` selects.

The bundle holds each harness with its own runtime (see
images/tools/build_tools.py); a sandbox that asks for some gets the bundle
read-only at ``ROOT`` and each chosen harness's ``bin`` directory appended to
its commands' PATH, after the image's own directories, so the image's own
tools win.
"""

from __future__ import annotations

from collections.abc import Iterable

from .errors import ConfigError

#: Where the tools volume (docker) is mounted in a sandbox.
ROOT = "/.orchard-tools"
#: The bundle itself, inside ROOT: the path its launchers and runtimes were built for.
BUNDLE = f"{ROOT}/bundle"
#: The harnesses the bundle holds (images/tools/build_tools.py: HARNESSES, PY_HARNESSES), with their versions
#: in BUNDLE/VERSIONS.
KNOWN = ("codex", "claude", "opencode", "pi", "openclaw", "mini")


def check(names: Iterable[str]) -> list[str]:
    """``names`` in order, once each; an unknown one is a ``ConfigError`` listing those there are."""
    chosen: list[str] = []
    for name in names:
        if name not in KNOWN:
            raise ConfigError(f"tools=[{name!r}]: no such harness in the tools bundle; it has {', '.join(KNOWN)}")
        if name not in chosen:
            chosen.append(name)
    return chosen


#: The bundle's shared runtimes each harness runs on, beside its own directory.
NEEDS = {"pi": ("node",), "openclaw": ("node",), "mini": ("python",)}

#: Copies the chosen parts of the bundle (``$@``) from the tools image's /bundle into /target/bundle,
#: with the tools image's static busybox (kubernetes: the init container of a pod with tools).
COPY = """
set -e
b=/installer/busybox
$b mkdir -p /target/bundle
for part in "$@"; do $b cp -a "/bundle/$part" /target/bundle/; done
"""


def parts(names: Iterable[str]) -> list[str]:
    """The top-level entries of the bundle that ``names`` need: the loader's libraries, runtimes, themselves."""
    out = ["lib", "VERSIONS"]
    for name in names:
        for part in (*NEEDS.get(name, ()), name):
            if part not in out:
                out.append(part)
    return out


def path_dirs(names: Iterable[str]) -> str:
    """The directories to append to PATH for ``names``, ':'-separated."""
    return ":".join(f"{BUNDLE}/{name}/bin" for name in names)
