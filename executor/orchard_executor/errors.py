"""The executor's one exception type, sent to the client as an ``Error`` body."""

from __future__ import annotations

import errno

from .protocol import Error, ErrorCode

STATUS: dict[str, int] = {
    "unauthorized": 401,
    "bad_request": 400,
    "not_found": 404,
    "file_not_found": 404,
    "file_exists": 409,
    "is_a_directory": 409,
    "not_a_directory": 409,
    "permission_denied": 403,
    "no_space": 507,
    "command_not_found": 404,
    "process_not_found": 404,
    "session_not_found": 404,
    "unsupported": 501,
    "unsafe_archive": 400,
    "too_large": 413,
    "port_closed": 502,
    "too_many_tunnels": 429,
    "no_display": 502,
    "stopping": 503,
    "internal": 500,
}

_ERRNO: dict[int, ErrorCode] = {
    errno.ENOENT: "file_not_found",
    errno.EEXIST: "file_exists",
    errno.ENOTEMPTY: "file_exists",
    errno.EISDIR: "is_a_directory",
    errno.ENOTDIR: "not_a_directory",
    errno.EACCES: "permission_denied",
    errno.EPERM: "permission_denied",
    errno.EROFS: "permission_denied",
    errno.ENOSPC: "no_space",
    errno.EDQUOT: "no_space",
    # Paths the OS cannot take: too long, or a loop of (or a refused) symlink.
    errno.ENAMETOOLONG: "bad_request",
    errno.ELOOP: "bad_request",
}


class ExecutorError(Exception):
    """A failure the client is told about, with a code from the wire schema."""

    def __init__(self, code: ErrorCode, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.error = Error(code=code, message=message, path=path)

    @property
    def status(self) -> int:
        """The HTTP status that carries this error."""
        return STATUS[self.error.code]

    @classmethod
    def from_os_error(cls, exc: OSError, path: str | None = None) -> ExecutorError:
        """Map an OSError from a file operation to its error code."""
        code: ErrorCode = _ERRNO.get(exc.errno or 0, "internal")
        where = path or exc.filename
        return cls(code, f"{exc.strerror or exc}: {where}" if where else str(exc), where)
