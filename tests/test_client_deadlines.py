"""The client never hangs on, and never trusts, an executor.

A STOPped executor (a real one, local backend) and hostile fake executors (a
raw asyncio server on 127.0.0.1 speaking just enough HTTP) against the real
client code: every request ends with a typed error within its configured
deadline, and the client stops reading what it would not accept. Closing a
sandbox or its Client with execs in flight fails them with ``SandboxClosed``
and kills the commands.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import msgspec
import pytest

import orchard
from orchard import errors
from orchard._rpc import ExecutorClient
from orchard._sandbox import Sandbox
from orchard._spec import SandboxSpec
from orchard_executor.protocol import FRAME_HEADER, Info
from support import host_pid_alive, host_processes, read_pid, stopped, unisolated_ok

pytestmark = pytest.mark.executor

T = TypeVar("T")
#: Far above the deadlines these tests configure (1-2 s): reaching it means the client hung.
BOUND = 30.0
MIB = 1024 * 1024
#: What a hostile executor tries to make the client swallow.
FLOOD = 256 * MIB


async def bounded(aw: Awaitable[T]) -> T:
    """``aw``, or a plain TimeoutError (never an Orchard one) if the client hangs."""
    return await asyncio.wait_for(aw, BOUND)


# A real executor, frozen with SIGSTOP


async def test_a_stopped_executor_gives_a_typed_timeout(quick_client: orchard.Client) -> None:
    async with quick_client.sandbox() as sb:
        pid = (await sb.info()).pid
        with stopped(pid):
            with pytest.raises(errors.SandboxTimeout, match="liveness_timeout") as info:
                await bounded(sb.exec("true"))
            assert info.value.sandbox_id == sb.id
            with pytest.raises(errors.SandboxTimeout):
                await bounded(sb.exec("sleep 1", timeout=None))
            with pytest.raises(errors.SandboxTimeout):
                await bounded(sb.exec("true", timeout=5))
            with pytest.raises(errors.SandboxTimeout):
                await bounded(sb.stat("."))
        # The sandbox itself is fine once it runs again: the timeouts broke nothing.
        assert (await bounded(sb.exec("echo back"))).stdout == "back\n"


async def test_a_long_command_outlives_many_liveness_probes(quick_client: orchard.Client) -> None:
    async with quick_client.sandbox() as sb:
        r = await bounded(sb.exec("sleep 4; echo done", timeout=None))
        assert (r.exit_code, r.stdout) == (0, "done\n")
        process = await sb.start_process("sleep 4")
        assert (await bounded(process.wait())).exit_code == 0


# Hostile fake executors


class Hostile:
    """An HTTP/1.1 server that answers ``/healthz`` and misbehaves on every other request.

    ``sent`` counts the reply bytes the client accepted before it closed the
    connection; ``finished`` is set when the misbehaving reply ended.
    """

    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour
        self.sent = 0
        self.finished = asyncio.Event()
        self.server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                path = lines[0].split()[1]
                headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
                await reader.readexactly(int(headers.get("content-length", "0")))
                if path == "/healthz" and self.behaviour != "frozen":
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    await writer.drain()
                    continue
                await self.misbehave(writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.finished.set()
            writer.close()

    async def send(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(data)
        await writer.drain()
        self.sent += len(data)

    async def misbehave(self, writer: asyncio.StreamWriter) -> None:
        b = self.behaviour
        ok = b"HTTP/1.1 200 OK\r\nContent-Type: application/msgpack\r\n"
        if b in ("frozen", "silent"):
            await asyncio.Event().wait()  # accept the request, never answer
        elif b == "huge-length":
            writer.write(ok + b"Content-Length: %d\r\n\r\n" % FLOOD)
            while self.sent < FLOOD:
                await self.send(writer, bytes(MIB))
        elif b in ("huge-chunked", "huge-error"):
            status = b"HTTP/1.1 500 Internal Server Error\r\n" if b == "huge-error" else b"HTTP/1.1 200 OK\r\n"
            writer.write(status + b"Content-Type: application/msgpack\r\nTransfer-Encoding: chunked\r\n\r\n")
            while self.sent < FLOOD:
                await self.send(writer, b"%x\r\n%s\r\n" % (MIB, bytes(MIB)))
        elif b == "huge-error-length":
            writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: %d\r\n\r\n" % FLOOD)
            while self.sent < FLOOD:
                await self.send(writer, bytes(MIB))
        elif b == "cut":  # a chunked reply cut mid-chunk, its connection closed: an executor killed mid-reply
            writer.write(ok + b"Transfer-Encoding: chunked\r\n\r\n")
            frame = FRAME_HEADER.pack(100) + bytes(10)  # a frame of 100 bytes, 10 of them sent
            await self.send(writer, b"%x\r\n%s" % (1000, frame))
            raise ConnectionResetError
        elif b == "trickle":
            writer.write(ok + b"Content-Length: 1000\r\n\r\n")
            while True:  # a byte now and then: never idle, never done
                await self.send(writer, b"\x00")
                await asyncio.sleep(0.05)
        else:
            body, content_type = {
                "malformed": (b"\xc1\xc1 not msgpack", b"application/msgpack"),
                "wrong-schema": (msgspec.msgpack.encode({"surprise": [1, 2, 3]}), b"application/msgpack"),
                "wrong-type": (b"<html>hello</html>", b"text/html"),
                "bad-error": (b"\xc1 not an error body", b"application/msgpack"),
            }[b]
            status = b"500 Internal Server Error" if b == "bad-error" else b"200 OK"
            await self.send(
                writer,
                b"HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s"
                % (status, content_type, len(body), body),
            )


@pytest.fixture
async def hostile(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Hostile, Sandbox]]:
    """A hostile executor and a Sandbox whose real client talks to it."""
    server = Hostile(request.param)
    server.server = await asyncio.start_server(server.handle, "127.0.0.1", 0)

    async def diagnose() -> errors.OrchardError | None:
        return None  # the backend sees nothing wrong: only the client can tell

    async def close() -> None:
        pass

    async with aiohttp.ClientSession() as session:
        rpc = ExecutorClient(
            session,
            server.url,
            "token",
            sandbox_id="sb-fake",
            diagnose=diagnose,
            read_timeout=1.0,
            liveness_timeout=1.0,
        )
        sb = Sandbox(sandbox_id="sb-fake", spec=SandboxSpec(), rpc=rpc, timings={}, close=close)
        try:
            yield server, sb
        finally:
            await sb.aclose()
            server.server.close()


def stopped_reading(server: Hostile) -> bool:
    # Far below what was sent at it: the client read up to its cap (64 MiB) plus socket buffers.
    return server.sent < FLOOD // 2


@pytest.mark.parametrize("hostile", ["huge-length", "huge-chunked"], indirect=True)
async def test_a_huge_reply_is_refused_without_reading_it(hostile: tuple[Hostile, Sandbox]) -> None:
    server, sb = hostile
    with pytest.raises(errors.ProtocolError, match="too large") as info:
        await bounded(sb.info())
    assert info.value.sandbox_id == "sb-fake"
    await bounded(server.finished.wait())
    assert stopped_reading(server), server.sent


@pytest.mark.parametrize("hostile", ["huge-chunked"], indirect=True)
async def test_an_exec_reply_is_capped_by_its_max_output(hostile: tuple[Hostile, Sandbox]) -> None:
    server, sb = hostile
    with pytest.raises(errors.ProtocolError, match="too large"):
        await bounded(sb.exec("true", max_output=1000))
    await bounded(server.finished.wait())
    # 2 x max_output plus slack, not the general 64 MiB cap.
    assert server.sent < 32 * MIB, server.sent


@pytest.mark.parametrize("hostile", ["cut"], indirect=True)
async def test_a_reply_cut_mid_body_is_a_lost_sandbox(hostile: tuple[Hostile, Sandbox]) -> None:
    """Not aiohttp's ClientPayloadError: the chaos run's reclaim got it from a read_file once."""
    _, sb = hostile
    for call in (sb.read_file("x"), sb.stat("x"), sb.exec("true")):
        with pytest.raises(errors.SandboxLost, match="unreachable"):
            await bounded(call)


@pytest.mark.parametrize("hostile", ["huge-error", "huge-error-length"], indirect=True)
async def test_a_huge_error_body_is_refused_without_reading_it(hostile: tuple[Hostile, Sandbox]) -> None:
    server, sb = hostile
    with pytest.raises(errors.ProtocolError, match="too large"):
        await bounded(sb.stat("x"))
    await bounded(server.finished.wait())
    assert server.sent < 32 * MIB, server.sent


@pytest.mark.parametrize("hostile", ["malformed", "wrong-schema", "wrong-type"], indirect=True)
async def test_a_reply_that_is_not_the_schema_is_a_protocol_error(hostile: tuple[Hostile, Sandbox]) -> None:
    _, sb = hostile
    with pytest.raises(errors.ProtocolError) as info:
        await bounded(sb.exec("true"))
    assert isinstance(info.value, errors.OrchardError)
    with pytest.raises(errors.ProtocolError):
        await bounded(sb._rpc.call("GET", "/v1/info", Info))


@pytest.mark.parametrize("hostile", ["bad-error"], indirect=True)
async def test_an_undecodable_error_body_is_still_a_typed_error(hostile: tuple[Hostile, Sandbox]) -> None:
    _, sb = hostile
    with pytest.raises(errors.ExecutorError, match="HTTP 500") as info:
        await bounded(sb.stat("x"))
    assert info.value.code == "internal"


@pytest.mark.parametrize("hostile", ["trickle"], indirect=True)
async def test_a_reply_that_never_ends_times_out(hostile: tuple[Hostile, Sandbox]) -> None:
    server, sb = hostile
    with pytest.raises(errors.SandboxTimeout, match="read_timeout"):
        await bounded(sb.exec("true"))
    await bounded(server.finished.wait())


@pytest.mark.parametrize("hostile", ["silent"], indirect=True)
async def test_a_request_never_answered_times_out(hostile: tuple[Hostile, Sandbox]) -> None:
    _, sb = hostile
    with pytest.raises(errors.SandboxTimeout, match="read_timeout"):
        await bounded(sb.stat("x"))
    with pytest.raises(errors.SandboxTimeout):
        await bounded(sb.exec("true", timeout=1))


@pytest.mark.parametrize("hostile", ["frozen"], indirect=True)
async def test_an_executor_that_stops_answering_probes_fails_long_requests(
    hostile: tuple[Hostile, Sandbox],
) -> None:
    _, sb = hostile
    with pytest.raises(errors.SandboxTimeout, match="liveness_timeout"):
        await bounded(sb.exec("sleep 1000", timeout=None))
    with pytest.raises(errors.SandboxTimeout, match="liveness_timeout"):
        await bounded(sb.exec("sleep 1000", timeout=1000))


# Closing with execs in flight


async def pids_of_sleepers(sb: orchard.Sandbox, n: int) -> tuple[list[asyncio.Task[Any]], list[int]]:
    """``n`` execs of ``sleep 300`` in flight, and their host pids."""
    tasks = [asyncio.create_task(sb.exec(f"echo $$ > sleeper{i}; exec sleep 300")) for i in range(n)]
    pids = [await read_pid(sb, f"sleeper{i}") for i in range(n)]
    return tasks, pids


async def test_closing_a_sandbox_fails_execs_in_flight_and_kills_them(local_client: orchard.Client) -> None:
    sb = await local_client.create()
    executor = (await sb.info()).pid
    tasks, pids = await pids_of_sleepers(sb, 2)
    await bounded(sb.aclose())
    for task in tasks:
        with pytest.raises(errors.SandboxClosed, match="closed"):
            await bounded(task)
    assert not host_pid_alive(executor)
    assert [p for p in pids if host_pid_alive(p)] == []
    with pytest.raises(errors.SandboxClosed):
        await sb.exec("true")


async def test_closing_the_client_with_execs_in_flight_closes_everything(local_root: Path) -> None:
    client = orchard.Client(orchard.LocalConfig(root=str(local_root), isolation="none"))
    sandboxes = [await client.create() for _ in range(2)]
    executors = [(await sb.info()).pid for sb in sandboxes]
    flights = [await pids_of_sleepers(sb, 2) for sb in sandboxes]
    await bounded(client.aclose())
    for tasks, pids in flights:
        for task in tasks:
            with pytest.raises(errors.SandboxClosed):
                await bounded(task)
        assert [p for p in pids if host_pid_alive(p)] == []
    assert [p for p in executors if host_pid_alive(p)] == []
    assert list(local_root.iterdir()) == []
    for sb in sandboxes:
        await sb.aclose()  # still safe, and says nothing
    with pytest.raises(errors.SandboxClosed):
        await client.create()


async def test_closing_the_client_during_a_create_fails_it_and_leaves_nothing(
    local_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The start is held where it waits for its executor's ready line: the executor runs, the start has not ended.
    from orchard._backends.local import LocalBackend

    reached, never = asyncio.Event(), asyncio.Event()
    read_ready = LocalBackend._read_ready

    async def held(self: LocalBackend, *args: Any) -> int:
        reached.set()
        await never.wait()
        return await read_ready(self, *args)

    monkeypatch.setattr(LocalBackend, "_read_ready", held)
    with unisolated_ok():
        client = await orchard.Client(orchard.LocalConfig(root=str(local_root), isolation="none")).__aenter__()
    creating = asyncio.create_task(client.create())
    await bounded(reached.wait())
    assert [argv for _, _, argv in host_processes() if str(local_root).encode() in b" ".join(argv)] != []
    await bounded(client.aclose())
    # It waited on, its backend closed under it (or failed as the fork server went, its executor left running).
    with pytest.raises(errors.SandboxClosed, match="closed while the sandbox started"):
        await asyncio.wait_for(creating, 10)
    assert list(local_root.iterdir()) == []
    assert [argv for _, _, argv in host_processes() if str(local_root).encode() in b" ".join(argv)] == []
