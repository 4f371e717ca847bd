"""Regenerate README's performance tables and the PNG plots from the JSON results.

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


def startup(r: dict[str, Any]) -> str:
    rows = [
        f"Measured by `python benchmarks/bench_startup.py` on the dev cluster ({machine(r)}); "
        "phases are ms since the create call; the runtime copied by an init container, then mounted as an "
        "image volume, in one session (N = 1: p50 / max of repeated starts, wall s their p50).",
        "",
        "| create to ready, N concurrent | runtime | wall s | phase p50 / max, ms | API writes per sandbox |",
        "| --- | --- | ---: | --- | ---: |",
    ]
    for s in r["startup"]:
        phases = ", ".join(f"{k} {v['p50']:.0f} / {v['max']:.0f}" for k, v in s["phases_ms"].items() if k != "queued")
        how = {"init-container": "init container copy", "image-volume": "image volume"}[
            s.get("injection", "init-container")
        ]
        rows.append(f"| N = {s['n']} | {how} | {s['wall_s']:.2f} | {phases} | {s['api_writes_per_sandbox']:.0f} |")
    return "\n".join(rows)


def machine(r: dict[str, Any]) -> str:
    m = r.get("machine", {})
    load = m.get("load_before") or m.get("load")
    return f"{m.get('cpus', '?')} cores" + (f", load average {load[0]:.2f} at start" if load else "")


def executor(r: dict[str, Any]) -> str:
    return "\n".join(
        [
            f"Measured by `python images/executor/measure_bundle.py` ({machine(r)}): the runtime the init "
            "container injects, started as PID 1 of a busybox container.",
            "",
            "| injected executor | measured | target |",
            "| --- | ---: | ---: |",
            f"| bundle on disk | {r['bundle_mb']:.1f} MB | ≤ 60 MB |",
            f"| start to ready, spawn to ready line, p50 / max | {r['start_to_ready_host_ms']['p50']:.0f} / "
            f"{r['start_to_ready_host_ms']['max']:.0f} ms | ≤ 300 ms |",
            f"| start to ready in a container, engine start to /healthz, p50 | "
            f"{r['start_to_ready_docker_ms']['p50']:.0f} ms | |",
            f"| idle RSS after 200 execs | {r['idle_rss_mb']:.1f} MB | ≤ 30 MB |",
        ]
    )


def _run_row(label: str, x: dict[str, Any]) -> str:
    p = x["phases_ms"]
    return (
        f"| {label} | {x['n']} | {x['success_rate'] * 100:.0f}% | {x['wall_s']:.1f} | {x['commands_per_s']:.0f} | "
        f"{p['create']['p50']:.0f} / {p['create']['p99']:.0f} | {p['command']['p50']:.1f} / {p['command']['p99']:.1f} | "
        f"{p['delete']['p50']:.0f} | {x['client_cpu_s']:.2f} | {x['client_peak_rss_mb']:.0f} | {x['left_over']} |"
    )


RUN_HEADER = [
    "| backend | N | success | wall s | commands/s | create p50 / p99 ms | command p50 / p99 ms | delete p50 ms "
    "| client CPU s | client peak RSS MB | left over |",
    "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
]


def lifecycle(r: dict[str, Any]) -> str:
    rows = [
        "Measured by `python benchmarks/run.py --only lifecycle` (`bench_lifecycle.py`): N sandboxes at once "
        "from one Client, each create, `python -c 'import sys; print(sys.version)'`, `ls /`, "
        "`cat /etc/os-release | head -1` twice, delete. Image `orchard-test/swe` (Debian with python3) on "
        "kubernetes and docker; the host itself on local. The largest N is as many as the node holds: its free pod slots, and memory for 64 MiB each.",
        "",
        *RUN_HEADER,
    ]
    for backend in ("kubernetes", "docker", "local"):
        rows += [_run_row(backend, x) for x in r.get(backend, [])]
    return "\n".join(rows)


def scale(r: dict[str, Any]) -> str:
    rows = [
        f"Measured by `python benchmarks/bench_scale.py` on up to {r['fake_nodes']} KWOK {r['kwok']} fake nodes "
        f"({r['pods_per_node']} pods each, as many as N needs) against "
        f"the dev cluster's real API server, scheduler and etcd ({machine(r)}); one real executor on this host "
        "answers at every fake pod IP and runs every command. Reference: 1,000 sandboxes through the same protocol "
        "in 26 s (154 commands/s).",
        "",
        *RUN_HEADER,
    ]
    rows += [_run_row("kubernetes (KWOK)", x) for x in r["runs"]]
    rows += [
        "",
        "| N | API requests, all clients | client's own: create / delete / other | CPU s: API server / KWOK / "
        "executor and its commands |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for x in r["runs"]:
        own = x["api_requests"]
        other = sum(v for k, v in own.items() if k not in ("create", "delete"))
        cpu = x["cpu_s"]
        rows.append(
            f"| {x['n']} | {x['apiserver_requests']['total']} | {own.get('create', 0)} / {own.get('delete', 0)} / "
            f"{other} | {cpu['apiserver']:.0f} / {cpu['kwok']:.0f} / {cpu['executor']:.0f} |"
        )
    return "\n".join(rows)


def healthz_poll(r: dict[str, Any]) -> str:
    rows = [
        "Client cost of waiting for executors, before and after polling `/healthz` less often once a start is "
        "slow (`benchmarks/results/healthz-poll.json`: the same protocol, old code then new, in one session):",
        "",
        "| backend | N | client CPU s, every 10 ms | client CPU s, 10 ms then up to 100 ms | wall s, before / after |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for backend, pair in r["runs"].items():
        for before, after in zip(pair["before"], pair["after"], strict=True):
            rows.append(
                f"| {backend} | {before['n']} | {before['client_cpu_s']:.1f} | {after['client_cpu_s']:.1f} | "
                f"{before['wall_s']:.1f} / {after['wall_s']:.1f} |"
            )
    return "\n".join(rows)


def _measured_by(name: str, m: dict[str, Any]) -> str:
    """The opening of a table's caption: the command, the cores and the load it ran at."""
    return (
        f"Measured by `python benchmarks/bench_{name}.py --json benchmarks/results/{name}.json` on {m['cpus']} "
        f"cores (load average {m['load_before'][0]:.1f} at start, {m['load_after'][0]:.1f} at the end): "
    )


