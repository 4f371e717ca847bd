"""The wire schema shared by the Orchard client and the executor.

Every request and response body is one of these msgspec Structs, encoded as
msgpack (``application/msgpack``) or, for debugging with curl, JSON
(``application/json``). Streams (streaming exec, file bodies, tar archives)
are described next to the endpoint that uses them.

Endpoints, all under ``/v1`` except ``/healthz``::

    GET    /healthz                          no auth, "ok"
    GET    /v1/info                          -> Info
    POST   /v1/exec                          ExecRequest (or WITH_STDIN) -> ExecResult
    POST   /v1/exec/stream                   ExecRequest (or WITH_STDIN) -> frames of StreamEvent
    POST   /v1/processes                     ExecRequest -> ProcessStatus
    GET    /v1/processes                     -> ProcessList
    GET    /v1/processes/{id}                -> ProcessStatus
    GET    /v1/processes/{id}/output         ?stream=&offset=&limit= -> OutputChunk
    POST   /v1/processes/{id}/stdin          StdinRequest -> ProcessStatus
    POST   /v1/processes/{id}/signal         SignalRequest -> ProcessStatus
    POST   /v1/processes/{id}/wait           WaitRequest -> ProcessStatus
    DELETE /v1/processes/{id}                kill and forget -> ProcessStatus
    POST   /v1/sessions                      SessionRequest -> SessionInfo
    POST   /v1/sessions/{id}/exec            SessionExecRequest -> ExecResult
    DELETE /v1/sessions/{id}                 -> SessionInfo
    PUT    /v1/files?path=&mode=&parents=&setid=  raw body -> FileStat (atomic)
    GET    /v1/files?path=                   -> frames of ByteFrame (the file)
    GET    /v1/files/stat?path=              -> FileStat
    GET    /v1/files/list?path=              -> FileList
    POST   /v1/files/mkdir                   MkdirRequest -> FileStat
    POST   /v1/files/remove                  RemoveRequest -> Empty
    PUT    /v1/files/tar?path=&max_bytes=&max_members=  plain tar body -> FileStat (all or nothing)
    GET    /v1/files/tar?path=&changed=&max_bytes=&max_members=  -> frames of ByteFrame (a plain tar;
                                             changed=1: only what changed since the start, on path's file system)
    PUT    /v1/files/restore?path=&max_bytes=&max_members=  a snapshot's tar -> FileStat (in place)
    GET    /v1/display?display=&xauthority=    -> DisplayInfo (an X server in the sandbox)
    POST   /v1/display/screenshot            ScreenshotRequest -> Screenshot (PNG)
    POST   /v1/display/input                 InputRequest -> DisplayInfo (synthetic input through XTEST)
    GET    /v1/ports/{port}/connect          websocket upgrade -> a tunnel to 127.0.0.1:port (see ports.py)
    GET    /v1/ports/{port}/listen           websocket upgrade -> 127.0.0.1:port (0: a free one) listens while it lasts
    GET    /v1/ports/{port}/accept/{id}      websocket upgrade -> a tunnel for connection id to that port (ports.py)

Errors come back with a 4xx/5xx status and an ``Error`` body; ``code`` is one
of ``ERROR_CODES`` and the client maps it to an exception through a fixed
table.

Streamed replies (``FRAMES``) are length-prefixed msgpack messages (see
``frame``), so that a failure after the reply started can still be told:
the stream then ends with an ``ErrorEvent`` instead of its normal last
frame (``ExitEvent`` for exec, ``EndFrame`` for files and tars). A stream
that stops without its last frame was cut. While a stream has nothing to
say, the executor sends a ``HeartbeatEvent`` every ``HEARTBEAT`` seconds, so
the client can hold an idle deadline on it and tell a frozen executor from
a quiet command.

Limits: structured (msgpack/JSON) bodies are at most ``MAX_BODY`` bytes
(raw file and tar bodies are streamed and not limited). An exec streams a
stdin of any size as a ``WITH_STDIN`` body: its ``ExecRequest`` (without
``stdin`` or ``request_id``, since a stream cannot be replayed) as one frame,
then the stdin, fed to the command as it reads; a command that exits leaves
the rest unread (the connection closes after the reply), and a body that
breaks off kills the command. Strings that reach the OS (argv, env, paths) may not hold NUL,
env names may not hold ``=``; timeouts are finite and positive, modes are
within 0..0o7777 and carry setuid/setgid bits only when asked
(``setid=1``, ``MkdirRequest.setid``); a bad value is a 400 ``bad_request``.
"""

