"""The command line's output through rich: live on a terminal, plain lines in a log or a pipe."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from rich.console import Console


def console(out: TextIO) -> Console:
    """A console on ``out``: colours and live redraws on a terminal; elsewhere plain text, never wrapped."""
    from rich.console import Console

    if out.isatty():
        return Console(file=out)
    return Console(file=out, no_color=True, highlight=False, width=100_000, emoji=False, soft_wrap=True)


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str], out: TextIO) -> None:
    """Rows as a table with a header: ruled on a terminal, aligned plain columns elsewhere."""
    from rich import box
    from rich.table import Table

    con = console(out)
    grid = Table(
        box=box.SIMPLE_HEAD if con.is_terminal else None,
        show_edge=False,
        pad_edge=False,
        header_style="bold" if con.is_terminal else "",
    )
    for column in columns:
        numeric = bool(rows) and all(_numeric(row.get(column, "")) for row in rows)
        grid.add_column(column.upper(), no_wrap=True, justify="right" if numeric else "left")
    for row in rows:
        grid.add_row(*(str(row.get(c, "")) for c in columns))
    if con.is_terminal:
        con.print(grid)
        return
    with con.capture() as captured:
        con.print(grid)
    out.write("".join(line.rstrip() + "\n" for line in captured.get().splitlines()))


def _numeric(value: Any) -> bool:
    try:
        float(str(value))
    except ValueError:
        return str(value) == "-"
    return True


class Progress:
    """Sandboxes done of a total: a rich progress bar on a terminal, a plain line every tenth elsewhere."""

    def __init__(self, total: int, out: TextIO, *, quiet: bool = False) -> None:
        self.total = total
        self.done = 0
        self.failed = 0
        self._out = out
        self._quiet = quiet
        self._bar: Any = None
        self._task: Any = None
        if not quiet and out.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as Bar

            self._bar = Bar(
                TextColumn("sandboxes"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("ok={task.fields[ok]} failed={task.fields[failed]}"),
                TimeElapsedColumn(),
                console=console(out),
            )
            self._task = self._bar.add_task("sandboxes", total=total, ok=0, failed=0)
            self._bar.start()

    def advance(self, ok: bool) -> None:
        """One more sandbox finished."""
        self.done += 1
        self.failed += not ok
        if self._quiet:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, ok=self.done - self.failed, failed=self.failed)
            if self.done == self.total:
                self._bar.stop()
        elif self.done == self.total or self.done % max(1, self.total // 10) == 0:
            self._out.write(f"{self.done}/{self.total} sandboxes  ok={self.done - self.failed} failed={self.failed}\n")
            self._out.flush()

    def close(self) -> None:
        """Stop the bar (an interrupted run), leaving the terminal as it was."""
        if self._bar is not None:
            self._bar.stop()
