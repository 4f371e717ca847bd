"""GUI environments on docker: Chromium driven by Playwright over CDP through forward(), a virtual desktop
driven through the executor's own X11 client, and their failures as typed errors."""

from __future__ import annotations

import asyncio
import struct

import pytest
from docker_support import SWE

import orchard
import orchard.gui
import orchard.rollout
from gui_support import (
    BROWSER,
    SIZE,
    browser_navigates_clicks_and_screenshots,
    desktop_drives_a_headed_browser,
    desktop_types_into_xterm,
    serve_page,
)
from orchard import DockerConfig
from orchard.errors import BrowserCrashed, GuiUnavailable, InvalidRequest, NoDisplay
from orchard.rollout._runner import infra_cause
from orchard.tasks import Reward, Task
from orchard_executor.protocol import ButtonEvent, DisplayInfo, PointerMove

pytestmark = [pytest.mark.docker, pytest.mark.timeout(180)]


@pytest.mark.parametrize("transport", ["unix", "tcp"])
async def test_browser_navigates_clicks_and_screenshots(docker_ready: str, transport: str) -> None:
    async with orchard.Client(DockerConfig(transport=transport)) as client, client.sandbox(BROWSER) as sb:
        await browser_navigates_clicks_and_screenshots(sb)


async def test_desktop_types_into_xterm_and_drives_a_headed_browser(client: orchard.Client) -> None:
    async with client.sandbox(BROWSER) as sb:
        await desktop_types_into_xterm(sb)
        await desktop_drives_a_headed_browser(sb)


async def test_an_image_without_x_server_or_browser_is_a_typed_error_naming_it(client: orchard.Client) -> None:
    async with client.sandbox(SWE) as sb:
        with pytest.raises(GuiUnavailable, match="Xvfb"):
            async with orchard.gui.desktop(sb):
                pass
        with pytest.raises(GuiUnavailable, match="chromium"):
            async with orchard.gui.browser(sb):
                pass
        # Nothing left running.
        assert [p for p in await sb.processes() if p.running] == []


async def test_off_screen_input_unknown_keys_and_a_dead_x_server_are_typed_errors(client: orchard.Client) -> None:
    async with client.sandbox(BROWSER) as sb, orchard.gui.desktop(sb, size=SIZE, window_manager=None) as d:
        assert d.window_manager is None
        with pytest.raises(InvalidRequest, match="outside the 1280x800 screen"):
            await d.click(1280, 10)
        with pytest.raises(InvalidRequest, match="unknown key 'hyperdrive'"):
            await d.key("ctrl+hyperdrive")
        with pytest.raises(InvalidRequest, match="unknown computer-use action"):
            await d.act({"action": "teleport"})
        # The executor refuses it too (a client that skipped the check), and plays none of the events:
        # the button press before the bad move never happened, so the button is not stuck down.
        with pytest.raises(InvalidRequest, match=r"\(5000, 10\) is outside"):
            await d.send([ButtonEvent(button=1, down=True), PointerMove(x=5000, y=10)])
        await d.send([PointerMove(x=5, y=5)])
        # A display name or cookie path the OS could not take is refused before anything connects.
        for query in ({"display": "/etc/passwd"}, {"display": ":1\x00"}, {"display": d.display, "xauthority": ""}):
            with pytest.raises(InvalidRequest, match="invalid display query"):
                await sb._rpc.call("GET", "/v1/display", DisplayInfo, params=query)
        # The X server dies: the next action is NoDisplay, an environment failure for the runner.
        await sb.exec(["sh", "-c", "kill -9 $(pidof Xvfb)"])

        async def screenshots() -> None:
            for _ in range(50):
                await d.screenshot()
                await asyncio.sleep(0.05)

        with pytest.raises(NoDisplay):
            await screenshots()
        assert infra_cause(NoDisplay("gone", code="no_display")) is not None


async def test_the_x_server_keeps_its_state_when_its_last_client_leaves(client: orchard.Client) -> None:
    # With no window manager the executor is the X server's only client, and a refused request drops
    # its connection. An X server started without -noreset then resets: the pointer goes back to the
    # middle, and a client connecting meanwhile has its connection reset (a NoDisplay in a CI run).
    async with client.sandbox(BROWSER) as sb, orchard.gui.desktop(sb, size=SIZE, window_manager=None) as d:
        await d.send([PointerMove(x=5, y=5)])
        with pytest.raises(InvalidRequest, match="is outside"):
            await d.send([PointerMove(x=5000, y=10)])
        await asyncio.sleep(1)  # a reset, if there is one, is over by then
        where = await sb.exec(["xdotool", "getmouselocation"], env={"DISPLAY": d.display})
        assert where.exit_code == 0, where.stderr
        assert where.stdout.startswith("x:5 y:5 "), where.stdout


