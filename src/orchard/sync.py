"""Orchard for synchronous code: the async API, run on a background event loop.

Example::

    import orchard.sync

    with orchard.sync.Client() as client, client.sandbox() as sb:
        print(sb.exec("echo hi").stdout)

The names and arguments are those of ``orchard``: ``Client``, ``Sandbox``,
``Shell``, ``Process`` and the ``sandbox()`` shortcut, with ``close()`` for
``aclose()``, ``with`` for ``async with`` and plain iterators for async ones
(``exec_stream``, ``stream_file``, ``download_tar``: one item is fetched per
step, nothing is read ahead). Errors are those of ``orchard.errors``.

Every call runs on one event loop in a daemon thread of its own, started by
the first Client and shared by all, and blocks the calling thread until its
result is ready. So it also works where an event loop is already running (a
notebook cell, async code calling sync code), without ``nest_asyncio``: that
loop's thread is blocked for the duration of the call, and its other tasks
wait too. Ctrl-C (``KeyboardInterrupt``) cancels the call it interrupts; a
sandbox being created is deleted, and the ``with`` blocks delete theirs.
Sandboxes a sync Client started are deleted when it closes, or at
interpreter exit if it was never closed. Where the async API takes an async
iterable of bytes (``stdin``, ``write_file``, ``upload_tar``), a sync
iterator (a generator, a file opened in binary mode) works too.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import functools
import inspect
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from types import TracebackType
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar

from . import _client, _sandbox
from ._backends import BackendConfig
from ._handle import Handle
from ._rpc import LIVENESS_TIMEOUT, READ_TIMEOUT
from ._spec import SandboxSpec
from .errors import SyncLoopError

__all__ = ["Client", "Process", "Sandbox", "Shell", "sandbox"]

_P = ParamSpec("_P")
_R = TypeVar("_R")
_T = TypeVar("_T")
_W = TypeVar("_W")
_A = TypeVar("_A")


class _Loop:
    """The process's background event loop, in a daemon thread of its own."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        #: Why the loop no longer runs; None while it does.
        self.dead: str | None = None
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="orchard-sync", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        reason = "was stopped"
        try:
            self.loop.run_forever()
        except BaseException as exc:  # a task raised SystemExit or KeyboardInterrupt, which stop a loop
            reason = f"died of {exc!r}"
        finally:
            with self._lock:
                self.dead = f"orchard.sync's event loop thread {reason}"
                pending, self._pending = self._pending, set()
            # Calls waiting on the loop would wait forever: fail them.
            for fut in pending:
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    fut.set_exception(SyncLoopError(self.dead))
        if reason == "was stopped":
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    def run(
        self,
        coro: Coroutine[Any, Any, _R],
        *,
        shield: bool = False,
        release: Callable[[_R], Coroutine[Any, Any, object]] | None = None,
    ) -> _R:
        """Run ``coro`` on the loop and wait for its result in the calling thread.

        A ``KeyboardInterrupt`` while it waits cancels ``coro`` (unless
        ``shield``) and waits for it to unwind, so what it was creating is
        deleted; a result it still produced is given to ``release``.
        """
        if threading.get_ident() == self.thread.ident:
            coro.close()
            raise SyncLoopError("an orchard.sync call on orchard.sync's own loop thread would wait for itself")
        fut: concurrent.futures.Future[_R] = concurrent.futures.Future()
        tasks: list[asyncio.Task[_R]] = []

        def start() -> None:
            task = self.loop.create_task(coro)
            tasks.append(task)
            task.add_done_callback(functools.partial(_settle, fut))

        with self._lock:
            if self.dead is not None:
                coro.close()
                raise SyncLoopError(self.dead)
            self._pending.add(fut)
        try:
            self.loop.call_soon_threadsafe(start)
            try:
                return fut.result()
            except KeyboardInterrupt:
                if not shield:
                    # Runs after start(): the loop runs its callbacks in order.
                    self.loop.call_soon_threadsafe(lambda: tasks[0].cancel())
                # A second Ctrl-C stops this wait; atexit still deletes the Client's sandboxes.
                with contextlib.suppress(Exception, concurrent.futures.CancelledError):
                    result = fut.result()
                    if release is not None:
                        self.run(release(result), shield=True)
                raise
        finally:
            with self._lock:
                self._pending.discard(fut)

    def close_iterator(self, it: AsyncIterator[Any]) -> None:
        """Close an async iterator the caller left early (its command is killed)."""
        aclose = getattr(it, "aclose", None)
        if aclose is None:
            return
        if threading.get_ident() == self.thread.ident or self.dead is not None:
            # Collected on the loop itself (or too late): close it without waiting.
            if self.dead is None:
                self.loop.create_task(aclose())
            return
        self.run(aclose(), shield=True)


