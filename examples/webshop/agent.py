"""A scripted agent for the shop's tasks: Playwright on Chromium in the sandbox, a screenshot after each step."""

from __future__ import annotations

import random
import re
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orchard
from orchard.tasks import Task

from .env import URL, read_state, start_site

if TYPE_CHECKING:
    from playwright.async_api import Page

_ROWS = "rows => rows.map(r => ({id: r.dataset.productId, price: Number(r.dataset.price)}))"


class Steps:
    """What an episode did: a name and a screenshot (PNG bytes) per step."""

    def __init__(self, page: Page) -> None:
        self.page = page
        self.names: list[str] = []
        self.images: list[bytes] = []

    async def __call__(self, name: str) -> None:
        self.names.append(name)
        self.images.append(await self.page.screenshot())


async def _search(page: Page, step: Steps, query: str, sort: str = "relevance") -> list[dict[str, Any]]:
    """Search from the home page; the results, in the page's order, as ``{"id", "price"}``."""
    await page.goto(f"{URL}/")
    await page.get_by_test_id("search-input").fill(query)
    await page.get_by_test_id("sort").select_option(sort)
    await step(f"search {query!r}, {sort}")
    await page.get_by_test_id("search-button").click()
    await page.wait_for_url(re.compile(r"/search\?"))
    rows: list[dict[str, Any]] = await page.get_by_test_id("result").evaluate_all(_ROWS)
    await step(f"{len(rows)} results")
    return rows


async def _add(page: Page, step: Steps, product_id: str, quantity: int = 1) -> None:
    """From a result list: open the product's page and add ``quantity`` to the cart."""
    row = page.locator(f'[data-testid="result"][data-product-id="{product_id}"]')
    await row.get_by_test_id("product-link").click()
    await page.wait_for_url(re.compile(r"/product/"))
    await page.get_by_test_id("quantity").fill(str(quantity))
    await step(f"add {quantity} x {product_id}")
    await page.get_by_test_id("add-to-cart").click()
    await page.wait_for_url(re.compile(r"/cart$"))
    await step("cart")


async def _remove(page: Page, step: Steps, product_id: str) -> None:
    """On the cart page: remove one line."""
    row = page.locator(f'[data-testid="cart-item"][data-product-id="{product_id}"]')
    await row.get_by_test_id("remove").click()
    await row.wait_for(state="detached")  # the form posts back to /cart: the same URL, without the row
    await step(f"removed {product_id}")


async def _checkout(page: Page, step: Steps, name: str, address: str) -> None:
    """From any page: the cart, the checkout form, the order."""
    await page.get_by_test_id("cart-link").click()
    await page.wait_for_url(re.compile(r"/cart$"))
    await page.get_by_test_id("checkout-link").click()
    await page.wait_for_url(re.compile(r"/checkout$"))
    await page.get_by_test_id("name").fill(name)
    await page.get_by_test_id("address").fill(address)
    await step("checkout")
    await page.get_by_test_id("place-order").click()
    await page.wait_for_url(re.compile(r"/order/\d+$"))
    await step("order placed")


# One script per task. ``right=False`` makes the mistake a hasty shopper would.


async def _cheapest_blue_mug(page: Page, step: Steps, right: bool) -> None:
    # Wrong: the cheapest mug of any colour.
    rows = await _search(page, step, "blue mug" if right else "mug", "price-asc")
    await _add(page, step, rows[0]["id"], 2)


async def _lamp_under_40(page: Page, step: Steps, right: bool) -> None:
    # Wrong: the highest-rated lamp, over the budget.
    rows = await _search(page, step, "desk lamp", "rating-desc")
    pick = next(r for r in rows if r["price"] < 40) if right else rows[0]
    await _add(page, step, pick["id"])
    await _checkout(page, step, "Ada Lovelace", "12 Analytical Way, London")


async def _cheaper_tee(page: Page, step: Steps, right: bool) -> None:
    for colour in ("red", "black"):
        rows = await _search(page, step, f"{colour} t-shirt")
        await _add(page, step, rows[0]["id"])
    lines = await page.get_by_test_id("cart-item").evaluate_all(_ROWS)
    # Wrong: removes the cheaper one.
    pick = (max if right else min)(lines, key=lambda r: r["price"])
    await _remove(page, step, pick["id"])


