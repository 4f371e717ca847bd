"""A virtual X desktop in a sandbox: Xvfb and a window manager, seen and driven through the executor."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from typing import TYPE_CHECKING, Any, Literal

from orchard_executor.protocol import (
    ButtonEvent,
    DisplayInfo,
    InputEvent,
    InputRequest,
    KeyEvent,
    PauseEvent,
    PointerMove,
    Screenshot,
    ScreenshotRequest,
)

from .._rpc import MAX_REPLY
from ..errors import CommandNotFound, GuiUnavailable, NoDisplay, OrchardError
from . import _keys
from ._common import checked_size, ended, invalid

if TYPE_CHECKING:
    from .._sandbox import Process, Sandbox

Button = Literal["left", "middle", "right"]
_BUTTONS = {"left": 1, "middle": 2, "right": 3}
#: Seconds for the X server to take connections; it is usually up in 0.1-0.3 s.
START_TIMEOUT = 20.0


class Desktop:
    """An X display in a sandbox, with the actions computer-use models are trained on.

    Made by ``orchard.gui.desktop(sb)``. Coordinates are screen pixels from the
    top left; every action returns once the X server has processed it. Input
    goes through the X server's XTEST extension and screenshots read the
    screen directly, both by the executor, so the image needs no xdotool or
    screenshot tool, only an X server.
    """

    def __init__(self, sb: Sandbox, display: str, info: DisplayInfo, window_manager: str | None) -> None:
        self.sandbox = sb
        #: The display's name in the sandbox, such as ":0": ``DISPLAY`` for applications.
        self.display = display
        self.width = info.width
        self.height = info.height
        #: The window manager running on it ("openbox"), or None.
        self.window_manager = window_manager
        self._processes: list[Process] = []

    def __repr__(self) -> str:
        return f"<Desktop {self.display} {self.width}x{self.height} in {self.sandbox.id}>"

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) in pixels."""
        return self.width, self.height

    async def screenshot(self, *, region: tuple[int, int, int, int] | None = None, level: int = 1) -> bytes:
        """The screen (or the region ``(x, y, width, height)``) as PNG bytes; ``level`` is zlib's, 1 fast, 9 small."""
        req = ScreenshotRequest(display=self.display, region=region, level=level)
        shot = await self.sandbox._rpc.call("POST", "/v1/display/screenshot", Screenshot, req, limit=MAX_REPLY)
        return shot.png

    async def launch(
        self, cmd: str | Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | None = None
    ) -> Process:
        """Start an application on this display (``DISPLAY`` set); it is stopped when the desktop closes."""
        process = await self.sandbox.start_process(cmd, env={**(env or {}), "DISPLAY": self.display}, cwd=cwd)
        self._processes.append(process)
        return process

    async def send(self, events: Iterable[InputEvent]) -> None:
        """Play raw input events (``orchard_executor.protocol``'s PointerMove, ButtonEvent, KeyEvent, PauseEvent)."""
        req = InputRequest(display=self.display, events=list(events))
        await self.sandbox._rpc.call("POST", "/v1/display/input", DisplayInfo, req, retry=False)

    def _at(self, x: int, y: int) -> PointerMove:
        if not (isinstance(x, int) and isinstance(y, int)):
            raise invalid(f"coordinates must be integers, not ({x!r}, {y!r})")
        if not (0 <= x < self.width and 0 <= y < self.height):
            raise invalid(f"({x}, {y}) is outside the {self.width}x{self.height} screen")
        return PointerMove(x=x, y=y)

    @staticmethod
    def _button(button: Button) -> int:
        try:
            return _BUTTONS[button]
        except KeyError:
            raise invalid(f"unknown mouse button {button!r} (left, middle or right)") from None

    async def move(self, x: int, y: int) -> None:
        """Move the pointer."""
        await self.send([self._at(x, y)])

    async def click(
        self, x: int | None = None, y: int | None = None, *, button: Button = "left", count: int = 1
    ) -> None:
        """Click (``count`` times, as a double or triple click) at (x, y), or where the pointer is."""
        if not 1 <= count <= 10:
            raise invalid(f"count={count!r} must be 1 to 10")
        b = self._button(button)
        events: list[InputEvent] = [] if x is None and y is None else [self._at(x or 0, y or 0)]
        for _ in range(count):
            events += [ButtonEvent(button=b, down=True), ButtonEvent(button=b, down=False)]
        await self.send(events)

    async def double_click(self, x: int | None = None, y: int | None = None, *, button: Button = "left") -> None:
        """Two clicks."""
        await self.click(x, y, button=button, count=2)

    async def triple_click(self, x: int | None = None, y: int | None = None, *, button: Button = "left") -> None:
        """Three clicks (selects a line in most applications)."""
        await self.click(x, y, button=button, count=3)

    async def mouse_down(self, button: Button = "left") -> None:
        """Press a button and hold it."""
        await self.send([ButtonEvent(button=self._button(button), down=True)])

    async def mouse_up(self, button: Button = "left") -> None:
        """Release a button."""
        await self.send([ButtonEvent(button=self._button(button), down=False)])

    async def drag(self, path: Sequence[tuple[int, int]], *, button: Button = "left", steps: int = 5) -> None:
        """Press at ``path[0]``, move through each point (in ``steps`` moves per segment), release at the last."""
        if len(path) < 2:
            raise invalid("a drag needs at least two points")
        b = self._button(button)
        points = [self._at(x, y) for x, y in path]
        events: list[InputEvent] = [points[0], ButtonEvent(button=b, down=True), PauseEvent(seconds=0.02)]
        for a, z in zip(points, points[1:], strict=False):
            for i in range(1, steps + 1):
                events.append(PointerMove(x=a.x + (z.x - a.x) * i // steps, y=a.y + (z.y - a.y) * i // steps))
        events += [PauseEvent(seconds=0.02), ButtonEvent(button=b, down=False)]
        await self.send(events)

    async def scroll(self, x: int | None = None, y: int | None = None, *, dx: int = 0, dy: int = 0) -> None:
        """Scroll by wheel clicks at (x, y): ``dy`` > 0 down, < 0 up; ``dx`` > 0 right, < 0 left."""
        if abs(dx) > 1000 or abs(dy) > 1000:
            raise invalid("scroll by at most 1000 clicks a call")
        events: list[InputEvent] = [] if x is None and y is None else [self._at(x or 0, y or 0)]
        for amount, neg, pos in ((dy, 4, 5), (dx, 6, 7)):
            b = pos if amount > 0 else neg
            for _ in range(abs(amount)):
                events += [ButtonEvent(button=b, down=True), ButtonEvent(button=b, down=False)]
        await self.send(events)

    async def type(self, text: str) -> None:
        """Type text as key presses (any Unicode character; newline is Return)."""
        events: list[InputEvent] = []
        for ch in text:
            sym = _keys.char_keysym(ch)
            events += [KeyEvent(keysym=sym, down=True), KeyEvent(keysym=sym, down=False)]
        await self.send(events)

    async def key(self, keys: str) -> None:
        """Press a key or combination, xdotool style: ``"Return"``, ``"ctrl+s"``; several separated by spaces."""
        events: list[InputEvent] = []
        for one in keys.split():
            syms = _keys.combo(one)
            events += [KeyEvent(keysym=s, down=True) for s in syms]
            events += [KeyEvent(keysym=s, down=False) for s in reversed(syms)]
        if not events:
            raise invalid("no key given")
        await self.send(events)

    async def act(self, action: Mapping[str, Any]) -> bytes | None:
        """Run one action as Anthropic's or OpenAI's computer-use tools write it; a screenshot returns PNG bytes.

        See docs/gui.md for the mapping.
        """
        return await _act(self, dict(action))

    async def _stop(self) -> None:
        for process in reversed(self._processes):
            with suppress(OrchardError):
                await process.kill()


async def _act(d: Desktop, a: dict[str, Any]) -> bytes | None:
    kind = a.pop("action", None) or a.pop("type", None)
    xy = a.pop("coordinate", None)
    if xy is None and "x" in a:
        xy = (a.pop("x"), a.pop("y", None))
    x, y = (None, None) if xy is None else (xy[0], xy[1])
    match kind:
        case "screenshot":
            return await d.screenshot()
        case "mouse_move" | "move":
            await d.move(x, y)  # type: ignore[arg-type]
        case "left_click" | "right_click" | "middle_click":
            await d.click(x, y, button=kind.split("_")[0])
        case "click":
            await d.click(x, y, button=a.get("button", "left"))
        case "double_click":
            await d.double_click(x, y)
        case "triple_click":
            await d.triple_click(x, y)
        case "left_mouse_down":
            await d.mouse_down()
        case "left_mouse_up":
            await d.mouse_up()
        case "left_click_drag":
            start = a.get("start_coordinate")
            if start is None:
                raise invalid("left_click_drag needs start_coordinate and coordinate")
            await d.drag([tuple(start), (x, y)])  # type: ignore[list-item]
        case "drag":
            await d.drag([(p["x"], p["y"]) if isinstance(p, Mapping) else tuple(p) for p in a.get("path", [])])
        case "scroll":
            if "scroll_direction" in a:  # Anthropic: a direction and an amount of clicks
                n = int(a.get("scroll_amount", 3))
                dx, dy = {"up": (0, -n), "down": (0, n), "left": (-n, 0), "right": (n, 0)}[a["scroll_direction"]]
            else:  # OpenAI: pixels; a wheel click is taken as about 100 of them
                dx = round(a.get("scroll_x", 0) / 100)
                dy = round(a.get("scroll_y", 0) / 100)
            await d.scroll(x, y, dx=dx, dy=dy)
        case "type":
            await d.type(a["text"])
        case "key":
            await d.key(a["text"])
        case "keypress":  # OpenAI: a list of keys pressed together
            await d.key("+".join(a["keys"]))
        case "wait":
            await asyncio.sleep(float(a.get("duration", a.get("ms", 1000) / 1000)))
        case _:
            raise invalid(f"unknown computer-use action {kind!r}")
    return None


async def _wait_ready(sb: Sandbox, display: str, server: Process, deadline: float) -> DisplayInfo:
    while True:
        try:
            return await sb._rpc.call("GET", "/v1/display", DisplayInfo, params={"display": display})
        except NoDisplay:
            end = await ended(server)
            if end is not None:
                raise GuiUnavailable(
                    f"the X server for {display} exited ({end[0]}): {end[3]}", sandbox_id=sb.id
                ) from None
            if time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.02)


@asynccontextmanager
async def desktop(
    sb: Sandbox,
    *,
    size: tuple[int, int] = (1280, 800),
    window_manager: str | None = "auto",
    display: str | None = None,
) -> AsyncIterator[Desktop]:
    """A virtual desktop in the sandbox for an ``async with`` block: Xvfb, then a window manager.

    The X server is the image's ``Xvfb`` (Debian's ``xvfb`` package), on
    ``display`` or the first free one. ``window_manager="auto"`` runs
    ``openbox`` when the image has it and none otherwise (``Desktop.window_manager``
    tells which); a name runs that one and fails if it is missing; None runs none.
    Everything started here stops when the block exits.

    Raises:
        GuiUnavailable: the image has no Xvfb (or no window manager that was named), or it did not start.
    """
    w, h = checked_size(size)
    argv = ["Xvfb", display or "-displayfd", *([] if display else ["1"])]
    # -noreset: without it the server resets when its last client leaves (the executor drops its
    # connection after a refused request), losing its state and refusing whoever connects meanwhile.
    argv += ["-screen", "0", f"{w}x{h}x24", "-nolisten", "tcp", "-noreset"]
    try:
        server = await sb.start_process(argv)
    except CommandNotFound:
        raise GuiUnavailable(
            f"image {sb.image!r} has no X server: orchard.gui.desktop needs Xvfb (Debian's xvfb package) on PATH",
            sandbox_id=sb.id,
        ) from None
    d: Desktop | None = None
    try:
        deadline = time.monotonic() + START_TIMEOUT
        if display is None:
            display = await _display_number(sb, server, deadline)
        info = await _wait_ready(sb, display, server, deadline)
        d = Desktop(sb, display, info, None)
        d._processes.append(server)
        if window_manager is not None:
            name = "openbox" if window_manager == "auto" else window_manager
            try:
                await d.launch([name])
                d.window_manager = name
            except CommandNotFound:
                if window_manager != "auto":
                    raise GuiUnavailable(
                        f"image {sb.image!r} has no window manager {name!r} on PATH", sandbox_id=sb.id
                    ) from None
        yield d
    finally:
        if d is not None:
            await d._stop()
        else:
            with suppress(OrchardError):
                await server.kill()


async def _display_number(sb: Sandbox, server: Process, deadline: float) -> str:
    """The display Xvfb picked (``-displayfd 1`` writes its number, then a newline, to stdout)."""
    while True:
        out = await server.output("stdout")
        if out.endswith(b"\n") and out.strip().isdigit():
            return f":{int(out)}"
        end = await ended(server)
        if end is not None:
            raise GuiUnavailable(f"Xvfb exited ({end[0]}) before it took a display: {end[3]}", sandbox_id=sb.id)
        if time.monotonic() > deadline:
            raise GuiUnavailable(f"Xvfb took no display in {START_TIMEOUT:g}s", sandbox_id=sb.id)
        await asyncio.sleep(0.02)
