"""What the browser and the desktop share: refusing bad input, and telling how a process in the sandbox ended."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import InvalidRequest

if TYPE_CHECKING:
    from .._sandbox import Process


def invalid(message: str) -> InvalidRequest:
    """The error for an action the client refuses before sending it: the executor's type for the same refusal."""
    return InvalidRequest(message, code="bad_request")


def checked_size(size: tuple[int, int]) -> tuple[int, int]:
    """A screen or window size: two integers from 16 to 8192."""
    w, h = size
    if not (isinstance(w, int) and isinstance(h, int) and 16 <= w <= 8192 and 16 <= h <= 8192):
        raise invalid(f"size={size!r}: width and height must be integers from 16 to 8192")
    return w, h


async def ended(process: Process) -> tuple[str, int | None, int | None, str] | None:
    """None while ``process`` runs; once it ended, how (words), its exit code, its signal and its stderr's end."""
    status = await process.status()
    if status.running:
        return None
    stderr = (await process.output("stderr")).decode(errors="replace")[-4000:]
    how = f"exit code {status.exit_code}" if status.signal is None else f"signal {status.signal}"
    return how, status.exit_code, status.signal, stderr
