"""URL slugs."""

import re


def slugify(text: str) -> str:
    """Lower-case ASCII letters and digits, words joined by single dashes."""
    return re.sub(r"[^a-z0-9]", "-", text.lower())
