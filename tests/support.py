"""Helpers shared by the test modules (fixtures live in conftest.py)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import random
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp

import orchard

#: Generous: the machine running the suite is small and shared.
WAIT = 60.0


async def eventually(check: Callable[[], Awaitable[bool] | bool], *, timeout: float = WAIT, what: str = "") -> None:
    """Poll ``check`` until it is true; fail the test if it never is."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if loop.time() > deadline:
            raise AssertionError(f"still not true after {timeout:g}s: {what or check}")
        await asyncio.sleep(0.05)


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name, or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return raw[raw.rfind(b")") + 2 :].decode().split()


def host_pid_alive(pid: int) -> bool:
    """Whether a host process exists and is not a zombie (a zombie is dead, just not reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = proc_stat(pid)
    return stat is not None and stat[0] != "Z"


async def sandbox_pid_alive(sb: orchard.Sandbox, pid: int) -> bool:
    """The same check made from inside the sandbox, so it holds on any backend."""
    r = await sb.exec(["cat", f"/proc/{pid}/stat"])
    if r.exit_code != 0:
        return False
    return r.stdout[r.stdout.rfind(")") + 2 :].split()[0] != "Z"


async def read_pid(sb: orchard.Sandbox, path: str) -> int:
    """A pid a command wrote to a file in the sandbox, waiting for it to appear."""
    await eventually(lambda: sb.exists(path), what=f"{path} exists")
    data = b""

    async def written() -> bool:
        nonlocal data
        data = await sb.read_file(path)
        return data.endswith(b"\n")

    await eventually(written, what=f"{path} holds a whole line")
    return int(data.split()[0])


def pattern_chunks(total: int, chunk: int, seed: int) -> list[bytes]:
    """Deterministic, incompressible data in chunks (random bytes, fixed seed)."""
    rng = random.Random(seed)
    block = rng.randbytes(chunk)
    # Vary every chunk cheaply so that misplaced chunks change the digest.
    chunks = []
    for i in range(0, total, chunk):
        size = min(chunk, total - i)
        chunks.append(i.to_bytes(8, "big") + block[8:size] if size > 8 else block[:size])
    return chunks


async def agen(chunks: list[bytes]) -> AsyncIterator[bytes]:
    """An async generator over ``chunks``, yielding to the loop between them."""
    for c in chunks:
        yield c
        await asyncio.sleep(0)


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The hex digest of a local file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


def executor_opener(sb: orchard.Sandbox) -> Callable[[], Awaitable[Connection]]:
    """Opens raw connections to the sandbox's executor as its client reaches it now (TCP, or a unix socket)."""
    connector = sb._rpc._session.connector
    if isinstance(connector, aiohttp.UnixConnector):
        path = connector.path
        return lambda: asyncio.open_unix_connection(path)
    host, port = sb._rpc._base.removeprefix("http://").rsplit(":", 1)
    return lambda: asyncio.open_connection(host, int(port))


async def open_executor(sb: orchard.Sandbox) -> Connection:
    """A raw connection to the sandbox's executor."""
    return await executor_opener(sb)()


@contextlib.asynccontextmanager
async def raw_http(sb: orchard.Sandbox) -> AsyncIterator[aiohttp.ClientSession]:
    """A plain aiohttp session that reaches the sandbox's executor the way its client does."""
    async with aiohttp.ClientSession(connector=sb._rpc._session.connector, connector_owner=False) as session:
        yield session
