"""Tasks and rewards: SWE-bench instances as they are, generic tasks, and grading."""

from ._types import Reward, Task

__all__ = ["Reward", "Task"]
