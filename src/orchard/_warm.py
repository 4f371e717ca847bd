"""Warm pools: sandboxes started ahead of time and claimed at once (``Client(warm=...)``).

A pool keeps ``size`` started, never-used sandboxes of one image and spec,
and refills in the background. Each is sent a first request as it
starts (its connection, and what its executor sets up on a first request,
are then ready when it is claimed), and another every 10 s while it waits,
which keeps that connection open and replaces one that stopped answering
before a claim finds it. A claim takes the oldest ready one,
checks its executor answers, and hands it out exactly once; an empty pool, a spec
that differs, or a pooled sandbox that died means a cold start instead,
never an error. A pool whose sandboxes fail to start backs off (0.5 s,
doubling, up to 30 s) rather than looping.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from ._finish import finish
from ._spec import SandboxSpec, make_spec
from .errors import ConfigError, OrchardError, SandboxTimeout

if TYPE_CHECKING:
    from ._sandbox import Sandbox

log = logging.getLogger("orchard.warm")

#: Seconds a claim waits for a pooled executor to answer before it starts one cold instead.
CLAIM_CHECK_TIMEOUT = 2.0
#: Seconds between the requests a pool sends each of its ready sandboxes: under the executor's keep-alive
#: (15 s), so that a claim finds the connection its sandbox's first request made still open.
PING_INTERVAL = 10.0
BACKOFF_FIRST, BACKOFF_MAX = 0.5, 30.0


def next_delay(delay: float) -> float:
    """The back-off after another failed start: 0.5 s first, then doubling, never over 30 s."""
    return min(max(2 * delay, BACKOFF_FIRST), BACKOFF_MAX)


def parse(warm: Mapping[str, int | Mapping[str, Any]] | None) -> dict[str, tuple[int, SandboxSpec]]:
    """``{image: size}`` or ``{image: {"size": n, **spec}}`` -> image -> (size, spec), or ``ConfigError``."""
    pools: dict[str, tuple[int, SandboxSpec]] = {}
    for image, value in (warm or {}).items():
        options = dict(value) if isinstance(value, Mapping) else {"size": value}
        size = options.pop("size", None)
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ConfigError(f"warm[{image!r}]: the pool size must be a whole number >= 0, not {size!r}")
        pools[image] = (size, make_spec(image, options))
    return pools


class Pool:
    """The ready sandboxes of one image and spec, kept at ``size`` by a background task."""

    def __init__(self, spec: SandboxSpec, size: int, start: Callable[[], Awaitable[Sandbox]]) -> None:
        self.spec = spec
        self.size = size
        self._start = start
        self._ready: collections.deque[tuple[float, Sandbox]] = collections.deque()
        self._changed = asyncio.Event()  # a claim took one (refill) or a start ended (waiters)
        self._task: asyncio.Task[None] | None = None
        self._dropping: set[asyncio.Task[None]] = set()
        self._pinged = time.monotonic()
        #: Why the last start failed, while the pool backs off (None once one succeeds).
        self.last_error: BaseException | None = None
        #: Starts attempted for this pool, successful or not.
        self.starts = 0
        # An idle executor exits after idle_timeout, and ttl counts from the start: recycle at half of either.
        limits = [t for t in (spec.idle_timeout, spec.ttl) if t is not None]
        self._max_age = min(limits) / 2 if limits else None

    @property
    def ready(self) -> int:
        return len(self._ready)

    def status(self) -> dict[str, Any]:
        error = None if self.last_error is None else f"{type(self.last_error).__name__}: {self.last_error}"
        return {"size": self.size, "ready": len(self._ready), "starts": self.starts, "last_error": error}

    def open(self) -> None:
        if self._task is None and self.size > 0:
            self._task = asyncio.get_running_loop().create_task(self._keep(), name=f"orchard-warm-{self.spec.image}")

    async def aclose(self) -> None:
        """Stop refilling; the pooled sandboxes are the Client's to delete (they are among its open ones)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._ready.clear()
        if self._dropping:
            await asyncio.gather(*self._dropping, return_exceptions=True)

    async def claim(self) -> Sandbox | None:
        """A ready sandbox whose executor answers, handed out once, or None (start one cold)."""
        while self._ready:
            born, sb = self._ready.popleft()
            self._changed.set()
            if self._stale(born):
                self._drop(sb)
                continue
            try:
                await _check(sb)
            except (OrchardError, TimeoutError) as exc:
                log.info("warm pool %s: %s did not answer (%s); trying the next", self.spec.image, sb.id, exc)
                self._drop(sb)
                continue
            except BaseException:  # the claim was cancelled: the sandbox is still fresh, and the pool's
                self._ready.appendleft((born, sb))
                raise
            return sb
        return None

    async def wait_full(self) -> None:
        while len(self._ready) < self.size:
            self._changed.clear()
            await self._changed.wait()

    def _stale(self, born: float) -> bool:
        return self._max_age is not None and time.monotonic() - born > self._max_age

    def _drop(self, sb: Sandbox) -> None:
        task = asyncio.get_running_loop().create_task(sb.aclose())
        self._dropping.add(task)
        task.add_done_callback(self._dropping.discard)

    async def _start_one(self) -> None:
        self.starts += 1
        sb = await self._start()
        try:
            # A first request here, not in the claim: the connection, and what the executor sets up on its
            # first request, are then ready when the claim's check and first command come.
            await _check(sb)
        except BaseException:
            await finish(sb.aclose())
            raise
        self._ready.append((time.monotonic(), sb))
        self.last_error = None
        self._changed.set()

    async def _keep(self) -> None:
        delay = 0.0
        while True:
            while self._ready and self._stale(self._ready[0][0]):
                self._drop(self._ready.popleft()[1])
            missing = self.size - len(self._ready)
            if missing > 0:
                results = await asyncio.gather(*(self._start_one() for _ in range(missing)), return_exceptions=True)
                errors = [r for r in results if isinstance(r, BaseException)]
                if errors:
                    if any(isinstance(e, asyncio.CancelledError) for e in errors):
                        raise asyncio.CancelledError
                    self.last_error = errors[0]
                    delay = next_delay(delay)
                    log.warning("warm pool %s: start failed (%s); retrying in %.1fs", self.spec.image, errors[0], delay)
                    self._changed.set()
                    await asyncio.sleep(delay)
                else:
                    delay = 0.0
                continue
            self._changed.clear()
            wait = self._pinged + PING_INTERVAL - time.monotonic()
            if self._max_age is not None:
                wait = min(wait, self._max_age / 4)  # recheck the ages
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, wait)):
                    await self._changed.wait()
            if time.monotonic() >= self._pinged + PING_INTERVAL:
                await self._ping()

    async def _ping(self) -> None:
        """A request to each pooled sandbox; one that does not answer is replaced before a claim finds it.

        Each request keeps the sandbox's connection open for its claim (the executor closes one idle for
        15 s: a claim then paid a new connection, on Kubernetes a TLS handshake).
        """
        self._pinged = time.monotonic()
        ready = list(self._ready)
        answers = await asyncio.gather(*(self._answers(sb) for _, sb in ready))
        for entry, answered in zip(ready, answers, strict=True):
            if not answered and entry in self._ready:  # not claimed meanwhile
                log.info("warm pool %s: %s did not answer; replacing it", self.spec.image, entry[1].id)
                self._ready.remove(entry)
                self._drop(entry[1])

    @staticmethod
    async def _answers(sb: Sandbox) -> bool:
        try:
            await _check(sb)
        except (OrchardError, TimeoutError):
            return False
        return True


async def _check(sb: Sandbox) -> None:
    """The executor answers within ``CLAIM_CHECK_TIMEOUT``, or this raises why not."""
    async with asyncio.timeout(CLAIM_CHECK_TIMEOUT):
        await sb.info()


async def wait_full(pools: Mapping[str, Pool], timeout: float) -> None:
    """Return once every pool is full, or raise ``SandboxTimeout`` naming those that are not and why."""
    try:
        async with asyncio.timeout(timeout):
            await asyncio.gather(*(p.wait_full() for p in pools.values()))
    except TimeoutError:
        short = [
            f"{image}: {p.ready} of {p.size} ready" + (f", last start failed: {p.last_error}" if p.last_error else "")
            for image, p in pools.items()
            if p.ready < p.size
        ]
        raise SandboxTimeout(f"warm pools not full within {timeout:g}s ({'; '.join(short)})") from None
