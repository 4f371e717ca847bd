"""docs/promises.md names a proof for each README promise: every test and file it names exists.

A test is named by its pytest node id (``tests/x.py::test_name``, or
``tests/x.py::TestClass::test_name``, a parametrized id's ``[...]`` ignored) and
found by parsing the file, so a renamed or deleted test fails here instead of
leaving its promise unproven in silence. Benchmarks and results files are named
by their paths.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
PROMISES = ROOT / "docs" / "promises.md"
#: A backticked test node id, or a backticked path under benchmarks/.
NODE = re.compile(r"`(tests/[\w/.-]+\.py)((?:::\w+)+)(\[[^`]*\])?`")
PATH = re.compile(r"`(benchmarks/[\w/.-]+\.(?:py|json|png|md))`")


def defined(tree: ast.Module, names: list[str]) -> bool:
    """Whether ``names`` (a class path ending in a function) is defined at the top of ``tree``."""
    body: list[ast.stmt] = tree.body
    for i, name in enumerate(names):
        last = i == len(names) - 1
        kinds = (ast.FunctionDef, ast.AsyncFunctionDef) if last else (ast.ClassDef,)
        found = [n for n in body if isinstance(n, kinds) and n.name == name]
        if not found:
            return False
        body = getattr(found[0], "body", [])
    return True


def missing(text: str, root: Path) -> list[str]:
    """What ``text`` (a promises page) names that does not exist under ``root``."""
    absent: list[str] = []
    trees: dict[Path, ast.Module | None] = {}
    for path, node, _params in NODE.findall(text):
        file = root / path
        if file not in trees:
            trees[file] = ast.parse(file.read_text()) if file.is_file() else None
        tree = trees[file]
        names = node.removeprefix("::").split("::")
        if tree is None or not defined(tree, names):
            absent.append(f"{path}{node}")
    absent += [path for path in PATH.findall(text) if not (root / path).is_file()]
    return absent


def test_every_test_and_file_the_promises_name_exists() -> None:
    text = PROMISES.read_text()
    assert len(NODE.findall(text)) > 100  # the page still names its proofs the way this test reads them
    assert len(PATH.findall(text)) > 10
    assert missing(text, ROOT) == []


def test_a_missing_test_a_missing_method_and_a_missing_file_are_reported(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "bench_x.py").write_text("")
    (tmp_path / "tests" / "test_x.py").write_text(
        "def test_here(): pass\n\nasync def test_async(): pass\n\nclass TestGroup:\n    def test_method(self): pass\n"
    )
    page = (
        "| a | `tests/test_x.py::test_here` |\n"
        "| b | `tests/test_x.py::test_async[local-bwrap]` |\n"
        "| c | `tests/test_x.py::TestGroup::test_method` |\n"
        "| d | `benchmarks/bench_x.py` |\n"
    )
    assert missing(page, tmp_path) == []
    wrong = (
        "`tests/test_x.py::test_gone` `tests/test_x.py::TestGroup::test_gone` `tests/test_x.py::test_method` "
        "`tests/test_y.py::test_here` `benchmarks/results/x.json`"
    )
    assert missing(wrong, tmp_path) == [
        "tests/test_x.py::test_gone",
        "tests/test_x.py::TestGroup::test_gone",
        "tests/test_x.py::test_method",
        "tests/test_y.py::test_here",
        "benchmarks/results/x.json",
    ]
