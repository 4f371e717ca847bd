"""Cleanup that no cancel cuts short."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def finish(aw: Awaitable[T]) -> T:
    """Await ``aw`` to its end even if this task is cancelled meanwhile, any number of times; then raise the cancel.

    ``asyncio.shield`` alone keeps ``aw`` running but returns at the first
    cancel. A task cancelled twice (a Client closing cancels its starts, and
    its warm pools cancel their refills, the same starts) then stopped
    waiting for what it was deleting, and the backend was closed under the
    deletion: a sandbox's directory, container or pod was left behind.
    """
    task = asyncio.ensure_future(aw)
    cancelled: asyncio.CancelledError | None = None
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError as exc:
            cancelled = exc
    if cancelled is not None:
        if not task.cancelled():
            task.exception()  # retrieved: the caller sees its cancel instead
        raise cancelled
    return task.result()
