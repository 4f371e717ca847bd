"""What a run gives back: its records, pass rates, a table, plots and the chat export."""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from ._store import PARAMS, RESULTS, dumps, read_records

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from rich.table import Table

KINDS = ("ok", "agent_error", "infra_error", "reward_error", "skipped")


class Results:
    """The records of a run, one per attempt (docs/rollout.md), with summaries.

    ``records`` are dicts in task order, then attempt order. Pass rates count
    ``ok`` and ``agent_error`` attempts (an agent error is unsolved); infra and
    reward failures and skipped attempts are left out of them.
    """

    def __init__(
        self,
        records: Sequence[dict[str, Any]],
        *,
        tasks: Sequence[dict[str, Any]] = (),
        params: dict[str, Any] | None = None,
    ) -> None:
        #: One dict per attempt.
        self.records = list(records)
        #: The tasks as run.json lists them (id, image, instruction, workdir).
        self.tasks = {t["id"]: t for t in tasks}
        #: The run's parameters (run.json).
        self.params = params or {}

    @classmethod
    def load(cls, out: str | os.PathLike[str]) -> Results:
        """The results in an ``out=`` directory (the last record of each attempt), without running anything."""
        directory = Path(out)
        try:
            records = read_records(directory / RESULTS)
        except FileNotFoundError:
            raise ConfigError(f"{directory / RESULTS} does not exist: not a rollout out= directory") from None
        params: dict[str, Any] = {}
        if (directory / PARAMS).exists():
            params = json.loads((directory / PARAMS).read_text(encoding="utf-8"))
        order = {t["id"]: i for i, t in enumerate(params.get("tasks", []))}
        records.sort(key=lambda r: (order.get(r["task"], len(order)), r["task"], r["attempt"]))
        return cls(records, tasks=params.get("tasks", []), params=params)

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.records)

    def __repr__(self) -> str:
        counts = ", ".join(f"{k}={v}" for k, v in self.counts.items() if v)
        rate = self.overall
        return f"<Results {len(self.groups)} tasks, {counts}, pass rate {'-' if rate is None else f'{rate:.1%}'}>"

    def __str__(self) -> str:
        """The table as plain text."""
        from rich.console import Console

        console = Console(width=120, color_system=None, force_terminal=False, force_jupyter=False)
        with console.capture() as capture:
            console.print(self.table())
        return capture.get()

    @property
    def groups(self) -> dict[str, list[dict[str, Any]]]:
        """Records by task, in attempt order (a GRPO group each)."""
        groups: dict[str, list[dict[str, Any]]] = {}
        for tid in self.tasks:
            groups[tid] = []
        for r in self.records:
            groups.setdefault(r["task"], []).append(r)
        return {tid: g for tid, g in groups.items() if g}

    @property
    def counts(self) -> dict[str, int]:
        """Attempts by kind: ok, agent_error, infra_error, reward_error, skipped."""
        c = collections.Counter(r["kind"] for r in self.records)
        return {k: c[k] for k in KINDS}

    @property
    def pass_rate(self) -> dict[str, float | None]:
        """Task id -> solved / counted attempts (None if no attempt counted)."""
        return {tid: _rate(g) for tid, g in self.groups.items()}

    @property
    def overall(self) -> float | None:
        """Solved / counted over all attempts (None if none counted)."""
        return _rate(self.records)

    def table(self) -> Table:
        """A rich Table, one row per task: counts by kind, pass rate, mean reward and durations.

        It displays itself in a notebook; in a terminal ``rich.print(results.table())``
        (or ``print(results)`` for plain text).
        """
        from rich.table import Table

        table = Table(title="rollout results")
        for name in ("task", "attempts", "solved", "agent err", "infra", "reward err", "skipped", "pass rate"):
            table.add_column(name, justify="left" if name == "task" else "right")
        table.add_column("mean reward", justify="right")
        table.add_column("agent s (mean)", justify="right")
        for tid, g in self.groups.items():
            c = collections.Counter(r["kind"] for r in g)
            rewards = [r["reward"] for r in g if r["kind"] in ("ok", "agent_error")]
            agent = [r["durations"]["agent"] for r in g if (r.get("durations") or {}).get("agent") is not None]
            rate = _rate(g)
            table.add_row(
                tid,
                str(len(g) - c["skipped"]),
                str(sum(1 for r in g if r["kind"] == "ok" and r.get("solved"))),
                str(c["agent_error"]),
                str(c["infra_error"]),
                str(c["reward_error"]),
                str(c["skipped"]),
                "-" if rate is None else f"{rate:.0%}",
                f"{sum(rewards) / len(rewards):.3f}" if rewards else "-",
                f"{sum(agent) / len(agent):.2f}" if agent else "-",
            )
        rate = self.overall
        table.caption = (
            f"{len(self.groups)} tasks; " + ", ".join(f"{k} {v}" for k, v in self.counts.items() if v)
            if self.records
            else "no attempts"
        ) + ("" if rate is None else f"; pass rate {rate:.1%}")
        return table

    def plot(self) -> Figure:
        """A matplotlib Figure: pass rate per task, a histogram of durations, and the sandbox timeline."""
        from matplotlib.figure import Figure

        fig = Figure(figsize=(13, 4), layout="constrained")
        ax_rate, ax_dur, ax_time = fig.subplots(1, 3)
        rates = [(tid, rate) for tid, rate in self.pass_rate.items() if rate is not None]
        ax_rate.barh([tid for tid, _ in rates], [rate for _, rate in rates], color="tab:green")
        ax_rate.set_xlim(0, 1)
        ax_rate.invert_yaxis()
        ax_rate.set_xlabel("pass rate")
        ax_rate.set_title("pass rate per task")

        for phase, color in (("start", "tab:gray"), ("agent", "tab:blue"), ("reward", "tab:orange")):
            values = [r["durations"][phase] for r in self.records if (r.get("durations") or {}).get(phase) is not None]
            if values:
                ax_dur.hist(values, bins=20, alpha=0.6, label=phase, color=color)
        ax_dur.set_xlabel("seconds")
        ax_dur.set_ylabel("attempts")
        ax_dur.set_title("durations")
        if ax_dur.get_legend_handles_labels()[0]:
            ax_dur.legend()

        ran = [r for r in self.records if r["kind"] != "skipped" and r.get("started_at") and r.get("ended_at")]
        colors = {"ok": "tab:green", "agent_error": "tab:red", "infra_error": "tab:purple", "reward_error": "tab:brown"}
        if ran:
            t0 = min(r["started_at"] for r in ran)
            ran.sort(key=lambda r: r["started_at"])
            for lane, r in enumerate(ran):
                color = colors[r["kind"]]
                if r["kind"] == "ok" and not r.get("solved"):
                    color = "tab:olive"
                ax_time.plot([r["started_at"] - t0, r["ended_at"] - t0], [lane, lane], color=color, linewidth=2)
        ax_time.set_xlabel("seconds since the first start")
        ax_time.set_ylabel("attempt (by start)")
        ax_time.set_title("timeline (green solved, olive unsolved, red agent error, purple infra)")
        ax_time.title.set_fontsize("small")
        return fig

    def to_chat(self, path: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
        """The graded attempts in the chat format SFT and RL trainers take, one dict per attempt.

        Each is ``{"messages": [...], "reward": float, "solved": bool, "task": id, "attempt": i,
        "kind": "ok" | "agent_error"}``. The messages are the answer's own when the agent returned
        a dict with a ``"messages"`` list; otherwise a user message with the task's instruction
        and an assistant message with the answer (a string as is, anything else as JSON; an agent
        error's assistant message is empty). Infra failures, reward failures and skipped
        attempts are left out: they have no reward. With ``path``, also written there as JSON lines.
        """
        rows = []
        for r in self.records:
            if r["kind"] not in ("ok", "agent_error"):
                continue
            answer = r.get("answer")
            if isinstance(answer, dict) and isinstance(answer.get("messages"), list):
                messages = answer["messages"]
            else:
                if answer is None:
                    content = ""
                elif isinstance(answer, str):
                    content = answer
                else:
                    content = json.dumps(answer, default=repr, ensure_ascii=False)
                instruction = self.tasks.get(r["task"], {}).get("instruction", "")
                messages = [{"role": "user", "content": instruction}, {"role": "assistant", "content": content}]
            rows.append(
                {
                    "messages": messages,
                    "reward": r["reward"],
                    "solved": bool(r.get("solved")),
                    "task": r["task"],
                    "attempt": r["attempt"],
                    "kind": r["kind"],
                }
            )
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.writelines(dumps(row) for row in rows)
        return rows


def _rate(records: Sequence[dict[str, Any]]) -> float | None:
    counted = [r for r in records if r["kind"] in ("ok", "agent_error")]
    if not counted:
        return None
    return sum(1 for r in counted if r["kind"] == "ok" and r.get("solved")) / len(counted)
