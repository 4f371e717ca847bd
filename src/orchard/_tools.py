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

#: Where the tools volume (docker) or emptyDir (kubernetes, copied) is mounted in a sandbox; an image volume
#: (kubernetes) is mounted at BUNDLE.
ROOT = "/.orchard-tools"
#: The bundle itself, inside ROOT: the path its launchers and runtimes were built for.
BUNDLE = f"{ROOT}/bundle"
#: The bundle inside the tools image (mounted straight from it where the cluster has image volumes).
BUNDLE_IN_IMAGE = "/bundle"
#: The harnesses the bundle holds (images/tools/build_tools.py: HARNESSES, PY_HARNESSES), with their versions
#: in BUNDLE/VERSIONS.
KNOWN = ("codex", "claude", "opencode", "pi", "openclaw", "mini", "hermes")


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
NEEDS = {"pi": ("node",), "openclaw": ("node",), "mini": ("python",), "hermes": ("python",)}

# Both run in the tools image, with its static busybox, and write to /target.

#: Fills a shared volume (docker): the whole bundle is copied beside ``bundle`` and renamed into
#: place, so a sandbox never sees half of it, and two fillers racing leave one copy.
_FILL = """
set -e
b=/installer/busybox
[ -d /target/bundle ] && exit 0
staging=/target/.staging-$($b cat /proc/sys/kernel/random/uuid)
$b cp -a /bundle "$staging"
$b mv -T "$staging" /target/bundle 2>/dev/null || $b rm -rf "$staging"
[ -d /target/bundle ]
"""

#: Copies the chosen parts of the bundle (``$@``) into one pod's emptyDir (kubernetes' init container).
_COPY = """
set -e
b=/installer/busybox
$b mkdir -p /target/bundle
for part in "$@"; do $b cp -a "/bundle/$part" /target/bundle/; done
"""


def fill() -> list[str]:
    """The command that fills a tools volume mounted at /target with the whole bundle."""
    return ["/installer/busybox", "sh", "-c", _FILL]


def copy(names: Iterable[str]) -> list[str]:
    """The command that copies what ``names`` need (``parts``) into /target/bundle."""
    return ["/installer/busybox", "sh", "-c", _COPY, "copy", *parts(names)]


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
