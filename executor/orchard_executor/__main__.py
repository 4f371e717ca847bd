"""Run the executor: ``python -m orchard_executor --help``."""

from __future__ import annotations

import os
import sys

#: The environment variable that carries the executor's TLS certificate and key (PEM).
TLS_ENV = "ORCHARD_EXECUTOR_TLS"

# Without TLS (a unix socket, or loopback), keep libssl out of the executor's memory (aiohttp copes).
if not os.environ.get(TLS_ENV):
    sys.modules.setdefault("ssl", None)  # type: ignore[arg-type]
    _read_ca_store = None
else:
    # aiohttp builds a CA-verifying client context when imported, reading the image's whole CA store
    # (about 45 ms of every start with Debian's). The executor is a TLS server that opens no TLS
    # connection, so that context goes unused: it is built without the store (restored just below).
    import ssl as _ssl

    _read_ca_store = _ssl.SSLContext.load_default_certs
    _ssl.SSLContext.load_default_certs = lambda self, purpose=_ssl.Purpose.SERVER_AUTH: None  # type: ignore[method-assign]

import argparse
import asyncio
import functools
import json
import logging
import resource
import shutil
import signal
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from aiohttp import web

from . import listener, reaper
from .app import STATE, Settings, clean_environ, create_app
from .protocol import API_VERSION

if _read_ca_store is not None:
    _ssl.SSLContext.load_default_certs = _read_ca_store  # type: ignore[method-assign]

if TYPE_CHECKING:
    import ssl

PARENT_GONE = "parent went away"
#: Seconds an idle connection is kept open.
KEEPALIVE_TIMEOUT = 15.0
#: Log records kept per logger and message in ``LOG_WINDOW`` seconds, and bytes of log in all.
LOG_BURST = 10
LOG_WINDOW = 60.0
LOG_BUDGET = 4 * 1024 * 1024


