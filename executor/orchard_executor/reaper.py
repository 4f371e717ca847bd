"""Orphans: reaping them as PID 1 or a subreaper, and killing every descendant at shutdown.

At start the executor makes itself a child subreaper (``become_subreaper``),
so a command's daemonized grandchildren (``cmd &``, ``setsid``, a double
fork) stay its descendants instead of escaping to init, and
``kill_descendants`` kills them all, whatever their process group, when
it stops (stop, SIGTERM, stdin EOF, idle). A SIGKILLed executor runs no
cleanup: then the container (docker, kubernetes: the executor is its PID 1)
or bubblewrap's pid namespace (``--die-with-parent``) takes them down; with
local ``isolation="none"`` nothing does.

A process whose parent exits is reparented to PID 1, and only PID 1 can wait
for it: in a container without an init, that is the executor, and without a
reaper every daemonized or escaped grandchild stays a zombie forever. But the
executor waits for its own children by pid (``runner.Child``), and a blanket
``wait()`` would steal their exit statuses.

So the reaper reaps only what the executor did not start. Every command is a
``runner.Child``, whose pid is in ``runner.TRACKED`` from its spawn until
``Child`` itself has waited for it. On SIGCHLD, and every few seconds in case
a signal was coalesced away, the reaper lists the executor's children from
/proc and reaps, without blocking, each one that is not tracked. A pid leaves
``TRACKED`` only once waited for, so a tracked pid cannot have been recycled
into an orphan's (the one exception, a pid reaped by the fallback waiter
thread and recycled before the loop hears of it, is reaped at the next sweep).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

from .runner import TRACKED, descendants, parents

#: Seconds between sweeps when no SIGCHLD arrives.
SWEEP_INTERVAL = 5.0
PR_SET_CHILD_SUBREAPER = 36


def children(pid: int) -> set[int]:
    """The pids of ``pid``'s children, from /proc."""
    found: set[int] = set()
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children", "rb") as f:
                found.update(int(c) for c in f.read().split())
        return found
    except FileNotFoundError:
        pass  # a kernel without CONFIG_PROC_CHILDREN: scan every process
    except OSError:
        return found
    found.update(child for child, parent in parents().items() if parent == pid)
    return found


class Reaper:
    """Reaps the executor's orphaned descendants, never the children it waits for itself."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._pid = os.getpid()
        self._timer: asyncio.TimerHandle | None = None
        #: Orphans reaped so far.
        self.reaped = 0

    def sweep(self) -> None:
        """Reap every zombie child that the executor did not start."""
        for pid in children(self._pid):
            if pid in TRACKED:
                continue
            with contextlib.suppress(ChildProcessError):
                done, _ = os.waitpid(pid, os.WNOHANG)
                if done:
                    self.reaped += 1

    def start(self) -> None:
        """Sweep on SIGCHLD and every ``SWEEP_INTERVAL`` seconds."""
        self._loop.add_signal_handler(signal.SIGCHLD, self.sweep)
        self._periodic()

    def _periodic(self) -> None:
        self.sweep()
        self._timer = self._loop.call_later(SWEEP_INTERVAL, self._periodic)

    def stop(self) -> None:
        """Stop sweeping."""
        if self._timer is not None:
            self._timer.cancel()
        with contextlib.suppress(RuntimeError):
            self._loop.remove_signal_handler(signal.SIGCHLD)


def become_subreaper() -> bool:
    """Make orphaned descendants (``cmd &``, setsid, double forks) our children, not init's.

    So that they can all be found and killed at shutdown. PID 1 already is
    one; elsewhere it takes prctl through ctypes (Linux), which the docker
    runtime bundle leaves out, where the executor is PID 1 anyway.
    """
    if os.getpid() == 1:
        return True
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (ImportError, OSError, AttributeError):
        return False


def start(loop: asyncio.AbstractEventLoop) -> Reaper | None:
    """Start a reaper if orphans come to this process (PID 1, or a subreaper); otherwise do nothing."""
    if not become_subreaper():
        return None
    reaper = Reaper(loop)
    reaper.start()
    return reaper


def kill_descendants(deadline: float = 5.0) -> int:
    """SIGKILL every descendant, whatever its process group or session, and reap them.

    Repeated until none is left, since one may fork between the listing and
    its kill (its child then comes to us, a subreaper, and is found next
    round). Returns how many kills were sent.
    """
    me = os.getpid()
    killed = 0
    end = time.monotonic() + deadline
    while (strays := descendants(me)) and time.monotonic() < end:
        for pid in strays:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
        _reap_all()
        time.sleep(0.005)
    _reap_all()
    return killed


def _reap_all() -> None:
    """Reap every child that has exited (at shutdown, tracked ones included)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        TRACKED.discard(pid)
