"""A zygote: the executor imported once, forked for every local sandbox.

A fresh interpreter spends most of a local sandbox's start importing the
executor (aiohttp above all). The local backend starts this process once per
client instead, and asks it for each sandbox over a SOCK_SEQPACKET socket on
its stdin: one JSON request per message, with the new executor's stdin,
stderr and ready pipe, and for an isolated sandbox the namespaces bubblewrap
made for it (pinned and checked by the client), as SCM_RIGHTS.

For an unisolated sandbox it forks the executor once, which starts a session
of its own. For an isolated one it forks twice: the middle process joins the namespaces
in the order given (for a non-root client, the user namespace owning the
others first and the first process's own last; the pid namespace counts
only for its child), drops every privilege (the bounding set, the capabilities,
root's uid and groups for a root client, no_new_privs) and makes itself
non-dumpable, so that nothing in the sandbox can open its /proc files; then
it forks the executor, which is a member of the sandbox's pid namespace,
sees the sandbox's root, and runs as its uid, as one started by bubblewrap
would. The middle process reports the executor's pid and exits; the zygote
answers at the report, not the exit, and, a child subreaper, inherits the
executor and reports its exit status to the client. The reply
to a request carries the executor's pid and a pidfd.

The zygote holds nothing of the client's: it is a separate interpreter that
imported the executor and nothing else, and before its first fork served
two requests itself (``preload``), so that what an executor builds on its
first request is built once, not in every sandbox. It exits when the client's end of
the socket closes; its executors then see their stdin close and exit too.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import selectors
import signal
import socket
import sys
import traceback
from typing import Any

from . import __main__ as executor_main

PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_SET_CHILD_SUBREAPER = 36
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
#: The namespaces a request may name; they are joined in the order it gives them: "owner" is the user
#: namespace owning the others (first), "user" the sandbox's first process's (last, where it differs).
NAMESPACES = frozenset(("owner", "mnt", "pid", "net", "ipc", "uts", "cgroup", "user"))
#: Where the new executor finds its pipes: stdin 0, stdout 1 (/dev/null), stderr 2, the ready fd 3, and
#: under bubblewrap the pipe whose closing ends the sandbox's first process (so the sandbox ends with it) 4.
READY_FD = 3
HOLD_FD = 4
_MAX_MESSAGE = 1 << 20
_MAX_FDS = 16

_libc = ctypes.CDLL(None, use_errno=True)


def _call(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _last_capability() -> int:
    with open("/proc/sys/kernel/cap_last_cap") as f:
        return int(f.read())


def drop_privileges(uid: int | None, gid: int | None, last_cap: int) -> None:
    """Every capability gone (the bounding set too), root's ids for ``uid``/``gid`` if given, no new privileges."""
    for cap in range(last_cap + 1):
        _call(_libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"dropping capability {cap} from the bounding set")
    if uid is not None and gid is not None:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    _call(_libc.capset(ctypes.byref(header), data), "capset")
    _call(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    _call(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "dumpable")


def _place(fds: list[int]) -> None:
    """Put ``fds`` at 0, 1, 2, ... (copied above them first, so that none is overwritten before it moves)."""
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, len(fds)) for fd in fds]
    for i, fd in enumerate(high):
        os.dup2(fd, i)
        os.close(fd)


def set_title(words: list[str]) -> None:
    """Show ``words`` as this process's command line (in ps, /proc/PID/cmdline), within the zygote's.

    A fork's command line is its zygote's; this writes over it in place, as
    setproctitle(3) does, truncated to the room the zygote's arguments took.
    Where /proc/self/mem cannot be written, the zygote's stays.
    """
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        # Fields 48 and 49 (arg_start, arg_end), counted from the state, field 3.
        start, end = int(fields[48 - 3]), int(fields[49 - 3])
        title = "\0".join(words).encode()[: end - start - 1]
        with open("/proc/self/mem", "r+b", buffering=0) as mem:
            mem.seek(start)
            mem.write(title.ljust(end - start, b"\0"))
    except (OSError, IndexError, ValueError):
        pass


def _executor(request: dict[str, Any], pipes: list[int]) -> None:
    """The forked executor: its pipes in place, everything else closed, its environment; never returns."""
    code = 1
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        stdin, stderr, *rest = pipes
        _place([stdin, devnull, stderr, *rest])
        for fd in range(READY_FD, 3 + len(rest)):
            os.set_inheritable(fd, False)
        os.closerange(3 + len(rest), 1 << 16)
        environ: dict[str, str] = request["env"]
        os.environ.clear()
        os.environ.update(environ)
        executor_main.main(_argv(request), environ=environ)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def _argv(request: dict[str, Any]) -> list[str]:
    return [*request["argv"], f"--ready-fd={READY_FD}"]


def _pipes(request: dict[str, Any]) -> int:
    """How many of a request's fds are pipes: stdin, stderr, ready, and the hold pipe if it has one."""
    return 4 if request.get("hold") else 3


def _detach(request: dict[str, Any], stderr: int) -> None:
    """In a fork: errors to the executor's stderr, its command line shown, a session of its own."""
    # Errors from here on go where the executor's would: the client keeps their tail.
    os.dup2(stderr, 2)
    # Here, while the host's /proc is ours and we may write our memory (the executor inherits it).
    set_title(["orchard-executor", *(a for a in _argv(request) if not a.startswith("--token-sha256="))])
    os.setsid()


