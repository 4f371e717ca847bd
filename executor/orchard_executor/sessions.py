"""Persistent shell sessions, made of snapshots rather than a long-lived shell.

Each command runs in a fresh ``bash`` that first restores the session's
state (exported and shell variables, functions, options, cwd) from a file
and, when the command ends, however it ends, writes the new state from an
EXIT trap. The executor adopts the new state only if the command finished
in time, so a command killed by its timeout leaves the session exactly as it
was, and nothing can wedge it: there is no shell left waiting on a prompt.
Background jobs (``cmd &``) do not carry over; use background processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil

from . import files
from .errors import ExecutorError
from .protocol import ExecRequest, ExecResult, SessionExecRequest
from .runner import run

# $1: state file to restore, $2: file to write the new state to,
# $3: file to write the cwd to, $4: the command.
_SCRIPT = r"""
if [ -f "$1" ]; then
  for __orchard_n in $(compgen -e); do unset -v "$__orchard_n" 2>/dev/null; done
  source "$1"
fi
__orchard_next=$2 __orchard_cwd=$3 __orchard_cmd=$4
set -- 
__orchard_save() {
  __orchard_rc=$?
  {
    printf 'builtin cd -- %q 2>/dev/null\n' "$PWD"
    for __orchard_n in $(compgen -v); do
      case $__orchard_n in
        __orchard_*|BASH*|SHELLOPTS|EUID|PPID|UID|FUNCNAME|GROUPS|DIRSTACK|PIPESTATUS|\
        RANDOM|SRANDOM|SECONDS|LINENO|HISTCMD|EPOCHREALTIME|EPOCHSECONDS|SHLVL|_|PWD|OLDPWD|\
        COMP_WORDBREAKS|HOSTNAME|HOSTTYPE|MACHTYPE|OSTYPE|OPTIND|OPTERR) continue ;;
      esac
      case ${!__orchard_n@a} in *r*) continue ;; esac
      declare -p "$__orchard_n" 2>/dev/null
    done
    declare -f
    shopt -p
    set +o
  } >"$__orchard_next" 2>/dev/null
  printf '%s' "$PWD" >"$__orchard_cwd" 2>/dev/null
  return $__orchard_rc
}
trap __orchard_save EXIT
eval "$__orchard_cmd"
"""


class Session:
    """A shell session: a directory holding its state between commands."""

    def __init__(self, id_: str, directory: str, shell: str, cwd: str, env: dict[str, str], login: bool) -> None:
        self.id = id_
        self.dir = directory
        self.shell = shell
        self.cwd = cwd
        self.env = env
        self.login = login
        self.lock = asyncio.Lock()

    async def exec(self, request: SessionExecRequest) -> ExecResult:
        """Run one command; state carries over only if it finished in time."""
        state = os.path.join(self.dir, "state.sh")
        nxt = os.path.join(self.dir, "next.sh")
        cwd_file = os.path.join(self.dir, "cwd")
        async with self.lock:
            for path in (nxt, cwd_file):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            # Until a command has left a state, a login session starts each one as a login shell.
            startup = "--login" if self.login and not os.path.exists(state) else "--noprofile"
            result = await run(
                ExecRequest(
                    cmd=[
                        self.shell,
                        startup,
                        "--norc",
                        "-c",
                        _SCRIPT,
                        "orchard",
                        state,
                        nxt,
                        cwd_file,
                        request.command,
                    ],
                    stdin=request.stdin,
                    timeout=request.timeout,
                    max_output=request.max_output,
                    merge_output=request.merge_output,
                ),
                cwd=self.cwd,
                env=self.env,
            )
            if not result.timed_out and os.path.exists(nxt):
                os.replace(nxt, state)
                with contextlib.suppress(OSError, ExecutorError, UnicodeDecodeError):
                    # The command may have left a FIFO or a symlink there: open_regular refuses both.
                    cwd = await asyncio.to_thread(_read_small, cwd_file)
                    self.cwd = cwd or self.cwd
            return result


def _read_small(path: str) -> str:
    fd = files.open_regular(path, follow=False)
    try:
        return files.read_at(fd, 0, 1024 * 1024).decode()
    finally:
        os.close(fd)


class SessionTable:
    """The executor's sessions, by id."""

    def __init__(self, state_dir: str) -> None:
        self._dir = os.path.join(state_dir, "sessions")
        os.makedirs(self._dir, exist_ok=True)
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def create(self, *, shell: str, cwd: str, env: dict[str, str], path: str, login: bool = False) -> Session:
        """Start a session (no process runs until its first command)."""
        found = shutil.which(shell, path=path) if "/" not in shell else shell
        if found is None or not os.access(found, os.X_OK):
            raise ExecutorError(
                "command_not_found", f"sessions need bash in the sandbox; {shell!r} was not found", shell
            )
        if not os.path.isdir(cwd):
            raise ExecutorError("file_not_found", f"working directory {cwd!r} does not exist", cwd)
        id_ = secrets.token_hex(8)
        directory = os.path.join(self._dir, id_)
        os.makedirs(directory, mode=0o700)
        session = Session(id_, directory, found, cwd, env, login)
        self._sessions[id_] = session
        return session

    def get(self, id_: str) -> Session:
        """The session with this id, or a session_not_found error."""
        try:
            return self._sessions[id_]
        except KeyError:
            raise ExecutorError("session_not_found", f"no shell session {id_!r}") from None

    def close(self, id_: str) -> Session:
        """Forget a session and its state."""
        session = self.get(id_)
        del self._sessions[id_]
        shutil.rmtree(session.dir, ignore_errors=True)
        return session
