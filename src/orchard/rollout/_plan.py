"""Which attempt runs next: tasks x n, and with ``adaptive`` the settling of groups (pure logic, no I/O)."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable

#: ``adaptive=True`` means this threshold on the probability that a settled group would have been mixed.
DEFAULT_THRESHOLD = 0.5


def settle_after(n: int, threshold: float) -> int:
    """How many agreeing outcomes settle a group of ``n`` attempts (``k``; ``n`` means never early).

    Under a uniform prior on the group's solve rate, after ``k`` attempts that
    all agree the chance that the other ``m = n - k`` would include a different
    outcome (the group would have been mixed) is ``m / (n + 1)``: the
    posterior is Beta(k+1, 1), and the chance of ``m`` more alike is
    ``(k+1) / (n+1)``. ``k`` is the smallest value, at least 2, for which that
    chance is below ``threshold``.
    """
    for k in range(2, n + 1):
        if (n - k) / (n + 1) < threshold:
            return k
    return n


@dataclasses.dataclass
class _Group:
    #: attempt -> solved, for the attempts that count (ok and agent_error).
    outcomes: dict[int, bool] = dataclasses.field(default_factory=dict)
    #: Attempts that ended without a counted outcome (infra or reward failures).
    uncounted: set[int] = dataclasses.field(default_factory=set)
    running: set[int] = dataclasses.field(default_factory=set)
    skipped: set[int] = dataclasses.field(default_factory=set)
    settled: bool = False
    next_extra: int = 0

    def used(self) -> int:
        return len(self.outcomes) + len(self.uncounted) + len(self.running)

    def mixed(self) -> bool:
        return len(set(self.outcomes.values())) == 2

    def taken(self, attempt: int) -> bool:
        return (
            attempt in self.outcomes or attempt in self.uncounted or attempt in self.running or attempt in self.skipped
        )


class Plan:
    """The schedule of a run: hands out ``(task_id, attempt)`` pairs and settles groups.

    Base attempts (``0 .. n-1``) go out attempt-major (attempt 0 of every
    task, then attempt 1, ...), so every group reaches ``k`` outcomes early.
    With ``settle`` (``k``), a group whose counted outcomes number at least
    ``k`` and all agree is settled: its base attempts not yet started are
    skipped. The base attempts of a group already mixed wait until no other
    group's base attempt does: they cannot change that the group is mixed,
    while the others' may. The attempts freed by settled groups go, once no
    base attempt is waiting, to mixed groups (fewest attempts first) as
    extra attempts numbered from ``n`` on. Attempts run (started, whatever
    their end) never exceed ``len(tasks) * n``.
    """

    def __init__(self, task_ids: Iterable[str], n: int, settle: int | None) -> None:
        self.n = n
        self.settle = settle
        self.groups: dict[str, _Group] = {tid: _Group(next_extra=n) for tid in task_ids}
        self.budget = len(self.groups) * n
        self._pending: collections.deque[tuple[str, int]] = collections.deque(
            (tid, a) for a in range(n) for tid in self.groups
        )
        #: Base attempts of mixed groups, put off (adaptive only) until ``_pending`` is empty.
        self._deferred: collections.deque[tuple[str, int]] = collections.deque()
        self._skips: list[tuple[str, int, str]] = []
        self.extras = 0

    def restore(self, task_id: str, attempt: int, kind: str, solved: bool | None) -> None:
        """Take in an attempt finished by an earlier run (a record read back on resume)."""
        g = self.groups.get(task_id)
        if g is None:
            return
        if kind == "skipped":
            g.skipped.add(attempt)
        elif kind in ("ok", "agent_error"):
            g.outcomes[attempt] = bool(solved)
        else:  # infra and reward failures are run again
            return
        if attempt >= self.n:
            self.extras += 1
            g.next_extra = max(g.next_extra, attempt + 1)

    def restored(self) -> None:
        """Settle the groups the restored records settle."""
        for tid in self.groups:
            self._check(tid)

    def start(self) -> tuple[str, int] | None:
        """The next attempt to start now, marked running; None if none may start until one ends."""
        while self._pending or self._deferred:
            tid, a = self._pending.popleft() if self._pending else self._deferred.popleft()
            g = self.groups[tid]
            if g.settled or g.taken(a):
                continue
            if self.settle is not None and self._pending and g.mixed():
                self._deferred.append((tid, a))
                continue
            g.running.add(a)
            return tid, a
        if self.settle is None or self.used() >= self.budget:
            return None
        mixed = [(g.used(), i, tid) for i, (tid, g) in enumerate(self.groups.items()) if g.mixed()]
        if not mixed:
            return None
        tid = min(mixed)[2]
        g = self.groups[tid]
        a = g.next_extra
        g.next_extra += 1
        g.running.add(a)
        self.extras += 1
        return tid, a

    def finish(self, task_id: str, attempt: int, solved: bool | None) -> None:
        """An attempt ended: ``solved`` is its counted outcome, or None if it does not count."""
        g = self.groups[task_id]
        g.running.discard(attempt)
        if solved is None:
            g.uncounted.add(attempt)
        else:
            g.outcomes[attempt] = solved
        self._check(task_id)

    def _check(self, task_id: str) -> None:
        g = self.groups[task_id]
        if self.settle is None or g.settled or g.mixed() or len(g.outcomes) < self.settle:
            return
        g.settled = True
        outcome = "solved" if next(iter(g.outcomes.values())) else "failed"
        why = f"group settled: {len(g.outcomes)} of {len(g.outcomes)} counted attempts {outcome}"
        for a in range(self.n):
            if not g.taken(a):
                g.skipped.add(a)
                self._skips.append((task_id, a, why))

    def take_skips(self) -> list[tuple[str, int, str]]:
        """Attempts newly skipped, with the reason, to record."""
        skips, self._skips = self._skips, []
        return skips

    def used(self) -> int:
        """Attempts started so far (running or ended), of the budget."""
        return sum(g.used() for g in self.groups.values())

    def running(self) -> int:
        """Attempts running now."""
        return sum(len(g.running) for g in self.groups.values())

    def skipped(self) -> int:
        """Attempts skipped so far."""
        return sum(len(g.skipped) for g in self.groups.values())
