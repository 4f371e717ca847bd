"""Regenerate README's performance tables from the JSON results.

    python benchmarks/readme.py      # after a benchmark wrote benchmarks/results/*.json

Each table sits between ``<!-- perf:NAME -->`` and ``<!-- /perf:NAME -->``
markers and is rebuilt from ``benchmarks/results/NAME.json``; nothing in
them is typed by hand.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def local(r: dict[str, Any]) -> str:
    e, x, m = r["exec_true"], r["executor"], r["machine"]
    rows = [
        f"Measured by `python benchmarks/bench_local.py --json benchmarks/results/local.json` "
        f"on {m['cpus']} cores ({m['platform']}, Python {m['python']}, load average "
        f"{m['load_before'][0]:.2f} at start); {r['iterations']} round trips per path, interleaved.",
        "",
        "| exec round trip of `true` | p50 ms | p99 ms | mean ms |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, key in (
        ("bare `asyncio.create_subprocess_exec` (floor)", "bare_spawn"),
        ('`sb.exec(["true"])`, local backend', "orchard_local"),
    ):
        v = e[key]
        rows.append(f"| {name} | {v['p50_ms']:.3f} | {v['p99_ms']:.3f} | {v['mean_ms']:.3f} |")
    rows += [
        f"| **overhead of the library path** | **{e['p50_overhead_ms']:+.3f}** | {e['p99_overhead_ms']:+.3f} | |",
        "",
        "| executor | measured | target |",
        "| --- | ---: | ---: |",
        f"| idle RSS | {x['idle_rss_mb']:.1f} MB (PSS {x['idle_pss_mb']:.1f} MB) | ≤ 30 MB |",
        f"| start to ready, p50 / max | {x['start_to_ready_ms']['p50']:.0f} / "
        f"{x['start_to_ready_ms']['max']:.0f} ms | ≤ 300 ms |",
    ]
    return "\n".join(rows)


def k8s(r: dict[str, Any]) -> str:
    e = r["exec"]
    rows = [
        f"Measured by `python benchmarks/bench_k8s.py --json benchmarks/results/k8s.json` on the dev cluster "
        f"({r['machine']['cpus']} cores, load average {r['machine']['load_before'][0]:.2f} at start), "
        "all paths on the same pod in the same run.",
        "",
        "| exec round trip of `true` | p50 ms | p99 ms | n |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, key in (
        ("orchard, straight to the pod IP", "pod_ip"),
        ("API-server exec (kubernetes_asyncio websocket)", "api_server_exec"),
        ("`kubectl exec`", "kubectl_exec"),
    ):
        v = e[key]
        rows.append(f"| {name} | {v['p50_ms']:.2f} | {v['p99_ms']:.2f} | {v['n']} |")
    rows += [
        "",
        f"Pod IP vs API-server exec at p50: **{e['speedup_p50_vs_api_exec']:.0f}x** faster; "
        f"vs `kubectl exec`: **{e['speedup_p50_vs_kubectl']:.0f}x** (target ≥ 20x).",
        "",
        "| create to ready, N concurrent | wall s | phase p50 / max, ms since the create call | API writes per sandbox |",
        "| --- | ---: | --- | ---: |",
    ]
    for s in r["startup"]:
        phases = ", ".join(f"{k} {v['p50']:.0f} / {v['max']:.0f}" for k, v in s["phases_ms"].items() if k != "queued")
        rows.append(f"| N = {s['n']} | {s['wall_s']:.1f} | {phases} | {s['api_writes_per_sandbox']:.0f} |")
    return "\n".join(rows)


TABLES: dict[str, Callable[[dict[str, Any]], str]] = {"local": local, "k8s": k8s}


def main() -> None:
    readme = ROOT / "README.md"
    text = readme.read_text()
    for name, render in TABLES.items():
        path = RESULTS / f"{name}.json"
        if not path.exists():
            continue
        table = render(json.loads(path.read_text()))
        pattern = re.compile(rf"(<!-- perf:{name} -->\n).*?(<!-- /perf:{name} -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"README.md has no <!-- perf:{name} --> markers")
        text = pattern.sub(lambda m, table=table: m.group(1) + table + "\n" + m.group(2), text)
    readme.write_text(text)


if __name__ == "__main__":
    main()
