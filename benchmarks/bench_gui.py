"""GUI environments: browser ready time, screenshots and actions through each path, memory, and capacity.

    python benchmarks/bench_gui.py [--backend docker|kubernetes] [--transport direct|port-forward] \
        [--reps 40] [--starts 5] [--json PATH]
    python benchmarks/bench_gui.py --capacity [--backend kubernetes] [--max 200] [--reserve-gib 2]

All in orchard-test/browser (Chromium 156, Xvfb, openbox), same run, a 1280x800 page served in the sandbox:

- ``ready``: sandbox create to the first screenshot of the page, with
  ``orchard.gui.browser`` (Playwright in the client over CDP through
  ``forward()``; its driver started for the browser, or already running
  under ``orchard.gui.playwright()``), against the reference's way: a server in the sandbox that
  runs Playwright and Chromium there, reached by ``exec`` of ``curl``
  (REFERENCE below, what the seed's browser recipe does).
- ``screenshot`` p50/p99 of 1280x800: Playwright ``page.screenshot()``
  through forward; ``Desktop.screenshot()`` (the executor reads the X display
  and encodes a PNG) of a headed Chromium showing the page; ``exec`` of
  ``scrot``; and the reference (exec + curl, Playwright in the sandbox).
- ``action`` round trip (a click): ``Desktop.click`` (XTEST from the
  executor), Playwright ``mouse.click`` through forward, ``exec`` of
  ``xdotool``, and the reference (exec + curl).
- ``memory``: the sandbox's cgroup (rss + shmem) with the browser and one page open.
- ``--capacity``: GUI sandboxes (a browser with the page open in each) started
  one after another until the node's available memory falls under
  ``--reserve-gib`` (or a start fails, or ``--max``); how many, each one's
  memory, and that every one was cleaned up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from _stats import pct

import orchard
import orchard.gui

IMAGE = "orchard-test/browser:latest"
SIZE = (1280, 800)
PAGE = (
    """<!doctype html><html><body style="margin:0;font:16px sans-serif">
<h1>Orchard shop</h1><input id="q" placeholder="search"><button id="go" onclick="window.n=(window.n||0)+1">Go</button>
<table>"""
    + "".join(f"<tr><td>item {i}</td><td>${i * 3 % 97}.99</td><td>in stock</td></tr>" for i in range(60))
    + """
