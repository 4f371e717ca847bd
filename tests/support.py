"""Helpers shared by the test modules (fixtures live in conftest.py)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import os
import random
import signal
import socket
import ssl
import struct
import subprocess
import sys
import threading
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import aiohttp
import yarl

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


def host_processes() -> Iterator[tuple[int, int, list[bytes]]]:
    """Each live host process: its pid, its parent's pid and its command line (argv)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = proc_stat(int(entry))
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().rstrip(b"\0").split(b"\0")
        except OSError:
            continue
        if stat is not None and stat[0] != "Z":
            yield int(entry), int(stat[1]), argv


def workdir_executors(root: str | os.PathLike[str]) -> list[int]:
    """Pids of the executors whose sandboxes live under ``root`` (by their ``--workdir=`` argument)."""
    prefix = f"--workdir={os.fspath(root)}/".encode()
    return sorted(pid for pid, _, argv in host_processes() if any(arg.startswith(prefix) for arg in argv))


def listening(port: int) -> list[str]:
    """The local addresses of every listening TCP socket on ``port`` (IPv4 and IPv6), from /proc/net."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                local, state = row.split()[1], row.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    found.append(address)
    return found


async def cancel_twice(start: asyncio.Task[orchard.Sandbox], first: float, again: float) -> None:
    """Cancel a create ``first`` s after it began, and again ``again`` s later, while the first cancel's cleanup runs.

    A sandbox the create returned anyway (it ended before the cancels landed) is closed.
    """
    await asyncio.sleep(first)
    start.cancel()
    await asyncio.sleep(again)
    start.cancel()
    try:
        sb = await start
    except asyncio.CancelledError:
        return
    await sb.aclose()


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
    url = yarl.URL(sb._rpc._base)
    host, port = url.host, url.port
    if url.scheme == "https":
        # Raw connections only need to reach the executor; pinning its certificate is the client's (tests/docker/test_tls.py).
        tls = ssl.create_default_context()
        tls.check_hostname, tls.verify_mode = False, ssl.CERT_NONE
        return lambda: asyncio.open_connection(host, port, ssl=tls, server_hostname="")
    return lambda: asyncio.open_connection(host, port)


async def open_executor(sb: orchard.Sandbox) -> Connection:
    """A raw connection to the sandbox's executor."""
    return await executor_opener(sb)()


@contextlib.asynccontextmanager
async def raw_http(sb: orchard.Sandbox) -> AsyncIterator[aiohttp.ClientSession]:
    """A plain aiohttp session that reaches the sandbox's executor the way its client does."""
    if sb._rpc._base.startswith("https:"):  # its own connector, pinning the executor's certificate
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=sb._rpc._ssl)) as session:
            yield session
        return
    async with aiohttp.ClientSession(connector=sb._rpc._session.connector, connector_owner=False) as session:
        yield session


@dataclasses.dataclass(frozen=True)
class Segment:
    """One captured IPv4 TCP segment that carried data."""

    src: str
    dst: str
    sport: int
    dport: int
    payload: bytes


@contextlib.contextmanager
def captured_tcp() -> Iterator[list[Segment]]:
    """Every IPv4 TCP segment with data, on every interface of this host, while the block runs.

    A packet socket (root) sees what crosses the Docker bridges, the dev
    cluster's pod bridge and loopback, as a sniffer on those links would.
    """
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(0x0003))  # ETH_P_ALL, no link header
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
    sock.settimeout(0.05)
    segments: list[Segment] = []
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            try:
                packet = sock.recv(1 << 16)
            except TimeoutError:
                continue
            if len(packet) < 20 or packet[0] >> 4 != 4 or packet[9] != 6:  # IPv4, TCP
                continue
            ip_len = (packet[0] & 0xF) * 4
            tcp = packet[ip_len:]
            if len(tcp) < 20:
                continue
            payload = tcp[(tcp[12] >> 4) * 4 :]
            if payload:
                src, dst = socket.inet_ntoa(packet[12:16]), socket.inet_ntoa(packet[16:20])
                sport, dport = struct.unpack("!HH", tcp[:4])
                segments.append(Segment(src, dst, sport, dport, payload))

    thread = threading.Thread(target=run, name="capture", daemon=True)
    thread.start()
    try:
        yield segments
    finally:
        stop.set()
        thread.join()
        sock.close()


def to_executor(segments: list[Segment], sb: orchard.Sandbox) -> list[Segment]:
    """The captured segments that went to the sandbox's executor (its address and port)."""
    url = yarl.URL(sb._rpc._base)
    return [s for s in segments if s.dst == url.host and s.dport == url.port]


