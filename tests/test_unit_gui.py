"""The pure parts of the GUI layer: the executor's PNG encoder, Xauthority parsing, and key names."""

from __future__ import annotations

import io
import os
import struct
from pathlib import Path

import pytest
from PIL import Image

from orchard.errors import InvalidRequest
from orchard.gui import _keys
from orchard_executor.display import cookie, encode_png, socket_path


def test_the_png_encoder_keeps_every_pixel() -> None:
    w, h = 37, 11  # odd sizes: rows are not word-aligned
    rgb = os.urandom(w * h * 3)
    bgrx = bytearray(w * h * 4)
    bgrx[2::4], bgrx[1::4], bgrx[0::4], bgrx[3::4] = rgb[0::3], rgb[1::3], rgb[2::3], b"\xaa" * (w * h)
    for level in (0, 1, 9):
        with Image.open(io.BytesIO(encode_png(memoryview(bytes(bgrx)), w, h, level))) as im:
            assert (im.size, im.mode) == ((w, h), "RGB")
            assert im.tobytes() == rgb


def entry(family: int, address: bytes, number: bytes, name: bytes, data: bytes) -> bytes:
    return struct.pack(">H", family) + b"".join(struct.pack(">H", len(f)) + f for f in (address, number, name, data))


def test_the_cookie_for_the_display_is_read_from_an_xauthority_file(tmp_path: Path) -> None:
    path = tmp_path / "xauth"
    path.write_bytes(
        entry(256, b"host", b"3", b"MIT-MAGIC-COOKIE-1", b"three")
        + entry(256, b"host", b"7", b"XDM-AUTHORIZATION-1", b"other")
        + entry(256, b"host", b"7", b"MIT-MAGIC-COOKIE-1", b"seven")
    )
    assert cookie(str(path), ":7") == b"seven"
    assert cookie(str(path), ":3.0") == b"three"
    assert cookie(str(path), ":9") is None
    assert socket_path(":12.0") == "/tmp/.X11-unix/X12"


def test_a_truncated_xauthority_file_is_a_bad_request(tmp_path: Path) -> None:
    from orchard_executor.errors import ExecutorError

    path = tmp_path / "xauth"
    path.write_bytes(entry(256, b"host", b"1", b"MIT-MAGIC-COOKIE-1", b"x")[:-3] + b"\xff\xff")
    with pytest.raises(ExecutorError, match="not an Xauthority file"):
        cookie(str(path), ":5")


def test_key_names_as_models_write_them() -> None:
    ctrl, shift = _keys.NAMED["ctrl"], _keys.NAMED["shift"]
    assert _keys.combo("ctrl+s") == [ctrl, ord("s")]
    assert _keys.combo("CTRL+SHIFT+T") == [ctrl, shift, ord("T")]
    assert _keys.combo("Return") == _keys.combo("ENTER") == [0xFF0D]
    assert _keys.combo("ArrowLeft") == _keys.combo("Left") == [0xFF51]
    assert _keys.combo("ctrl++") == [ctrl, ord("+")]
    assert _keys.combo("F12") == [0xFFC9]
    assert _keys.char_keysym("é") == 0xE9
    assert _keys.char_keysym("€") == 0x010020AC
    assert _keys.char_keysym("\n") == 0xFF0D


@pytest.mark.parametrize("bad", ["hyperdrive", "ctrl+", "ctrl++x", "", "F25"])
def test_unknown_or_malformed_keys_are_invalid_requests(bad: str) -> None:
    with pytest.raises(InvalidRequest):
        _keys.combo(bad)


def test_control_characters_cannot_be_typed() -> None:
    with pytest.raises(InvalidRequest, match="control character"):
        _keys.char_keysym("\x07")


def test_the_callers_chromium_features_are_merged_with_orchards() -> None:
    from orchard.gui._browser import _features

    argv = _features(["--enable-features=Foo", "--lang=de", "--disable-features=Bar,Baz"])
    assert argv[0] == "--enable-features=CDPScreenshotNewSurface,Foo"
    assert argv[1].startswith("--disable-features=PaintHolding,")
    assert argv[1].endswith(",Bar,Baz")
    assert argv[2:] == ["--lang=de"]
