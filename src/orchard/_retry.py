"""The one retry policy: jittered exponential backoff on transient failures.

It is applied only to calls that are safe to repeat: reads, idempotent
writes, and execs that carry a request id the executor deduplicates.
"""

from __future__ import annotations

from collections.abc import Iterator

import aiohttp
from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    retry_if_not_exception_type,
    stop_after_attempt,
    wait_random_exponential,
)

#: Failures worth another try: the connection broke or could not be made, or broke in the middle of a
#: reply's body (aiohttp's ClientPayloadError: an executor killed while it answered).
TRANSIENT = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)
#: Among those, a deadline that passed: not retried, since a slow or frozen
#: executor would only make the caller wait the whole deadline again.
TOO_SLOW = (aiohttp.ServerTimeoutError,)
#: And a peer that is not the executor the client made a certificate for: no retry makes it so.
IMPOSTOR = (aiohttp.ServerFingerprintMismatch,)


def policy(attempts: int = 4) -> AsyncRetrying:
    """A fresh retrying controller for one call."""
    return AsyncRetrying(
        retry=retry_if_exception_type(TRANSIENT) & retry_if_not_exception_type((*TOO_SLOW, *IMPOSTOR)),
        wait=wait_random_exponential(multiplier=0.05, max=2.0),
        stop=stop_after_attempt(attempts),
        reraise=True,
    )


def poll_delays(fast: float = 0.01, fast_for: float = 0.5, cap: float = 0.1) -> Iterator[float]:
    """Pauses between polls of a starting executor's ``/healthz``.

    Every ``fast`` seconds for the first ``fast_for`` seconds, since an executor
    usually answers within a few hundred milliseconds of its container running;
    then doubling up to ``cap``, so hundreds of sandboxes starting slowly on a
    loaded node do not spend the client's CPU on refused connections.
    """
    for _ in range(round(fast_for / fast)):
        yield fast
    delay = fast
    while True:
        delay = min(cap, delay * 2)
        yield delay
