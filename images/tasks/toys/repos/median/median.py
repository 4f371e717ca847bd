"""The median of a list of numbers."""


def median(xs: list[float]) -> float:
    """The middle value of ``xs``, or the mean of the two middle values when there is an even number."""
    if not xs:
        raise ValueError("median of no numbers")
    s = sorted(xs)
    return s[len(s) // 2]
