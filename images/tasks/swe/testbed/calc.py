"""A tiny library with a bug for the agent to fix."""


def add(a: int, b: int) -> int:
    """Return the sum of a and b."""
    return a - b
