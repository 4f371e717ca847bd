"""The progress bar (tqdm): attempts done of the budget, counts by kind, pass rate, sandboxes in flight."""

from __future__ import annotations

import time
from collections.abc import Mapping


class Progress:
    """A tqdm bar over the run's budget (``tasks x n`` attempts), redrawn at most ten times a second."""

    def __init__(self, total: int) -> None:
        from tqdm.auto import tqdm  # type: ignore[import-untyped]  # (no stubs installed)

        self._bar = tqdm(total=total, unit="attempt", desc="rollout", dynamic_ncols=True)
        self._drawn = 0.0

    def update(
        self, kinds: Mapping[str, int], solved: int, extras: int, in_flight: int, *, force: bool = False
    ) -> None:
        """Show these counts (``kinds``: records by kind; ``extras``: extra attempts started)."""
        now = time.monotonic()
        if not force and now - self._drawn < 0.1:
            return
        self._drawn = now
        counted = kinds.get("ok", 0) + kinds.get("agent_error", 0)
        done = counted + kinds.get("infra_error", 0) + kinds.get("reward_error", 0)
        # Skipped attempts are done too, less those whose budget went to extra attempts.
        self._bar.n = min(self._bar.total, done + max(0, kinds.get("skipped", 0) - extras))
        postfix: dict[str, object] = {
            "ok": kinds.get("ok", 0),
            "agent_err": kinds.get("agent_error", 0),
            "infra": kinds.get("infra_error", 0),
            "skipped": kinds.get("skipped", 0),
            "pass": f"{solved / counted:.0%}" if counted else "-",
            "in_flight": in_flight,
        }
        if kinds.get("reward_error"):
            postfix["reward_err"] = kinds["reward_error"]
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.refresh()

    def close(self) -> None:
        """Leave the bar as it ended."""
        self._bar.close()