async def test_the_browser_crashing_is_browser_crashed(client: orchard.Client) -> None:
    async with client.sandbox(BROWSER) as sb:
        url = await serve_page(sb)

        async def rollout() -> None:
            async with orchard.gui.browser(sb) as page:
                await page.goto(url)
                await sb.exec(["sh", "-c", "kill -9 $(pidof chromium)"])
                await asyncio.sleep(0.5)
                await page.goto(url)

        with pytest.raises(BrowserCrashed) as caught:
            await rollout()
        assert caught.value.signal == 9 or caught.value.exit_code is not None
        assert infra_cause(caught.value) is caught.value
        # Its profile was removed and no browser is left.
        assert (await sb.exec(["sh", "-c", "ls -d /tmp/orchard-browser-* 2>/dev/null; pidof chromium"])).stdout == ""


async def test_a_display_that_wants_a_cookie_refuses_without_it_and_takes_the_xauthority_file(
    client: orchard.Client,
) -> None:
    async with client.sandbox(BROWSER) as sb:
        cookie = b"\x13" * 16
        fields = (b"sandbox", b"55", b"MIT-MAGIC-COOKIE-1", cookie)
        await sb.write_file(
            "/tmp/xauth", struct.pack(">H", 256) + b"".join(struct.pack(">H", len(f)) + f for f in fields)
        )
        server = await sb.start_process(["Xvfb", ":55", "-auth", "/tmp/xauth", "-nolisten", "tcp"])
        with_cookie = {"display": ":55", "xauthority": "/tmp/xauth"}
        for _ in range(200):
            try:
                info = await sb._rpc.call("GET", "/v1/display", DisplayInfo, params=with_cookie)
                break
            except NoDisplay:
                await asyncio.sleep(0.05)
        assert (info.width, info.height) > (0, 0)
        with pytest.raises(NoDisplay, match="refused the connection"):
            await sb._rpc.call("GET", "/v1/display", DisplayInfo, params={"display": ":55"})
        await server.kill()


#: Not an X server: it answers the connection setup with the given bytes, then with whatever it is sent.
FAKE_X = r"""
import os, socket, sys
os.makedirs("/tmp/.X11-unix", exist_ok=True)
s = socket.socket(socket.AF_UNIX)
s.bind("/tmp/.X11-unix/X" + sys.argv[1]); s.listen()
setup = bytes.fromhex(sys.argv[2])
while True:
    c, _ = s.accept()
    c.recv(4096)
    c.sendall(setup)
    c.close()
"""


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("01000b0000000400" + "00" * 16, "not an X server"),  # a success whose body is too short to parse
        ("00050b000000020068656c6c6f000000", "refused the connection: hello"),
        ("ff" * 64, "not an X server"),
    ],
)
async def test_something_else_on_the_display_socket_is_no_display(
    client: orchard.Client, setup: str, message: str
) -> None:
    async with client.sandbox(BROWSER) as sb:
        await sb.write_file("/tmp/fake_x.py", FAKE_X)
        await sb.start_process(["python3", "/tmp/fake_x.py", "66", setup])
        for _ in range(100):
            if await sb.exists("/tmp/.X11-unix/X66"):
                break
            await asyncio.sleep(0.05)
        with pytest.raises(NoDisplay, match=message):
            await sb._rpc.call("GET", "/v1/display", DisplayInfo, params={"display": ":66"})
        # The executor is fine.
        assert (await sb.exec(["true"])).exit_code == 0


async def test_a_browser_crash_in_a_rollout_is_an_infra_error_not_the_agents(client: orchard.Client) -> None:
    async def agent(sb: orchard.Sandbox, task: Task, *, attempt: int) -> str:
        url = await serve_page(sb)
        async with orchard.gui.browser(sb) as page:
            await page.goto(url)
            await sb.exec(["sh", "-c", "kill -9 $(pidof chromium)"])
            await asyncio.sleep(0.5)
            await page.click("#big")
        return "clicked"

    async def reward(client: orchard.Client, task: Task, answer: str) -> Reward:
        return Reward(value=1.0, solved=True)

    task = Task(id="crash", image=BROWSER, instruction="click the button")
    results = await orchard.rollout.run(client, [task], agent=agent, reward=reward, retries=0, progress=False)
    (record,) = results.records
    assert record["kind"] == "infra_error", record
    assert "BrowserCrashed" in record["error"]