from __future__ import annotations

import struct
from typing import Annotated, Literal, TypeVar

import msgspec

API_VERSION = "v1"
MSGPACK = "application/msgpack"
JSON = "application/json"
OCTET = "application/octet-stream"
TAR = "application/x-tar"
#: A stream of length-prefixed msgpack messages (see ``frame``).
FRAMES = "application/x-orchard-frames"
#: A request body that streams a command's stdin: the ``ExecRequest`` as one
#: ``frame``, then the raw stdin bytes to the end of the body.
WITH_STDIN = "application/x-orchard-stdin"

#: Default cap, per stream, on the output an exec returns.
DEFAULT_MAX_OUTPUT = 10 * 1024 * 1024
#: Largest structured (msgpack/JSON) request body.
MAX_BODY = 64 * 1024 * 1024
#: Seconds between heartbeats on a stream that has nothing else to send.
HEARTBEAT = 1.0
#: Largest timeout a request may give, in seconds (a year).
MAX_TIMEOUT = 366 * 24 * 3600.0
#: Largest offset or count a request may give (a signed 64-bit file offset).
MAX_INT = 2**63 - 1
#: The setuid and setgid bits, which a mode carries only when asked.
SETID_BITS = 0o6000

# Constraints the OS imposes, checked when a body is decoded.
Text = Annotated[str, msgspec.Meta(pattern=r"^[^\x00]*$")]
PathText = Annotated[str, msgspec.Meta(min_length=1, pattern=r"^[^\x00]*$")]
EnvName = Annotated[str, msgspec.Meta(pattern=r"^[^\x00=]+$")]
Env = dict[EnvName, Text]
Timeout = Annotated[float, msgspec.Meta(gt=0, le=MAX_TIMEOUT)]
Mode = Annotated[int, msgspec.Meta(ge=0, le=0o7777)]
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_INT)]
RequestId = Annotated[str, msgspec.Meta(max_length=256)]

ErrorCode = Literal[
    "unauthorized",
    "bad_request",
    "not_found",
    "file_not_found",
    "file_exists",
    "is_a_directory",
    "not_a_directory",
    "permission_denied",
    "no_space",
    "command_not_found",
    "process_not_found",
    "session_not_found",
    "unsupported",
    "unsafe_archive",
    "too_large",
    "port_closed",
    "too_many_tunnels",
    "no_display",
    "stopping",
    "internal",
]
ERROR_CODES: frozenset[str] = frozenset(ErrorCode.__args__)  # type: ignore[attr-defined]


class Error(msgspec.Struct, kw_only=True):
    """The body of every non-2xx response."""

    code: ErrorCode
    message: str
    path: str | None = None


class Empty(msgspec.Struct):
    """A response with nothing to say but success."""


class Info(msgspec.Struct, kw_only=True):
    """What ``/v1/info`` reports about the executor."""

    version: str
    api: str
    pid: int
    uptime: float
    load: tuple[float, float, float]
    idle_timeout: float | None
    running_processes: int
    sessions: int
    cwd: str


