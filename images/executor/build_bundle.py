"""Build the executor's self-contained runtime directory.

Run by ``Dockerfile.executor`` in its build stage, with the base image's own
CPython (3.11 or newer)::

    python3 build_bundle.py --wheels DIR --executor DIR --out /orchard

The result needs nothing from the image it is later mounted into: it holds
the CPython binary, a pruned stdlib, the wheels' packages and the executor,
every shared library those load, and the dynamic loader itself. It is
started as::

    OUT/lib/ld.so --library-path OUT/lib --inhibit-cache OUT/bin/python3 -OO -m orchard_executor ...

``bin/python3._pth`` sets ``sys.path`` relative to the binary (and implies
isolated mode), so no environment variable is needed, and none can leak into
the commands the executor runs. The directory is relocatable.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import os
import re
import shutil
import stat
import subprocess
import sys
import sysconfig
import zipfile

VERSION = f"python{sys.version_info.major}.{sys.version_info.minor}"

#: Stdlib packages and modules the executor never imports (by top-level name).
STDLIB_PRUNE = {
    "__phello__",
    "_pydecimal.py",
    "config-" + VERSION[6:],
    "curses",
    "dbm",
    "distutils",
    "doctest.py",
    "ensurepip",
    "idlelib",
    "lib2to3",
    "msilib",
    "pydoc.py",
    "pydoc_data",
    "site-packages",
    "dist-packages",
    "sqlite3",
    "test",
    "tkinter",
    "turtle.py",
    "turtledemo",
    "venv",
    "wsgiref",
    "xmlrpc",
}
#: Extension modules kept from lib-dynload (prefix before the first dot).
#: Everything else (ctypes, curses, readline, sqlite, tk, dbm, test modules,
#: ...) would drag in libraries the executor never needs. ``_ssl`` (libssl) is
#: for executors reached over a network, which speak TLS; it is loaded only then.
DYNLOAD_KEEP = {
    "_asyncio",
    "_blake2",
    "_bisect",
    "_codecs_iso2022",
    "_contextvars",
    "_datetime",
    "_decimal",
    "_heapq",
    "_json",
    "_md5",
    "_multibytecodec",
    "_opcode",
    "_posixsubprocess",
    "_queue",
    "_random",
    "_sha1",
    "_sha2",
    "_sha256",
    "_sha3",
    "_sha512",
    "_socket",
    "_ssl",
    "_statistics",
    "_struct",
    "_typing",
    "_zoneinfo",
    "array",
    "binascii",
    "fcntl",
    "grp",
    "math",
    "mmap",
    "pyexpat",
    "resource",
    "select",
    "termios",
    "unicodedata",
    "zlib",
}
#: Files in installed wheels that only matter for building or type checking.
SITE_JUNK = re.compile(r".*\.(c|h|pyx|pxd|pyi|cpp)$|py\.typed$")
#: Optional accelerators the executor does not need (each package falls back to
#: pure Python): websockets carry only forward()'s tunnels (measured in
#: benchmarks/bench_forward.py), and frozenlist's C++ module alone would
#: map libstdc++ (about 1 MB of resident memory) into every executor.
SITE_DROP = re.compile(r"aiohttp/_websocket/(reader_c|mask)\.cpython-.*\.so$|frozenlist/_frozenlist\.cpython-.*\.so$")


#: Packages whose ``__init__`` imports all their submodules, made to import each one when
#: one of its names is first used (PEP 562): aiohttp's imports its whole HTTP client
#: (about 30 ms of every executor start, measured), which the executor, a server, never uses.
LAZY_PACKAGES = ("aiohttp",)
_LAZY_GETATTR = """

_LAZY = {names!r}
_SUBMODULES = {modules!r}


def __getattr__(name):
    import importlib

    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module("." + module, __name__), attr)
    elif name in _SUBMODULES:
        value = importlib.import_module("." + name, __name__)
    else:
        return {fallback}(name)
    globals()[name] = value
    return value


def _no_attribute(name):
    raise AttributeError(f"module {{__name__!r}} has no attribute {{name!r}}")
