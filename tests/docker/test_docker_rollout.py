"""orchard.rollout on the docker backend: a task whose image does not exist fails as infrastructure, the rest runs."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from docker_support import BUSYBOX, containers

import orchard
import orchard.rollout
from orchard.tasks import Reward, Task

pytestmark = pytest.mark.docker


async def agent(sb: orchard.Sandbox, task: Task, *, attempt: int) -> str:
    return (await sb.exec(["cat", "/etc/hostname"])).stdout


async def reward(client: orchard.Client, task: Task, answer: Any) -> Reward:
    return Reward(value=1.0, solved=bool(answer))


async def test_a_missing_image_is_infra_and_the_run_goes_on(client: orchard.Client) -> None:
    tasks = [Task(id="missing", image="orchard-test/no-such-image:1"), Task(id="busybox", image=BUSYBOX)]
    results = await orchard.rollout.run(
        client,
        tasks,
        agent=agent,
        reward=reward,
        n=2,
        retries=1,
        sandbox={"image_pull_policy": "Never"},
        progress=False,
    )
    assert results.pass_rate == {"missing": None, "busybox": 1.0}
    for r in results.groups["missing"]:
        assert (r["kind"], r["reward"], r["tries"]) == ("infra_error", None, 2)
        assert [(f["phase"], f["error"], f["reason"]) for f in r["infra"]] == [
            ("start", "SandboxStartError", "ErrImageNeverPull")
        ] * 2
        assert "orchard-test/no-such-image:1" in r["error"]
    assert containers(f"orchard.dev/session={client.session_id}") == []


#: A rollout as a user runs one, as a script: attempts 0 and 1 of each task end at once; with STALL=1 the later
#: ones sleep in their containers until Ctrl-C. It prints its client's session id, to count its containers by.
SCRIPT = """
import asyncio, os, sys
import orchard, orchard.rollout
from orchard.tasks import Reward, Task

async def agent(sb, task, *, attempt):
    if attempt >= 2 and os.environ.get("STALL") == "1":
        await sb.exec("sleep 600", timeout=700)
    return (await sb.exec(["cat", "/etc/hostname"])).stdout

async def reward(client, task, answer):
    return Reward(value=1.0, solved=bool(answer))

async def main():
    async with orchard.Client("docker") as client:
        print(client.session_id, flush=True)
        tasks = [Task(id=f"t{i}", image=sys.argv[2]) for i in range(2)]
        results = await orchard.rollout.run(
            client, tasks, agent=agent, reward=reward, n=4, concurrency=4, out=sys.argv[1], progress=False
        )
        print(results.counts["ok"], flush=True)

asyncio.run(main())
"""


async def test_ctrl_c_deletes_the_containers_keeps_what_finished_and_the_run_resumes(tmp_path: Path) -> None:
    out = tmp_path / "run"
    script = tmp_path / "rollout.py"
    script.write_text(SCRIPT)
    results = out / "results.jsonl"
    run = subprocess.Popen(
        [sys.executable, str(script), str(out), BUSYBOX],
        env={**os.environ, "STALL": "1"},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert run.stdout is not None
        session = run.stdout.readline().strip()
        label = f"orchard.dev/session={session}"
        deadline = time.monotonic() + 90
        # Attempts 0 and 1 of both tasks ended (their sandboxes gone); attempts 2 and 3 sleep in 4 containers.
        while not (
            results.exists()
            and len(results.read_text().splitlines()) == 4
            and len([c for c in containers(label) if c["State"] == "running"]) >= 4
        ):
            assert run.poll() is None, "the run ended before Ctrl-C"
            assert time.monotonic() < deadline, "the stalled run did not get going"
            await asyncio.sleep(0.2)
        run.send_signal(signal.SIGINT)
        assert run.wait(timeout=60) != 0
    finally:
        run.kill()
        run.wait()
    assert containers(label) == []  # the in-flight containers were deleted
    first = [json.loads(line) for line in results.read_text().splitlines()]
    assert sorted((r["task"], r["attempt"], r["kind"]) for r in first) == [
        (t, a, "ok") for t in ("t0", "t1") for a in (0, 1)
    ]

    again = subprocess.run(
        [sys.executable, str(script), str(out), BUSYBOX], capture_output=True, text=True, timeout=300, check=True
    )
    assert again.stdout.split()[1] == "8"
    keys = [(r["task"], r["attempt"]) for r in map(json.loads, results.read_text().splitlines())]
    assert sorted(keys) == [(t, a) for t in ("t0", "t1") for a in range(4)]  # each attempt once
    assert containers(f"orchard.dev/session={again.stdout.split()[0]}") == []