def _settle(fut: concurrent.futures.Future[_R], task: asyncio.Task[_R]) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if task.cancelled():
            fut.set_exception(concurrent.futures.CancelledError())
        elif (exc := task.exception()) is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(task.result())


_current: _Loop | None = None
_current_lock = threading.Lock()
#: Sync Clients not closed yet, closed at interpreter exit if the user forgot.
_open_clients: set[Client] = set()


def _get_loop() -> _Loop:
    """The shared loop, started on first use (again if the last one died)."""
    global _current
    with _current_lock:
        if _current is None or _current.dead is not None:
            if _current is None:
                atexit.register(_at_exit)
            _current = _Loop()
        return _current


def _at_exit() -> None:
    for client in list(_open_clients):
        with contextlib.suppress(Exception):
            client.close()
    loop = _current
    if loop is not None and loop.dead is None:
        loop.loop.call_soon_threadsafe(loop.loop.stop)
        loop.thread.join(10)


async def _anext(it: AsyncIterator[_T]) -> tuple[bool, _T | None]:
    try:
        return True, await anext(it)
    except StopAsyncIteration:
        return False, None


def _iterate(loop: _Loop, it: AsyncIterator[_T]) -> Iterator[_T]:
    """A sync iterator pulling one item at a time from an async one."""
    try:
        while True:
            more, item = loop.run(_anext(it))
            if not more:
                return
            yield item  # type: ignore[misc]  # item is a _T whenever more is True
    finally:
        loop.close_iterator(it)


async def _pull(it: Iterator[bytes]) -> AsyncIterator[bytes]:
    """A sync iterator's items, each fetched in a worker thread so the loop is never blocked."""
    done = object()
    while (chunk := await asyncio.to_thread(next, it, done)) is not done:
        yield chunk  # type: ignore[misc]  # a chunk the iterator gave


def _arg(value: Any) -> Any:
    """An argument as the async API wants it: proxies unwrapped, sync byte iterators made async."""
    if isinstance(value, _Proxy):
        return value._target
    if isinstance(value, Iterator) and not hasattr(value, "__aiter__"):
        return _pull(value)
    return value


