"""Orchard's exceptions: one base, each subclass also the builtin it means.

Errors the executor reports arrive as a code from the wire schema and are
mapped to these classes through ``EXECUTOR_ERRORS``, a fixed table.
"""

from __future__ import annotations


class OrchardError(Exception):
    """Base of every error Orchard raises."""

    def __init__(self, message: str, *, sandbox_id: str | None = None) -> None:
        super().__init__(message)
        self.sandbox_id = sandbox_id


class UnisolatedWarning(UserWarning):
    """Sandboxes of ``LocalConfig(isolation="none")`` run commands on the host, unisolated."""


class ConfigError(OrchardError, ValueError):
    """A client or sandbox option is invalid; the message names the option."""


class TaskError(ConfigError):
    """A task file or task is malformed, found before any sandbox starts; or a task cannot run on this backend.

    The message names the file (or the list index), the line and the field.
    """

    def __init__(
        self,
        message: str,
        *,
        source: str | None = None,
        line: int | None = None,
        field: str | None = None,
        task_id: str | None = None,
    ) -> None:
        super().__init__(message)
        #: The task file's path, or ``"tasks[i]"`` for a list given in memory.
        self.source = source
        #: The 1-based line of the task file (None for a list).
        self.line = line
        #: The field at fault, if one.
        self.field = field
        #: The task's id, once known.
        self.task_id = task_id


class TraceError(OrchardError, OSError):
    """The ``trace=`` file cannot be opened (at sandbox creation, before any start) or written."""

    def __init__(self, message: str, *, path: str | None = None, sandbox_id: str | None = None) -> None:
        super().__init__(message, sandbox_id=sandbox_id)
        #: The trace file's path.
        self.path = path


class InvalidHandle(OrchardError, ValueError):
    """A sandbox handle given to ``Client.attach`` is malformed, or not for this Client's backend.

    The message never repeats the handle: it carries the sandbox's token.
    """


class SandboxStartError(OrchardError, RuntimeError):
    """A sandbox could not be started (bad image, dead at start, no capacity)."""

    def __init__(self, message: str, *, sandbox_id: str | None = None, reason: str | None = None) -> None:
        super().__init__(message, sandbox_id=sandbox_id)
        #: The backend's short reason, such as ``ImagePullBackOff`` or ``exited``.
        self.reason = reason


class SandboxTimeout(OrchardError, TimeoutError):
    """A sandbox was not ready within ``start_timeout``, or its executor stopped answering.

    The message names the deadline that passed (``start_timeout``, or the
    Client's ``read_timeout`` or ``liveness_timeout``).
    """


class SandboxLost(OrchardError, ConnectionError):
    """The sandbox went away (killed, deleted, evicted, executor exited)."""

    def __init__(self, message: str, *, sandbox_id: str | None = None, reason: str | None = None) -> None:
        super().__init__(message, sandbox_id=sandbox_id)
        #: The backend's short reason, such as ``OOMKilled`` or ``exited``.
        self.reason = reason


class ClusterUnavailable(OrchardError, ConnectionError):
    """The cluster's API server did not answer (restarting, its etcd down, unreachable), retried for a while.

    Sandboxes already running are not affected: their executors are reached directly.
    """


class AccessDenied(OrchardError, PermissionError):
    """The cluster's API server refused this client: its credentials (401), or an action its RBAC lacks (403)."""


class SandboxClosed(OrchardError, RuntimeError):
    """The sandbox (or its client) was already closed."""


class SyncLoopError(OrchardError, RuntimeError):
    """``orchard.sync`` cannot run the call: its event loop thread died or stopped (interpreter exit).

    Also raised for a sync call made on that loop's own thread, which would
    wait for itself. Objects of a dead loop stay unusable; a new
    ``orchard.sync.Client`` starts a new loop.
    """


class ProtocolError(OrchardError, ConnectionError):
    """The executor sent a reply the client refuses: too large, not the wire schema, or not msgpack.

    The client stops reading at once; a sound executor never sends such a
    reply, so it means a broken or hostile one.
    """


class ExecutorError(OrchardError):
    """An error reported by the executor inside the sandbox."""

    def __init__(self, message: str, *, code: str, path: str | None = None, sandbox_id: str | None = None) -> None:
        super().__init__(message, sandbox_id=sandbox_id)
        #: The wire error code (see ``orchard_executor.protocol.ErrorCode``).
        self.code = code
        #: The sandbox path the error is about, if any.
        self.path = path


class AuthError(ExecutorError, PermissionError):
    """The executor rejected the sandbox token."""


class InvalidRequest(ExecutorError, ValueError):
    """The executor rejected a request as malformed or out of range."""


