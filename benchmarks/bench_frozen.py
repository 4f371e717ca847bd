"""How long a call waits on a frozen executor before its typed error, with the Client's default deadlines.

README: "a frozen executor is caught within about 40 s" (``liveness_timeout=20``
of silence, then a ``/healthz`` probe that goes unanswered too). A local
sandbox (unisolated, so that its executor's pid is this host's) runs a call
with no deadline of its own, ``exec("sleep 600", timeout=None)``; the
executor is then frozen with SIGSTOP and the time to the call's
``SandboxTimeout`` is measured. The baseline, in the same run, is the same
call on a live executor whose command is killed: how soon a call ends when
the executor answers.

    python benchmarks/bench_frozen.py [--runs 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import sys
import tempfile
import time
import warnings
from typing import Any

import orchard
from orchard._rpc import LIVENESS_TIMEOUT, READ_TIMEOUT
from orchard.errors import SandboxTimeout, UnisolatedWarning


async def frozen(client: orchard.Client) -> float:
    """Seconds from freezing the executor under a call in flight to that call's SandboxTimeout."""
    async with client.sandbox() as sb:
        pid = (await sb.info()).pid
        call = asyncio.create_task(sb.exec("sleep 600", timeout=None))
        await asyncio.sleep(0.5)  # the command runs
        t0 = time.perf_counter()
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.wait_for(call, 300)
        except SandboxTimeout:
            return time.perf_counter() - t0
        finally:
            os.kill(pid, signal.SIGCONT)
        raise AssertionError("the call ended without SandboxTimeout")


async def answered(client: orchard.Client) -> float:
    """Seconds from killing the command under the same call to its result, the executor alive."""
    async with client.sandbox() as sb:
        call = asyncio.create_task(sb.exec("echo $$ > pid; exec sleep 600", timeout=None))
        while not await sb.exists("pid"):
            await asyncio.sleep(0.05)
        command = int((await sb.read_file("pid")).decode())
        t0 = time.perf_counter()
        os.kill(command, signal.SIGKILL)
        await asyncio.wait_for(call, 300)
        return time.perf_counter() - t0


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs must be 1 or more, not {args.runs}")
    warnings.simplefilter("ignore", UnisolatedWarning)
    caught, baseline = [], []
    with tempfile.TemporaryDirectory() as root:
        async with orchard.Client(orchard.LocalConfig(root=root, isolation="none")) as client:  # default deadlines
            for _ in range(args.runs):
                baseline.append(await answered(client))
                caught.append(await frozen(client))
    result: dict[str, Any] = {
        "read_timeout_s": READ_TIMEOUT,
        "liveness_timeout_s": LIVENESS_TIMEOUT,
        "frozen_to_typed_error_s": [round(s, 2) for s in caught],
        "answered_s": [round(s, 4) for s in baseline],
        "python": sys.version.split()[0],
        "machine": platform.machine(),
    }
    worst = max(caught)
    print(
        f"frozen executor, default deadlines (liveness_timeout={LIVENESS_TIMEOUT:g} s): SandboxTimeout after "
        + ", ".join(f"{s:.1f} s" for s in caught)
        + f" (worst {worst / LIVENESS_TIMEOUT:.2f}x liveness_timeout); a live executor answers in "
        + f"{max(baseline) * 1000:.0f} ms"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    asyncio.run(main())