async def _two_cheapest_notebooks(page: Page, step: Steps, right: bool) -> None:
    rows = await _search(page, step, "notebook", "price-asc")
    await _add(page, step, rows[0]["id"])
    if right:  # wrong: buys only the cheapest
        await _search(page, step, "notebook", "price-asc")
        await _add(page, step, rows[1]["id"])
    await _checkout(page, step, "Grace Hopper", "1 Compiler Lane, Arlington")


async def _backpack_16_inch(page: Page, step: Steps, right: bool) -> None:
    # Wrong: the first backpack with a laptop sleeve, which fits 15 inches.
    rows = await _search(page, step, "backpack 16-inch" if right else "backpack laptop")
    await _add(page, step, rows[0]["id"])


SCRIPTS: dict[str, Callable[[Page, Steps, bool], Awaitable[None]]] = {
    "cheapest-blue-mug": _cheapest_blue_mug,
    "lamp-under-40": _lamp_under_40,
    "cheaper-tee": _cheaper_tee,
    "two-cheapest-notebooks": _two_cheapest_notebooks,
    "backpack-16-inch": _backpack_16_inch,
}


class ScriptedShopper:
    """An agent for the shop's tasks that needs no model: ``await agent(sandbox, task, attempt=i)``.

    Each attempt starts the shop in the sandbox, opens Chromium there
    (``orchard.gui.browser``) and clicks through the task's script, right or
    with a plausible mistake, taking a screenshot after each step. The
    choice is a draw seeded by ``(seed, task.id, attempt)``, as
    ``orchard.tasks.ScriptedPolicy``'s is, so ``chooses_right`` tells it in
    advance. Then the episode reads the shop's state (/api/state) from inside
    the sandbox, before it closes: that is what ``reward`` grades.

    The answer is ``{"state", "right", "steps", "screenshots"}``: the shop's
    state, the draw, the step names and, with ``shots``, the PNG files'
    paths (``shots/<task>/<attempt>/NN.png``). The PNG bytes are also kept in
    ``self.screenshots[(task_id, attempt)]``.

    Args:
        p_right: the probability of the right script.
        seed: the run's seed.
        shots: a directory for the screenshots, or None to keep them in memory only.
        size: the browser's viewport, which is the screenshots' size.
    """

    def __init__(
        self,
        p_right: float = 1.0,
        seed: int = 0,
        shots: str | Path | None = None,
        size: tuple[int, int] = (800, 520),
    ) -> None:
        if not 0.0 <= p_right <= 1.0:
            raise ValueError(f"p_right={p_right!r}: a probability is a number from 0 to 1")
        self.p_right = p_right
        self.seed = seed
        self.shots = Path(shots) if shots is not None else None
        self.size = size
        self.screenshots: dict[tuple[str, int], list[bytes]] = {}

    def __repr__(self) -> str:
        return f"ScriptedShopper(p_right={self.p_right!r}, seed={self.seed!r})"

    def chooses_right(self, task: Task, attempt: int = 0) -> bool:
        """Whether attempt ``attempt`` of ``task`` follows the right script."""
        return random.Random(f"{self.seed}:{task.id}:{attempt}").random() < self.p_right

    async def __call__(self, sb: orchard.Sandbox, task: Task, *, attempt: int = 0) -> dict[str, Any]:
        """Run one episode of ``task`` in ``sb``; the answer holds the shop's end state."""
        from orchard import gui

        right = self.chooses_right(task, attempt)
        await start_site(sb)
        async with gui.browser(sb, size=self.size) as page:
            step = Steps(page)
            self.screenshots[(task.id, attempt)] = step.images  # kept as they come, so a failed episode shows its steps
            await SCRIPTS[task.id](page, step, right)
        state = await read_state(sb)
        return {"state": state, "right": right, "steps": step.names, "screenshots": self._save(task, attempt, step)}

    def _save(self, task: Task, attempt: int, step: Steps) -> list[str]:
        if self.shots is None:
            return []
        where = self.shots / task.id / str(attempt)
        shutil.rmtree(where, ignore_errors=True)  # a retried attempt's earlier try
        where.mkdir(parents=True)
        paths = []
        for i, png in enumerate(step.images):
            path = where / f"{i:02d}.png"
            path.write_bytes(png)
            paths.append(str(path))
        return paths