"""


def lazy_init(path: str) -> None:
    """Rewrite a package's ``__init__.py``: each ``from .module import name`` runs when ``name`` is first used.

    The package's own ``__getattr__``, if any, still answers other names.
    """
    with open(path) as f:
        tree = ast.parse(f.read())
    names: dict[str, tuple[str, str]] = {}
    body: list[ast.stmt] = []
    fallback = "_no_attribute"
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            names.update({alias.asname or alias.name: (node.module, alias.name) for alias in node.names})
            continue
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            node.name = fallback = "_package_getattr"
        body.append(node)
    if not names:
        raise SystemExit(f"build_bundle: {path} imports nothing from its submodules to make lazy")
    modules = sorted({module.split(".")[0] for module, _ in names.values()})
    code = ast.unparse(ast.Module(body=body, type_ignores=[]))
    with open(path, "w") as f:
        f.write(code + _LAZY_GETATTR.format(names=names, modules=modules, fallback=fallback))


def _install_wheels(wheels: str, site: str) -> list[str]:
    """Unpack every wheel in ``wheels`` into ``site`` (a wheel is a zip of its install tree)."""
    names = sorted(n for n in os.listdir(wheels) if n.endswith(".whl") and not n.startswith("pip-"))
    if not names:
        raise SystemExit(f"build_bundle: no wheels in {wheels}")
    for name in names:
        with zipfile.ZipFile(os.path.join(wheels, name)) as whl:
            whl.extractall(site)
    # Wheels may carry ``<name>.data/{purelib,platlib}``: those belong in site too.
    for entry in os.listdir(site):
        if entry.endswith(".data"):
            data = os.path.join(site, entry)
            for scheme in ("purelib", "platlib"):
                src = os.path.join(data, scheme)
                if os.path.isdir(src):
                    shutil.copytree(src, site, dirs_exist_ok=True)
            shutil.rmtree(data)
    for root, _, files in os.walk(site):
        for f in files:
            path = os.path.join(root, f)
            if SITE_JUNK.match(f) or SITE_DROP.search(os.path.relpath(path, site)):
                os.unlink(path)
    return names


def _copy_stdlib(out_lib: str) -> str:
    src = sysconfig.get_path("stdlib")
    dst = os.path.join(out_lib, VERSION)

    def ignore(directory: str, names: list[str]) -> set[str]:
        skip = {n for n in names if n == "__pycache__" or n.endswith((".pyc", ".exe"))}
        if os.path.samefile(directory, src):
            skip |= STDLIB_PRUNE & set(names) | {"lib-dynload"}
        return skip

    shutil.copytree(src, dst, ignore=ignore, symlinks=False)
    dynload_src = sysconfig.get_config_var("DESTSHARED")
    dynload = os.path.join(dst, "lib-dynload")
    os.makedirs(dynload, exist_ok=True)
    if dynload_src and os.path.isdir(dynload_src):
        for name in os.listdir(dynload_src):
            if name.split(".", 1)[0] in DYNLOAD_KEEP:
                shutil.copy2(os.path.join(dynload_src, name), dynload)
    return dst


def _is_elf(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"\x7fELF"


def _collect_libraries(out: str) -> str:
    """Copy every shared library the bundle's ELF files need into ``out/lib``; return the loader's name."""
    lib = os.path.join(out, "lib")
    elves = []
    for root, _, files in os.walk(out):
        for f in files:
            path = os.path.join(root, f)
            if not os.path.islink(path) and os.path.isfile(path) and _is_elf(path):
                elves.append(path)
    needed: dict[str, str] = {}
    loader = ""
    line_re = re.compile(r"^\s*(\S+)\s+=>\s+(\S+)\s+\(0x|^\s*(/\S+)\s+\(0x")
    for elf in elves:
        proc = subprocess.run(["ldd", elf], capture_output=True, text=True, check=False)
        if "not found" in proc.stdout:
            raise SystemExit(f"build_bundle: {elf} needs a library the base image lacks:\n{proc.stdout}")
        for line in proc.stdout.splitlines():
            m = line_re.match(line)
            if not m:
                continue
            if m.group(3):  # the program interpreter: "/lib64/ld-linux-x86-64.so.2 (0x...)"
                loader = os.path.basename(m.group(3))
                needed[loader] = m.group(3)
            else:
                needed[m.group(1)] = m.group(2)
    if not loader:
        raise SystemExit("build_bundle: ldd named no dynamic loader for the python binary")
    for soname, path in sorted(needed.items()):
        shutil.copy(os.path.realpath(path), os.path.join(lib, soname))
    os.symlink(loader, os.path.join(lib, "ld.so"))
    return loader


def _compile(path: str) -> None:
    # The executor runs with -OO (no docstrings: about 1 MB less resident memory),
    # so only .opt-2.pyc files are built, without column tables (-X no_debug_ranges:
    # smaller code objects). Unchecked-hash pycs are used without stat-ing their
    # sources: the bundle is mounted read-only, so a stale or missing pyc would
    # mean recompiling on every start.
    argv = [sys.executable, "-X", "no_debug_ranges", "-m", "compileall", "-q", "-o", "2"]
    argv += ["--invalidation-mode", "unchecked-hash", path]
    if subprocess.run(argv, check=False).returncode != 0:
        raise SystemExit(f"build_bundle: compiling {path} failed")


def _normalize_modes(out: str) -> None:
    # Readable (and directories searchable) by whatever user the task image runs as.
    for root, dirs, files in os.walk(out):
        for name in dirs + files:
            path = os.path.join(root, name)
            if os.path.islink(path):
                continue
            mode = os.stat(path).st_mode
            executable = stat.S_ISDIR(mode) or mode & 0o111
            os.chmod(path, 0o755 if executable else 0o644)


def source_hash(package: str) -> str:
    """A digest of a package's Python sources: tells a stale injector image from a current one."""
    digest = hashlib.sha256()
    for root, dirs, files in os.walk(package):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(root, name)
            digest.update(os.path.relpath(path, package).encode() + b"\0")
            with open(path, "rb") as f:
                digest.update(f.read() + b"\0")
    return digest.hexdigest()[:16]