</table></body></html>"""
)
#: The reference: Playwright and Chromium in the sandbox behind a small HTTP server, called through exec + curl.
REFERENCE = r"""
from http.server import BaseHTTPRequestHandler, HTTPServer
from urllib.parse import parse_qs, urlparse
from playwright.sync_api import sync_playwright
pw = sync_playwright().start()
browser = pw.chromium.launch(executable_path="/usr/lib/chromium/chromium",
                             args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
page = browser.new_page(viewport={"width": 1280, "height": 800})
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        u = urlparse(self.path); q = {k: v[0] for k, v in parse_qs(u.query).items()}
        body, kind = b"ok", "text/plain"
        if u.path == "/goto": page.goto(q["url"])
        elif u.path == "/screenshot": body, kind = page.screenshot(), "image/png"
        elif u.path == "/click": page.mouse.click(int(q["x"]), int(q["y"]))
        self.send_response(200); self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
server = HTTPServer(("127.0.0.1", 9000), H)
open("/tmp/reference.ready", "w").close()
server.serve_forever()
"""
SITE = "http://127.0.0.1:8000/index.html"


def config(backend: str, transport: str) -> orchard.DockerConfig | orchard.KubernetesConfig:
    if backend == "docker":
        return orchard.DockerConfig()
    kubeconfig = os.environ.get("KUBECONFIG", "/var/lib/orchard-devcluster/kubeconfig")
    namespace = os.environ.get("ORCHARD_BENCH_NAMESPACE", "orchard-bench")
    return orchard.KubernetesConfig(kubeconfig=kubeconfig, namespace=namespace, transport=transport)


async def serve_site(sb: orchard.Sandbox) -> None:
    await sb.write_file("/tmp/site/index.html", PAGE)
    await sb.start_process(["python3", "-m", "http.server", "8000", "--bind", "127.0.0.1", "--directory", "/tmp/site"])
    while (await sb.exec(["curl", "-sf", "-o", "/dev/null", SITE])).exit_code != 0:
        await asyncio.sleep(0.02)


async def curl(sb: orchard.Sandbox, path: str) -> bytes:
    r = await sb.exec(["curl", "-sf", f"http://127.0.0.1:9000{path}"], timeout=60)
    if r.exit_code != 0:
        raise RuntimeError(f"reference server: curl {path} exited {r.exit_code}: {r.stderr}")
    return r.stdout_bytes


async def start_reference(sb: orchard.Sandbox) -> orchard.Process:
    await sb.write_file("/tmp/reference.py", REFERENCE)
    process = await sb.start_process(["python3", "/tmp/reference.py"])
    while not await sb.exists("/tmp/reference.ready"):
        status = await process.status()
        if not status.running:
            raise RuntimeError(f"the reference server exited: {(await process.output('stderr')).decode()[-2000:]}")
        await asyncio.sleep(0.02)
    return process


async def timed(fn: Callable[[], Awaitable[Any]], reps: int) -> dict[str, float]:
    await fn()  # warm
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        await fn()
        times.append((time.perf_counter() - t) * 1000)
    return {"p50_ms": round(pct(times, 50), 2), "p99_ms": round(pct(times, 99), 2), "n": reps}


async def memory(sb: orchard.Sandbox) -> float:
    """The sandbox cgroup's rss + shmem in MiB (cgroup v1's memory.stat, or v2's memory.stat)."""
    for path in ("/sys/fs/cgroup/memory/memory.stat", "/sys/fs/cgroup/memory.stat"):
        if await sb.exists(path):
            stat = dict(line.split() for line in (await sb.read_file(path)).decode().splitlines())
            if "total_rss" in stat:
                return (int(stat["total_rss"]) + int(stat.get("total_shmem", 0))) / 2**20
            return (int(stat["anon"]) + int(stat.get("shmem", 0))) / 2**20
    raise RuntimeError("no cgroup memory.stat in the sandbox")


def phases(t0: float, created: float, served: float, opened: float, shot: float) -> dict[str, float]:
    """Milliseconds of each phase of a start; the total leaves out serving the site, which is the same either way."""
    return {
        "create_ms": (created - t0) * 1000,
        "site_ms": (served - created) * 1000,
        "browser_ms": (opened - served) * 1000,
        "first_screenshot_ms": (shot - opened) * 1000,
        "total_ms": (shot - t0) * 1000 - (served - created) * 1000,
    }


async def ready_orchard(client: orchard.Client) -> dict[str, float]:
    t0 = time.perf_counter()
    async with client.sandbox(IMAGE) as sb:
        created = time.perf_counter()
        await serve_site(sb)
        served = time.perf_counter()
        async with orchard.gui.browser(sb, size=SIZE) as page:
            opened = time.perf_counter()
            await page.goto(SITE)
            await page.screenshot()
            shot = time.perf_counter()
    return phases(t0, created, served, opened, shot)


async def ready_reference(client: orchard.Client) -> dict[str, float]:
    t0 = time.perf_counter()
    async with client.sandbox(IMAGE) as sb:
        created = time.perf_counter()
        await serve_site(sb)
        served = time.perf_counter()
        await start_reference(sb)
        opened = time.perf_counter()
        await curl(sb, f"/goto?url={SITE}")
        await curl(sb, "/screenshot")
        shot = time.perf_counter()
    return phases(t0, created, served, opened, shot)


def summary(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(pct([r[k] for r in runs], 50), 1) for k in runs[0]}


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"backend": args.backend, "reps": args.reps}
    if args.backend == "kubernetes":
        results["transport"] = args.transport
    async with orchard.Client(config(args.backend, args.transport)) as client:
        # Interleaved, so both ways see the same machine.
        ours, warm, theirs = [], [], []
        for _ in range(args.starts):
            ours.append(await ready_orchard(client))
            async with orchard.gui.playwright():  # Playwright's driver already running, as in a rollout worker
                warm.append(await ready_orchard(client))
            theirs.append(await ready_reference(client))
        results["ready"] = {
            "orchard": summary(ours),
            "orchard_driver_running": summary(warm),
            "reference": summary(theirs),
            "starts": args.starts,
        }
        print("ready (create to first screenshot, p50):", json.dumps(results["ready"]), flush=True)

        async with client.sandbox(IMAGE) as sb:
            await serve_site(sb)
            shots: dict[str, Any] = {}
            actions: dict[str, Any] = {}
            async with orchard.gui.browser(sb, size=SIZE) as page:
                await page.goto(SITE)
                results["memory_mib_headless_browser"] = round(await memory(sb), 1)
                # Both browsers run while either is measured.
                reference = await start_reference(sb)
                await curl(sb, f"/goto?url={SITE}")
                shots["playwright_cdp_forward"] = await timed(page.screenshot, args.reps)
                actions["playwright_mouse_click"] = await timed(lambda: page.mouse.click(300, 60), args.reps)
                shots["reference_exec_curl"] = await timed(lambda: curl(sb, "/screenshot"), args.reps)
                actions["reference_exec_curl"] = await timed(lambda: curl(sb, "/click?x=300&y=60"), args.reps)
            await reference.kill()
            async with (
                orchard.gui.desktop(sb, size=SIZE) as d,
                orchard.gui.browser(sb, display=d.display, size=SIZE) as page,
            ):
                await page.goto(SITE)
                results["memory_mib_desktop_and_headed_browser"] = round(await memory(sb), 1)
                env = {"DISPLAY": d.display}
                shots["desktop_executor_x11"] = await timed(d.screenshot, args.reps)
                shots["exec_scrot"] = await timed(
                    lambda: sb.exec(["sh", "-c", "scrot -o /tmp/s.png && cat /tmp/s.png"], env=env), args.reps
                )
                actions["desktop_click_executor_xtest"] = await timed(lambda: d.click(300, 150), args.reps)
                actions["exec_xdotool"] = await timed(
                    lambda: sb.exec(["xdotool", "mousemove", "300", "150", "click", "--delay", "0", "1"], env=env),
                    args.reps,
                )
                png = await d.screenshot()
                results["desktop_png_kib"] = round(len(png) / 1024, 1)
    base_shot = shots["reference_exec_curl"]["p50_ms"]
    base_act = actions["reference_exec_curl"]["p50_ms"]
    for v in shots.values():
        v["x_reference"] = round(v["p50_ms"] / base_shot, 3)
    for v in actions.values():
        v["x_reference"] = round(v["p50_ms"] / base_act, 3)
    results["screenshot_1280x800"] = shots
    results["click_round_trip"] = actions
    return results


