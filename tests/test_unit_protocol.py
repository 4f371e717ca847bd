"""The wire schema: every message survives msgpack and JSON, tagged unions decode by tag."""

from __future__ import annotations

import msgspec
import pytest

from orchard_executor import protocol as p

pytestmark = pytest.mark.unit

NASTY = bytes(range(256)) + b"\xff\xfe\x00\x80"

MESSAGES: list[object] = [
    p.Error(code="file_not_found", message="no such file", path="/x"),
    p.Error(code="internal", message="boom"),
    p.Empty(),
    p.Info(
        version="1",
        api="v1",
        pid=7,
        uptime=1.5,
        load=(0.1, 0.2, 0.3),
        idle_timeout=None,
        running_processes=2,
        sessions=1,
        cwd="/w",
    ),
    p.ExecRequest(cmd=["printf", "%s", "a b"], cwd="sub", env={"A": "1"}, stdin=NASTY, timeout=2.5, request_id="r1"),
    p.ExecRequest(cmd="echo hi | tr h H", max_output=0, shell="/bin/bash"),
    p.ExecResult(
        exit_code=None,
        signal=9,
        stdout_bytes=NASTY,
        stderr_bytes=b"\x00",
        stdout_truncated=True,
        stdout_total=10**10,
        timed_out=True,
        duration=1.25,
    ),
    p.OutputEvent(stream="stderr", data=NASTY),
    p.ExitEvent(result=p.ExecResult(exit_code=3)),
    p.ProcessStatus(id="a", pid=1, running=False, exit_code=0, stdout_size=5, duration=0.5),
    p.ProcessList(processes=[p.ProcessStatus(id="a", pid=1, running=True)]),
    p.OutputChunk(data=NASTY, offset=3, next_offset=3 + len(NASTY), eof=True),
    p.StdinRequest(data=NASTY, close=True),
    p.SignalRequest(signal=15),
    p.WaitRequest(timeout=None),
    p.SessionRequest(cwd="/tmp", env={"K": "v"}),
    p.SessionInfo(id="s", cwd="/"),
    p.SessionExecRequest(command="cd /", timeout=1.0, stdin=b"x", request_id="q"),
    p.FileStat(path="/a/l", name="l", type="symlink", size=1, mode=0o777, mtime=1.0, link_target="../t"),
    p.FileList(entries=[p.FileStat(path="/a", name="a", type="directory", size=0, mode=0o755, mtime=0.0)]),
    p.MkdirRequest(path="d", parents=False, mode=0o700, exist_ok=False),
    p.RemoveRequest(path="d", recursive=True, missing_ok=True),
]


@pytest.mark.parametrize("content_type", [p.MSGPACK, p.JSON])
@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message: object, content_type: str) -> None:
    data = p.encode(message, content_type)
    assert p.decode(data, type(message), content_type) == message


def test_json_is_chosen_by_a_content_type_with_parameters() -> None:
    data = p.encode(p.SignalRequest(signal=2), p.JSON)
    assert data == b'{"signal":2}'
    assert p.decode(data, p.SignalRequest, "application/json; charset=utf-8") == p.SignalRequest(signal=2)


def test_exec_result_output_goes_on_the_wire_as_stdout_and_stderr() -> None:
    result = p.ExecResult(exit_code=0, stdout_bytes=b"out", stderr_bytes=b"err")
    raw = msgspec.msgpack.decode(p.encode(result))
    assert raw["stdout"] == b"out"
    assert raw["stderr"] == b"err"
    assert "stdout_bytes" not in raw


def test_exec_result_text_replaces_invalid_utf8_but_bytes_stay_exact() -> None:
    result = p.decode(p.encode(p.ExecResult(exit_code=0, stdout_bytes=b"ok\xff\x00")), p.ExecResult)
    assert result.stdout_bytes == b"ok\xff\x00"
    assert result.stdout == "ok\ufffd\x00"


@pytest.mark.parametrize(
    ("exit_code", "timed_out", "ok"),
    [(0, False, True), (0, True, False), (1, False, False), (None, False, False)],
)
def test_exec_result_ok(exit_code: int | None, timed_out: bool, ok: bool) -> None:
    assert p.ExecResult(exit_code=exit_code, timed_out=timed_out).ok is ok


def test_stream_events_decode_by_their_tag() -> None:
    out = p.encode(p.OutputEvent(stream="stdout", data=b"x"))
    end = p.encode(p.ExitEvent(result=p.ExecResult(exit_code=0)))
    assert msgspec.msgpack.decode(out)["type"] == "output"
    assert msgspec.msgpack.decode(end)["type"] == "exit"
    assert isinstance(p.decode(out, p.StreamEvent), p.OutputEvent)  # type: ignore[arg-type]
    assert isinstance(p.decode(end, p.StreamEvent), p.ExitEvent)  # type: ignore[arg-type]


def test_an_unknown_event_tag_is_rejected_not_guessed() -> None:
    bogus = msgspec.msgpack.encode({"type": "progress", "stream": "stdout", "data": b"x"})
    with pytest.raises(msgspec.ValidationError):
        p.decode(bogus, p.StreamEvent)  # type: ignore[arg-type]


def test_frames_are_length_prefixed_msgpack() -> None:
    event = p.OutputEvent(stream="stdout", data=NASTY)
    framed = p.frame(event) + p.frame(p.ExitEvent(result=p.ExecResult(exit_code=1)))
    decoded = []
    while framed:
        (size,) = p.FRAME_HEADER.unpack(framed[: p.FRAME_HEADER.size])
        body = framed[p.FRAME_HEADER.size : p.FRAME_HEADER.size + size]
        framed = framed[p.FRAME_HEADER.size + size :]
        decoded.append(p.decode(body, p.StreamEvent))  # type: ignore[arg-type]
    assert decoded == [event, p.ExitEvent(result=p.ExecResult(exit_code=1))]


def test_validation_rejects_wrong_types_and_unknown_error_codes() -> None:
    with pytest.raises(msgspec.ValidationError):
        p.decode(p.encode({"cmd": 5}), p.ExecRequest)
    with pytest.raises(msgspec.ValidationError):
        p.decode(p.encode({"code": "teapot", "message": "x"}), p.Error)
    with pytest.raises(msgspec.ValidationError):
        p.decode(p.encode({"stream": "stdin", "data": b"", "type": "output"}), p.OutputEvent)


def test_request_defaults() -> None:
    req = p.decode(p.encode({"cmd": "true"}), p.ExecRequest)
    assert req.max_output is None  # each endpoint's own default (DEFAULT_MAX_OUTPUT for an exec)
    assert req.shell is None  # /bin/sh, or with login bash where there is one
    assert (req.login, req.merge_output) == (False, False)
    assert req.stdin is None
    assert req.timeout is None
    assert req.request_id is None


def test_error_codes_are_the_literal() -> None:
    assert set(p.ErrorCode.__args__) == p.ERROR_CODES  # type: ignore[attr-defined]
    assert "unauthorized" in p.ERROR_CODES
    assert "internal" in p.ERROR_CODES