class ExecRequest(msgspec.Struct, kw_only=True):
    """Run a command: ``cmd`` is an argv list, or a string for the shell."""

    cmd: list[Text] | Text
    cwd: PathText | None = None
    env: Env | None = None
    stdin: bytes | None = None
    timeout: Timeout | None = None
    #: Bytes kept per stream: an exec keeps the first and last halves (default
    #: ``DEFAULT_MAX_OUTPUT``); a background process the first bytes, in a file
    #: (default: the executor's cap, 256 MiB), the rest read and dropped.
    max_output: Count | None = None
    #: Shell that runs a string ``cmd``, as ``shell -c cmd``; ``/bin/sh`` if None, and
    #: with ``login``, ``bash`` where the command's PATH has it, else ``/bin/sh``.
    shell: PathText | None = None
    #: Run under a login shell, ``shell -l -c cmd``, so profile scripts (conda, a task
    #: image's /etc/profile.d) load first. An argv list then runs exactly as given after
    #: them, as ``shell -l -c 'exec "$@"' shell argv...`` (a missing program is exit 127).
    login: bool = False
    #: Send stderr into the stdout pipe, as ``2>&1`` does: one stream in true order,
    #: returned as ``output`` (streamed as "output" events; a background process's in stdout).
    merge_output: bool = False
    #: Makes the request idempotent: a retry returns the first run's result.
    request_id: RequestId | None = None


class ExecResult(msgspec.Struct, kw_only=True):
    """The outcome of a command.

    ``stdout``/``stderr`` are text (invalid UTF-8 replaced); the exact bytes
    are in ``stdout_bytes``/``stderr_bytes``. When a stream exceeded the
    request's ``max_output``, its first and last halves are kept, the
    ``*_truncated`` flag is set and ``*_total`` counts every byte produced.
    With ``merge_output`` both streams are in ``output``/``output_bytes``
    (same cap and flags) and ``stdout``/``stderr`` are empty.
    """

    exit_code: int | None
    #: The signal that ended the process, if one did (``exit_code`` is None).
    signal: int | None = None
    stdout_bytes: bytes = msgspec.field(default=b"", name="stdout")
    stderr_bytes: bytes = msgspec.field(default=b"", name="stderr")
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    stdout_total: int = 0
    stderr_total: int = 0
    timed_out: bool = False
    duration: float = 0.0
    #: Stdout and stderr interleaved as produced, when the request asked for ``merge_output``.
    output_bytes: bytes = msgspec.field(default=b"", name="output")
    output_truncated: bool = False
    output_total: int = 0

    @property
    def stdout(self) -> str:
        """Standard output decoded as UTF-8, invalid bytes replaced."""
        return self.stdout_bytes.decode("utf-8", "replace")

    @property
    def stderr(self) -> str:
        """Standard error decoded as UTF-8, invalid bytes replaced."""
        return self.stderr_bytes.decode("utf-8", "replace")

    @property
    def output(self) -> str:
        """The merged output (``merge_output``) decoded as UTF-8, invalid bytes replaced."""
        return self.output_bytes.decode("utf-8", "replace")

    @property
    def ok(self) -> bool:
        """True when the command exited with status 0 in time."""
        return self.exit_code == 0 and not self.timed_out


class OutputEvent(msgspec.Struct, tag="output", kw_only=True):
    """A chunk of a streaming exec's output, as the command produced it ("output" when merged)."""

    stream: Literal["stdout", "stderr", "output"]
    data: bytes


class ExitEvent(msgspec.Struct, tag="exit", kw_only=True):
    """The last frame of a streaming exec: the result, without the output."""

    result: ExecResult


class HeartbeatEvent(msgspec.Struct, tag="heartbeat"):
    """Sent on a stream with nothing else to say, every ``HEARTBEAT`` seconds."""


class ErrorEvent(msgspec.Struct, tag="error", kw_only=True):
    """The last frame of a stream that failed after its reply started."""

    error: Error


class DataFrame(msgspec.Struct, tag="data", kw_only=True):
    """The next bytes of a streamed file or tar archive."""

    data: bytes


class EndFrame(msgspec.Struct, tag="end"):
    """The last frame of a streamed file or tar archive that was sent whole."""


StreamEvent = OutputEvent | ExitEvent | HeartbeatEvent | ErrorEvent
ByteFrame = DataFrame | EndFrame | HeartbeatEvent | ErrorEvent


