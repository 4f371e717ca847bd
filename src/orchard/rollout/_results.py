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
        "kind": "ok" | "agent_error"}``, plus ``"tools"`` when the conversation came with tool
        definitions. The messages are, first found:

        - the answer's own, when the agent returned a dict with a ``"messages"`` list;
        - the model calls the attempt's gateway recorded (``sandbox={"model": gateway}``): the
          last answered call's request messages (as Chat Completions, whichever API the harness
          spoke) followed by its reply, the whole trajectory as the model last saw it;
        - a user message with the task's instruction and an assistant message with the answer
          (a string as is, anything else as JSON; an agent error's is empty).

        Infra failures, reward failures and skipped attempts are left out: they have no reward.
        With ``path``, also written there as JSON lines.
        """
        rows = []
        for r in self.records:
            if r["kind"] not in ("ok", "agent_error"):
                continue
            answer = r.get("answer")
            tools: Any = None
            if isinstance(answer, dict) and isinstance(answer.get("messages"), list):
                messages = answer["messages"]
            elif (conversation := conversation_of(r.get("calls") or [])) is not None:
                messages, tools = conversation
            else:
                if answer is None:
                    content = ""
                elif isinstance(answer, str):
                    content = answer
                else:
                    content = json.dumps(answer, default=repr, ensure_ascii=False)
                instruction = self.tasks.get(r["task"], {}).get("instruction", "")
                messages = [{"role": "user", "content": instruction}, {"role": "assistant", "content": content}]
            row: dict[str, Any] = {
                "messages": messages,
                "reward": r["reward"],
                "solved": bool(r.get("solved")),
                "task": r["task"],
                "attempt": r["attempt"],
                "kind": r["kind"],
            }
            if tools:
                row["tools"] = tools
            rows.append(row)
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.writelines(dumps(row) for row in rows)
        return rows


def conversation_of(calls: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], Any] | None:
    """The messages and tools of a sandbox's last answered model call, its reply appended; None if none answered.

    The request is the Chat Completions body (the harness's own for ``chat``, the gateway's translation sent
    upstream for ``messages`` and ``responses``); the reply is turned into a Chat Completions assistant message.
    """
    for call in reversed(calls):
        if call.get("status") != 200 or call.get("error") or not isinstance(call.get("response"), dict):
            continue
        body = call.get("request") if call.get("api") == "chat" else call.get("upstream_request")
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            continue
        reply = _assistant_message(call["api"], call["response"])
        if reply is None:
            continue
        return [*body["messages"], reply], body.get("tools")
    return None


def _assistant_message(api: str, response: dict[str, Any]) -> dict[str, Any] | None:
    """A reply in the API the harness spoke, as a Chat Completions assistant message."""
    text: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    if api == "chat":
        choices = response.get("choices") or []
        chosen = choices[0].get("message") if choices and isinstance(choices[0], dict) else None
        if not isinstance(chosen, dict):
            return None
        return {k: v for k, v in chosen.items() if v is not None} | {"role": "assistant"}
    if api == "messages":
        for block in response.get("content") or []:
            kind = block.get("type")
            if kind == "text":
                text.append(block.get("text", ""))
            elif kind == "thinking":
                reasoning.append(block.get("thinking", ""))
            elif kind == "tool_use":
                arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
                calls.append(_tool_call(block.get("id"), block.get("name"), arguments))
    elif api == "responses":
        for item in response.get("output") or []:
            kind = item.get("type")
            if kind == "message":
                text.extend(p.get("text", "") for p in item.get("content") or [] if p.get("type") == "output_text")
            elif kind == "reasoning":
                parts = [*(item.get("summary") or []), *(item.get("content") or [])]
                reasoning.extend(
                    p.get("text", "") for p in parts if p.get("type") in ("summary_text", "reasoning_text")
                )
            elif kind == "function_call":
                calls.append(_tool_call(item.get("call_id"), item.get("name"), item.get("arguments") or "{}"))
    else:
        return None
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _tool_call(call_id: Any, name: Any, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _rate(records: Sequence[dict[str, Any]]) -> float | None:
    counted = [r for r in records if r["kind"] in ("ok", "agent_error")]
    if not counted:
        return None
    return sum(1 for r in counted if r["kind"] == "ok" and r.get("solved")) / len(counted)
