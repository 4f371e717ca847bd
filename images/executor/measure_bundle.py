"""Measure the injected executor against its budget: bundle size, start to ready, idle RSS.

    python3 images/executor/measure_bundle.py [--image orchard-executor:latest] [--starts 10]

Needs the Docker engine and the images of scripts/docker-setup.sh. Reports:

- bundle: the runtime directory's size on disk (budget 60 MB);
- start to ready: the runtime copied out of the injector image and started on
  this host, from spawn to the executor's ready line (budget 300 ms); and the
  same phase in a container, from the engine's start call to the first /healthz
  answer through the published port (the backend's ``started`` to
  ``executor_ready``);
- idle RSS: the executor's VmRSS as PID 1 of a busybox container, after 200
  execs and a second of idleness (budget 30 MB).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import io
import json
import os
import statistics
import subprocess
import tarfile
import tempfile
import time

import orchard
from orchard._backends.docker import Engine

MB = 1024 * 1024


async def _copy_runtime(image: str, dest: str) -> None:
    engine = Engine(None)
    try:
        created = json.loads(await engine.request("POST", "/containers/create", body={"Image": image}))
        try:
            raw = await engine.request("GET", f"/containers/{created['Id']}/archive", params={"path": "/orchard"})
        finally:
            await engine.remove(created["Id"])
    finally:
        await engine.close()
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        tar.extractall(dest)


def _disk_usage(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            st = os.lstat(os.path.join(root, name))
            total += st.st_blocks * 512
    return total


def _host_starts(runtime: str, starts: int) -> tuple[list[float], list[float]]:
    """Wall time and CPU time from spawn to the ready line, per start."""
    token_hash = hashlib.sha256(b"measure").hexdigest()
    times, cpu = [], []
    for i in range(starts):
        r, w = os.pipe()
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [
                f"{runtime}/lib/ld.so",
                "--library-path",
                f"{runtime}/lib",
                "--inhibit-cache",
                f"{runtime}/bin/python3",
                "-OO",
                "-m",
                "orchard_executor",
                "--host=127.0.0.1",
                "--port=0",
                f"--token-sha256={token_hash}",
                f"--ready-fd={w}",
                f"--state-dir={runtime}/../state-{i}",
            ],
            pass_fds=(w,),
            env={},
            cwd="/",
            stderr=subprocess.DEVNULL,
        )
        os.close(w)
        line = os.read(r, 4096)
        times.append(time.perf_counter() - t0)
        with open(f"/proc/{proc.pid}/schedstat") as f:
            cpu.append(int(f.read().split()[0]) / 1e9)  # on-CPU time: what a busy machine does not inflate
        os.close(r)
        proc.terminate()
        proc.wait()
        if not line:
            raise SystemExit("the executor exited before it was ready")
    return times, cpu


async def _in_container(starts: int) -> tuple[list[float], int]:
    phases, rss = [], 0
    async with orchard.Client("docker") as client:
        for i in range(starts):
            async with client.sandbox("orchard-test/busybox:latest") as sb:
                phases.append(sb.timings["executor_ready"] - sb.timings["started"])
                if i == 0:
                    for _ in range(200):
                        await sb.exec(["true"])
                    await asyncio.sleep(1.0)
                    status = (await sb.read_file("/proc/1/status")).decode()
                    rss = int(status.split("VmRSS:")[1].split()[0]) * 1024
    return phases, rss


def main() -> None:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image", default="orchard-executor:latest")
    parser.add_argument("--starts", type=int, default=10)
    parser.add_argument("--json", default=None, help="also write the figures as JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(_copy_runtime(args.image, tmp))
        runtime = os.path.join(tmp, "orchard")
        size = _disk_usage(runtime)
        host, cpu = _host_starts(runtime, args.starts)
    phases, rss = asyncio.run(_in_container(args.starts))
    print(f"bundle on disk:          {size / 1e6:.1f} MB ({size / MB:.1f} MiB)   budget 60 MB")
    print(
        f"start to ready (host):   p50 {statistics.median(host) * 1000:.0f} ms, max {max(host) * 1000:.0f} ms"
        f" (on-CPU p50 {statistics.median(cpu) * 1000:.0f} ms; load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)"
        "   budget 300 ms"
    )
    print(
        f"start to ready (docker): p50 {statistics.median(phases) * 1000:.0f} ms, max {max(phases) * 1000:.0f} ms"
        " (engine start call returned -> /healthz answered)"
    )
    print(f"idle RSS (PID 1):        {rss / MB:.1f} MiB ({rss / 1e6:.1f} MB)   budget 30 MB")
    if args.json:
        figures = {
            "machine": {"cpus": os.cpu_count(), "load": os.getloadavg()},
            "image": args.image,
            "bundle_mb": size / 1e6,
            "start_to_ready_host_ms": {"p50": statistics.median(host) * 1000, "max": max(host) * 1000},
            "start_to_ready_host_cpu_ms": {"p50": statistics.median(cpu) * 1000},
            "start_to_ready_docker_ms": {"p50": statistics.median(phases) * 1000, "max": max(phases) * 1000},
            "idle_rss_mb": rss / 1e6,
        }
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
