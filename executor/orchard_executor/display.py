"""Screenshots and synthetic input on an X display in the sandbox, spoken in the X11 protocol itself.

The executor talks to the X server over its unix socket (``/tmp/.X11-unix/XN``)
with the handful of core requests it needs (GetImage, GetKeyboardMapping,
ChangeKeyboardMapping, GetInputFocus) and the XTEST extension's FakeInput, so
it works in any image that has an X server: no xdotool, no Xlib, no Python
packages. A screenshot is the root window's pixels as a PNG (zlib from the
stdlib); input is a list of pointer, button and key events, replied to once the
server has processed them all.

One connection per display is kept and used by one request at a time; a
connection that broke (the X server died) is dropped and the next request
connects again, or gets ``no_display``.
"""

from __future__ import annotations

import asyncio
import struct
import zlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from .errors import ExecutorError
from .protocol import (
    ButtonEvent,
    DisplayInfo,
    InputEvent,
    KeyEvent,
    PauseEvent,
    PointerMove,
    Screenshot,
)

X11_DIR = "/tmp/.X11-unix"
#: Seconds to connect and for any one reply; an X server that takes longer is treated as gone.
TIMEOUT = 10.0
_COOKIE = b"MIT-MAGIC-COOKIE-1"
# Core request opcodes, and XTEST's FakeInput.
_GET_INPUT_FOCUS = 43
_GET_IMAGE = 73
_QUERY_EXTENSION = 98
_CHANGE_KEYBOARD_MAPPING = 100
_GET_KEYBOARD_MAPPING = 101
_XTEST_FAKE_INPUT = 2
_KEY_PRESS, _KEY_RELEASE, _BUTTON_PRESS, _BUTTON_RELEASE, _MOTION = 2, 3, 4, 5, 6
_SHIFT_L = 0xFFE1
#: The largest reply read from an X server (a 8192x8192 screenshot is 256 MiB); more is not an X server.
MAX_REPLY = 8192 * 8192 * 4 + 32
#: Keycodes the executor rebinds, round robin, for keysyms no key types (so a run of
#: such characters does not rebind the keycode an application has not read yet).
_SPARE_KEYCODES = 8


def socket_path(display: str) -> str:
    """The unix socket of display ":N" (the wire schema checked its form)."""
    return f"{X11_DIR}/X{display[1:].split('.')[0]}"


def _pad(n: int) -> int:
    return (4 - n % 4) % 4


def cookie(xauthority: str, display: str) -> bytes | None:
    """The MIT-MAGIC-COOKIE-1 for ``display`` in an Xauthority file, if it has one."""
    number = display[1:].split(".")[0].encode()
    with open(xauthority, "rb") as f:
        data = f.read(1 << 20)
    pos = 0

    def field() -> bytes:
        nonlocal pos
        (n,) = struct.unpack_from(">H", data, pos)
        if pos + 2 + n > len(data):
            raise struct.error("a field runs past the end")
        value = data[pos + 2 : pos + 2 + n]
        pos += 2 + n
        return value

    try:
        while pos < len(data):
            pos += 2  # family
            field()  # address
            num, name, value = field(), field(), field()
            if name == _COOKIE and num in (number, b""):
                return value
    except struct.error:
        raise ExecutorError("bad_request", f"{xauthority} is not an Xauthority file") from None
    return None


