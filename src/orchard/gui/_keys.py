"""Key names as computer-use models write them, to X keysyms.

``key("ctrl+s")``, ``key("Return")``, ``key("alt+Tab")``, ``key("ctrl+shift+t")``:
xdotool's syntax, which Anthropic's computer-use tool uses, with the names of
OpenAI's computer-use ``keypress`` (``"CTRL"``, ``"ENTER"``, ``"ARROWLEFT"``)
accepted too, case-insensitively. A single character is itself; anything
else must be a name here, or ``InvalidRequest`` is raised.
"""

from __future__ import annotations

from ._common import invalid

#: X keysyms of named keys (from X11/keysymdef.h), and the aliases models use.
NAMED: dict[str, int] = {
    "return": 0xFF0D,
    "enter": 0xFF0D,
    "kp_enter": 0xFF8D,
    "tab": 0xFF09,
    "iso_left_tab": 0xFE20,
    "escape": 0xFF1B,
    "esc": 0xFF1B,
    "backspace": 0xFF08,
    "delete": 0xFFFF,
    "del": 0xFFFF,
    "insert": 0xFF63,
    "home": 0xFF50,
    "end": 0xFF57,
    "left": 0xFF51,
    "up": 0xFF52,
    "right": 0xFF53,
    "down": 0xFF54,
    "arrowleft": 0xFF51,
    "arrowup": 0xFF52,
    "arrowright": 0xFF53,
    "arrowdown": 0xFF54,
    "page_up": 0xFF55,
    "prior": 0xFF55,
    "pageup": 0xFF55,
    "page_down": 0xFF56,
    "next": 0xFF56,
    "pagedown": 0xFF56,
    "print": 0xFF61,
    "menu": 0xFF67,
    "pause": 0xFF13,
    "scroll_lock": 0xFF14,
    "num_lock": 0xFF7F,
    "caps_lock": 0xFFE5,
    "capslock": 0xFFE5,
    "shift": 0xFFE1,
    "shift_l": 0xFFE1,
    "shift_r": 0xFFE2,
    "ctrl": 0xFFE3,
    "control": 0xFFE3,
    "control_l": 0xFFE3,
    "control_r": 0xFFE4,
    "alt": 0xFFE9,
    "alt_l": 0xFFE9,
    "alt_r": 0xFFEA,
    "option": 0xFFE9,
    "meta": 0xFFE7,
    "meta_l": 0xFFE7,
    "super": 0xFFEB,
    "super_l": 0xFFEB,
    "super_r": 0xFFEC,
    "cmd": 0xFFEB,
    "win": 0xFFEB,
    "space": 0x20,
    "minus": 0x2D,
    "plus": 0x2B,
    "equal": 0x3D,
    "comma": 0x2C,
    "period": 0x2E,
    "slash": 0x2F,
    "backslash": 0x5C,
    "semicolon": 0x3B,
    "apostrophe": 0x27,
    "quotedbl": 0x22,
    "grave": 0x60,
    "asciitilde": 0x7E,
    "bracketleft": 0x5B,
    "bracketright": 0x5D,
    "braceleft": 0x7B,
    "braceright": 0x7D,
    "parenleft": 0x28,
    "parenright": 0x29,
    "less": 0x3C,
    "greater": 0x3E,
    "question": 0x3F,
    "exclam": 0x21,
    "at": 0x40,
    "numbersign": 0x23,
    "dollar": 0x24,
    "percent": 0x25,
    "asciicircum": 0x5E,
    "ampersand": 0x26,
    "asterisk": 0x2A,
    "underscore": 0x5F,
    "bar": 0x7C,
    "colon": 0x3A,
}
NAMED.update({f"f{n}": 0xFFBE + n - 1 for n in range(1, 25)})


def char_keysym(ch: str) -> int:
    """The keysym that types one character (Latin-1 is itself, the rest Unicode's keysym range)."""
    if ch == "\n":
        return NAMED["return"]
    if ch == "\t":
        return NAMED["tab"]
    code = ord(ch)
    if code < 0x20 or 0x7F <= code < 0xA0:
        raise invalid(f"cannot type control character {ch!r}")
    return code if code < 0x100 else 0x01000000 + code


def keysym(name: str) -> int:
    """The keysym of one key name: ``"a"``, ``"Return"``, ``"ctrl"``, ``"F5"``, ``"ARROWLEFT"``."""
    if len(name) == 1:
        return char_keysym(name)
    found = NAMED.get(name.lower())
    if found is None:
        raise invalid(f"unknown key {name!r} (a character, or a name such as Return, ctrl, F5, Left)")
    return found


def combo(keys: str) -> list[int]:
    """The keysyms of ``"ctrl+shift+t"``: held in order, released in reverse."""
    parts = keys.split("+") if keys != "+" else ["+"]
    if "" in parts:
        # "ctrl++" means ctrl and plus.
        if keys.endswith("++"):
            parts = [*keys[:-2].split("+"), "+"]
        else:
            raise invalid(f"malformed key combination {keys!r}")
    return [keysym(p) for p in parts]
