"""The ``local`` backend: an executor child process per sandbox, on this machine.

The "image" is recorded but not used: commands run on this machine's system,
in a private directory that is deleted with the sandbox. With bubblewrap
(``isolation="bwrap"``, or ``"auto"`` where it works) each sandbox gets a root
built from an allowlist (the system's /usr and libraries, a minimal /etc),
its own pid, mount, ipc, uts and network namespaces (loopback only), an
unprivileged uid, and an executor that listens on a unix socket only its
client can reach. ``network=True`` adds a user-mode network from slirp4netns
that reaches what the host reaches, except the host's loopback. ``isolation="none"`` runs commands on the host, unisolated,
and says so with an ``UnisolatedWarning``.

Nothing leaks: deleting the sandbox kills the executor and every process it
started; the executor also exits (and deletes the directory) when the client
process dies, because it watches the pipe the client holds on its stdin.
Under bubblewrap the sandbox is a pid namespace that dies with the executor
or with bwrap (``--die-with-parent``).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Coroutine
from typing import Any, BinaryIO, TypeVar

import aiohttp
import msgspec

import orchard_executor

from .._finish import finish
from .._handle import HandleFields
from .._spec import SandboxSpec, quantity_bytes
from .._tls import Identity
from ..errors import (
    ConfigError,
    OrchardError,
    SandboxLost,
    SandboxStartError,
    SandboxTimeout,
    UnisolatedWarning,
)
from . import LocalConfig, _unix
from ._forks import ForkedExecutor, Zygote, forks_work, tail_into, written

_LAUNCH = "import sys; sys.path[:0] = {paths!r}; from orchard_executor.__main__ import main; main()"

#: Where the executor's socket directory appears inside an isolated sandbox.
_SOCKET_DIR = "/.orchard"
_SOCKET = "executor.sock"
#: What /etc holds in an isolated sandbox: what programs need, nothing secret
#: (passwd, group, hosts and, with a network, resolv.conf are written for the sandbox).
_ETC = (
    "alternatives",
    "bash.bashrc",
    "ca-certificates",
    "ca-certificates.conf",
    "debian_version",
    "inputrc",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "locale.alias",
    "localtime",
    "mime.types",
    "nsswitch.conf",
    "os-release",
    "profile",
    "protocols",
    "python3",
    f"python{sys.version_info[0]}.{sys.version_info[1]}",
    "services",
    "ssl/certs",
    "ssl/openssl.cnf",
    "timezone",
)
#: slirp4netns's DNS forwarder, as the sandbox sees it.
_SLIRP_DNS = "10.0.2.3"
#: ioctl(2) on a namespace: its owning user namespace (linux/nsfs.h).
_NS_GET_USERNS = 0xB701
#: How long a closed sandbox's network helper gets to exit before it is killed.
_HELPER_GRACE = 5.0


def _import_paths() -> list[str]:
    """Where this process found the executor and its dependencies."""
    import multidict
    import yarl

    paths: list[str] = []
    for module in (orchard_executor, aiohttp, msgspec, multidict, yarl):
        assert module.__file__ is not None
        parent = os.path.dirname(os.path.dirname(module.__file__))
        if parent not in paths:
            paths.append(parent)
    return paths


def _namespaces(as_root: bool) -> list[str]:
    """Every namespace unshared; for root, every one but the user namespace.

    Root's sandboxes drop to an unprivileged uid with setpriv instead: in a
    user namespace mapped to host root, root's files would still be theirs.
    """
    if as_root:
        return ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-net", "--unshare-cgroup-try"]
    return ["--unshare-all", "--cap-drop", "ALL"]


def _under(path: str, parents: list[str]) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in parents)


def stage_etc(directory: str, files: dict[str, bytes]) -> None:
    """Fill ``directory`` (new, empty) with an isolated sandbox's /etc: ``_ETC`` copied from the host, and ``files``.

    Copied once per client and mounted read-only whole. What the host's /etc
    gains or changes later (an ld.so.cache rebuilt by a package install) is
    seen by sandboxes started by the next client. An entry the client cannot
    read is left out, as it would have been unreadable in the sandbox.
    """
    for name in _ETC:
        source, dest = os.path.join("/etc", name), os.path.join(directory, name)
        if not os.path.lexists(source):
            continue
        # Parents readable by the sandbox's uid (/etc/ssl for ssl/certs).
        os.makedirs(os.path.dirname(dest), mode=0o755, exist_ok=True)
        try:
            if os.path.islink(source):
                os.symlink(os.readlink(source), dest)
            elif os.path.isdir(source):
                shutil.copytree(source, dest, symlinks=True)
            else:
                shutil.copy2(source, dest)
        except (PermissionError, shutil.Error):  # copytree's: what it could not copy (it copied the rest)
            continue
    for path, content in files.items():
        with open(os.path.join(directory, os.path.relpath(path, "/etc")), "xb") as f:
            f.write(content)
            os.fchmod(f.fileno(), 0o444)
    os.chmod(directory, 0o755)


def sweep_etc(parent: str) -> None:
    """Remove the sandbox /etc directories (``etc-<pid>-*``) of clients whose process has ended."""
    for name in os.listdir(parent):
        pid = name.split("-")[1] if name.startswith("etc-") and name.count("-") >= 2 else ""
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            _unix.remove_tree(os.path.join(parent, name))
        except (PermissionError, OverflowError):  # alive (another user's pid) / no such pid either
            pass


def _bwrap_argv(
    bwrap: str,
    *,
    directory: str,
    workdir: str,
    runtime: list[str],
    as_root: bool,
    etc: str,
    info_fd: int | None = None,
    as_pid_1: bool = False,
    shm: int | None = None,
) -> list[str]:
    """Bubblewrap options: a root from an allowlist, the sandbox's own directories writable.

    ``runtime`` lists what the executor itself needs (the interpreter, its
    prefix, its import paths), bound read-only, each directory alone (never
    its parents); ``etc`` is the sandbox's /etc, a directory ``stage_etc``
    made (one mount where a bind per entry took about 7 ms); ``info_fd`` gets the
    sandbox's pid and namespaces (for its network helper, and the forked
    executor); ``as_pid_1``: the command is the pid namespace's init, with no
    reaper of bwrap's (the forked executor's placeholder); ``shm``: /dev/shm is
    a tmpfs of that many bytes (else the one of bwrap's /dev).
    """
    argv = [bwrap, "--die-with-parent", "--new-session", *_namespaces(as_root), "--hostname", "orchard"]
    if info_fd is not None:
        argv += ["--info-fd", str(info_fd)]
    if as_pid_1:
        argv.append("--as-pid-1")
        if as_root:
            # Root's placeholder stays uid 0 (a setpriv's uid change would cancel --die-with-parent's
            # signal), but with no capability: the sandbox's uid cannot touch it, and it can do nothing.
            argv += ["--cap-drop", "ALL"]
    system = ["/usr"]
    argv += ["--ro-bind", "/usr", "/usr"]
    # Merged-/usr systems make these symlinks into /usr; older ones real directories.
    for name in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(name):
            argv += ["--symlink", os.readlink(name), name]
        elif os.path.isdir(name):
            argv += ["--ro-bind", name, name]
            system.append(name)
    argv += ["--ro-bind", etc, "/etc"]
    argv += ["--dev", "/dev", "--proc", "/proc", "--perms", "1777", "--tmpfs", "/tmp"]
    if shm is not None:
        argv += ["--perms", "1777", "--size", str(shm), "--tmpfs", "/dev/shm"]
    made = {"/", "/tmp", "/etc", "/usr"}

    def bind(option: str, source: str, dest: str) -> None:
        # bwrap would make the missing parents 0700 (root's): make them 0755 so the sandbox uid can pass.
        parents = []
        parent = os.path.dirname(dest)
        while parent not in made:
            parents.append(parent)
            made.add(parent)
            parent = os.path.dirname(parent)
        for path in reversed(parents):
            argv.extend(["--dir", path])
        argv.extend([option, source, dest])

    bound: list[str] = []
    for path in sorted({os.path.realpath(p) for p in runtime}, key=len):
        if os.path.isdir(path) and not _under(path, system + bound):
            bind("--ro-bind", path, path)
            bound.append(path)
    for path in sorted(set(runtime)):
        real = os.path.realpath(path)
        if path != real and os.path.isdir(real) and not _under(path, system + bound):
            bind("--ro-bind", real, path)
    bind("--bind", directory, directory)
    bind("--bind", os.path.join(directory, "run"), _SOCKET_DIR)
    if not workdir.startswith(directory + os.sep):
        bind("--bind", workdir, workdir)
    # The placeholder (root's has no capability to enter the sandbox's directories) waits in /.
    return [*argv, "--chdir", "/" if as_pid_1 else workdir, "--"]


def _bwrap_works(bwrap: str, as_root: bool) -> bool:
    try:
        probe = [bwrap, *_namespaces(as_root), "--ro-bind", "/", "/", "--proc", "/proc", "--", "true"]
        return subprocess.run(probe, capture_output=True, check=False, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def find_isolation(isolation: str) -> tuple[str, str | None] | None:
    """The bwrap binary (and setpriv, as root) to use, None for no isolation, or a ConfigError.

    ``"auto"`` never degrades silently: without a working bubblewrap it is
    an error, and ``"none"`` warns that commands run on the host.
    """
    if isolation == "none":
        warnings.warn(
            "LocalConfig(isolation='none'): sandbox commands run on the host unisolated, as the user running "
            "the client (they can read its files, environment and memory); use isolation='bwrap' for hostile code",
            UnisolatedWarning,
            stacklevel=4,
        )
        return None
    as_root = os.getuid() == 0
    bwrap = shutil.which("bwrap")
    setpriv = shutil.which("setpriv") if as_root else None
    if bwrap is None or not _bwrap_works(bwrap, as_root):
        raise ConfigError(
            f"isolation={isolation!r} but bubblewrap is not installed or cannot create namespaces here: "
            "install it (apt-get install bubblewrap), or choose isolation='none' to run sandbox commands "
            "on the host unisolated"
        )
    if as_root:
        if setpriv is None or not os.path.realpath(setpriv).startswith("/usr/"):
            raise ConfigError(
                f"isolation={isolation!r} as root needs util-linux's setpriv in /usr to drop to an unprivileged "
                "uid (apt-get install util-linux), or choose isolation='none' (unisolated)"
            )
        setpriv = os.path.realpath(setpriv)
    return bwrap, setpriv


def find_slirp4netns() -> str:
    """The slirp4netns binary for ``network=True`` on isolated sandboxes, or a ConfigError naming the package.

    Only one from the system's /usr: it runs as the client's user (as root,
    root) and parses the sandbox's packets.
    """
    found = shutil.which("slirp4netns")
    if found is None or not os.path.realpath(found).startswith("/usr/"):
        raise ConfigError(
            "network=True on an isolated local sandbox needs slirp4netns in /usr for its user-mode network "
            "(apt-get install slirp4netns); without it, isolated sandboxes have loopback only"
        )
    return os.path.realpath(found)


def bwrap_available() -> bool:
    """Whether ``isolation="bwrap"`` works on this machine (for callers that choose, like the demo)."""
    try:
        return find_isolation("bwrap") is not None
    except ConfigError:
        return False


def _not_ready(sandbox_id: str, spec: SandboxSpec) -> SandboxTimeout:
    return SandboxTimeout(
        f"sandbox {sandbox_id}: the executor was not ready within start_timeout={spec.start_timeout:g}s",
        sandbox_id=sandbox_id,
    )


@functools.cache
def _own_namespace(name: str) -> int:
    """The inode of this process's namespace of that kind (they do not change)."""
    return os.stat(f"/proc/self/ns/{name}").st_ino


def _pin_namespaces(sandbox_id: str, child: dict[str, int]) -> list[tuple[str, int]]:
    """The namespaces of bwrap's first process (``child``: its ``--info-fd``), opened and checked, in join order.

    Each one bwrap reported is checked by inode once open, so a pid reused
    since cannot lend the executor another process's namespaces (and the
    sandbox's namespaces die with that process, its pid namespace's init).
    A non-root client's sandbox has two user namespaces: the one owning the
    others (``owner``, asked of the mount namespace) and, inside it, the
    first process's (``user``), opened before the checks that prove it the
    sandbox's; the owner is joined first and the first process's last.
    Namespaces that are this process's own are left out.
    """
    pid = child["child-pid"]
    opened: dict[str, int] = {}

    def own(name: str, fd: int) -> bool:
        return os.fstat(fd).st_ino == _own_namespace("user" if name == "owner" else name)

    try:
        for name in ("user", "cgroup", "mnt", "pid", "net", "ipc", "uts"):
            fd = os.open(f"/proc/{pid}/ns/{name}", os.O_RDONLY | os.O_CLOEXEC)
            opened[name] = fd
            expected = child.get(f"{name}-namespace")
            if expected is not None and os.fstat(fd).st_ino != expected:
                raise SandboxStartError(
                    f"sandbox {sandbox_id}: its first process ended before its executor started",
                    sandbox_id=sandbox_id,
                    reason="exited",
                )
        opened["owner"] = fcntl.ioctl(opened["mnt"], _NS_GET_USERNS)
        os.set_inheritable(opened["owner"], False)
        if os.fstat(opened["owner"]).st_ino == os.fstat(opened["user"]).st_ino:
            os.close(opened.pop("user"))
        for name, fd in list(opened.items()):
            if own(name, fd):
                os.close(opened.pop(name))
    except OSError as exc:
        for fd in opened.values():
            os.close(fd)
        raise SandboxStartError(
            f"sandbox {sandbox_id}: cannot open its namespaces: {exc}", sandbox_id=sandbox_id, reason="exited"
        ) from exc
    except SandboxStartError:
        for fd in opened.values():
            os.close(fd)
        raise
    order = ("owner", "mnt", "pid", "net", "ipc", "uts", "cgroup", "user")
    return sorted(opened.items(), key=lambda item: order.index(item[0]))


async def _read_pipe(pipe: BinaryIO, separator: bytes) -> bytes:
    """Bytes from a pipe up to and including ``separator``, or what came before its EOF."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
    try:
        return await reader.readuntil(separator)
    except asyncio.IncompleteReadError as exc:
        return exc.partial
    finally:
        transport.close()


T = TypeVar("T")


async def _outcome(step: asyncio.Future[T]) -> T | None:
    """What a shielded step of a cancelled start came to: its result, or None if it failed or is stuck.

    It is given 5 s; a step still going then is cancelled.
    """
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.wait([step]), 5)
    if not step.done():
        step.cancel()
        return None
    if step.cancelled() or step.exception() is not None:
        return None
    return step.result()


class LocalInstance:
    """One executor process and its directory (and, with a network, its slirp4netns)."""

    def __init__(
        self,
        sandbox_id: str,
        directory: str,
        proc: asyncio.subprocess.Process | ForkedExecutor,
        ttl: float | None,
        bwrap: asyncio.subprocess.Process | None = None,
    ) -> None:
        self.id = sandbox_id
        self.dir = directory
        self.proc = proc
        #: A forked executor's bubblewrap, whose first process holds the sandbox's namespaces.
        self.bwrap = bwrap
        self.base_url = ""
        self.timings: dict[str, float] = {}
        #: The executor's unix socket, once connected (None: on loopback, through the Client's session).
        self.held: _unix.Held | None = None
        self._stderr = bytearray()
        self._drain = asyncio.create_task(tail_into(self.proc.stderr, self._stderr))
        #: The network helper (slirp4netns), and the pipe whose closing tells it to exit.
        self.helper: asyncio.subprocess.Process | None = None
        self._helper_exit: int | None = None
        self._helper_stderr = bytearray()
        self._helper_drain: asyncio.Task[None] | None = None
        self._deleted = False
        self._expired = False
        self._ttl = asyncio.get_running_loop().call_later(ttl, self._expire) if ttl else None

    async def tail(self) -> str:
        """The end of the executor's stderr (waiting briefly for what a dead executor wrote last)."""
        if self.proc.returncode is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._drain), 0.5)
        return bytes(self._stderr[-2000:]).decode("utf-8", "replace").strip()

    def connect(self, path: str) -> None:
        """Talk to the executor over the unix socket it made at ``path``, held by inode.

        The sandbox can write the socket's directory; connecting through an
        O_PATH descriptor means a socket or symlink swapped in later is never
        followed. Holding it also keeps the inode's number from being reused,
        which is how an attaching process recognises the socket (``describe``).
        """
        self.held = _unix.hold(path, self.id)
        self.base_url = "http://sandbox"

    @property
    def http(self) -> aiohttp.ClientSession | None:
        """The HTTP session for this sandbox's unix socket (None: the Client's shared one)."""
        return self.held.http if self.held is not None else None

    def describe(self) -> dict[str, Any]:
        """Its executor's address, or its socket's path and inode (``HandleFields``)."""
        return self.held.describe() if self.held is not None else {"url": self.base_url}

    async def start_network(self, slirp4netns: str, info: BinaryIO) -> None:
        """Give the sandbox a user-mode network from slirp4netns, configured when this returns.

        ``info`` is the pipe bwrap writes the sandbox's pid and namespaces to.
        The helper joins the sandbox's network namespace by an fd pinned and
        checked here (a reused pid cannot redirect it), refuses the host's
        loopback, forwards no port to the sandbox, runs under a seccomp
        filter (as root, also in a mount namespace of its own, capabilities
        dropped), and exits when the pipe this instance holds closes: at
        ``delete()``, or when the client dies.
        """
        raw = await _read_pipe(info, b"}")
        if not raw.endswith(b"}"):
            await self.proc.wait()
            raise SandboxStartError(
                f"sandbox {self.id}: bubblewrap exited at start ({self.proc.returncode}): " + await self.tail(),
                sandbox_id=self.id,
                reason="exited",
            )
        await self.network(slirp4netns, json.loads(raw))

    async def network(self, slirp4netns: str, child: dict[str, int]) -> None:
        """Start the network of the sandbox whose first process bwrap described in ``child``."""
        ready_r, ready_w = os.pipe()
        pinned = [ready_w]
        with os.fdopen(ready_r, "rb", buffering=0) as ready:
            self.helper = helper = await self._spawn_helper(slirp4netns, child, pinned)
            self._helper_drain = asyncio.create_task(tail_into(helper.stderr, self._helper_stderr))
            if await _read_pipe(ready, b"1") != b"1":
                await helper.wait()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(self._helper_drain), 0.5)
                tail = bytes(self._helper_stderr[-2000:]).decode("utf-8", "replace").strip()
                raise SandboxStartError(
                    f"sandbox {self.id}: slirp4netns could not start the network ({helper.returncode}): {tail}",
                    sandbox_id=self.id,
                    reason="network",
                )

    async def _spawn_helper(
        self, slirp4netns: str, child: dict[str, int], pinned: list[int]
    ) -> asyncio.subprocess.Process:
        """Start slirp4netns on the namespaces bwrap reported; ``pinned`` fds are closed here."""
        try:
            # Root's helper gets a mount namespace of its own and drops its capabilities; a user's has
            # none to drop, and slirp4netns cannot make that namespace outside a user namespace.
            args = ["--netns-type=path", *(["--enable-sandbox"] if os.geteuid() == 0 else [])]
            # Opened before the netns, which is checked: both are the sandbox's first process's.
            userns = os.open(f"/proc/{child['child-pid']}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
            pinned.append(userns)
            # A non-root client's sandbox has a user namespace of its own, which owns its netns: join it first.
            if os.fstat(userns).st_ino != os.stat("/proc/self/ns/user").st_ino:
                args.append(f"--userns-path=/proc/self/fd/{userns}")
            netns = os.open(f"/proc/{child['child-pid']}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            pinned.append(netns)
            if os.fstat(netns).st_ino != child["net-namespace"]:
                raise SandboxStartError(
                    f"sandbox {self.id}: its first process ended before its network started",
                    sandbox_id=self.id,
                    reason="network",
                )
            # Set before the spawn: whatever happens next, delete() closing it ends the helper.
            exit_r, self._helper_exit = os.pipe()
            pinned.append(exit_r)
            return await asyncio.create_subprocess_exec(
                slirp4netns,
                "--configure",
                "--mtu=65520",
                "--disable-host-loopback",
                "--enable-seccomp",
                f"--exit-fd={exit_r}",
                f"--ready-fd={pinned[0]}",
                *args,
                f"/proc/self/fd/{netns}",
                "tap0",
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
                cwd="/",
                env={},
                pass_fds=pinned,
                # Its own session: a Ctrl-C meant for the client must not cut the network first.
                start_new_session=True,
            )
        except OSError as exc:
            raise SandboxStartError(
                f"sandbox {self.id}: cannot start slirp4netns: {exc}", sandbox_id=self.id, reason="network"
            ) from exc
        finally:
            for fd in pinned:
                os.close(fd)

    async def _stop_helper(self) -> None:
        """End the network helper: closing its exit pipe is its cue; killed if it lingers."""
        if self._helper_exit is not None:
            os.close(self._helper_exit)
            self._helper_exit = None
        if self.helper is not None and self.helper.returncode is None:
            try:
                await asyncio.wait_for(self.helper.wait(), _HELPER_GRACE)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.helper.kill()
                await self.helper.wait()
        if self._helper_drain is not None:
            self._helper_drain.cancel()

    def _expire(self) -> None:
        self._expired = True
        if self.proc.stdin is not None:
            self.proc.stdin.close()

    async def diagnose(self) -> OrchardError | None:
        """The executor process's fate, with the tail of its stderr."""
        if self._deleted:
            return SandboxLost("the sandbox was deleted", sandbox_id=self.id, reason="deleted")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.5):  # not wait_for: on Python 3.11 it can drop a cancel
                await asyncio.shield(self.proc.wait())
        code = self.proc.returncode
        # Past its ttl the sandbox is ending, even if the executor is still shutting down.
        if code is None and not self._expired:
            return None
        reason = "ttl" if self._expired else f"exited({code})"
        tail = await self.tail()
        return SandboxLost(
            f"sandbox {self.id}: the executor process ended ({reason})" + (f": {tail}" if tail else ""),
            sandbox_id=self.id,
            reason=reason,
        )

    async def delete(self) -> None:
        """Stop the executor (it kills its commands) and remove the directory."""
        if self._deleted:
            return
        self._deleted = True
        if self._ttl is not None:
            self._ttl.cancel()
        # Closing its stdin is the executor's cue to kill its commands and exit,
        # which also works through bubblewrap (signals to bwrap are not forwarded).
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        if self.proc.returncode is None:
            try:
                await asyncio.wait_for(self.proc.wait(), 5)
            except TimeoutError:
                # Killing bwrap kills its pid namespace (--die-with-parent).
                for proc in (self.proc, self.bwrap):
                    with contextlib.suppress(ProcessLookupError):
                        if proc is not None:
                            proc.kill()
                await self.proc.wait()
        if self.bwrap is not None:
            # Its first process exits when the executor's end of its stdin closes (with the executor).
            try:
                await asyncio.wait_for(self.bwrap.wait(), 5)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.bwrap.kill()
                await self.bwrap.wait()
        self._drain.cancel()
        await self._stop_helper()
        if self.held is not None:
            await self.held.close()
            self.held = None
        await asyncio.to_thread(_unix.remove_tree, self.dir)


class LocalAttachment:
    """A local sandbox of another process, reached from this one: ``delete`` only lets go of it."""

    def __init__(self, handle: HandleFields, held: _unix.Held | None = None) -> None:
        self.id = handle.sandbox_id
        self._handle = handle
        self._held = held
        self.http = held.http if held is not None else None
        self.base_url = "http://sandbox" if held is not None else handle.url
        self.timings: dict[str, float] = {}

    def describe(self) -> dict[str, Any]:
        """The handle's own address fields."""
        return {"url": self._handle.url, "socket": self._handle.socket, "inode": self._handle.inode}

    async def diagnose(self) -> OrchardError | None:
        """Gone if its socket left its path (deleted, or its creating process ended)."""
        path = self._handle.socket
        if path is None:
            return None
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            st = None
        if st is None or (st.st_dev, st.st_ino) != self._handle.inode:
            return SandboxLost(
                f"sandbox {self.id}: its executor socket is gone: the sandbox was deleted or the process "
                "that created it ended",
                sandbox_id=self.id,
                reason="deleted",
            )
        return None

    async def delete(self) -> None:
        """Close this process's connections to it; the sandbox stays its creator's."""
        if self._held is not None:
            await self._held.close()
            self._held = self.http = None


class LocalBackend:
    """Runs each sandbox's executor as a child of this process."""

    name = "local"
    #: Its executors are on a unix socket or loopback: nothing crosses a network.
    tls = False
    tools = False
    changes_root: str | None = None

    def __init__(self, config: LocalConfig) -> None:
        self._python = config.python or sys.executable
        self._root = config.root or os.path.join(tempfile.gettempdir(), f"orchard-{os.getuid()}")
        paths = _import_paths()
        self._launch = _LAUNCH.format(paths=paths)
        python = os.path.realpath(self._python)
        #: What the executor needs to start: the interpreter, its prefixes and import paths.
        self._runtime = [os.path.dirname(self._python), os.path.dirname(python), sys.prefix, sys.base_prefix, *paths]
        self._as_root = os.getuid() == 0
        # As root the sandbox runs as config.uid; otherwise as the user, in a user namespace.
        self._uid, self._gid = (config.uid, config.uid) if self._as_root else (os.getuid(), os.getgid())
        found = find_isolation(config.isolation)
        self._bwrap: str | None = found[0] if found else None
        self._setpriv: str | None = found[1] if found else None
        self._zygote = Zygote(self._python, paths) if config.fork and forks_work() else None
        #: The isolated sandboxes' /etc, without and with a network (resolv.conf): made at their first start.
        self._etc_dirs: dict[bool, str] = {}

    def _environment(self, spec: SandboxSpec, workdir: str, tmp: str) -> dict[str, str]:
        env = {
            "PATH": os.environ.get("PATH", os.defpath),
            "HOME": workdir,
            "TMPDIR": tmp,
            "LANG": "C.UTF-8",
        }
        return env | spec.env

    def _etc_files(self, *, network: bool) -> dict[str, bytes]:
        """passwd, group and hosts naming only what the sandbox has; resolv.conf with a network."""
        users = {0: "root", self._uid: "sandbox"}
        groups = {0: "root", self._gid: "sandbox"}
        dns = {"/etc/resolv.conf": f"nameserver {_SLIRP_DNS}\n".encode()} if network else {}
        return dns | {
            "/etc/passwd": "".join(
                f"{name}:x:{uid}:{uid if uid == 0 else self._gid}:{name}:/:/bin/sh\n" for uid, name in users.items()
            ).encode(),
            "/etc/group": "".join(f"{name}:x:{gid}:\n" for gid, name in groups.items()).encode(),
            "/etc/hosts": b"127.0.0.1 localhost orchard\n::1 localhost ip6-localhost ip6-loopback\n",
        }

    def _etc(self, *, network: bool) -> str:
        """The directory mounted as an isolated sandbox's /etc, made once per client (``stage_etc``).

        In a directory of the user's own (``/tmp/orchard-etc-<uid>``): another user's could change
        what the sandboxes' programs read, ld.so.conf.d among it. Removed at ``aclose``; one left by a
        client that died is removed by the next client to make one.
        """
        if network not in self._etc_dirs:
            parent = os.path.join(tempfile.gettempdir(), f"orchard-etc-{os.getuid()}")
            _unix.private_dir(parent, "TMPDIR")
            if not self._etc_dirs:
                sweep_etc(parent)
            directory = tempfile.mkdtemp(prefix=f"etc-{os.getpid()}-", dir=parent)
            try:
                stage_etc(directory, self._etc_files(network=network))
            except BaseException:
                _unix.remove_tree(directory)
                raise
            self._etc_dirs[network] = directory
        return self._etc_dirs[network]

    def _isolated_argv(
        self,
        directory: str,
        workdir: str,
        info_fd: int | None,
        *,
        network: bool,
        as_pid_1: bool = False,
        shm: int | None = None,
    ) -> list[str]:
        assert self._bwrap is not None
        argv = _bwrap_argv(
            self._bwrap,
            directory=directory,
            workdir=workdir,
            runtime=self._runtime,
            as_root=self._as_root,
            etc=self._etc(network=network),
            info_fd=info_fd,
            as_pid_1=as_pid_1,
            shm=shm,
        )
        if self._setpriv is not None and not as_pid_1:
            argv += [
                self._setpriv,
                f"--reuid={self._uid}",
                f"--regid={self._gid}",
                "--clear-groups",
                "--inh-caps=-all",
                "--bounding-set=-all",
                "--no-new-privs",
                "--",
            ]
        return argv

    async def start(
        self, spec: SandboxSpec, *, sandbox_id: str, token_sha256: str, tls: Identity | None = None
    ) -> LocalInstance:
        """Start an executor process and wait for its ready line (``tls`` is unused: see ``tls``)."""
        t0 = time.monotonic()
        if spec.workdir and not os.path.isabs(spec.workdir):
            raise ConfigError(f"workdir={spec.workdir!r} must be an absolute path")
        shm = quantity_bytes("shm", spec.shm) if spec.shm is not None else None
        if shm is not None and not self._bwrap:
            raise ConfigError(
                f"shm={spec.shm!r}: LocalConfig(isolation='none') cannot give a sandbox a /dev/shm of its own "
                "(it would share the host's); use isolation='bwrap', or the docker or kubernetes backend"
            )
        slirp4netns = find_slirp4netns() if spec.network and self._bwrap else None
        try:
            if self._bwrap:
                self._etc(network=slirp4netns is not None)
        except OSError as exc:
            raise SandboxStartError(
                f"cannot make the isolated sandboxes' /etc: {exc}",
                sandbox_id=sandbox_id,
                reason="directory",
            ) from exc
        try:
            _unix.private_dir(self._root, "LocalConfig(root=...)")
            directory = tempfile.mkdtemp(prefix=f"{sandbox_id}-", dir=self._root)
            subdirs = [os.path.join(directory, d) for d in ("work", "state", "tmp", "run")]
            for d in subdirs:
                os.mkdir(d, 0o700)
            if self._bwrap and self._as_root:
                for d in (directory, *subdirs):
                    os.chown(d, self._uid, self._gid)
        except OSError as exc:
            raise SandboxStartError(
                f"cannot create the sandbox directory under {self._root}: {exc}",
                sandbox_id=sandbox_id,
                reason="directory",
            ) from exc
        work, state, tmp, _ = subdirs
        workdir = spec.workdir or work
        try:
            created = not os.path.exists(workdir)
            os.makedirs(workdir, exist_ok=True)
            if created and self._bwrap and self._as_root:
                os.chown(workdir, self._uid, self._gid)
        except OSError as exc:
            _unix.remove_tree(directory)
            raise ConfigError(f"workdir={spec.workdir!r} cannot be created: {exc}") from exc
        options = [
            f"--token-sha256={token_sha256}",
            f"--workdir={workdir}",
            f"--state-dir={state}",
            "--exit-with-stdin",
            f"--orphan-dir={directory}",
            *([f"--unix={_SOCKET_DIR}/{_SOCKET}"] if self._bwrap else ["--host=127.0.0.1", "--port=0"]),
            *([f"--idle-timeout={spec.idle_timeout}"] if spec.idle_timeout is not None else []),
        ]
        env = self._environment(spec, workdir, tmp)
        if self._zygote is not None:
            return await self._start_forked(spec, sandbox_id, directory, workdir, options, env, slirp4netns, t0, shm)
        ready_r, ready_w = os.pipe()
        info_r, info_w = os.pipe() if slirp4netns else (-1, -1)
        executor = [self._python, "-I", "-c", self._launch, f"--ready-fd={ready_w}", *options]
        if self._bwrap:
            isolated = self._isolated_argv(
                directory, workdir, info_w if slirp4netns else None, network=slirp4netns is not None, shm=shm
            )
            argv = [*isolated, *executor]
        else:
            argv = executor
        # Shielded: asyncio kills a process whose spawn is cancelled, and a bwrap killed before its setup is done
        # can leave its namespace's first process behind for good. A start cancelled meanwhile lets the spawn
        # end, then ends the executor by its stdin.
        spawning = asyncio.ensure_future(
            asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
                cwd=workdir,
                env=env,
                pass_fds=(ready_w, *((info_w,) if slirp4netns else ())),
            )
        )
        try:
            proc = await asyncio.shield(spawning)
        except BaseException as exc:

            async def abandon() -> None:
                if (spawned := await _outcome(spawning)) is not None:
                    await LocalInstance(sandbox_id, directory, spawned, None).delete()
                os.close(ready_r)
                if slirp4netns:
                    os.close(info_r)
                _unix.remove_tree(directory)

            await finish(abandon())
            if isinstance(exc, OSError):
                raise SandboxStartError(
                    f"cannot run the executor with {self._python!r}: {exc}; set LocalConfig(python=...)",
                    sandbox_id=sandbox_id,
                    reason="spawn",
                ) from exc
            raise
        finally:
            os.close(ready_w)
            if slirp4netns:
                os.close(info_w)
        instance = LocalInstance(sandbox_id, directory, proc, spec.ttl)
        instance.timings["spawned"] = time.monotonic() - t0
        ready = os.fdopen(ready_r, "rb", buffering=0)
        info = os.fdopen(info_r, "rb", buffering=0) if slirp4netns else None

        async def started() -> int:
            # The network first: no command reaches the sandbox before start() returns, with its network up.
            if slirp4netns and info:
                await instance.start_network(slirp4netns, info)
            return await self._read_ready(ready, instance)

        try:
            await self._serving(instance, started(), spec.start_timeout, spec)
        finally:
            ready.close()
            if info:
                info.close()
        instance.timings["executor_ready"] = time.monotonic() - t0
        return instance

    async def _start_forked(
        self,
        spec: SandboxSpec,
        sandbox_id: str,
        directory: str,
        workdir: str,
        options: list[str],
        env: dict[str, str],
        slirp4netns: str | None,
        t0: float,
        shm: int | None,
    ) -> LocalInstance:
        """Start a sandbox whose executor the zygote forks (into bwrap's namespaces, under bubblewrap)."""
        assert self._zygote is not None
        loop = asyncio.get_running_loop()
        stdin_r, stdin_w = os.pipe()
        err_r, err_w = os.pipe()
        ready_r, ready_w = os.pipe()
        stderr = asyncio.StreamReader()
        err = os.fdopen(err_r, "rb", 0)
        stderr_pipe: asyncio.BaseTransport | None = None
        # Ours to close once the zygote has its copies (or on failure).
        sent = [stdin_r, err_w, ready_w]
        namespaces: list[tuple[str, int]] = []
        bwrap: asyncio.subprocess.Process | None = None
        child: dict[str, int] = {}
        proc: ForkedExecutor | None = None
        placing: asyncio.Future[tuple[asyncio.subprocess.Process, dict[str, int]]] | None = None
        forking: asyncio.Future[ForkedExecutor] | None = None
        try:
            # In the try: a start cancelled even here (a rollout's cancel) leaves no directory or pipe behind.
            stderr_pipe, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stderr), err)
            async with asyncio.timeout(spec.start_timeout):
                if self._bwrap:
                    hold_r, hold_w = os.pipe()
                    sent.append(hold_w)
                    # Shielded: a bwrap killed before its setup is done can leave its namespace's first process
                    # behind for good; a start cancelled meanwhile waits for the setup, then ends it.
                    placing = asyncio.ensure_future(
                        self._placeholder(
                            sandbox_id,
                            directory,
                            workdir,
                            env,
                            hold_r,
                            err_w,
                            stderr,
                            network=slirp4netns is not None,
                            shm=shm,
                        )
                    )
                    bwrap, child = await asyncio.shield(placing)
                    namespaces = _pin_namespaces(sandbox_id, child)
                request = {
                    "argv": options,
                    "env": env,
                    "cwd": workdir,
                    "namespaces": [name for name, _ in namespaces],
                    "isolated": bwrap is not None,
                    "uid": self._uid if bwrap is not None and self._as_root else None,
                    "gid": self._gid if bwrap is not None and self._as_root else None,
                    "hold": bwrap is not None,
                }
                fds = [*sent, *(fd for _, fd in namespaces)]
                forking = asyncio.ensure_future(self._zygote.fork(sandbox_id, request, fds, stdin_w, stderr))
                # Shielded: a start cancelled once its request is out waits for the executor to be forked,
                # then ends it, so that nothing it writes to the directory outlives the directory's removal.
                proc = await asyncio.shield(forking)
        except BaseException as exc:

            async def abandon(proc: ForkedExecutor | None, bwrap: asyncio.subprocess.Process | None) -> None:
                # A stuck bwrap is killed as it is; a stuck zygote's fork, if it comes, finds its stdin closed.
                if placing is not None and bwrap is None and (placed := await _outcome(placing)) is not None:
                    bwrap = placed[0]
                if forking is not None and proc is None:
                    proc = await _outcome(forking)
                if proc is not None:
                    proc.stdin.close()
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(proc.wait(), 5)
                else:
                    os.close(stdin_w)
                if stderr_pipe is not None:
                    stderr_pipe.close()
                else:
                    err.close()
                if bwrap is not None and bwrap.returncode is None:
                    bwrap.kill()
                    await bwrap.wait()
                os.close(ready_r)
                _unix.remove_tree(directory)

            await finish(abandon(proc, bwrap))
            if isinstance(exc, TimeoutError):
                raise _not_ready(sandbox_id, spec) from None
            raise
        finally:
            for fd in [*sent, *(fd for _, fd in namespaces)]:
                os.close(fd)
        instance = LocalInstance(sandbox_id, directory, proc, spec.ttl, bwrap)
        instance.timings["spawned"] = time.monotonic() - t0
        ready = os.fdopen(ready_r, "rb", buffering=0)

        async def started() -> int:
            if slirp4netns:
                await instance.network(slirp4netns, child)
            return await self._read_ready(ready, instance)

        try:
            await self._serving(instance, started(), max(spec.start_timeout - (time.monotonic() - t0), 0), spec)
        finally:
            ready.close()
        instance.timings["executor_ready"] = time.monotonic() - t0
        return instance

    async def _placeholder(
        self,
        sandbox_id: str,
        directory: str,
        workdir: str,
        env: dict[str, str],
        hold: int,
        err: int,
        stderr: asyncio.StreamReader,
        *,
        network: bool,
        shm: int | None,
    ) -> tuple[asyncio.subprocess.Process, dict[str, int]]:
        """Start bubblewrap with a placeholder first process: the sandbox's namespaces, for the executor to join.

        The placeholder is the pid namespace's init (no signal from inside reaches it) and reads ``hold``
        (closed here), whose write end the executor keeps: when the executor ends, so does the sandbox.
        """
        info_r, info_w = os.pipe()
        up_r, up_w = os.pipe()
        argv = [
            *self._isolated_argv(directory, workdir, info_w, network=network, as_pid_1=True, shm=shm),
            "/bin/sh",
            "-c",
            "echo; exec cat",
        ]
        try:
            bwrap = await asyncio.create_subprocess_exec(
                *argv, stdin=hold, stdout=up_w, stderr=err, cwd=workdir, env=env, pass_fds=(info_w,)
            )
        except OSError as exc:
            os.close(info_r)
            os.close(up_r)
            raise SandboxStartError(
                f"sandbox {sandbox_id}: cannot run bubblewrap: {exc}", sandbox_id=sandbox_id, reason="spawn"
            ) from exc
        finally:
            for fd in (hold, info_w, up_w):
                os.close(fd)
        try:
            with os.fdopen(info_r, "rb", buffering=0) as info, os.fdopen(up_r, "rb", buffering=0) as up:
                raw = await _read_pipe(info, b"}")
                if raw.endswith(b"}") and await _read_pipe(up, b"\n") == b"\n":
                    return bwrap, json.loads(raw)
        except BaseException:  # cancelled: only when its setup is stuck (see _start_forked)
            with contextlib.suppress(ProcessLookupError):
                bwrap.kill()
            await finish(bwrap.wait())
            raise
        await bwrap.wait()
        raise SandboxStartError(
            f"sandbox {sandbox_id}: bubblewrap exited at start ({bwrap.returncode}): " + await written(stderr),
            sandbox_id=sandbox_id,
            reason="exited",
        )

    async def _serving(
        self, instance: LocalInstance, started: Coroutine[Any, Any, int], timeout: float, spec: SandboxSpec
    ) -> None:
        """Connect to the executor once ``started`` (its port) is done; if it is not, delete the sandbox."""
        try:
            # Not asyncio.wait_for: on Python 3.11 it drops a cancel that comes in the step its awaitable ends.
            async with asyncio.timeout(timeout):
                port = await started
            if self._bwrap:
                instance.connect(os.path.join(instance.dir, "run", _SOCKET))
            else:
                instance.base_url = f"http://127.0.0.1:{port}"
        except TimeoutError:
            await finish(instance.delete())
            raise _not_ready(instance.id, spec) from None
        except BaseException:
            await finish(instance.delete())
            raise

    async def _read_ready(self, pipe: BinaryIO, instance: LocalInstance) -> int:
        """The port from the executor's ready line, or why it died first."""
        line = await _read_pipe(pipe, b"\n")
        if not line.endswith(b"\n"):
            await instance.proc.wait()
            raise SandboxStartError(
                f"sandbox {instance.id}: the executor exited at start ({instance.proc.returncode}): "
                + await instance.tail(),
                sandbox_id=instance.id,
                reason="exited",
            )
        port: int = json.loads(line)["port"]
        return port

    async def attach(self, handle: HandleFields, *, owner: bool) -> LocalAttachment:
        """Reach a sandbox another process of this user started on this machine (its socket or port)."""
        if owner:
            raise ConfigError(
                f"attach(owner=True): local sandbox {handle.sandbox_id} lives in the process that created it "
                "(it ends when that process closes it or exits), so it cannot be handed over; attach it "
                "with owner=False"
            )
        if handle.socket is None:
            return LocalAttachment(handle)
        return LocalAttachment(handle, _unix.open_handle(handle, "a local sandbox lives in its creating process"))

    async def aclose(self) -> None:
        """The fork server ends, and the sandboxes' /etc is removed (sandboxes are deleted by the client)."""
        if self._zygote is not None:
            await self._zygote.aclose()
        for directory in self._etc_dirs.values():
            _unix.remove_tree(directory)
        self._etc_dirs.clear()