class ProcessStatus(msgspec.Struct, kw_only=True):
    """A background process: running, or how it ended."""

    id: str
    pid: int
    running: bool
    exit_code: int | None = None
    signal: int | None = None
    #: Bytes kept on disk per stream (at most the request's ``max_output``).
    stdout_size: int = 0
    stderr_size: int = 0
    started_at: float = 0.0
    duration: float | None = None
    timed_out: bool = False
    #: Bytes the process wrote per stream, kept or not.
    stdout_total: int = 0
    stderr_total: int = 0
    #: Whether output beyond the cap was dropped (the first bytes are kept).
    stdout_truncated: bool = False
    stderr_truncated: bool = False


class ProcessList(msgspec.Struct, kw_only=True):
    """Every background process the executor knows about."""

    processes: list[ProcessStatus]


class OutputChunk(msgspec.Struct, kw_only=True):
    """Output of a background process read from ``offset``."""

    data: bytes
    offset: int
    next_offset: int
    #: True when the process has ended and ``next_offset`` is the end.
    eof: bool


class StdinRequest(msgspec.Struct, kw_only=True):
    """Write to a background process's stdin, optionally closing it."""

    data: bytes = b""
    close: bool = False


class SignalRequest(msgspec.Struct, kw_only=True):
    """Send a signal to a background process's whole process group."""

    signal: Annotated[int, msgspec.Meta(ge=1, le=128)]


class WaitRequest(msgspec.Struct, kw_only=True):
    """Wait for a background process to end, at most ``timeout`` seconds."""

    timeout: Annotated[float, msgspec.Meta(ge=0, le=MAX_TIMEOUT)] | None = None


class SessionRequest(msgspec.Struct, kw_only=True):
    """Start a persistent shell session."""

    cwd: PathText | None = None
    env: Env | None = None
    shell: PathText = "bash"
    #: Start from a login shell's state: the first command runs under ``bash --login``, so
    #: /etc/profile and ~/.bash_profile (or ~/.profile) load (conda, a task's PATH),
    #: and what they set carries over like everything else.
    login: bool = False


class SessionInfo(msgspec.Struct, kw_only=True):
    """A persistent shell session and where it stands."""

    id: str
    cwd: str


class SessionExecRequest(msgspec.Struct, kw_only=True):
    """Run a shell command in a session; its cwd, env and variables persist."""

    command: Text
    timeout: Timeout | None = None
    stdin: bytes | None = None
    max_output: Count = DEFAULT_MAX_OUTPUT
    request_id: RequestId | None = None
    #: As ``ExecRequest.merge_output``.
    merge_output: bool = False


FileType = Literal["file", "directory", "symlink", "other"]


class FileStat(msgspec.Struct, kw_only=True):
    """What ``stat`` (without following a final symlink) says about a path."""

    path: str
    name: str
    type: FileType
    size: int
    mode: int
    mtime: float
    link_target: str | None = None


class FileList(msgspec.Struct, kw_only=True):
    """The entries of a directory, sorted by name."""

    entries: list[FileStat]


class MkdirRequest(msgspec.Struct, kw_only=True):
    """Create a directory."""

    path: PathText
    parents: bool = True
    mode: Mode = 0o755
    exist_ok: bool = True
    #: Allow the setuid/setgid bits in ``mode``.
    setid: bool = False


class RekeyRequest(msgspec.Struct, kw_only=True):
    """Replace the bearer token: from this request on, only the new one is accepted."""

    #: SHA-256 (hex) of the new token.
    token_sha256: str


class RemoveRequest(msgspec.Struct, kw_only=True):
    """Remove a file, a symlink, or (with ``recursive``) a directory tree."""

    path: PathText
    recursive: bool = False
    missing_ok: bool = False