def rollout(r: dict[str, Any]) -> str:
    rows = [
        _measured_by("rollout", r["machine"]) + "the six toy "
        "tasks x n attempts of `ScriptedPolicy(p_right=0.5)`, each graded by `swe_reward` in a second sandbox; n "
        "gives at least twice as many attempts as slots. Utilisation is the attempts' time in flight / (concurrency "
        "x wall).",
        "",
        "| backend | concurrency | attempts | wall s | attempts/s | utilisation | mean s: start / agent / reward |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for x in r["throughput"]:
        s = x["mean_s"]
        rows.append(
            f"| {x['backend']} | {x['concurrency']} | {x['attempts']} | {x['wall_s']:.0f} | "
            f"{x['attempts_per_s']:.2f} | {x['utilisation']:.2f} | "
            f"{s['start'] or 0:.2f} / {s['agent'] or 0:.2f} / {s['reward'] or 0:.2f} |"
        )
    a = r.get("adaptive")
    if a:
        rows += [
            "",
            f"`adaptive=True` against without, on the local backend ({a['tasks']} generic tasks x {a['n']}, solve "
            "rates spread as an RL pool's: 40% never solved, 20% always, 40% between; seeded):",
            "",
            f"| | attempts to reach {a['target_mixed_groups']} mixed groups | attempts run | mixed groups at the end "
            "| attempts in mixed groups |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for name in ("without", "adaptive"):
            x = a[name]
            rows.append(
                f"| {name} | {x['attempts_to_target']} | {x['attempts']} | {x['mixed_groups']} | "
                f"{x['attempts_in_mixed_groups']} |"
            )
    return "\n".join(rows)


def warm(r: dict[str, Any]) -> str:
    rows = [
        _measured_by("warm", r["machine"]) + "from "
        '`client.create` to the answer of `exec("true")`, one at a time with the pool full before each claim '
        "(cold and warm alternating), then a burst at once (the whole group answered). local runs under bubblewrap"
        + (", local-none unisolated." if any(x["backend"] == "local-none" for x in r["runs"]) else "."),
        "",
        "| backend | cold p50 / p99 ms | warm p50 / p99 ms | cold / warm p50 | burst at once: cold / warm s |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for x in r["runs"]:
        c, w = x["cold"], x["warm"]
        rows.append(
            f"| {x['backend']} | {c['p50_ms']:.1f} / {c['p99_ms']:.1f} | {w['p50_ms']:.1f} / {w['p99_ms']:.1f} | "
            f"{c['p50_ms'] / w['p50_ms']:.0f}x | {x['burst']}: {x['cold_burst_s']:.2f} / {x['warm_burst_s']:.2f} |"
        )
    shared = [x for x in r["runs"] if "shared" in x]
    if shared:
        rows += ["", "A pool shared across processes (`orchard pool keep`; a claim lists, patches and re-keys):", ""]
        for x in shared:
            c, s = x["cold"], x["shared"]
            rows.append(
                f"- {x['backend']}: shared p50 / p99 {s['p50_ms']:.1f} / {s['p99_ms']:.1f} ms "
                f"({c['p50_ms'] / s['p50_ms']:.0f}x faster than cold); {x['burst']} at once {x['shared_burst_s']:.2f} s"
            )
    fresh = [x for x in r["runs"] if "fresh" in x]
    if fresh:
        rows += [
            "",
            "Local cold starts are forks of the backend's fork server (`LocalConfig(fork=True)`, the default), "
            "against a fresh interpreter per sandbox (`fork=False`) measured in the same run:",
            "",
        ]
        for x in fresh:
            c, f = x["cold"], x["fresh"]
            rows.append(
                f"- {x['backend']}: fork=False p50 / p99 {f['p50_ms']:.1f} / {f['p99_ms']:.1f} ms, the fork server "
                f"{f['p50_ms'] / c['p50_ms']:.1f}x faster; {x['burst']} at once {x['fresh_burst_s']:.2f} s, "
                f"forked {x['cold_burst_s']:.2f} s"
            )
    for x in r["runs"]:
        if "tcp" in x:
            c, t = x["cold"], x["tcp"]
            rows += [
                "",
                f"{x['backend']} cold starts use the unix transport (the default: the executor on a socket in a "
                'bind-mounted directory, no network for `network=False`), against `transport="tcp"` (TLS to the '
                f"container on a bridge network) measured in the same run: tcp p50 / p99 {t['p50_ms']:.1f} / "
                f"{t['p99_ms']:.1f} ms, unix {t['p50_ms'] / c['p50_ms']:.1f}x faster; {x['burst']} at once "
                f"{x['tcp_burst_s']:.2f} s, unix {x['cold_burst_s']:.2f} s.",
            ]
    missed = sum(x["claims_missed"] for x in r["runs"])
    if missed:
        rows += ["", f"{missed} claims found the pool empty and started cold."]
    for x in r["runs"]:
        if "machine" in x:  # a backend measured in a later run of its own
            load = x["machine"]["load_before"][0]
            rows += ["", f"{x['backend']}: {x['note']} (`--backend {x['backend']}`, load average {load:.2f} at start)."]
    phased = [x for x in r["runs"] if x.get("cold_phases_ms")]
    if phased:
        rows += [
            "",
            "Where a cold start's time goes: when each step (`sb.timings`) ended, median ms from the create call:",
            "",
        ]
        rows += [
            f"- {x['backend']}: " + ", ".join(f"{k} {v:.0f}" for k, v in x["cold_phases_ms"].items()) for x in phased
        ]
    return "\n".join(rows)


def fork(r: dict[str, Any]) -> str:
    x0 = r["runs"][0]
    rows = [
        _measured_by("fork", r["machine"]) + "from `client.create` until the venv's Python imports "
        f"{', '.join(x0['packages'])}: a cold sandbox that does the setup (venv, pip install from uploaded wheels), "
        "one started cold with `restore=` the snapshot of a base that did it, and one claimed from a warm pool "
        "with `restore=` (alternating). local runs under bubblewrap.",
        "",
        "| backend | setup in the base s | snapshot MiB / s | cold + setup p50 s | cold + restore p50 s "
        "| warm + restore p50 s | setup / warm restore |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for x in r["runs"]:
        s, c, w = x["cold_setup"]["p50_s"], x["cold_restore"]["p50_s"], x["warm_restore"]["p50_s"]
        rows.append(
            f"| {x['backend']} | {x['base_setup_s']:.2f} | {x['snapshot_mib']:.1f} / {x['snapshot_s']:.2f} | "
            f"{s:.2f} | {c:.2f} | {w:.2f} | {s / w:.1f}x |"
        )
    return "\n".join(rows)


def chaos(r: dict[str, Any]) -> str:
    """bench_chaos.py: per fault window, what the sandboxes at work saw; then every file and pod accounted for."""
    t = r["totals"]
    rows = [
        _measured_by("chaos", r["machine"]) + f"{r['n']} busybox sandboxes at work from one Client "
        f"(`read_timeout={r['read_timeout_s']:g}`, `liveness_timeout={r['liveness_timeout_s']:g}`), each worker "
        "writing random bytes to a fresh file, running `echo ok` and now and then reading a file back, its sandbox "
        f"replaced every {r['lifetime_s']:g} s or so (all its files read back first) or when lost; every call under "
        f"an outer {r['outer_timeout_s']:g} s deadline (past it: hung). Faults fire one after another; a fault's "
        "window runs until the next one fires. Affected: sandboxes with a call that failed or took more than "
        f"{r['delayed_s']:g} s; recovered: those whose worker worked again after, in the same sandbox or a new one; "
        "back at work: seconds from the fault until the last worker it troubled worked again.",
        "",
        "| fault | fault s | calls ok / failed | slowest call s: work / create | creates | sandboxes affected | recovered | "
        "back at work s | typed errors | to typed error p50 / max s | hung | untyped | files lost | pods left |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for x in r["windows"]:
        if x["window"] in ("warm-up", "verify and close"):
            continue
        f = x["fault"]
        err = x["to_typed_error_s"]
        typed = ", ".join(f"{k} x{v}" for k, v in x["typed_errors"].items()) or "none"
        back = x["back_to_work_s"]
        rows.append(
            f"| {x['window']} | {_s(f.get('fault_s'))} | {x['calls_ok']} / {x['calls_failed']} | "
            f"{x['slowest_work_s']:.1f} / {x['slowest_create_s']:.1f} | {x['creates']} | {x['sandboxes_affected']} | {x['recovered_by_retry']} | "
            f"{_s(back)} | {typed} | {_s(err and err['p50'])} / {_s(err and err['max'])} | {x['hung']} | "
            f"{x['untyped']} | {x['files_lost']} | {x['pods_left_over']} |"
        )
    files = t["files"]
    ends = t["sandbox_ends"]
    rows += [
        "",
        f"In all: {t['calls']} calls, {t['hung']} hung, {t['untyped']} untyped errors; {t['sandboxes']} sandboxes "
        f"started, {ends.get('verified', 0)} read back whole, {ends.get('lost', 0)} reported lost "
        f"(`SandboxLost`), {ends.get('abandoned', 0)} given up without a report; {files.get('written', 0)} files "
        f"written, {files.get('verified', 0)} read back intact, **{t['files_lost']} lost** (a write that returned "
        f"but whose bytes were gone or different), {files.get('lost with a reported sandbox', 0)} gone with a "
        f"sandbox reported lost; {t['pods_left_over']} pods left once the Client closed.",
    ]
    killed = next((x["fault"].get("result") for x in r["windows"] if x["window"] == "SIGKILL a client"), None)
    if isinstance(killed, dict):
        rows[-1] += (
            f" Of the SIGKILLed client's {len(killed['started'])} pods, `collect_garbage` (what `orchard gc` runs) "
            f"deleted {len(killed['pods_collected'])} once its {killed['lease_s']} s Lease had expired; "
            f"{len(killed['pods_left_over'])} left."
        )
    if "rollout" in r:
        rows += ["", *_chaos_rollout(r["rollout"])]
    return "\n".join(rows)


def _chaos_rollout(r: dict[str, Any]) -> list[str]:
    """bench_chaos.py's rollout phase: what each fault cost the attempts, then every task accounted for."""
    t = r["totals"]
    rows = [
        f"The rollout runner under faults: `orchard.rollout.run` over {r['tasks']} toy tasks at `concurrency="
        f"{r['concurrency']}` (default `retries={r['retries']}`), each attempt a busybox sandbox made ready by a setup "
        f"command, an agent that runs {r['agent_steps']} short commands, writes its answer to a file and reads it "
        "back, and a reward that checks the answer in a sandbox of its own; the whole run under an outer "
        f"{r['outer_deadline_s']:g} s deadline (past it: hung). Failed tries: sandboxes that did not start (the "
        "agent's or the reward's) and calls of the agent or the reward that raised; back at work: seconds from the "
        "fault until an agent that started after it did all its work.",
        "",
        "| fault | fault s | attempts in flight | attempts ended: ok / ok after retries / infra_error | failed tries "
        "| back at work s |",
        "| --- | ---: | ---: | ---: | --- | ---: |",
    ]
    for x in r["windows"]:
        if x["window"] in ("baseline", "after the faults"):
            continue
        f, ended = x["fault"], x["attempts_ended"]
        failed = ", ".join(f"{k} x{v}" for k, v in x["tries_failed_by_type"].items()) or "none"
        rows.append(
            f"| {x['window']} | {_s(f.get('fault_s'))} | {x['attempts_in_flight']} | {ended.get('ok', 0)} / "
            f"{ended.get('ok after retries', 0)} / {ended.get('infra_error', 0)} | {failed} | "
            f"{_s(f.get('back_at_work_s'))} |"
        )
    infra = ", ".join(f"`{k}` x{v}" for k, v in t["infra_error_types"].items())
    rows += [
        "",
        f"Every task accounted for: {t['ok_first_try']} ok at the first try, {t['ok_after_retries']} ok after "
        f"retries, {t['infra_error']} `infra_error` in the end" + (f" ({infra})" if infra else "") + f", "
        f"**{t['agent_error']} `agent_error`** and {t['reward_error']} `reward_error` (a fault blamed on the agent "
        f"or the grader), {t['unsolved']} unsolved, {t['no_record']} without a record"
        + (f" ({', '.join(t['no_record_tasks'])})" if t["no_record"] else "")
        + f"; the run {'**hung**' if t['hung'] else 'finished'} in {r['wall_s']:.0f} s; "
        f"{t['pods_left_over']} pods left once the Client closed.",
    ]
    return rows


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def suite(r: dict[str, Any]) -> str:
    parts = ", ".join(f"{k} {v / 60:.1f}" for k, v in r.get("parts_s", {}).items())
    total = r["total_s"] if "total_s" in r else sum(r.get("parts_s", {}).values())
    return f"`scripts/bench` takes {total / 60:.0f} minutes on this machine (minutes per part, last measured: {parts})."


def _exec(r: dict[str, Any]) -> str:
    import bench_exec

    return str(bench_exec.markdown(r))


_GUI_PATHS = {
    "playwright_cdp_forward": "Playwright `page.screenshot()` / `mouse.click`, over CDP through `forward()`",
    "playwright_mouse_click": "Playwright `page.screenshot()` / `mouse.click`, over CDP through `forward()`",
    "desktop_executor_x11": "`Desktop.screenshot()` / `Desktop.click` (the executor's X11 client)",
    "desktop_click_executor_xtest": "`Desktop.screenshot()` / `Desktop.click` (the executor's X11 client)",
    "exec_scrot": "`exec` of `scrot` / `xdotool`",
    "exec_xdotool": "`exec` of `scrot` / `xdotool`",
    "reference_exec_curl": "reference: Playwright in the sandbox behind a server, `exec` of `curl`",
}


def gui(r: dict[str, Any]) -> str:
    """bench_gui.py on docker and kubernetes, and the dev node's capacity."""
    lines = []
    for run in r["runs"]:
        where = run["backend"] + (f" ({run['transport']})" if run.get("transport") else "")
        m = run["machine"]
        lines.append(
            f"**{where}**, load average {m['load_before'][0]:.1f} at start, {run['reps']} reps per path, "
            f"{run['ready']['starts']} starts per way, interleaved:"
        )
        lines.append("")
        lines.append("| 1280x800, p50 / p99 ms (x the reference's p50) | screenshot (PNG) | click round trip |")
        lines.append("| --- | ---: | ---: |")
        rows: dict[str, list[str]] = {}
        for section in ("screenshot_1280x800", "click_round_trip"):
            for key, v in run[section].items():
                label = _GUI_PATHS[key]
                cell = f"{v['p50_ms']:.1f} / {v['p99_ms']:.1f} (x{v['x_reference']:.2f})"
                rows.setdefault(label, []).append(cell)
        for label, cells in rows.items():
            lines.append(f"| {label} | {' | '.join(cells)} |")
        ready = run["ready"]
        lines.append("")
        lines.append(
            "| create to first screenshot, p50 ms | create | browser ready | goto + first screenshot | total |"
        )
        lines.append("| --- | ---: | ---: | ---: | ---: |")
        for key, label in (
            ("orchard", "`orchard.gui.browser`, Playwright's driver started for it"),
            ("orchard_driver_running", "`orchard.gui.browser` under `orchard.gui.playwright()`"),
            ("reference", "reference: a server in the sandbox starts Playwright and Chromium"),
        ):
            x = ready[key]
            lines.append(
                f"| {label} | {x['create_ms']:.0f} | {x['browser_ms']:.0f} | {x['first_screenshot_ms']:.0f} | "
                f"{x['total_ms']:.0f} |"
            )
        lines.append("")
        lines.append(
            f"Memory of the sandbox (cgroup rss + shmem): {run['memory_mib_headless_browser']:.0f} MiB with headless "
            f"Chromium and one page, {run['memory_mib_desktop_and_headed_browser']:.0f} MiB with Xvfb, openbox and "
            f"a headed Chromium; a desktop screenshot is {run['desktop_png_kib']:.0f} KiB."
        )
        lines.append("")
    c = r.get("capacity")
    if c:
        lines.append(
            f"**Capacity** ({c['backend']}, the dev node, 24 GiB): GUI sandboxes started one after another, each a "
            f"headless Chromium with the page open, until {c['stopped_because']}: **{c['held']}** held at once, "
            f"{c['answering']} of them answering at the end, {c['memory_mib_p50']:.0f} MiB each (p50; max "
            f"{c['memory_mib_max']:.0f}); available memory {c['available_gib_start']:.1f} GiB before, "
            f"{c['available_gib_full']:.1f} GiB full, {c['available_gib_after']:.1f} GiB after; "
            f"{c['left_over']} sandboxes left over after the client closed ({c['seconds']:.0f} s in all)."
        )
    return "\n".join(lines).rstrip()


TABLES: dict[str, Callable[[dict[str, Any]], str]] = {
    "local": local,
    "executor": executor,
    "exec": _exec,
    "startup": startup,
    "lifecycle": lifecycle,
    "scale": scale,
    "healthz-poll": healthz_poll,
    "rollout": rollout,
    "warm": warm,
    "fork": fork,
    "gui": gui,
    "chaos": chaos,
    "suite": suite,
}


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_lifecycle(r: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for backend in ("kubernetes", "docker", "local"):
        runs = r.get(backend, [])
        if not runs:
            continue
        ns = [x["n"] for x in runs]
        ax1.plot(ns, [x["wall_s"] for x in runs], marker="o", label=backend)
        ax2.plot(ns, [x["commands_per_s"] for x in runs], marker="o", label=backend)
    for ax, title in ((ax1, "wall time, s"), (ax2, "commands/s")):
        ax.set_xscale("log")
        ax.set_xlabel("sandboxes at once (N)")
        ax.set_title(f"lifecycle protocol: {title}")
        ax.grid(True, alpha=0.3)
        ax.legend()
    return [_save(fig, out / "lifecycle.png")]


def plot_scale(r: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    runs = r["runs"]
    ns = [x["n"] for x in runs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(ns, [x["wall_s"] for x in runs], marker="o", label="Orchard on KWOK (this machine)")
    ax1.plot([1000], [26], marker="*", markersize=12, linestyle="none", label="reference: 1,000 in 26 s")
    ax1.set_title("lifecycle protocol: wall time, s")
    ax2.plot(ns, [x["client_cpu_s"] for x in runs], marker="o", label="client CPU, s")
    ax2.plot(ns, [x["cpu_s"]["apiserver"] for x in runs], marker="o", label="API server CPU, s")
    ax2.plot(ns, [x["cpu_s"]["executor"] for x in runs], marker="o", label="executor + commands CPU, s")
    ax2.plot(ns, [x["client_peak_rss_mb"] for x in runs], marker="s", linestyle="--", label="client peak RSS, MB")
    ax2.set_title("cost against N")
    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("sandboxes at once (N)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return [_save(fig, out / "scale.png")]


def _plot_exec(r: dict[str, Any], out: Path) -> list[Path]:
    import bench_exec

    return list(bench_exec.plot(r, out))


PLOTS: dict[str, Callable[[dict[str, Any], Path], list[Path]]] = {
    "exec": _plot_exec,
    "lifecycle": plot_lifecycle,
    "scale": plot_scale,
}


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    for name, draw in PLOTS.items():
        path = RESULTS / f"{name}.json"
        if path.exists():
            for png in draw(json.loads(path.read_text()), RESULTS):
                print(f"wrote {png.relative_to(ROOT)}")
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
