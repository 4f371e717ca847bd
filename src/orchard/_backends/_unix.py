"""Executors on unix sockets in directories their sandbox can write (local, docker).

The sandbox can replace what is at the socket's path (with a socket of its
own waiting for the token, or a symlink to one of the host's), so the client
never connects by path: it opens the socket once, without following links,
as its executor made it, holds that O_PATH descriptor and connects through
``/proc/self/fd``. Holding it also keeps the inode's number from being
reused, which is how an attaching process recognises the socket.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from typing import Any

import aiohttp

from .._handle import HandleFields
from ..errors import ConfigError, ProtocolError, SandboxLost, SandboxStartError


class Held:
    """An executor's socket held by an O_PATH fd, and the HTTP session whose connections go through it."""

    def __init__(self, path: str, fd: int, inode: tuple[int, int]) -> None:
        self.path, self.fd, self.inode = path, fd, inode
        self.http = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=f"/proc/self/fd/{fd}", limit=0, keepalive_timeout=30),
            cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=False,
        )

    def describe(self) -> dict[str, Any]:
        """Its path and inode, as a handle carries them (``HandleFields``)."""
        return {"url": "", "socket": self.path, "inode": self.inode}

    async def close(self) -> None:
        """Close its connections and let go of the socket."""
        await self.http.close()
        os.close(self.fd)


def _open(path: str) -> tuple[int, os.stat_result]:
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    return fd, os.fstat(fd)


def hold(path: str, sandbox_id: str) -> Held:
    """The socket its executor just made at ``path`` (never a link followed), held."""
    fd, st = _open(path)
    if not stat.S_ISSOCK(st.st_mode):
        os.close(fd)
        raise SandboxStartError(f"sandbox {sandbox_id}: {path} is not a socket", sandbox_id=sandbox_id, reason="socket")
    return Held(path, fd, (st.st_dev, st.st_ino))


def open_handle(handle: HandleFields, lives: str) -> Held:
    """The handle's executor socket, held once checked to be the very one its executor made.

    What is at the path now may be a socket of the sandbox's own: only the
    inode the creating client holds open (whose number cannot be reused while
    it does) is accepted. ``lives`` says where the sandbox lives, for the
    error when the socket is gone.
    """
    assert handle.socket is not None
    sid = handle.sandbox_id
    try:
        fd, st = _open(handle.socket)
    except FileNotFoundError:
        raise SandboxLost(
            f"sandbox {sid}: no executor socket at {handle.socket}: the sandbox was deleted, or the process "
            f"that created it ended ({lives})",
            sandbox_id=sid,
            reason="deleted",
        ) from None
    except OSError as exc:
        raise ConfigError(
            f"sandbox {sid}: cannot open its executor socket {handle.socket} ({exc.strerror}): attach it "
            "as the user that created it, on the same machine"
        ) from None
    if not stat.S_ISSOCK(st.st_mode) or (st.st_dev, st.st_ino) != handle.inode:
        os.close(fd)
        raise ProtocolError(
            f"sandbox {sid}: {handle.socket} is not its executor's socket (something in the sandbox replaced "
            "it); the token was not sent",
            sandbox_id=sid,
        )
    return Held(handle.socket, fd, handle.inode)


def private_dir(path: str, option: str) -> None:
    """Make ``path`` if missing (0700), and check that only this user can change what is in it.

    A directory another user made first (a squatted ``/tmp/orchard-<uid>``),
    or one others may write, would let them swap a socket of theirs in for an
    executor's before the client first holds it, and be sent its token.
    ``option`` names the setting that chooses another.
    """
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise ConfigError(
            f"{path} is not this user's own directory (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}): "
            f"another user could put a socket of theirs in an executor's place there; remove it, or set {option} "
            "to a directory only you can write"
        )


def remove_tree(directory: str) -> None:
    """Delete a directory a sandbox wrote, even where it took its own write permission away.

    Links are removed, never followed.
    """
    shutil.rmtree(directory, ignore_errors=True)
    if os.path.lexists(directory):
        for parent, dirs, _ in os.walk(directory):
            for name in dirs:
                with contextlib.suppress(OSError):
                    os.chmod(os.path.join(parent, name), 0o700, follow_symlinks=False)
        shutil.rmtree(directory, ignore_errors=True)
