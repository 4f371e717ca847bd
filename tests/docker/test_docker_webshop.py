"""The web shop example (examples/webshop) on docker: real Chromium in orchard-test/browser, real clicks.

Each attempt is a container from the browser image with the shop started in
it; the scripted shopper drives Chromium there through ``orchard.gui.browser``
and the reward grades the shop's own state (/api/state), read inside the
sandbox. The right script must score 1 on every task and the wrong one 0,
with the task's ``check`` command, run in the live sandbox, agreeing.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest
from docker_support import containers, engine

import orchard
import orchard.rollout
from orchard.tasks import Task

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import webshop  # noqa: E402
from webshop import shop  # noqa: E402

IMAGE = "orchard-test/browser:latest"

#: What the wrong script leaves, as the reward's reason says it.
WRONG = {
    "cheapest-blue-mug": "the cart holds {'mug-ember': 2}, not {'mug-cobalt': 2}",
    "lamp-under-40": "the order holds {'lamp-halo': 1}, not {'lamp-arc': 1}",
    "cheaper-tee": "the cart holds {'tee-heavy': 1}, not {'tee-cotton': 1}",
    "two-cheapest-notebooks": "the order holds {'note-lined': 1}, not {'note-lined': 1, 'note-dot': 1}",
    "backpack-16-inch": "the cart holds {'bag-trail': 1}, not {'bag-metro': 1}",
}


@pytest.mark.unit
def test_each_goal_is_what_its_instruction_asks() -> None:
    # The goals in tasks.jsonl, worked out again from the catalogue.
    def cents(p: shop.Product) -> int:
        return p.cents

    mug = min(shop.search("blue mug"), key=cents)
    lamp = max((p for p in shop.search("desk lamp") if p.cents < 4000), key=lambda p: p.rating)
    tee = min(shop.search("red t-shirt") + shop.search("black t-shirt"), key=cents)
    notebooks = sorted(shop.search("notebook"), key=cents)[:2]
    (backpack,) = [p for p in shop.CATALOGUE if p.category == "backpack" and "16-inch" in p.description]
    assert {t.id: webshop.goal_of(t) for t in webshop.load_tasks()} == {
        "cheapest-blue-mug": {"cart": {mug.id: 2}},
        "lamp-under-40": {"order": {"name": "Ada Lovelace", "items": {lamp.id: 1}}},
        "cheaper-tee": {"cart": {tee.id: 1}},
        "two-cheapest-notebooks": {"order": {"name": "Grace Hopper", "items": {p.id: 1 for p in notebooks}}},
        "backpack-16-inch": {"cart": {backpack.id: 1}},
    }
    assert len(shop.CATALOGUE) == 25


@pytest.mark.docker
@pytest.mark.timeout(300)
async def test_right_scripts_score_1_and_wrong_ones_0(client: orchard.Client, tmp_path: Path) -> None:
    if engine("GET", f"/images/{IMAGE}/json")[0] != 200:
        pytest.fail(f"{IMAGE} is missing: run scripts/docker-setup.sh", pytrace=False)
    todo = webshop.load_tasks()
    right = webshop.ScriptedShopper(p_right=1.0, shots=tmp_path / "shots")
    wrong = webshop.ScriptedShopper(p_right=0.0, shots=tmp_path / "shots")

    async def agent(sb: orchard.Sandbox, task: Task, *, attempt: int) -> dict[str, Any]:
        # Attempt 0 follows the right script, attempt 1 the wrong one; then the task's own check runs in the
        # live sandbox, against the shop the browser used.
        answer = await (right if attempt == 0 else wrong)(sb, task, attempt=attempt)
        check = await sb.exec(task.check or "false", timeout=30)
        answer["check"] = {"exit_code": check.exit_code, "output": check.stdout.strip()}
        return answer

    t0 = time.monotonic()
    results = await orchard.rollout.run(
        client, todo, agent=agent, reward=webshop.reward, n=2, concurrency=5, out=tmp_path / "run", progress=False
    )
    took = time.monotonic() - t0
    records = {(r["task"], r["attempt"]): r for r in results.records}
    for task in todo:
        good, bad = records[(task.id, 0)], records[(task.id, 1)]
        assert (good["kind"], good["reward"], good["reason"]) == ("ok", 1.0, None), good["error"]
        assert good["answer"]["check"] == {"exit_code": 0, "output": "the shop's state meets the goal"}
        assert (bad["kind"], bad["reward"], bad["reason"]) == ("ok", 0.0, WRONG[task.id]), bad["error"]
        assert bad["answer"]["check"] == {"exit_code": 1, "output": WRONG[task.id]}
        for record in (good, bad):
            shots = [Path(p) for p in record["answer"]["screenshots"]]
            assert len(shots) == len(record["answer"]["steps"]) >= 3
            assert all(p.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") for p in shots)
    assert results.pass_rate == {t.id: 0.5 for t in todo}
    assert containers(f"orchard.dev/session={client.session_id}") == []
    print(f"webshop: 10 attempts in {took:.1f} s")
