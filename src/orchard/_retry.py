"""The one retry policy: jittered exponential backoff on transient failures.

It is applied only to calls that are safe to repeat: reads, idempotent
writes, and execs that carry a request id the executor deduplicates.
"""

from __future__ import annotations

import aiohttp
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_random_exponential

#: Failures worth another try: the connection broke or could not be made.
TRANSIENT = (aiohttp.ClientConnectionError,)


def policy(attempts: int = 4) -> AsyncRetrying:
    """A fresh retrying controller for one call."""
    return AsyncRetrying(
        retry=retry_if_exception_type(TRANSIENT),
        wait=wait_random_exponential(multiplier=0.05, max=2.0),
        stop=stop_after_attempt(attempts),
        reraise=True,
    )