async def capacity(args: argparse.Namespace) -> dict[str, Any]:
    """Browser sandboxes until the node's memory is nearly used; then every one is deleted."""

    def available_gib() -> float:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) for line in f}
        return info["MemAvailable"] / 2**20

    held: list[tuple[orchard.Sandbox, Any]] = []
    per: list[float] = []
    low = available_gib()
    stop = "max"
    t0 = time.perf_counter()
    start_available = available_gib()
    async with orchard.Client(config(args.backend, args.transport)) as client:
        try:
            while len(held) < args.max:
                low = available_gib()
                if low < args.reserve_gib:
                    stop = f"available memory under {args.reserve_gib} GiB"
                    break
                try:
                    sb = await client.create(IMAGE, start_timeout=180)
                    await serve_site(sb)
                    browser = orchard.gui.browser(sb, size=SIZE)
                    page = await browser.__aenter__()
                    await page.goto(SITE)
                    await page.screenshot()
                except orchard.OrchardError as exc:
                    stop = f"a start failed: {type(exc).__name__}: {str(exc)[:200]}"
                    break
                held.append((sb, browser))
                per.append(await memory(sb))
                if len(held) % 10 == 0:
                    print(f"{len(held)} GUI sandboxes, {available_gib():.1f} GiB available", flush=True)
            # Every one still answers a screenshot.
            alive = 0
            for sb, _browser in held:
                shot = await sb.exec(["curl", "-sf", "-o", "/dev/null", SITE])
                alive += shot.exit_code == 0
        finally:
            held_n = len(held)
            low = min(low, available_gib())
            for _sb, browser in held:
                await browser.__aexit__(None, None, None)
    end_available = available_gib()
    left = await _left_over(args)
    return {
        "backend": args.backend,
        "held": held_n,
        "answering": alive,
        "stopped_because": stop,
        "memory_mib_p50": round(pct(per, 50), 1) if per else None,
        "memory_mib_max": round(max(per), 1) if per else None,
        "available_gib_start": round(start_available, 1),
        "available_gib_full": round(low, 1),
        "available_gib_after": round(end_available, 1),
        "seconds": round(time.perf_counter() - t0, 1),
        "left_over": left,
    }


async def _left_over(args: argparse.Namespace) -> int:
    """Sandboxes of this benchmark still there after the client closed (containers or pods)."""
    await asyncio.sleep(2)
    if args.backend == "docker":
        proc = await asyncio.create_subprocess_exec(
            "docker",
            "ps",
            "-aq",
            "--filter",
            "label=app.kubernetes.io/managed-by=orchard",
            stdout=asyncio.subprocess.PIPE,
        )
    else:
        proc = await asyncio.create_subprocess_exec(
            "kubectl",
            "--kubeconfig",
            os.environ.get("KUBECONFIG", "/var/lib/orchard-devcluster/kubeconfig"),
            "get",
            "pods",
            "-A",
            "-l",
            "app.kubernetes.io/managed-by=orchard",
            "-o",
            "name",
            stdout=asyncio.subprocess.PIPE,
        )
    out, _ = await proc.communicate()
    return len(out.split())


async def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.backend == "kubernetes":
        from bench_rollout import ensure_namespace  # this script's directory is on sys.path

        await ensure_namespace(os.environ.get("ORCHARD_BENCH_NAMESPACE", "orchard-bench"))
    return await (capacity(args) if args.capacity else measure(args))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["docker", "kubernetes"], default="docker")
    p.add_argument("--transport", choices=["direct", "port-forward"], default="direct")
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--starts", type=int, default=5)
    p.add_argument("--capacity", action="store_true")
    p.add_argument("--max", type=int, default=200)
    p.add_argument("--reserve-gib", type=float, default=2.0)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    load = os.getloadavg()
    results = asyncio.run(run(args))
    results["machine"] = {"cpus": os.cpu_count(), "load_before": load, "load_after": os.getloadavg()}
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
