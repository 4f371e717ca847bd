"""Chromium in a sandbox, driven from the client by Playwright over CDP through ``Sandbox.forward``."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager, suppress
from typing import TYPE_CHECKING

from ..errors import BrowserCrashed, CommandNotFound, GuiUnavailable, OrchardError, PathNotFound
from ._common import checked_size, ended

if TYPE_CHECKING:
    from playwright.async_api import Browser, Page, Playwright

    from .._sandbox import Process, Sandbox

#: Browsers looked for on the image's PATH, in order.
EXECUTABLES = ("chromium", "chromium-browser", "google-chrome", "chrome", "chromium-headless-shell")
#: Flags for Chromium in a container: no setuid sandbox (the container is the sandbox, and
#: Docker's default seccomp profile refuses Chromium's own), no GPU, no first-run UI, shared
#: memory in /tmp rather than /dev/shm, and no warning bar that would change the page's size.
FLAGS = (
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--no-default-browser-check",
    "--test-type",
    "--disable-background-networking",
    "--disable-component-update",
    "--password-store=basic",
    "--remote-debugging-port=0",
    "--window-position=0,0",
)
#: As Playwright launches Chromium: screenshots from a new surface (100 -> 80 ms for 1280x800 here), no paint
#: holding (a page paints before any input), and no calls home (the sandbox has no route anyway).
ENABLE_FEATURES = ("CDPScreenshotNewSurface",)
DISABLE_FEATURES = (
    "PaintHolding",
    "MediaRouter",
    "OptimizationHints",
    "NetworkTimeServiceQuerying",
    "AimEnabled",
    "PreconnectToSearch",
)


def _features(args: Sequence[str]) -> list[str]:
    """Orchard's ``--enable-features``/``--disable-features`` merged with the caller's (Chromium keeps the last)."""
    enable, disable, rest = list(ENABLE_FEATURES), list(DISABLE_FEATURES), []
    for arg in args:
        name, _, value = arg.partition("=")
        if name == "--enable-features":
            enable += value.split(",")
        elif name == "--disable-features":
            disable += value.split(",")
        else:
            rest.append(arg)
    return [f"--enable-features={','.join(enable)}", f"--disable-features={','.join(disable)}", *rest]


def playwright() -> AbstractAsyncContextManager[Playwright]:
    """Keep Playwright's driver running for an ``async with`` block, for the browsers opened in it.

    ``browser()`` starts the driver (a Node process, most of a browser's
    start) when none runs in this event loop and stops it when its last
    browser closes; a rollout worker that opens browsers one after another
    holds it here instead and saves that start each time.
    """
    return _Driver.use()


class _Driver:
    """One Playwright driver (a Node process) per event loop, shared by its browsers."""

    _by_loop: dict[asyncio.AbstractEventLoop, _Driver] = {}

    def __init__(self) -> None:
        self.users = 0
        self.lock = asyncio.Lock()
        self.playwright: Playwright | None = None

    @classmethod
    @asynccontextmanager
    async def use(cls) -> AsyncIterator[Playwright]:
        loop = asyncio.get_running_loop()
        driver = cls._by_loop.setdefault(loop, cls())
        async with driver.lock:
            if driver.playwright is None:
                try:
                    from playwright.async_api import async_playwright
                except ImportError:
                    raise GuiUnavailable(
                        "orchard.gui.browser needs Playwright in the client: pip install 'orchard-sandbox[gui]'"
                    ) from None
                driver.playwright = await async_playwright().start()
            driver.users += 1
            playwright = driver.playwright
        try:
            yield playwright
        finally:
            async with driver.lock:
                driver.users -= 1
                if driver.users == 0 and driver.playwright is not None:
                    await driver.playwright.stop()
                    driver.playwright = None
                    cls._by_loop.pop(loop, None)


async def _start(sb: Sandbox, argv: list[str], env: dict[str, str], executable: str | None) -> Process:
    names = [executable] if executable else list(EXECUTABLES)
    for name in names:
        try:
            return await sb.start_process([name, *argv], env=env)
        except CommandNotFound:
            continue
    raise GuiUnavailable(
        f"image {sb.image!r} has no browser: orchard.gui.browser looked for {', '.join(names)} on PATH "
        "(Debian's chromium package)",
        sandbox_id=sb.id,
    )


async def _crashed(sb: Sandbox, process: Process, what: str) -> BrowserCrashed | None:
    """A BrowserCrashed if the browser process has ended, else None."""
    try:
        end = await ended(process)
    except OrchardError as exc:
        return BrowserCrashed(f"the browser's sandbox failed: {exc}", sandbox_id=sb.id)
    if end is None:
        return None
    how, exit_code, signal, stderr = end
    return BrowserCrashed(
        f"the browser in the sandbox ended ({how}) {what}",
        exit_code=exit_code,
        signal=signal,
        stderr=stderr,
        sandbox_id=sb.id,
    )


async def _devtools_port(sb: Sandbox, process: Process, profile: str, deadline: float) -> int:
    """The port Chromium picked, from the DevToolsActivePort file it writes in its profile."""
    while True:
        with suppress(PathNotFound):
            first = (await sb.read_file(f"{profile}/DevToolsActivePort")).split(b"\n", 1)[0]
            if first.strip().isdigit():
                return int(first)
        crashed = await _crashed(sb, process, "before it opened its DevTools port")
        if crashed is not None:
            raise crashed
        if time.monotonic() > deadline:
            raise GuiUnavailable("the browser opened no DevTools port in time", sandbox_id=sb.id)
        await asyncio.sleep(0.02)


@asynccontextmanager
async def browser(
    sb: Sandbox,
    *,
    display: str | None = None,
    size: tuple[int, int] = (1280, 800),
    args: Sequence[str] = (),
    executable: str | None = None,
    timeout: float = 60.0,
) -> AsyncIterator[Page]:
    """A Playwright ``Page`` of a Chromium running in the sandbox, for an ``async with`` block.

    Chromium (the image's ``chromium``, or ``executable``) starts headless with
    a fresh profile under /tmp and DevTools on a sandbox-local port; the client
    reaches that port through ``sb.forward()`` and connects Playwright over CDP,
    so the whole Page API works with the browser inside the sandbox, and
    ``page.goto("http://127.0.0.1:8000/")`` loads a site served in the sandbox.
    With ``display`` (a ``Desktop``'s), it runs headed on that X display
    instead. Playwright is the ``gui`` extra and needs no browser download.

    When the block exits with a Playwright error and the browser has ended
    (crashed, killed, out of memory), ``BrowserCrashed`` is raised from it, so
    the rollout runner counts an environment failure, not the agent's. The
    browser and its profile are removed when the block exits.

    Raises:
        GuiUnavailable: no browser in the image, Playwright not installed, or no DevTools port in ``timeout``.
        BrowserCrashed: the browser ended before it was ready, or while the block ran.
    """
    w, h = checked_size(size)
    profile = f"/tmp/orchard-browser-{secrets.token_hex(6)}"
    argv = [*FLAGS, f"--user-data-dir={profile}", f"--window-size={w},{h}", *_features(args)]
    env = {"HOME": profile}
    if display is None:
        argv.append("--headless")
    else:
        env["DISPLAY"] = display
    argv.append("about:blank")
    deadline = time.monotonic() + timeout
    async with AsyncExitStack() as stack:
        process = await _start(sb, argv, env, executable)

        async def stop() -> None:
            with suppress(OrchardError):
                await process.kill()
            with suppress(OrchardError):
                await sb.remove(profile, recursive=True, missing_ok=True)

        stack.push_async_callback(stop)
        # Playwright's driver (a Node process, 0.6-0.8 s to start here) starts while Chromium does.
        port_wait = asyncio.ensure_future(_devtools_port(sb, process, profile, deadline))
        stack.callback(port_wait.cancel)
        playwright = await stack.enter_async_context(_Driver.use())
        port = await port_wait
        url = await stack.enter_async_context(sb.forward(port))
        from playwright.async_api import Error as PlaywrightError

        try:
            chrome = await playwright.chromium.connect_over_cdp(
                url, timeout=max(1.0, deadline - time.monotonic()) * 1000
            )
        except PlaywrightError as exc:
            crashed = await _crashed(sb, process, "while Playwright connected")
            if crashed is not None:
                raise crashed from exc
            raise
        stack.push_async_callback(_close, chrome)
        context = chrome.contexts[0] if chrome.contexts else await chrome.new_context()
        page = context.pages[0] if context.pages else await context.new_page()
        if display is None:
            await page.set_viewport_size({"width": w, "height": h})
        try:
            yield page
        except PlaywrightError as exc:
            crashed = await _crashed(sb, process, "during the rollout")
            if crashed is not None:
                raise crashed from exc
            raise


async def _close(chrome: Browser) -> None:
    from playwright.async_api import Error

    with suppress(Error, TimeoutError):
        await asyncio.wait_for(chrome.close(), 10)