#: An X display in the sandbox: ":N" or ":N.0" (the executor connects to /tmp/.X11-unix/XN).
DisplayName = Annotated[str, msgspec.Meta(pattern=r"^:[0-9]{1,5}(\.0)?$")]
Coordinate = Annotated[int, msgspec.Meta(ge=0, le=32767)]


class DisplayInfo(msgspec.Struct, kw_only=True):
    """An X display's root window: its size and depth."""

    width: int
    height: int
    depth: int


class DisplayQuery(msgspec.Struct, kw_only=True):
    """The query of ``GET /v1/display``: which display, and its cookie's file if it wants one."""

    display: DisplayName
    xauthority: PathText | None = None


class ScreenshotRequest(msgspec.Struct, kw_only=True):
    """Grab the display's root window (or a region of it) as a PNG."""

    display: DisplayName
    #: An Xauthority file holding the display's MIT-MAGIC-COOKIE-1, if the server asks for one.
    xauthority: PathText | None = None
    #: A region ``(x, y, width, height)`` inside the screen; the whole screen if None.
    region: (
        tuple[
            Coordinate,
            Coordinate,
            Annotated[int, msgspec.Meta(ge=1, le=32767)],
            Annotated[int, msgspec.Meta(ge=1, le=32767)],
        ]
        | None
    ) = None
    #: zlib level of the PNG: 1 is fast, 9 small.
    level: Annotated[int, msgspec.Meta(ge=0, le=9)] = 1


class Screenshot(msgspec.Struct, kw_only=True):
    """A PNG of the display and the size it shows."""

    width: int
    height: int
    png: bytes


class PointerMove(msgspec.Struct, tag="move", kw_only=True):
    """Move the pointer to an absolute position on the screen."""

    x: Coordinate
    y: Coordinate


class ButtonEvent(msgspec.Struct, tag="button", kw_only=True):
    """Press or release a mouse button: 1 left, 2 middle, 3 right, 4/5 wheel up/down, 6/7 wheel left/right."""

    button: Annotated[int, msgspec.Meta(ge=1, le=9)]
    down: bool


class KeyEvent(msgspec.Struct, tag="key", kw_only=True):
    """Press or release the key that types ``keysym``.

    Shift is added for a keysym on a shifted level, and a keysym no key types is
    bound to a spare keycode first.
    """

    keysym: Annotated[int, msgspec.Meta(ge=1, le=0x1FFFFFFF)]
    down: bool


class PauseEvent(msgspec.Struct, tag="pause", kw_only=True):
    """Wait between two events (some applications need time to see a drag)."""

    seconds: Annotated[float, msgspec.Meta(ge=0, le=10)]


InputEvent = PointerMove | ButtonEvent | KeyEvent | PauseEvent


class InputRequest(msgspec.Struct, kw_only=True):
    """Synthetic input, in order, through the X server's XTEST extension.

    The reply comes once the server has processed every event.
    """

    display: DisplayName
    xauthority: PathText | None = None
    events: Annotated[list[InputEvent], msgspec.Meta(max_length=100_000)]


# Streams of msgpack messages are framed by a 4-byte big-endian length.
FRAME_HEADER = struct.Struct(">I")
MAX_FRAME = 64 * 1024 * 1024

T = TypeVar("T")

_msgpack_encoder = msgspec.msgpack.Encoder()
_json_encoder = msgspec.json.Encoder()


def encode(obj: object, content_type: str = MSGPACK) -> bytes:
    """Encode a wire struct for the given content type."""
    if content_type == JSON:
        return _json_encoder.encode(obj)
    return _msgpack_encoder.encode(obj)


def decode(data: bytes, type_: type[T], content_type: str = MSGPACK) -> T:
    """Decode a wire struct, validating it against ``type_``."""
    if content_type.startswith(JSON):
        return msgspec.json.decode(data, type=type_)
    return msgspec.msgpack.decode(data, type=type_)


def frame(obj: object) -> bytes:
    """Encode one message of a framed msgpack stream."""
    body = _msgpack_encoder.encode(obj)
    return FRAME_HEADER.pack(len(body)) + body
