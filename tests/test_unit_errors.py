"""The fixed table from wire error codes to exceptions, and the executor's errno mapping."""

from __future__ import annotations

import errno

import pytest

import orchard
from orchard import errors
from orchard_executor import errors as executor_errors
from orchard_executor.protocol import ERROR_CODES

pytestmark = pytest.mark.unit

#: What each wire code must raise, and the builtin a caller may catch it as.
EXPECTED: dict[str, tuple[type[errors.ExecutorError], type[BaseException]]] = {
    "unauthorized": (errors.AuthError, PermissionError),
    "bad_request": (errors.InvalidRequest, ValueError),
    "not_found": (errors.InvalidRequest, ValueError),
    "file_not_found": (errors.PathNotFound, FileNotFoundError),
    "file_exists": (errors.PathExists, FileExistsError),
    "is_a_directory": (errors.IsADirectory, IsADirectoryError),
    "not_a_directory": (errors.NotADirectory, NotADirectoryError),
    "permission_denied": (errors.PermissionDenied, PermissionError),
    "no_space": (errors.NoSpace, OSError),
    "command_not_found": (errors.CommandNotFound, FileNotFoundError),
    "process_not_found": (errors.ProcessNotFound, LookupError),
    "session_not_found": (errors.SessionNotFound, LookupError),
    "unsupported": (errors.Unsupported, NotImplementedError),
    "unsafe_archive": (errors.UnsafeUpload, errors.UnsafeArchive),
    "too_large": (errors.SnapshotTooLarge, ValueError),
    "port_closed": (errors.PortClosed, ConnectionRefusedError),
    "too_many_tunnels": (errors.ExecutorError, errors.OrchardError),
    "no_display": (errors.NoDisplay, ConnectionError),
    "stopping": (errors.ExecutorError, errors.OrchardError),
    "internal": (errors.ExecutorError, errors.OrchardError),
}


def test_the_table_covers_every_wire_code_and_nothing_else() -> None:
    assert set(errors.EXECUTOR_ERRORS) == ERROR_CODES
    assert set(EXPECTED) == ERROR_CODES


def test_the_executor_has_an_http_status_for_every_code() -> None:
    assert set(executor_errors.STATUS) == ERROR_CODES
    assert executor_errors.STATUS["unauthorized"] == 401
    assert all(400 <= s < 600 for s in executor_errors.STATUS.values())


@pytest.mark.parametrize("code", sorted(ERROR_CODES))
def test_each_code_maps_to_its_class_and_builtin(code: str) -> None:
    cls, builtin = EXPECTED[code]
    assert errors.EXECUTOR_ERRORS[code] is cls
    exc = cls("msg", code=code, path="/p", sandbox_id="sb-1")
    assert isinstance(exc, builtin)
    assert isinstance(exc, errors.OrchardError)
    assert isinstance(exc, errors.ExecutorError)
    assert (exc.code, exc.path, exc.sandbox_id, str(exc)) == (code, "/p", "sb-1", "msg")


def test_client_side_errors_are_their_builtins_too() -> None:
    assert issubclass(errors.ConfigError, ValueError)
    assert issubclass(errors.SandboxTimeout, TimeoutError)
    assert issubclass(errors.SandboxLost, ConnectionError)
    assert issubclass(errors.SandboxClosed, RuntimeError)
    assert issubclass(errors.SandboxStartError, RuntimeError)
    lost = errors.SandboxLost("gone", sandbox_id="sb-2", reason="OOMKilled")
    assert (lost.sandbox_id, lost.reason, str(lost)) == ("sb-2", "OOMKilled", "gone")
    unsafe = errors.UnsafeArchive("refused", member="a/../../etc", rule="path", sandbox_id="sb-3")
    assert (unsafe.member, unsafe.rule, unsafe.sandbox_id, str(unsafe)) == ("a/../../etc", "path", "sb-3", "refused")
    assert issubclass(errors.ProtocolError, ConnectionError)
    for cls in (
        errors.ConfigError,
        errors.SandboxTimeout,
        errors.SandboxClosed,
        errors.SandboxStartError,
        errors.ProtocolError,
    ):
        assert issubclass(cls, errors.OrchardError)
    # A reply the client refuses is not an error the executor reported: no wire code.
    assert not issubclass(errors.ProtocolError, errors.ExecutorError)


@pytest.mark.parametrize(
    ("err", "code"),
    [
        (errno.ENOENT, "file_not_found"),
        (errno.EEXIST, "file_exists"),
        (errno.ENOTEMPTY, "file_exists"),
        (errno.EISDIR, "is_a_directory"),
        (errno.ENOTDIR, "not_a_directory"),
        (errno.EACCES, "permission_denied"),
        (errno.EPERM, "permission_denied"),
        (errno.EROFS, "permission_denied"),
        (errno.ENOSPC, "no_space"),
        (errno.EDQUOT, "no_space"),
        (errno.EIO, "internal"),
    ],
)
def test_executor_maps_errno_to_codes(err: int, code: str) -> None:
    exc = executor_errors.ExecutorError.from_os_error(OSError(err, "why", "/some/file"))
    assert exc.error.code == code
    assert exc.error.path == "/some/file"
    assert "/some/file" in exc.error.message
    assert exc.status == executor_errors.STATUS[code]


def test_executor_error_path_override() -> None:
    exc = executor_errors.ExecutorError.from_os_error(FileNotFoundError(errno.ENOENT, "gone"), "/given")
    assert exc.error.path == "/given"


def test_executor_error_message_is_the_os_reason_and_the_path() -> None:
    exc = executor_errors.ExecutorError.from_os_error(OSError(errno.ENOENT, "No such file or directory", "/f"))
    assert (exc.error.message, str(exc)) == ("No such file or directory: /f", "No such file or directory: /f")
    # No errno and no path: internal, with the error's own text.
    bare = executor_errors.ExecutorError.from_os_error(OSError("the device went away"))
    assert (bare.error.code, bare.error.message, bare.error.path) == ("internal", "the device went away", None)


@pytest.mark.parametrize(
    ("option", "value"), [("read_timeout", 0), ("liveness_timeout", -1.0), ("read_timeout", float("nan"))]
)
def test_deadline_options_must_be_positive_numbers(option: str, value: float) -> None:
    with pytest.raises(errors.ConfigError, match=option):
        orchard.Client(**{option: value})