class PathNotFound(ExecutorError, FileNotFoundError):
    """A file, directory or working directory does not exist in the sandbox."""


class PathExists(ExecutorError, FileExistsError):
    """The path already exists (or a directory is not empty)."""


class IsADirectory(ExecutorError, IsADirectoryError):
    """A file operation was given a directory."""


class NotADirectory(ExecutorError, NotADirectoryError):
    """A directory operation was given something else."""


class PermissionDenied(ExecutorError, PermissionError):
    """The sandbox's file permissions refused the operation."""


class NoSpace(ExecutorError, OSError):
    """The sandbox's disk is full; nothing was partially written."""


class CommandNotFound(ExecutorError, FileNotFoundError):
    """The program (or the shell for a string command) is not in the sandbox."""


class ProcessNotFound(ExecutorError, LookupError):
    """No background process with that id."""


class SessionNotFound(ExecutorError, LookupError):
    """No shell session with that id."""


class Unsupported(ExecutorError, NotImplementedError):
    """The executor does not support this operation."""


class PortClosed(ExecutorError, ConnectionRefusedError):
    """Nothing listens on the port ``Sandbox.forward`` was asked to reach inside the sandbox."""


class NoDisplay(ExecutorError, ConnectionError):
    """No X server answers on the display asked for in the sandbox (never started, or it died)."""


class GuiUnavailable(OrchardError, FileNotFoundError):
    """The sandbox's image lacks what a GUI environment needs (a browser, an X server); the message names it."""


class BrowserCrashed(OrchardError, ConnectionError):
    """The browser in the sandbox exited or its DevTools connection broke: the environment failed, not the agent.

    ``orchard.gui.browser`` raises it from the Playwright error that the next
    action got; ``exit_code``, ``signal`` and ``stderr`` tell how it ended.
    """

    def __init__(
        self,
        message: str,
        *,
        exit_code: int | None = None,
        signal: int | None = None,
        stderr: str = "",
        sandbox_id: str | None = None,
    ) -> None:
        super().__init__(message, sandbox_id=sandbox_id)
        self.exit_code = exit_code
        self.signal = signal
        #: The end of the browser's stderr.
        self.stderr = stderr


class UnsafeArchive(OrchardError, ValueError):
    """A transfer broke a safety rule, so nothing of it was written.

    ``Sandbox.download`` raises it for what a sandbox made: a device node or
    FIFO, a symlink that is absolute or leaves the destination, a hardlink to
    outside, a compressed or malformed stream, or more than ``max_bytes`` or
    ``max_members`` (raise those options for a bigger tree).
    """

    def __init__(
        self, message: str, *, member: str | None = None, rule: str | None = None, sandbox_id: str | None = None
    ) -> None:
        super().__init__(message, sandbox_id=sandbox_id)
        #: The offending tar member (or sandbox path), if one.
        self.member = member
        #: The rule broken, such as ``type``, ``link``, ``bytes`` (see ``orchard_executor.tarstream.Refused``).
        self.rule = rule


class UnsafeUpload(InvalidRequest, UnsafeArchive):
    """The executor refused an uploaded tar stream under the same rules; nothing was written in the sandbox."""


class SnapshotTooLarge(ExecutorError, ValueError):
    """A snapshot would pass its ``max_bytes``; ``path`` names the file that took it over, when known."""


EXECUTOR_ERRORS: dict[str, type[ExecutorError]] = {
    "unauthorized": AuthError,
    "bad_request": InvalidRequest,
    "not_found": InvalidRequest,
    "file_not_found": PathNotFound,
    "file_exists": PathExists,
    "is_a_directory": IsADirectory,
    "not_a_directory": NotADirectory,
    "permission_denied": PermissionDenied,
    "no_space": NoSpace,
    "command_not_found": CommandNotFound,
    "process_not_found": ProcessNotFound,
    "session_not_found": SessionNotFound,
    "unsupported": Unsupported,
    "unsafe_archive": UnsafeUpload,
    "too_large": SnapshotTooLarge,
    "port_closed": PortClosed,
    # Too many forwarded connections open at once in one sandbox.
    "too_many_tunnels": ExecutorError,
    "no_display": NoDisplay,
    # The client raises SandboxLost (with the backend's reason) for this one.
    "stopping": ExecutorError,
    "internal": ExecutorError,
}


class RecordError(OrchardError, OSError):
    """The model gateway's ``record=`` file cannot be opened (at construction) or a record could not be written.

    A record that fails to be written is logged at once and this error is
    raised when the gateway closes; the call itself was answered.
    """

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        #: The record file's path (None for a ``record=`` function).
        self.path = path


class GatewayClosed(OrchardError, RuntimeError):
    """The model gateway is not running: used outside its ``async with`` block (or before ``start()``)."""
