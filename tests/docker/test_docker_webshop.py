"""The web shop example (examples/webshop) on docker: real Chromium in orchard-test/browser, real clicks.

Each attempt is a container from the browser image with the shop started in
it; the scripted shopper drives Chromium there through ``orchard.gui.browser``
and the reward grades the shop's own state (/api/state), read inside the
sandbox. The right script must score 1 on every task and the wrong one 0,
with the task's ``check`` command, run in the live sandbox, agreeing.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
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


@pytest.fixture
def shop_url() -> Iterator[str]:
    # The shop on this machine, in a thread: its pages and state without a sandbox.
    server = shop.make_server(0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _post(url: str, **form: str) -> tuple[int, str]:
    # The shop's forms answer 303 to the next page; urllib follows it with a GET.
    data = urllib.parse.urlencode(form).encode()
    try:
        with urllib.request.urlopen(url, data=data, timeout=10) as reply:
            return reply.status, reply.url
    except urllib.error.HTTPError as exc:
        return exc.code, url


def _state(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/api/state", timeout=10) as reply:
        state: dict[str, Any] = json.load(reply)
    return state


@pytest.mark.unit
def test_the_shop_s_state_follows_its_forms_and_refuses_bad_ones(shop_url: str) -> None:
    assert _post(f"{shop_url}/cart/add", product_id="mug-navy", quantity="2") == (200, f"{shop_url}/cart")
    assert _post(f"{shop_url}/cart/add", product_id="mug-navy", quantity="1")[0] == 200
    assert _post(f"{shop_url}/cart/add", product_id="tee-heavy", quantity="1")[0] == 200
    for bad in ({"product_id": "no-such", "quantity": "1"}, {"product_id": "mug-navy", "quantity": "0"}):
        assert _post(f"{shop_url}/cart/add", **bad)[0] == 400
    state = _state(shop_url)
    assert [(i["id"], i["qty"]) for i in state["cart"]] == [("mug-navy", 3), ("tee-heavy", 1)]
    assert state["cart_total"] == 60.0
    assert _post(f"{shop_url}/cart/remove", product_id="tee-heavy")[0] == 200
    assert _post(f"{shop_url}/checkout", name=" ", address="1 Way")[0] == 400  # no name: no order
    assert _state(shop_url)["orders"] == []
    assert _post(f"{shop_url}/checkout", name="Ada", address="1 Way") == (200, f"{shop_url}/order/1")
    state = _state(shop_url)
    assert state["cart"] == []
    assert state["orders"] == [
        {
            "id": 1,
            "name": "Ada",
            "address": "1 Way",
            "items": [{"id": "mug-navy", "name": "Navy Stoneware Mug", "price": 12.0, "qty": 3}],
            "total": 36.0,
        }
    ]
    assert shop.check_state({"order": {"name": "Ada", "items": {"mug-navy": 3}}}, state) == (
        True,
        "the shop's state meets the goal",
    )
    assert shop.check_state({"cart": {"mug-navy": 3}}, state) == (False, "the cart holds nothing, not {'mug-navy': 3}")
    with urllib.request.urlopen(f"{shop_url}/search?q=blue+mug&sort=price-asc", timeout=10) as reply:
        page = reply.read().decode()
    assert re.findall(r'data-testid="result" data-product-id="([^"]+)"', page) == ["mug-cobalt", "mug-navy", "mug-sky"]