def main() -> None:
    """Entry point."""
    if sys.argv[1:2] == ["--source-hash"]:
        print(source_hash(sys.argv[2]))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--wheels", required=True, help="directory of the wheels to bundle")
    p.add_argument("--executor", required=True, help="the orchard_executor package directory")
    p.add_argument("--extra", action="append", default=[], help="a file to copy into the bundle's root")
    p.add_argument("--out", required=True, help="the bundle directory to create (must not exist)")
    args = p.parse_args()
    if sys.version_info < (3, 11):  # noqa: UP036 (this runs on the base image's Python, not ours)
        raise SystemExit("build_bundle: the bundle needs CPython >= 3.11 (for bin/python3._pth)")

    out = os.path.abspath(args.out)
    os.makedirs(os.path.join(out, "bin"))
    os.makedirs(os.path.join(out, "lib"))
    shutil.copy2(os.path.realpath(sys.executable), os.path.join(out, "bin", "python3"))
    stdlib = _copy_stdlib(os.path.join(out, "lib"))
    site = os.path.join(stdlib, "site-packages")
    os.makedirs(site)
    wheels = _install_wheels(args.wheels, site)
    for package in LAZY_PACKAGES:
        lazy_init(os.path.join(site, package, "__init__.py"))
    shutil.copytree(
        args.executor,
        os.path.join(site, "orchard_executor"),
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
    )
    for extra in args.extra:
        shutil.copy2(extra, out)
    with open(os.path.join(out, "bin", "python3._pth"), "w") as f:
        rel = os.path.relpath(stdlib, os.path.join(out, "bin"))
        f.write(f"{rel}\n{rel}/lib-dynload\n{rel}/site-packages\n")
    loader = _collect_libraries(out)
    _compile(out)
    _normalize_modes(out)
    with open(os.path.join(out, "MANIFEST"), "w") as f:
        f.write(f"python {sys.version.split()[0]} ({os.path.realpath(sys.executable)})\n")
        f.write(f"loader {loader}\n")
        f.write(f"executor {source_hash(args.executor)}\n")
        f.writelines(f"wheel {w}\n" for w in wheels)
    size = sum(os.lstat(os.path.join(r, n)).st_size for r, _, fs in os.walk(out) for n in fs)
    print(f"build_bundle: {out}: {size / 1e6:.1f} MB", file=sys.stderr)


if __name__ == "__main__":
    main()