class Connection:
    """One client connection to an X server."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._seq = 0
        self.lock = asyncio.Lock()
        self.info = DisplayInfo(width=0, height=0, depth=0)
        self.root = 0
        self.min_keycode = 8
        self.max_keycode = 255
        self._bgrx = False
        self._xtest_opcode = 0
        self._keymap: list[list[int]] = []
        self._codes: dict[int, tuple[int, bool]] = {}
        self._spare: list[int] = []
        self._next_spare = 0
        #: Keycodes pressed with a Shift the executor added, released with their key (in this request or a later one).
        self._shifted: set[int] = set()

    @classmethod
    async def open(cls, display: str, xauthority: str | None) -> Connection:
        """Connect, authenticate and read the server's setup."""
        path = socket_path(display)
        try:
            async with asyncio.timeout(TIMEOUT):
                reader, writer = await asyncio.open_unix_connection(path, limit=1 << 24)
        except (OSError, TimeoutError) as exc:
            raise ExecutorError("no_display", f"no X server answers on display {display} ({path}: {exc})") from None
        conn = cls(reader, writer)
        try:
            await conn._setup(display, xauthority)
        except (struct.error, IndexError):
            writer.close()
            raise ExecutorError(
                "no_display", f"what answers on {path} is not an X server (a malformed setup)"
            ) from None
        except BaseException:
            writer.close()
            raise
        return conn

    def close(self) -> None:
        """Drop the connection."""
        self._writer.close()

    @property
    def broken(self) -> bool:
        """Whether the server closed it (it exited) or it failed."""
        return self._reader.at_eof() or self._reader.exception() is not None or self._writer.is_closing()

    async def _read(self, n: int) -> bytes:
        try:
            async with asyncio.timeout(TIMEOUT):
                return await self._reader.readexactly(n)
        except (asyncio.IncompleteReadError, OSError, TimeoutError) as exc:
            raise ExecutorError("no_display", f"the X server went away ({type(exc).__name__})") from None

    async def _setup(self, display: str, xauthority: str | None) -> None:
        name = data = b""
        if xauthority is not None:
            found = cookie(xauthority, display)
            if found is not None:
                name, data = _COOKIE, found
        self._writer.write(
            struct.pack("<cxHHHHxx", b"l", 11, 0, len(name), len(data))
            + name
            + b"\0" * _pad(len(name))
            + data
            + b"\0" * _pad(len(data))
        )
        status, reason_len, _major, _minor, length = struct.unpack("<BBHHH", await self._read(8))
        if status not in (0, 1, 2):
            raise struct.error(f"setup status {status}")
        body = await self._read(length * 4)  # at most 256 KiB: the length is 16 bits
        if status != 1:
            reason = body[:reason_len] if status == 0 else body
            raise ExecutorError(
                "no_display", f"the X server on {display} refused the connection: {reason.decode(errors='replace')}"
            )
        vendor_len, _max_request, n_screens, n_formats, image_order = struct.unpack_from("<HHBBB", body, 16)
        self.min_keycode, self.max_keycode = body[26], body[27]
        pos = 32 + vendor_len + _pad(vendor_len)
        formats = {}
        for _ in range(n_formats):
            depth, bpp = body[pos], body[pos + 1]
            formats[depth] = bpp
            pos += 8
        if n_screens < 1:
            raise ExecutorError("no_display", f"the X server on {display} has no screen")
        root, width, height = struct.unpack_from("<I16xHH", body, pos)
        (root_visual,) = struct.unpack_from("<I", body, pos + 32)
        root_depth, n_depths = body[pos + 38], body[pos + 39]
        pos += 40
        masks = None
        for _ in range(n_depths):
            depth = body[pos]
            (n_visuals,) = struct.unpack_from("<H", body, pos + 2)
            pos += 8
            for _ in range(n_visuals):
                visual_id, red, green, blue = struct.unpack_from("<I4xIII", body, pos)
                if visual_id == root_visual and depth == root_depth:
                    masks = (red, green, blue)
                pos += 24
        self.root = root
        self.info = DisplayInfo(width=width, height=height, depth=root_depth)
        # 24-bit true colour in 32-bit pixels, least significant byte first: B, G, R, X.
        self._bgrx = (
            root_depth in (24, 32)
            and formats.get(root_depth) == 32
            and image_order == 0
            and masks == (0xFF0000, 0x00FF00, 0x0000FF)
        )

    def _write(self, request: bytes) -> None:
        """Send one request that has no reply."""
        self._writer.write(request)
        self._seq = (self._seq + 1) & 0xFFFF

    async def _request(self, data: bytes, reply: bool) -> bytes:
        """Send one request; return its whole reply (the 32-byte header, then the rest)."""
        self._write(data)
        if not reply:
            return b""
        try:
            async with asyncio.timeout(TIMEOUT):
                await self._writer.drain()
        except (OSError, TimeoutError) as exc:
            raise ExecutorError("no_display", f"the X server went away ({type(exc).__name__})") from None
        while True:
            head = await self._read(32)
            kind = head[0]
            if kind == 0:  # an error, for this request or an earlier one that has no reply
                code, seq, value = head[1], *struct.unpack_from("<HI", head, 2)
                raise ExecutorError("bad_request", f"the X server refused request {seq} (error {code}, value {value})")
            if kind != 1:  # an event (MappingNotify reaches every client): not ours to handle
                continue
            (seq, length) = struct.unpack_from("<HI", head, 2)
            if length * 4 > MAX_REPLY:
                raise ExecutorError("no_display", f"the X server sent a reply of {length * 4} bytes: not an X server")
            extra = await self._read(length * 4) if length else b""
            if seq == self._seq:
                return head + extra

    async def sync(self) -> None:
        """A round trip: every request sent before has been processed."""
        await self._request(struct.pack("<BxH", _GET_INPUT_FOCUS, 1), reply=True)

    async def screenshot(self, region: tuple[int, int, int, int] | None, level: int) -> Screenshot:
        """The root window's pixels (or a region's) as a PNG."""
        if not self._bgrx:
            raise ExecutorError(
                "unsupported", f"screenshots need a 24-bit true-colour screen; this one has depth {self.info.depth}"
            )
        x, y, w, h = region if region is not None else (0, 0, self.info.width, self.info.height)
        self._inside(x + w - 1, y + h - 1)
        reply = await self._request(
            struct.pack("<BBHIhhHHI", _GET_IMAGE, 2, 5, self.root, x, y, w, h, 0xFFFFFFFF), reply=True
        )
        if len(reply) < 32 + w * h * 4:
            raise ExecutorError("no_display", f"the X server sent {len(reply) - 32} bytes for a {w}x{h} image")
        pixels = memoryview(reply)[32 : 32 + w * h * 4]
        png = await asyncio.to_thread(encode_png, pixels, w, h, level)
        return Screenshot(width=w, height=h, png=png)

    def _inside(self, x: int, y: int) -> None:
        if x >= self.info.width or y >= self.info.height:
            raise ExecutorError("bad_request", f"({x}, {y}) is outside the {self.info.width}x{self.info.height} screen")

    async def _xtest(self) -> int:
        if not self._xtest_opcode:
            name = b"XTEST"
            reply = await self._request(
                struct.pack("<BxHHxx", _QUERY_EXTENSION, 2 + (len(name) + 3) // 4, len(name))
                + name
                + b"\0" * _pad(len(name)),
                reply=True,
            )
            if not reply[8]:
                raise ExecutorError("unsupported", "the X server has no XTEST extension, which synthetic input needs")
            self._xtest_opcode = reply[9]
        return self._xtest_opcode

    def _fake(self, kind: int, detail: int, x: int = 0, y: int = 0) -> bytes:
        return struct.pack(
            "<BBHBBxxIIxxxxxxxxhhxxxxxxxB",
            self._xtest_opcode,
            _XTEST_FAKE_INPUT,
            9,
            kind,
            detail,
            0,
            self.root,
            x,
            y,
            0,
        )

    async def _load_keymap(self) -> None:
        count = self.max_keycode - self.min_keycode + 1
        reply = await self._request(
            struct.pack("<BxHBBxx", _GET_KEYBOARD_MAPPING, 2, self.min_keycode, count), reply=True
        )
        per = reply[1]
        syms = struct.unpack_from(f"<{count * per}I", reply, 32)
        self._keymap = [list(syms[i * per : (i + 1) * per]) for i in range(count)]
        # The keycode that types each keysym, and whether it needs Shift: the first key with it
        # unshifted, else the first with it shifted.
        self._codes = {}
        for level in (0, 1):
            for i, row in enumerate(self._keymap):
                if len(row) > level and row[level]:
                    self._codes.setdefault(row[level], (self.min_keycode + i, level == 1))
        if not self._spare:
            empty = [self.min_keycode + i for i, row in enumerate(self._keymap) if not any(row)]
            self._spare = empty[-_SPARE_KEYCODES:]

    def _find(self, keysym: int) -> tuple[int, bool] | None:
        """The keycode that types ``keysym``, and whether it needs Shift."""
        return self._codes.get(keysym)

    async def _bind(self, keysym: int) -> int:
        """Bind a keysym no key types to a spare keycode (both levels), and return that keycode."""
        if not self._spare:
            raise ExecutorError("unsupported", f"no key types keysym {keysym:#x} and the keymap has no spare keycode")
        keycode = self._spare[self._next_spare % len(self._spare)]
        self._next_spare += 1
        per = len(self._keymap[0])
        row = [keysym, keysym] + [0] * (per - 2)
        await self._request(
            struct.pack("<BBHBBxx", _CHANGE_KEYBOARD_MAPPING, 1, 2 + per, keycode, per) + struct.pack(f"<{per}I", *row),
            reply=False,
        )
        for old in self._keymap[keycode - self.min_keycode]:  # the keysym it typed before types no more
            if self._codes.get(old, (0,))[0] == keycode:
                del self._codes[old]
        self._keymap[keycode - self.min_keycode] = row
        self._codes[keysym] = (keycode, False)
        # Applications reread the keymap when they see MappingNotify: let it arrive before the key.
        await self.sync()
        return keycode

    async def send(self, events: list[InputEvent]) -> None:
        """Play ``events`` in order through XTEST, then wait until the server processed them."""
        for event in events:  # all or nothing: refuse a bad position before any event is played
            if isinstance(event, PointerMove):
                self._inside(event.x, event.y)
        await self._xtest()
        if not self._keymap:
            await self._load_keymap()
        for event in events:
            if isinstance(event, PointerMove):
                self._write(self._fake(_MOTION, 0, event.x, event.y))
            elif isinstance(event, ButtonEvent):
                self._write(self._fake(_BUTTON_PRESS if event.down else _BUTTON_RELEASE, event.button))
            elif isinstance(event, KeyEvent):
                found = self._find(event.keysym)
                if found is None:
                    found = (await self._bind(event.keysym), False)
                keycode, shift = found
                shift_code = self._find(_SHIFT_L) if shift else None
                if event.down:
                    if shift_code is not None:
                        self._write(self._fake(_KEY_PRESS, shift_code[0]))
                        self._shifted.add(keycode)
                    self._write(self._fake(_KEY_PRESS, keycode))
                else:
                    self._write(self._fake(_KEY_RELEASE, keycode))
                    if keycode in self._shifted and shift_code is not None:
                        self._shifted.discard(keycode)
                        self._write(self._fake(_KEY_RELEASE, shift_code[0]))
            elif isinstance(event, PauseEvent):
                await self.sync()
                await asyncio.sleep(event.seconds)
        await self.sync()


def encode_png(bgrx: memoryview | bytes, width: int, height: int, level: int) -> bytes:
    """A PNG (8-bit RGB, no filter) of 32-bit B, G, R, X pixels."""
    bgrx = bytes(bgrx)  # strided slices of bytes copy three times faster than of a memoryview
    rgb = bytearray(width * height * 3)
    rgb[0::3] = bgrx[2::4]
    rgb[1::3] = bgrx[1::4]
    rgb[2::3] = bgrx[0::4]
    stride = width * 3
    packer = zlib.compressobj(level)
    parts = []
    view = memoryview(rgb)
    for row in range(height):
        parts.append(packer.compress(b"\0"))
        parts.append(packer.compress(view[row * stride : (row + 1) * stride]))
    parts.append(packer.flush())

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", b"".join(parts)) + chunk(b"IEND", b"")


class Displays:
    """The executor's connections to X displays in the sandbox, one per display."""

    def __init__(self) -> None:
        self._conns: dict[tuple[str, str | None], Connection] = {}
        self._opening = asyncio.Lock()

    @asynccontextmanager
    async def use(self, display: str, xauthority: str | None) -> AsyncIterator[Connection]:
        """A connection to the display for one request; dropped if the request broke it."""
        key = (display, xauthority)
        async with self._opening:
            conn = self._conns.get(key)
            if conn is not None and conn.broken:  # that server exited; another may have its display now
                self._drop(key, conn)
                conn = None
            if conn is None:
                conn = self._conns[key] = await Connection.open(display, xauthority)
        async with conn.lock:
            try:
                yield conn
            except (struct.error, IndexError):
                self._drop(key, conn)
                raise ExecutorError("no_display", f"a malformed reply from the X server on {display}") from None
            except BaseException:
                # The server went away, refused a request (its reply may still come) or the request
                # was cancelled mid-way: the stream may be out of step, so the next request reconnects.
                self._drop(key, conn)
                raise

    def _drop(self, key: tuple[str, str | None], conn: Connection) -> None:
        conn.close()
        if self._conns.get(key) is conn:
            del self._conns[key]

    def close(self) -> None:
        """Close every connection."""
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()