def _convert(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return tuple(map(_arg, args)), {k: _arg(v) for k, v in kwargs.items()}


def _release(value: Any) -> Coroutine[Any, Any, object]:
    """Release a result the interrupted caller never received (a new sandbox is deleted)."""

    async def release() -> None:
        aclose = getattr(value, "aclose", None)
        if aclose is not None:
            await aclose()

    return release()


class _Proxy(Generic[_A]):
    """A sync face of one async object; methods it does not spell out are adapted when first used."""

    def __init__(self, target: _A, loop: _Loop) -> None:
        self._target = target
        self._loop = loop

    def __repr__(self) -> str:
        return f"<sync {self._target!r}>"

    if not TYPE_CHECKING:  # typed wrappers are spelled out; this adapts methods added to the async API since

        def __getattr__(self, name: str) -> Any:
            if name.startswith("_"):
                raise AttributeError(name)
            method = getattr(type(self._target), name, None)
            adapted = _adapt(method) if callable(method) else None
            if adapted is None:
                return getattr(self._target, name)
            setattr(type(self), name, adapted)
            return adapted.__get__(self)


def _adapt(method: Callable[..., Any]) -> Callable[..., Any] | None:
    """A sync method for an async one, found by its kind; None for a plain method (called as it is)."""
    returns = str(getattr(method, "__annotations__", {}).get("return", ""))
    wrapped = getattr(method, "__wrapped__", None)
    if inspect.isasyncgenfunction(method) or returns.startswith(("AsyncIterator", "AsyncIterable")):
        return _iterating(method)
    if inspect.isasyncgenfunction(wrapped) or "AsyncContextManager" in returns:  # @asynccontextmanager
        return _managing(method, _wrap)
    if inspect.iscoroutinefunction(method):
        return _returning(method, _wrap)
    return None


def _wrap(value: Any, loop: _Loop) -> Any:
    """A result of the async API as the sync API gives it."""
    for async_type, sync_type in _SYNC_TYPES.items():
        if isinstance(value, async_type):
            return sync_type(value, loop)
    return value


def _url(value: Any, loop: _Loop) -> str:
    return str(value)


def _blocking(fn: Callable[Concatenate[_A, _P], Coroutine[Any, Any, _R]]) -> Callable[Concatenate[_Proxy[_A], _P], _R]:
    """The sync form of an async method."""

    def call(self: _Proxy[_A], /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        a, kw = _convert(args, kwargs)
        return self._loop.run(fn(self._target, *a, **kw))

    return _named(call, fn)


def _returning(
    fn: Callable[Concatenate[_A, _P], Coroutine[Any, Any, Any]], wrap: Callable[[Any, _Loop], _W]
) -> Callable[Concatenate[_Proxy[_A], _P], _W]:
    """The sync form of an async method whose result (a Sandbox, a Process) gets a sync face too."""

    def call(self: _Proxy[_A], /, *args: _P.args, **kwargs: _P.kwargs) -> _W:
        a, kw = _convert(args, kwargs)
        return wrap(self._loop.run(fn(self._target, *a, **kw), release=_release), self._loop)

    return _named(call, fn)


def _iterating(
    fn: Callable[Concatenate[_A, _P], AsyncIterator[_T]],
) -> Callable[Concatenate[_Proxy[_A], _P], Iterator[_T]]:
    """The sync form of an async method returning an async iterator."""

    def call(self: _Proxy[_A], /, *args: _P.args, **kwargs: _P.kwargs) -> Iterator[_T]:
        a, kw = _convert(args, kwargs)
        return _iterate(self._loop, fn(self._target, *a, **kw))

    return _named(call, fn)


def _managing(
    fn: Callable[Concatenate[_A, _P], AbstractAsyncContextManager[Any]], wrap: Callable[[Any, _Loop], _W]
) -> Callable[Concatenate[_Proxy[_A], _P], AbstractContextManager[_W]]:
    """The sync form of an async method returning an async context manager."""

    def call(self: _Proxy[_A], /, *args: _P.args, **kwargs: _P.kwargs) -> AbstractContextManager[_W]:
        a, kw = _convert(args, kwargs)
        return _Managed(self._loop, fn(self._target, *a, **kw), wrap)

    return _named(call, fn)


def _named(call: Callable[..., _T], fn: Callable[..., Any]) -> Callable[..., _T]:
    call.__name__, call.__qualname__, call.__doc__ = fn.__name__, fn.__qualname__, fn.__doc__
    call.__wrapped__ = fn  # type: ignore[attr-defined]  # so inspect.signature and help() show the async one's
    return call


class _Managed(AbstractContextManager[_W]):
    """A sync ``with`` over an async context manager."""

    def __init__(self, loop: _Loop, manager: AbstractAsyncContextManager[Any], wrap: Callable[[Any, _Loop], _W]):
        self._loop = loop
        self._manager = manager
        self._wrap = wrap

    def __enter__(self) -> _W:
        value = self._loop.run(self._manager.__aenter__(), release=lambda _: self._manager.__aexit__(None, None, None))
        return self._wrap(value, self._loop)

    def __exit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        if exc is not None and not isinstance(exc, Exception):
            # KeyboardInterrupt or SystemExit raised in a task would stop the loop: the block ends as cancelled.
            et, exc, tb = asyncio.CancelledError, asyncio.CancelledError(), None
        return bool(self._loop.run(self._manager.__aexit__(et, exc, tb), shield=True))


class Process(_Proxy[_sandbox.Process]):
    """A background process in a sandbox (see ``orchard.Process``)."""

    @property
    def id(self) -> str:
        """The process's id in the executor."""
        return self._target.id

    @property
    def pid(self) -> int:
        """Its pid in the sandbox."""
        return self._target.pid

    status = _blocking(_sandbox.Process.status)
    read = _blocking(_sandbox.Process.read)
    output = _blocking(_sandbox.Process.output)
    write_stdin = _blocking(_sandbox.Process.write_stdin)
    signal = _blocking(_sandbox.Process.signal)
    wait = _blocking(_sandbox.Process.wait)
    kill = _blocking(_sandbox.Process.kill)


class Shell(_Proxy[_sandbox.Shell]):
    """A persistent shell session (see ``orchard.Shell``); ``with`` closes it."""

    @property
    def id(self) -> str:
        """The session's id in the executor."""
        return self._target.id

    exec = _blocking(_sandbox.Shell.exec)

    def close(self) -> None:
        """End the session."""
        self._loop.run(self._target.aclose(), shield=True)

    def __enter__(self) -> Shell:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Sandbox(_Proxy[_sandbox.Sandbox]):
    """One sandbox (see ``orchard.Sandbox``); ``with`` deletes it."""

    @property
    def id(self) -> str:
        """The sandbox's id."""
        return self._target.id

    @property
    def spec(self) -> SandboxSpec:
        """The spec it was started with."""
        return self._target.spec

    @property
    def timings(self) -> dict[str, float]:
        """Seconds from the create request to each startup phase."""
        return self._target.timings

    @property
    def image(self) -> str:
        """The image the sandbox was started from."""
        return self._target.image

    def close(self) -> None:
        """Delete the sandbox and everything running in it; safe to call twice."""
        self._loop.run(self._target.aclose(), shield=True)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def handle(self) -> Handle:
        """A string another process gives to ``Client.attach``: a secret (see ``orchard.Sandbox.handle``)."""
        return self._target.handle()

    exec = _blocking(_sandbox.Sandbox.exec)
    exec_stream = _iterating(_sandbox.Sandbox.exec_stream)
    start_process = _returning(_sandbox.Sandbox.start_process, Process)
    processes = _blocking(_sandbox.Sandbox.processes)
    shell = _returning(_sandbox.Sandbox.shell, Shell)
    info = _blocking(_sandbox.Sandbox.info)
    write_file = _blocking(_sandbox.Sandbox.write_file)
    stream_file = _iterating(_sandbox.Sandbox.stream_file)
    read_file = _blocking(_sandbox.Sandbox.read_file)
    stat = _blocking(_sandbox.Sandbox.stat)
    exists = _blocking(_sandbox.Sandbox.exists)
    list_dir = _blocking(_sandbox.Sandbox.list_dir)
    mkdir = _blocking(_sandbox.Sandbox.mkdir)
    remove = _blocking(_sandbox.Sandbox.remove)
    upload = _blocking(_sandbox.Sandbox.upload)
    download = _blocking(_sandbox.Sandbox.download)
    download_tar = _iterating(_sandbox.Sandbox.download_tar)
    upload_tar = _blocking(_sandbox.Sandbox.upload_tar)
    snapshot = _blocking(_sandbox.Sandbox.snapshot)
    restore = _blocking(_sandbox.Sandbox.restore)
    # The tunnel is served by the loop thread, so the caller's thread is free to use the URL.
    forward = _managing(_sandbox.Sandbox.forward, _url)
    reverse_forward = _managing(_sandbox.Sandbox.reverse_forward, lambda port, loop: int(port))


_SYNC_TYPES: dict[type, Callable[[Any, _Loop], Any]] = {
    _sandbox.Sandbox: Sandbox,
    _sandbox.Shell: Shell,
    _sandbox.Process: Process,
}


class Client(_Proxy[_client.Client]):
    """Starts sandboxes and talks to them, from synchronous code (see ``orchard.Client``).

    Example::

        with orchard.sync.Client("docker") as client, client.sandbox("python:3.12") as sb:
            print(sb.exec("python3 -V").stdout)

    Takes the arguments of ``orchard.Client`` but ``http_session`` (the
    Client's session lives on orchard.sync's loop). ``close()``, the end of
    its ``with`` block or, failing both, interpreter exit deletes its
    sandboxes.
    """

    def __init__(
        self,
        backend: str | BackendConfig = "local",
        *,
        max_concurrent_starts: int = 64,
        read_timeout: float = READ_TIMEOUT,
        liveness_timeout: float = LIVENESS_TIMEOUT,
        **options: Any,
    ) -> None:
        target = _client.Client(
            backend,
            max_concurrent_starts=max_concurrent_starts,
            read_timeout=read_timeout,
            liveness_timeout=liveness_timeout,
            **options,
        )
        super().__init__(target, _get_loop())
        _open_clients.add(self)

    @property
    def config(self) -> BackendConfig:
        """The backend's config."""
        return self._target.config

    @property
    def session_id(self) -> str:
        """Identifies this client's sandboxes (labels, names)."""
        return self._target.session_id

    def __enter__(self) -> Client:
        self._loop.run(self._target.__aenter__())
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Delete every sandbox still open, then release the pool and backend."""
        try:
            self._loop.run(self._target.aclose(), shield=True)
        finally:
            _open_clients.discard(self)

    # Spelled out: mypy cannot pass ``**spec`` through a ParamSpec beside a named ``self``.
    def create(self, image: str = "local", **spec: Any) -> Sandbox:
        """Start a sandbox and return it once ready; ``sb.close()`` ends it (see ``orchard.Client.create``)."""
        return Sandbox(self._loop.run(self._target.create(image, **spec), release=_release), self._loop)

    attach = _returning(_client.Client.attach, Sandbox)
    wait_warm = _blocking(_client.Client.wait_warm)

    def warm_status(self) -> dict[str, dict[str, Any]]:
        """Image -> its warm pool now (see ``orchard.Client.warm_status``)."""
        return self._target.warm_status()

    def sandbox(self, image: str = "local", **spec: Any) -> AbstractContextManager[Sandbox]:
        """Start a sandbox for the duration of a ``with`` block."""
        return _Managed(self._loop, self._target.sandbox(image, **spec), Sandbox)


@contextlib.contextmanager
def sandbox(image: str = "local", *, backend: str | BackendConfig = "local", **spec: Any) -> Iterator[Sandbox]:
    """One sandbox with a Client of its own, for scripts that need just one.

    Example::

        with orchard.sync.sandbox() as sb:
            sb.exec("echo hi")
    """
    with Client(backend) as client, client.sandbox(image, **spec) as sb:
        yield sb
