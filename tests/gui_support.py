"""GUI tests shared by the docker and kubernetes tiers: real Chromium, Xvfb, openbox and xterm in
orchard-test/browser, driven from the client (Playwright over CDP; the executor's X11 client)."""

from __future__ import annotations

import asyncio
import io
import textwrap
import time
from collections.abc import Awaitable, Callable

from PIL import Image

import orchard
import orchard.gui
from orchard_executor.protocol import KeyEvent

BROWSER = "orchard-test/browser:latest"
#: The page the tests load from a server in the sandbox: a text box at the top, a big blue button
#: under it that turns red and counts its clicks, and 3000 px of page below to scroll.
PAGE = textwrap.dedent(
    """\
    <!doctype html>
    <html><body style="margin:0;background:#fff">
    <input id="box" style="position:absolute;left:10px;top:10px;width:600px;font-size:24px">
    <button id="big" style="position:absolute;left:0;top:150px;width:100%;height:650px;border:0;background:rgb(0,0,255)"
      onclick="this.style.background='rgb(255,0,0)';window.clicks=(window.clicks||0)+1">press</button>
    <div style="position:absolute;top:800px;height:3000px;width:10px"></div>
    </body></html>
    """
)
SIZE = (1280, 800)


def pixel(png: bytes, x: int, y: int) -> tuple[int, int, int]:
    """The RGB colour at (x, y) of a PNG."""
    with Image.open(io.BytesIO(png)) as im:
        assert im.size == SIZE, im.size
        r, g, b = im.convert("RGB").getpixel((x, y))  # type: ignore[misc]
        return r, g, b


def differing(a: bytes, b: bytes, box: tuple[int, int, int, int]) -> int:
    """How many pixels of ``box`` (left, top, right, bottom) differ between two PNGs."""
    with Image.open(io.BytesIO(a)) as ia, Image.open(io.BytesIO(b)) as ib:
        pa, pb = ia.convert("RGB").crop(box).tobytes(), ib.convert("RGB").crop(box).tobytes()
    return sum(pa[i : i + 3] != pb[i : i + 3] for i in range(0, len(pa), 3))


async def serve_page(sb: orchard.Sandbox) -> str:
    """Serve PAGE from 127.0.0.1:8000 in the sandbox; the URL, once it answers."""
    await sb.write_file("/tmp/site/index.html", PAGE)
    await sb.start_process(["python3", "-m", "http.server", "8000", "--bind", "127.0.0.1", "--directory", "/tmp/site"])
    url = "http://127.0.0.1:8000/index.html"
    for _ in range(200):
        if (await sb.exec(["curl", "-sf", "-o", "/dev/null", url])).exit_code == 0:
            return url
        await asyncio.sleep(0.05)
    raise AssertionError("the site in the sandbox never answered")


async def until(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 60.0) -> None:
    """Poll ``check`` until it holds (a GUI shows a change when it has painted its next frame)."""
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g}s")
        await asyncio.sleep(0.02)


def is_blue(rgb: tuple[int, int, int]) -> bool:
    return rgb[2] > 200 and rgb[0] < 60 and rgb[1] < 60


def is_red(rgb: tuple[int, int, int]) -> bool:
    return rgb[0] > 200 and rgb[1] < 60 and rgb[2] < 60


async def browser_navigates_clicks_and_screenshots(sb: orchard.Sandbox) -> None:
    """Playwright, in the client, drives Chromium in the sandbox on a site served there."""
    url = await serve_page(sb)
    async with orchard.gui.browser(sb, size=SIZE) as page:
        await page.goto(url)
        before = await page.screenshot()
        assert is_blue(pixel(before, 640, 500))
        await page.click("#big")
        await page.fill("#box", "typed through CDP")
        after = await page.screenshot()
        assert is_red(pixel(after, 640, 500)), pixel(after, 640, 500)
        assert await page.evaluate("window.clicks") == 1
        assert await page.input_value("#box") == "typed through CDP"
        # The page really is in the sandbox: the browser sees the sandbox's loopback, not the client's.
        assert await page.evaluate("location.host") == "127.0.0.1:8000"


async def desktop_types_into_xterm(sb: orchard.Sandbox) -> None:
    """Keys typed through the executor's XTEST reach a real X application; the screenshot shows them."""
    async with orchard.gui.desktop(sb, size=SIZE) as d:
        assert d.window_manager == "openbox"
        assert d.size == SIZE
        await d.launch(["xterm", "-fa", "DejaVu Sans Mono", "-fs", "14", "-geometry", "80x20+0+0"])
        blank = b""

        async def painted() -> bool:  # a white terminal on the black root window
            nonlocal blank
            blank = await d.screenshot()
            return pixel(blank, 100, 100) == (255, 255, 255)

        await until(painted, "xterm's window")
        await d.click(200, 150)
        await d.type("echo ")
        # A shifted key pressed in one request and released in the next: the Shift added for it goes with it.
        await d.send([KeyEvent(keysym=ord("S"), down=True)])
        await d.send([KeyEvent(keysym=ord("S"), down=False)])
        # Upper case, digits and shifted punctuation: Shift must be pressed for some keys and not others.
        await d.type("plit_Typed_By-Orchard:42 > /tmp/typed")
        await d.key("Return")
        await until(lambda: sb.exists("/tmp/typed"), "the typed command's file")
        assert await sb.read_file("/tmp/typed") == b"Split_Typed_By-Orchard:42\n"
        shown = await d.screenshot()
        # Two lines of text (the command, then the prompt) were drawn in the terminal's top rows.
        assert differing(blank, shown, (0, 0, 700, 60)) > 500
        assert differing(blank, shown, (0, 200, 1280, 800)) == 0


async def desktop_drives_a_headed_browser(sb: orchard.Sandbox) -> None:
    """The desktop's mouse and keyboard, through X, click, type into and scroll a headed Chromium."""
    url = await serve_page(sb)
    async with orchard.gui.desktop(sb, size=SIZE) as d, orchard.gui.browser(sb, display=d.display, size=SIZE) as page:
        await page.goto(url)
        await page.wait_for_selector("#big")
        # The button fills the window below the browser's own bars, whatever their height.
        before = await d.screenshot()
        assert is_blue(pixel(before, 640, 650)), pixel(before, 640, 650)
        await d.click(640, 650)
        # The X server has the click when click() returns; Chromium reads it from its connection after.

        async def clicked() -> bool:
            return bool(await page.evaluate("window.clicks") == 1)

        await until(clicked, "the page seeing the click")

        # The page changed at once; the screen shows it when Chromium has painted the next frame.
        async def red() -> bool:
            return is_red(pixel(await d.screenshot(), 640, 650))

        await until(red, "the clicked button turning red on the screen")
        await page.focus("#box")
        await d.type("Hello, World!")
        await d.key("ctrl+a BackSpace")
        await d.type("kept: A&B")

        async def typed() -> bool:
            return await page.input_value("#box") == "kept: A&B"

        await until(typed, "the text box holding what was typed", timeout=10)
        assert await page.evaluate("window.clicks") == 1
        await d.scroll(640, 650, dy=5)

        async def scrolled() -> bool:
            return bool(await page.evaluate("window.scrollY") > 0)

        await until(scrolled, "the page scrolling")
