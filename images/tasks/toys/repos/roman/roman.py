"""Roman numerals."""

_TABLE = [(1000, "M"), (500, "D"), (100, "C"), (50, "L"), (10, "X"), (5, "V"), (1, "I")]


def to_roman(n: int) -> str:
    """The Roman numeral for 1 <= n <= 3999."""
    if not 0 < n < 4000:
        raise ValueError(f"{n} has no Roman numeral")
    out = []
    for value, letters in _TABLE:
        while n >= value:
            out.append(letters)
            n -= value
    return "".join(out)