def _middle(request: dict[str, Any], fds: list[int], report: int, last_cap: int) -> None:
    """Join the sandbox's namespaces, drop privileges, fork the executor, report its pid; never returns."""
    code = 1
    try:
        pipes, namespaces = fds[: _pipes(request)], fds[_pipes(request) :]
        _detach(request, pipes[1])
        for name, fd in zip(request.get("namespaces", []), namespaces, strict=True):
            if name not in NAMESPACES:
                raise ValueError(f"unknown namespace {name!r}")
            _call(_libc.setns(fd, 0), f"joining the sandbox's {name} namespace")
            os.close(fd)
        os.chdir(request["cwd"])
        if request.get("isolated"):
            drop_privileges(request.get("uid"), request.get("gid"), last_cap)
        pid = os.fork()
        if pid == 0:
            os.close(report)
            _executor(request, pipes)
        os.write(report, f"{pid}\n".encode())
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


class Zygote:
    """The request loop: one fork per request, exit statuses reported, until the client's end closes."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.executors: set[int] = set()
        self.last_cap = _last_capability()

    def serve(self) -> None:
        """Answer requests and report exits until the client hangs up."""
        _call(_libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "subreaper")
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        selector = selectors.DefaultSelector()
        selector.register(self.sock, selectors.EVENT_READ)
        selector.register(wake_r, selectors.EVENT_READ)
        try:
            while True:
                for key, _ in selector.select():
                    if key.fileobj is self.sock:
                        if not self._request():
                            return
                    else:
                        while True:
                            try:
                                if not os.read(wake_r, 4096):
                                    break
                            except BlockingIOError:
                                break
                self._reap()
        finally:
            signal.set_wakeup_fd(-1)

    def _request(self) -> bool:
        try:
            message, fds, _, _ = socket.recv_fds(self.sock, _MAX_MESSAGE, _MAX_FDS)
        except ConnectionResetError:
            return False
        if not message:
            for fd in fds:
                os.close(fd)
            return False
        try:
            pid, pidfd = self._start(json.loads(message), fds)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self._send({"error": f"{type(exc).__name__}: {exc}"})
        else:
            self._send({"pid": pid}, [pidfd])
            os.close(pidfd)
        finally:
            for fd in fds:
                os.close(fd)
        return True

    def _start(self, request: dict[str, Any], fds: list[int]) -> tuple[int, int]:
        if len(fds) != _pipes(request) + len(request.get("namespaces", [])):
            raise ValueError(f"{len(fds)} fds for {len(request.get('namespaces', []))} namespaces")
        if not request.get("namespaces") and not request.get("isolated"):
            pid = self._fork_direct(request, fds)
        else:
            pid = self._fork_through_middle(request, fds)
        # Reaped only by the zygote (the middle process never waits; its orphans come to the subreaper) and
        # not before _reap, so the pid is still its executor's, a zombie at worst.
        pidfd = os.pidfd_open(pid)
        self.executors.add(pid)
        return pid, pidfd

    def _fork_through_middle(self, request: dict[str, Any], fds: list[int]) -> int:
        """The executor's pid, forked by a middle process in the sandbox's namespaces."""
        report_r, report_w = os.pipe()
        try:
            middle = os.fork()
            if middle == 0:
                self._child()
                os.close(report_r)
                _middle(request, fds, report_w, self.last_cap)
            os.close(report_w)
            report_w = -1
            # The pid as soon as the middle process writes it, not once it has exited (its exit, a 40 MB
            # address space torn down, took 2 to 7 ms); _reap collects it.
            raw = b""
            while not raw.endswith(b"\n") and (chunk := os.read(report_r, 64)):
                raw += chunk
        finally:
            for fd in (report_r, report_w):
                if fd >= 0:
                    os.close(fd)
        if not raw.endswith(b"\n"):
            _, status = os.waitpid(middle, 0)
            raise OSError(f"the executor could not be forked (exit status {os.waitstatus_to_exitcode(status)})")
        return int(raw)

    def _fork_direct(self, request: dict[str, Any], fds: list[int]) -> int:
        """An unisolated executor's pid, forked once: no namespace to join, so no middle process (a fork less)."""
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                self._child()
                _detach(request, fds[1])
                os.chdir(request["cwd"])
                _executor(request, fds)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        return pid

    def _child(self) -> None:
        """In a fork: the zygote's signal handling and socket are not the child's."""
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        self.sock.close()

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in self.executors:
                self.executors.discard(pid)
                self._send({"exit": pid, "status": os.waitstatus_to_exitcode(status)})

    def _send(self, message: dict[str, Any], fds: list[int] | None = None) -> None:
        try:
            socket.send_fds(self.sock, [json.dumps(message).encode()], fds or [])
        except OSError:
            pass  # the client is gone: the next receive ends the loop


def main() -> None:
    """Serve the SOCK_SEQPACKET socket on stdin (the launch checks it is one)."""
    sock = socket.socket(fileno=os.dup(0))
    if sock.type != socket.SOCK_SEQPACKET:
        raise SystemExit("orchard-executor zygote: stdin must be a SOCK_SEQPACKET socket")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    executor_main.preload()
    Zygote(sock).serve()


if __name__ == "__main__":
    main()