class _LogLimit(logging.Filter):
    """Rate-limits each kind of record and caps the executor's total log, whatever a peer provokes."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: dict[tuple[str, str], list[float]] = {}
        self._written = 0

    def filter(self, record: logging.LogRecord) -> bool:
        now = record.created
        key = (record.name, str(record.msg)[:200])
        times = [t for t in self._seen.get(key, []) if now - t < LOG_WINDOW]
        if len(times) >= LOG_BURST or self._written > LOG_BUDGET:
            self._seen[key] = times
            return False
        if len(self._seen) > 1000:
            self._seen.clear()
        self._seen[key] = [*times, now]
        self._written += len(str(record.msg)) + (2000 if record.exc_info else 200)
        if self._written > LOG_BUDGET:
            record.msg, record.args, record.exc_info = "log budget spent: no more records", None, None
        return True


def _setup_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_LogLimit())
    handler.setFormatter(logging.Formatter("orchard-executor: %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler], force=True)


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def tls_context(pem: str) -> ssl.SSLContext:
    """A TLS 1.3 server context for the certificate and key in ``pem``.

    The client made the key pair for this sandbox alone and pins the
    certificate's hash, so no CA is involved. ``ssl`` loads keys only from
    files: the PEM goes through a memfd (no disk, nothing another process can
    swap), closed at once.
    """
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    fd = os.memfd_create("orchard-tls", os.MFD_CLOEXEC)
    try:
        os.write(fd, pem.encode())
        ctx.load_cert_chain(f"/proc/self/fd/{fd}")
    except (ssl.SSLError, ValueError, OSError) as exc:
        raise SystemExit(f"orchard-executor: cannot load ${TLS_ENV} (a PEM certificate and key): {exc}") from None
    finally:
        os.close(fd)
    return ctx


def _parse(argv: list[str] | None) -> argparse.Namespace:
    args = _parser().parse_args(argv)
    if args.token_sha256 is None:
        args.token_sha256 = os.environ.get("ORCHARD_EXECUTOR_TOKEN_SHA256")
    return args


@functools.cache
def _parser() -> argparse.ArgumentParser:
    """The argument parser, built once: a zygote builds it before it forks (argparse's gettext lookups cost ms)."""
    p = argparse.ArgumentParser(prog="orchard-executor", description=__doc__)
    p.add_argument("--host", default="0.0.0.0", help="address to listen on")
    p.add_argument("--port", type=int, default=8750, help="port to listen on (0: any free port)")
    p.add_argument("--unix", default=None, metavar="PATH", help="listen on a unix socket at PATH instead of TCP")
    p.add_argument(
        "--token-sha256",
        default=None,
        help="SHA-256 hex of the bearer token (default: $ORCHARD_EXECUTOR_TOKEN_SHA256)",
    )
    p.add_argument("--workdir", default=None, help="default working directory of commands")
    p.add_argument("--state-dir", default=None, help="where background output and session state live")
    p.add_argument("--idle-timeout", type=float, default=None, help="exit after this many idle seconds")
    p.add_argument(
        "--ready-fd", type=int, default=None, help="write one JSON line with the bound port to this fd once serving"
    )
    p.add_argument(
        "--path-append",
        default=None,
        metavar="DIRS",
        help="directories (':'-separated) to append to the PATH of every command, after the image's own",
    )
    p.add_argument("--exit-with-stdin", action="store_true", help="exit when stdin reaches EOF (parent died)")
    p.add_argument(
        "--orphan-dir", default=None, help="a directory to delete if the executor exits after its parent died"
    )
    return p


async def _watch_stdin(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while await reader.read(4096):
        pass
    stop.set()


def _initial_environ() -> dict[str, str]:
    """The environment this process was started with, which its commands get.

    ``os.environ`` can differ from it: where no locale is set (a bare image),
    Python itself sets LC_CTYPE=C.UTF-8 (PEP 538), and that must not leak into
    the commands. /proc/self/environ still holds the original block.
    """
    try:
        with open("/proc/self/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return dict(os.environ)
    env = {}
    for entry in raw.split(b"\0"):
        key, sep, value = entry.partition(b"=")
        if sep and key:
            env[os.fsdecode(key)] = os.fsdecode(value)
    return env


#: PATH where the environment has none: what Docker gives a container whose image sets none.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def with_path_appended(env: dict[str, str], dirs: str | None) -> dict[str, str]:
    """``env`` with ``dirs`` after its PATH's own directories (the image's tools win)."""
    if not dirs:
        return env
    return env | {"PATH": f"{env.get('PATH') or DEFAULT_PATH}:{dirs}"}


async def serve(
    args: argparse.Namespace,
    environ: dict[str, str] | None = None,
    *,
    then: Callable[[], Awaitable[None]] | None = None,
) -> str:
    """Serve until told to stop; returns why it stopped (``environ``: the commands' environment, if not ours).

    ``then``: called once serving; the executor stops when it returns (``preload``'s requests).
    """
    if not args.token_sha256:
        raise SystemExit("orchard-executor: a token hash is required (--token-sha256); it never runs without auth")
    pem = os.environ.pop(TLS_ENV, "")
    tls = tls_context(pem) if pem else None
    settings = Settings(
        token_sha256=args.token_sha256,
        workdir=os.path.abspath(args.workdir or os.getcwd()),
        state_dir=args.state_dir,
        idle_timeout=args.idle_timeout,
        env=with_path_appended(clean_environ(_initial_environ() if environ is None else environ), args.path_append),
    )
    # Orphaned descendants come to the executor (PID 1, or a subreaper): reap them.
    init_reaper = reaper.start(asyncio.get_running_loop())
    app = create_app(settings)
    state = app[STATE]
    # A client that disconnects cancels its handler, which kills the command it was running.
    runner = web.AppRunner(
        app,
        handle_signals=False,
        access_log=None,
        handler_cancellation=True,
        # An idle connection (or one that never completes its headers) is closed after this.
        keepalive_timeout=KEEPALIVE_TIMEOUT,
        shutdown_timeout=5.0,
    )
    await runner.setup()
    assert runner.server is not None
    if args.unix:
        sock = socket.socket(socket.AF_UNIX)
        # Readable and writable by all (connecting needs write): the client may be another uid than
        # this executor's (on docker, the image's user); the socket's directory decides who reaches it.
        umask = os.umask(0o111)
        try:
            sock.bind(args.unix)
        finally:
            os.umask(umask)
        sock.listen(1024)
    else:
        sock = socket.create_server((args.host, args.port), backlog=1024)
    # Our own accept loop: a connection cap, and no error logged per accept at the fd limit.
    accepting = listener.Listener(sock, runner.server, listener.connection_cap(raise_fd_limit()), tls)
    accepting.start()
    loop = asyncio.get_running_loop()
    if os.getpid() != 1:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, state.stop, signal.Signals(sig).name)
    # As a container's PID 1 it handles neither: the kernel then drops them when the sandbox's own commands
    # send them (`kill 1`), so code in the sandbox cannot end it and have its attempt pass for an
    # infrastructure fault. Its runtime still ends it, by SIGKILL (at once, or after the grace period).
    watchers = []
    if args.exit_with_stdin:
        stdin_closed = asyncio.Event()
        watchers.append(asyncio.create_task(_watch_stdin(stdin_closed)))
        watchers.append(asyncio.create_task(_stop_when(stdin_closed, state.stop, PARENT_GONE)))
    if args.ready_fd is not None:
        port = 0 if args.unix else sock.getsockname()[1]
        os.write(args.ready_fd, json.dumps({"port": port, "pid": os.getpid()}).encode() + b"\n")
        os.close(args.ready_fd)
    if then is not None:
        watchers.append(asyncio.create_task(_stop_after(then, state.stop)))
    try:
        await state.stopped.wait()
    finally:
        for task in watchers:
            task.cancel()
        # Commands first: requests waiting on them then end at once, and nothing outlives the executor.
        accepting.close()
        reaper.kill_descendants()
        await runner.cleanup()
        if init_reaper is not None:
            init_reaper.stop()
    reason: str = state.stop_reason
    return reason


async def _stop_after(then: Callable[[], Awaitable[None]], stop: Callable[[str], None]) -> None:
    try:
        await then()
    finally:
        stop("preloaded")


async def _stop_when(event: asyncio.Event, stop: Callable[[str], None], reason: str) -> None:
    await event.wait()
    stop(reason)


#: The command ``preload`` asks its executor for: none by that name exists, so nothing runs.
PRELOAD_COMMAND = "/nonexistent/orchard-preload"
#: Seconds ``preload`` may take (it takes milliseconds): past them the zygote fails, and its client says why.
PRELOAD_TIMEOUT = 10.0


def preload() -> None:
    """Do once, in a zygote before it forks any executor, what every executor does first.

    A forked executor inherits this process's memory, so what an executor
    builds lazily (the argument parser, the router's compiled patterns,
    msgspec's type information, aiohttp's and asyncio's first-request state)
    is built here once per client and not once per sandbox. It serves two
    requests on a unix socket in a private directory, authenticated with a
    token it forgets, and asks for a command that does not exist, so none
    runs. Every thread it started has ended when it returns: a fork copies
    only the forking thread, and a lock another one held would stay locked in
    every executor.
    """
    import hashlib
    import secrets
    import tempfile
    import threading

    token = secrets.token_urlsafe(32)
    with tempfile.TemporaryDirectory(prefix="orchard-preload-") as private:
        path = os.path.join(private, "executor.sock")
        args = _parse(
            [
                f"--unix={path}",
                f"--token-sha256={hashlib.sha256(token.encode()).hexdigest()}",
                f"--workdir={private}",
                f"--state-dir={os.path.join(private, 'state')}",
            ]
        )

        statuses: list[bytes] = []

        async def requests() -> None:
            body = json.dumps({"cmd": [PRELOAD_COMMAND]}).encode()
            for head in (
                "GET /healthz HTTP/1.1\r\nHost: preload\r\n\r\n",
                f"POST /{API_VERSION}/exec HTTP/1.1\r\nHost: preload\r\nAuthorization: Bearer {token}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n",
            ):
                reader, writer = await asyncio.open_unix_connection(path)
                try:
                    writer.write(head.encode() + (body if head.startswith("POST") else b""))
                    statuses.append((await reader.readuntil(b"\r\n")).split(b" ")[1])
                finally:
                    writer.close()

        asyncio.run(asyncio.wait_for(serve(args, {"PATH": DEFAULT_PATH}, then=requests), PRELOAD_TIMEOUT))
    # The health check, and the command refused as not found: anything else is an executor that cannot serve.
    if statuses != [b"200", b"404"]:
        raise RuntimeError(f"orchard-executor: preload: the executor answered {statuses}, not [200, 404]")
    for thread in threading.enumerate():
        if thread is not threading.main_thread():
            thread.join(PRELOAD_TIMEOUT)
    if threading.active_count() > 1:
        raise RuntimeError(f"orchard-executor: preload: threads still running: {threading.enumerate()}")


def main(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> None:
    """Entry point (``environ``: for a forked executor, whose /proc/self/environ is its zygote's)."""
    args = _parse(argv)
    _setup_logging()
    parent = os.getppid()
    reason = ""
    if os.getpid() == 1:
        # Python's own SIGINT handler (KeyboardInterrupt) would let the sandbox's `kill -INT 1` through; with
        # the default action the kernel drops it, and asyncio.run then installs none (see serve()).
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        reason = asyncio.run(serve(args, environ))
        print(f"orchard-executor: stopped: {reason}", file=sys.stderr)
    finally:
        reaper.kill_descendants()
        # Nobody is left to clean up after an orphan but the orphan itself.
        if args.orphan_dir and (reason == PARENT_GONE or os.getppid() != parent):
            shutil.rmtree(args.orphan_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