#: Backends the generic tests run on: both local tiers, as plain ``pytest`` and ``scripts/test`` run them,
#: unless ``ORCHARD_TEST_BACKENDS`` chooses fewer (``=local``: the unisolated one alone). A tier that cannot run fails.
BACKENDS = os.environ.get("ORCHARD_TEST_BACKENDS", "local,local-bwrap").split(",")


@contextlib.contextmanager
def unisolated_ok() -> Iterator[None]:
    """Where a test chose ``isolation="none"`` on purpose: its warning is expected."""
    from orchard.errors import UnisolatedWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnisolatedWarning)
        yield


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """A process frozen with SIGSTOP for the block (an executor that answers nothing), then let go."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


#: How each bundled harness shows that it runs: the flag (mini has no --version) and what it prints of its version.
TOOL_CHECK = {
    "codex": ("--version", "codex-cli {v}"),
    "claude": ("--version", "{v} (Claude Code)"),
    "opencode": ("--version", "{v}"),
    "pi": ("--version", "{v}"),
    "openclaw": ("--version", "OpenClaw {v} "),
    "mini": ("--help", "This is mini-swe-agent version {v}."),
    "hermes": ("--version", "Hermes Agent v{v} "),
}


async def bundle_versions(sb: orchard.Sandbox) -> dict[str, str]:
    """The tools bundle's VERSIONS file, read inside the sandbox: name -> version."""
    from orchard import _tools

    text = (await sb.read_file(f"{_tools.BUNDLE}/VERSIONS")).decode()
    return {line.split()[0]: line.split()[1] for line in text.splitlines()}


async def check_tool(sb: orchard.Sandbox, name: str, versions: dict[str, str]) -> None:
    """Run one bundled harness as an argv (no shell needed) and check it says its pinned version."""
    flag, line = TOOL_CHECK[name]
    r = await sb.exec([name, flag], env={"HOME": f"/tmp/home-{name}"}, timeout=120, merge_output=True)
    assert r.exit_code == 0, (name, r.output)
    # One stream: pi prints its version to stderr, and codex warns there.
    assert line.format(v=versions[name]) in r.output, (name, r.output)


# -- The toy tasks rolled out (tests/test_rollout_toys.py and its docker and kubernetes twins) --

TOY_ATTEMPTS = 8


async def roll_out_toys(client: orchard.Client, out: str | os.PathLike[str], concurrency: int) -> str:
    """The six toy tasks x TOY_ATTEMPTS of a seeded ScriptedPolicy, graded by swebench's code, checked.

    Every attempt must be ``ok`` in one try and solved exactly when the
    policy's seeded draw chose the right fix, so the pass rates are known in
    advance. Returns a line saying what ran and how long it took.
    """
    import time
    from pathlib import Path

    import orchard.rollout
    from orchard import tasks

    toys = tasks.load(Path(__file__).resolve().parents[1] / "examples" / "tasks" / "swe-mini.jsonl")
    policy = tasks.ScriptedPolicy(p_right=0.5, seed=7)
    t0 = time.monotonic()
    results = await orchard.rollout.run(
        client,
        toys,
        agent=policy,
        reward=tasks.reward,
        n=TOY_ATTEMPTS,
        concurrency=concurrency,
        out=out,
        progress=False,
    )
    elapsed = time.monotonic() - t0
    total = len(toys) * TOY_ATTEMPTS
    assert results.counts == {"ok": total, "agent_error": 0, "infra_error": 0, "reward_error": 0, "skipped": 0}
    for r in results.records:
        task = next(t for t in toys if t.id == r["task"])
        assert (r["tries"], r["reason"]) == (1, None), r
        assert r["solved"] is policy.chooses_right(task, r["attempt"]), (r["task"], r["attempt"], r["log_tail"])
    expected = {t.id: sum(policy.chooses_right(t, a) for a in range(TOY_ATTEMPTS)) / TOY_ATTEMPTS for t in toys}
    assert results.pass_rate == expected
    return f"{len(toys)} toy tasks x {TOY_ATTEMPTS} attempts, concurrency {concurrency}: {elapsed:.1f} s; {expected}"


def executor_host_pids(token_sha256: str) -> list[int]:
    """Host pids of the executor whose token hash this is (a container's PID 1, as the host sees it)."""
    needle = f"ORCHARD_EXECUTOR_TOKEN_SHA256={token_sha256}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"orchard_executor" not in f.read():
                    continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def orchard_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120, cwd: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the real ``orchard`` command (``python -m orchard``) as a subprocess; ``env`` adds to this one's."""
    return subprocess.run(
        [sys.executable, "-m", "orchard", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=cwd,
        check=False,
    )
