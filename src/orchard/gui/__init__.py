"""GUI environments: a browser or a whole desktop in any sandbox, seen and driven from rollout code.

Example::

    import orchard
    import orchard.gui

    async with client.sandbox("orchard-test/browser") as sb:
        async with orchard.gui.browser(sb) as page:  # a Playwright Page; Chromium runs in the sandbox
            await page.goto("http://127.0.0.1:8000/")  # a site served inside the sandbox
            png = await page.screenshot()
        async with orchard.gui.desktop(sb, size=(1280, 800)) as d:  # Xvfb + a window manager
            await d.launch(["xterm"])
            await d.click(640, 400)
            await d.type("hello")
            await d.key("ctrl+s")
            png = await d.screenshot()  # PNG bytes

The desktop's screenshots and input go through the executor, which speaks the
X11 protocol to the display itself, so an image needs only an X server. The
browser needs Playwright in the client (the ``gui`` extra), never a browser
download. docs/gui.md has the image recipe and the computer-use action mapping.
"""

from ._browser import browser, playwright
from ._desktop import Desktop, desktop

__all__ = ["Desktop", "browser", "desktop", "playwright"]
