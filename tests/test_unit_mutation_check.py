"""``scripts/mutation --check``: which results of a run fail it (what CI's mutation check decides on)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytestmark = pytest.mark.unit

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "mutation"


def script() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("orchard_scripts_mutation", str(SCRIPT))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def summary(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "path": "src/orchard/_retry.py",
        "functions": ["poll_delays"],
        "survivors": [],
        "others": [],
        "untested_functions": {},
    }
    return base | fields


def survivor(name: str) -> dict[str, Any]:
    return {"name": name, "line": 7, "before": "a < b", "after": "a <= b"}


def test_a_clean_run_passes_and_a_listed_equivalent_survivor_does_not_fail_it() -> None:
    unhandled = script().unhandled
    assert unhandled([summary(others=[{"name": "m.x_f__mutmut_2", "status": "timeout"}])], {}) == []
    listed = summary(survivors=[survivor("m.x_poll_delays__mutmut_1")])
    assert unhandled([listed], {"m.x_poll_delays__mutmut_1": "why no caller can tell"}) == []


def test_an_unlisted_survivor_a_crash_and_an_untested_chosen_function_each_fail_it() -> None:
    unhandled = script().unhandled
    run = summary(
        survivors=[survivor("m.x_poll_delays__mutmut_1"), survivor("m.x_poll_delays__mutmut_3")],
        others=[{"name": "m.x_poll_delays__mutmut_4", "status": "segfault"}],
        untested_functions={"x_other": 5},
    )
    failures = unhandled([run], {"m.x_poll_delays__mutmut_1": "equivalent"})
    assert failures == [
        "survived: src/orchard/_retry.py:7 (poll_delays) a < b -> a <= b",
        "segfault: m.x_poll_delays__mutmut_4",
        "no test calls src/orchard/_retry.py: other",
    ]
    # A whole module's run (no functions chosen) does not fail on functions its tests never call:
    # those mutants show as "no tests" in the report instead.
    assert unhandled([summary(functions=None, untested_functions={"x_other": 5})], {}) == []
