"""A pytest plugin for ``scripts/mutation`` (mutmut): mutants of the executor reach its process.

Loaded only by mutation runs (``-p mutation_support``); plain pytest never
imports it. mutmut rewrites each function into a trampoline that picks the
original or one mutant by ``MUTANT_UNDER_TEST`` in the environment. The tests
import the mutated copy (``mutants/executor`` is first on PYTHONPATH) and the
local backend launches the executor from where this process found it, so the
executor's process runs the mutated code too; but the backend gives that
process a clean environment (``LocalBackend._environment``), without
``MUTANT_UNDER_TEST``, so every trampoline there would run the original.
This plugin adds the variable to that environment.

mutmut also maps each function to the tests that call it ("stats") by
recording calls in the test process; calls in an executor's process are not
seen. For the modules named in ``MUTATION_PROCESS_MODULES`` (comma
separated), a test that started an executor counts as calling every function
of those modules: coarse (a surviving mutant runs all such tests), never a
mutant left untested for want of a mapping.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import pytest

#: mutmut's modes that are not a mutant: in "stats" a trampoline records into
#: mutmut's state, which an executor cannot reach, so its process runs the original.
_NOT_A_MUTANT = {"stats", "list_all_tests", "mutant_generation"}
_started_executor = False


def _mutant() -> str:
    value = os.environ.get("MUTANT_UNDER_TEST", "")
    return "" if value in _NOT_A_MUTANT else value


def pytest_configure(config: pytest.Config) -> None:
    from orchard._backends import local

    original = local.LocalBackend._environment

    def _environment(self: Any, *args: Any, **kwargs: Any) -> dict[str, str]:
        global _started_executor
        _started_executor = True
        # Always present (empty for the clean run), so a test that reads the
        # sandbox's environment sees the same keys with and without a mutant.
        return {**original(self, *args, **kwargs), "MUTANT_UNDER_TEST": _mutant()}

    local.LocalBackend._environment = _environment  # type: ignore[method-assign]


def _functions(module_name: str) -> list[str]:
    """The names mutmut's stats give the trampolined functions of a mutated module."""
    module = importlib.import_module(module_name)
    prefix, suffix = "mutants_", "__mutmut"
    return [
        f"{module.__name__}.{name[len(prefix) : -len(suffix)]}"
        for name, value in vars(module).items()
        if name.startswith(prefix) and name.endswith(suffix) and isinstance(value, dict)
    ]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    """In mutmut's stats run: a test that started an executor called the executor modules."""
    global _started_executor
    started, _started_executor = _started_executor, False
    if os.environ.get("MUTANT_UNDER_TEST") != "stats" or not started:
        return
    from mutmut.state import state

    for module_name in filter(None, os.environ.get("MUTATION_PROCESS_MODULES", "").split(",")):
        state()._stats.update(_functions(module_name))
