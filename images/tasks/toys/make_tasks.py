"""Write the toy tasks: the repositories in repos/ (the image's and local_dir's) and examples/tasks/swe-mini.jsonl.

Each toy is a small Python module with a real bug and unittest tests: the
repository holds the buggy module and the tests that pass already
(PASS_TO_PASS); the task's ``test_patch`` adds the tests the bug fails
(FAIL_TO_PASS), its ``patch`` is the fix and ``wrong_patches`` are plausible
fixes that are wrong (for ``orchard.tasks.ScriptedPolicy``). Everything here
is the source: edit it and run ``python3 images/tasks/toys/make_tasks.py``,
which also checks each task with the host's python3 (3.11 or later: the
test names are unittest's 3.11 format): the tests named FAIL_TO_PASS fail
before the fix and pass after, PASS_TO_PASS pass in both, and every wrong
patch fails one of them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPOS = HERE / "repos"
OUT = HERE.parents[2] / "examples" / "tasks" / "swe-mini.jsonl"
IMAGE = "orchard-test/toys:latest"
# The same commit as orchard.tasks._sandbox.COMMIT_BASE and the Dockerfile make.
GIT_ENV = {
    "GIT_AUTHOR_NAME": "orchard",
    "GIT_AUTHOR_EMAIL": "orchard@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z",
    "GIT_COMMITTER_NAME": "orchard",
    "GIT_COMMITTER_EMAIL": "orchard@localhost",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z",
}
GITIGNORE = "__pycache__/\n"
HEADER = "import unittest\n\n"

TOYS: list[dict[str, object]] = [
    {
        "name": "roman",
        "module": '''"""Roman numerals."""

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
''',
        "fixed": '''"""Roman numerals."""

_TABLE = [
    (1000, "M"),
    (900, "CM"),
    (500, "D"),
    (400, "CD"),
    (100, "C"),
    (90, "XC"),
    (50, "L"),
    (40, "XL"),
    (10, "X"),
    (9, "IX"),
    (5, "V"),
    (4, "IV"),
    (1, "I"),
]


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
''',
        "wrong": [
            '''"""Roman numerals."""

_TABLE = [(1000, "M"), (500, "D"), (100, "C"), (50, "L"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")]


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
'''
        ],
        "class": "TestRoman",
        "p2p": {
            "test_one": 'self.assertEqual(to_roman(1), "I")',
            "test_three": 'self.assertEqual(to_roman(3), "III")',
            "test_twenty_six": 'self.assertEqual(to_roman(26), "XXVI")',
            "test_rejects_zero": "self.assertRaises(ValueError, to_roman, 0)",
        },
        "f2p": {
            "test_four": 'self.assertEqual(to_roman(4), "IV")',
            "test_nineteen_ninety_four": 'self.assertEqual(to_roman(1994), "MCMXCIV")',
        },
        "import": "from roman import to_roman",
        "issue": "to_roman(4) returns 'IIII' and to_roman(1994) returns 'MDCCCCLXXXXIIII'. "
        "Roman numerals write 4 as IV, 9 as IX, 40 as XL, 90 as XC, 400 as CD and 900 as CM.",
    },
    {
        "name": "slugify",
        "module": '''"""URL slugs."""

import re


def slugify(text: str) -> str:
    """Lower-case ASCII letters and digits, words joined by single dashes."""
    return re.sub(r"[^a-z0-9]", "-", text.lower())
''',
        "fixed": '''"""URL slugs."""

import re


def slugify(text: str) -> str:
    """Lower-case ASCII letters and digits, words joined by single dashes."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
''',
        "wrong": [
            '''"""URL slugs."""

import re


def slugify(text: str) -> str:
    """Lower-case ASCII letters and digits, words joined by single dashes."""
    return re.sub(r"[^a-z0-9]", "-", text.lower()).strip("-")
''',
            '''"""URL slugs."""

import re


def slugify(text: str) -> str:
    """Lower-case ASCII letters and digits, words joined by single dashes."""
    return re.sub(r"[^a-z]+", "-", text.lower()).strip("-")
''',
        ],
        "class": "TestSlugify",
        "p2p": {
            "test_two_words": 'self.assertEqual(slugify("Hello World"), "hello-world")',
            "test_lower_case": 'self.assertEqual(slugify("ABC"), "abc")',
            "test_keeps_digits": 'self.assertEqual(slugify("Route 66"), "route-66")',
        },
        "f2p": {
            "test_collapses_separators": 'self.assertEqual(slugify("Hello, World!"), "hello-world")',
            "test_strips_edges": 'self.assertEqual(slugify("  spaced out  "), "spaced-out")',
        },
        "import": "from slugify import slugify",
        "issue": 'slugify("Hello, World!") gives "hello--world-": punctuation and spaces next to each other '
        "should make one dash, and a slug should not begin or end with a dash.",
    },
    {
        "name": "intervals",
        "module": '''"""Merging closed intervals."""


def merge(intervals: list[list[int]]) -> list[list[int]]:
    """The union of closed intervals [start, end], as disjoint intervals in order."""
    out: list[list[int]] = []
    for start, end in intervals:
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out
''',
        "fixed": '''"""Merging closed intervals."""


def merge(intervals: list[list[int]]) -> list[list[int]]:
    """The union of closed intervals [start, end], as disjoint intervals in order."""
    out: list[list[int]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out
''',
        "wrong": [
            '''"""Merging closed intervals."""


def merge(intervals: list[list[int]]) -> list[list[int]]:
    """The union of closed intervals [start, end], as disjoint intervals in order."""
    out: list[list[int]] = []
    for start, end in sorted(intervals, key=lambda iv: iv[1]):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out
'''
        ],
        "class": "TestMerge",
        "p2p": {
            "test_empty": "self.assertEqual(merge([]), [])",
            "test_disjoint": "self.assertEqual(merge([[1, 2], [4, 5]]), [[1, 2], [4, 5]])",
            "test_overlapping": "self.assertEqual(merge([[1, 3], [2, 6]]), [[1, 6]])",
        },
        "f2p": {
            "test_unsorted": "self.assertEqual(merge([[8, 10], [1, 3], [2, 6]]), [[1, 6], [8, 10]])",
            "test_nested_unsorted": "self.assertEqual(merge([[2, 6], [1, 10]]), [[1, 10]])",
        },
        "import": "from intervals import merge",
        "issue": "merge([[8, 10], [1, 3], [2, 6]]) returns [[8, 10], [1, 6]]: intervals given out of order are "
        "neither merged nor sorted. merge should accept intervals in any order.",
    },
    {
        "name": "lru",
        "module": '''"""A least-recently-used cache."""

from collections import OrderedDict


class LRUCache:
    """Holds up to ``capacity`` items; adding one more evicts the least recently used."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._data: OrderedDict[str, object] = OrderedDict()

    def get(self, key: str) -> object:
        """The value of ``key``, or None."""
        if key not in self._data:
            return None
        return self._data[key]

    def put(self, key: str, value: object) -> None:
        """Store ``value`` under ``key``."""
        self._data[key] = value
        self._data.move_to_end(key)
        if len(self._data) > self.capacity:
            self._data.popitem(last=False)
''',
        "fixed": '''"""A least-recently-used cache."""

from collections import OrderedDict


class LRUCache:
    """Holds up to ``capacity`` items; adding one more evicts the least recently used."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._data: OrderedDict[str, object] = OrderedDict()

    def get(self, key: str) -> object:
        """The value of ``key``, or None."""
        if key not in self._data:
            return None
        self._data.move_to_end(key)
        return self._data[key]

    def put(self, key: str, value: object) -> None:
        """Store ``value`` under ``key``."""
        self._data[key] = value
        self._data.move_to_end(key)
        if len(self._data) > self.capacity:
            self._data.popitem(last=False)
''',
        "wrong": [
            '''"""A least-recently-used cache."""

from collections import OrderedDict


class LRUCache:
    """Holds up to ``capacity`` items; adding one more evicts the least recently used."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._data: OrderedDict[str, object] = OrderedDict()

    def get(self, key: str) -> object:
        """The value of ``key``, or None."""
        if key not in self._data:
            return None
        self._data.move_to_end(key, last=False)
        return self._data[key]

    def put(self, key: str, value: object) -> None:
        """Store ``value`` under ``key``."""
        self._data[key] = value
        self._data.move_to_end(key)
        if len(self._data) > self.capacity:
            self._data.popitem(last=False)
'''
        ],
        "class": "TestLRUCache",
        "p2p": {
            "test_put_then_get": 'c = LRUCache(2)\n        c.put("a", 1)\n        self.assertEqual(c.get("a"), 1)',
            "test_missing_is_none": 'self.assertIsNone(LRUCache(1).get("x"))',
            "test_evicts_oldest": 'c = LRUCache(2)\n        for k in "abc":\n            c.put(k, k)\n'
            '        self.assertIsNone(c.get("a"))\n        self.assertEqual(c.get("c"), "c")',
        },
        "f2p": {
            "test_get_refreshes": 'c = LRUCache(2)\n        c.put("a", 1)\n        c.put("b", 2)\n'
            '        c.get("a")\n        c.put("c", 3)\n        self.assertEqual(c.get("a"), 1)\n'
            '        self.assertIsNone(c.get("b"))',
        },
        "import": "from lru import LRUCache",
        "issue": "LRUCache evicts an item that was just read: after put a, put b, get a, put c (capacity 2), "
        "a is gone and b is kept. Reading an item should make it the most recently used.",
    },
    {
        "name": "semver",
        "module": '''"""Comparing version strings."""


def compare(a: str, b: str) -> int:
    """-1, 0 or 1 as version ``a`` ("MAJOR.MINOR.PATCH") is lower than, equal to or higher than ``b``."""
    left, right = a.split("."), b.split(".")
    return (left > right) - (left < right)
''',
        "fixed": '''"""Comparing version strings."""


def compare(a: str, b: str) -> int:
    """-1, 0 or 1 as version ``a`` ("MAJOR.MINOR.PATCH") is lower than, equal to or higher than ``b``."""
    left, right = [int(p) for p in a.split(".")], [int(p) for p in b.split(".")]
    return (left > right) - (left < right)
''',
        "wrong": [
            '''"""Comparing version strings."""


def compare(a: str, b: str) -> int:
    """-1, 0 or 1 as version ``a`` ("MAJOR.MINOR.PATCH") is lower than, equal to or higher than ``b``."""
    left, right = [p.zfill(2) for p in a.split(".")], [p.zfill(2) for p in b.split(".")]
    return (left > right) - (left < right)
'''
        ],
        "class": "TestCompare",
        "p2p": {
            "test_equal": 'self.assertEqual(compare("1.2.3", "1.2.3"), 0)',
            "test_major": 'self.assertEqual(compare("2.0.0", "1.0.0"), 1)',
            "test_patch_lower": 'self.assertEqual(compare("1.0.0", "1.0.1"), -1)',
        },
        "f2p": {
            "test_minor_ten": 'self.assertEqual(compare("1.10.0", "1.9.0"), 1)',
            "test_patch_ten": 'self.assertEqual(compare("1.0.2", "1.0.10"), -1)',
            "test_minor_hundred": 'self.assertEqual(compare("1.100.0", "1.99.0"), 1)',
        },
        "import": "from semver import compare",
        "issue": 'compare("1.10.0", "1.9.0") returns -1: version parts are compared as text, so 10 sorts '
        "before 9. They should be compared as numbers.",
    },
    {
        "name": "median",
        "module": '''"""The median of a list of numbers."""


def median(xs: list[float]) -> float:
    """The middle value of ``xs``, or the mean of the two middle values when there is an even number."""
    if not xs:
        raise ValueError("median of no numbers")
    s = sorted(xs)
    return s[len(s) // 2]
''',
        "fixed": '''"""The median of a list of numbers."""


def median(xs: list[float]) -> float:
    """The middle value of ``xs``, or the mean of the two middle values when there is an even number."""
    if not xs:
        raise ValueError("median of no numbers")
    s = sorted(xs)
    n = len(s)
    if n % 2:
        return s[n // 2]
    return (s[n // 2 - 1] + s[n // 2]) / 2
''',
        "wrong": [
            '''"""The median of a list of numbers."""


def median(xs: list[float]) -> float:
    """The middle value of ``xs``, or the mean of the two middle values when there is an even number."""
    if not xs:
        raise ValueError("median of no numbers")
    n = len(xs)
    if n % 2:
        return sorted(xs)[n // 2]
    return (xs[n // 2 - 1] + xs[n // 2]) / 2
''',
            '''"""The median of a list of numbers."""


def median(xs: list[float]) -> float:
    """The middle value of ``xs``, or the mean of the two middle values when there is an even number."""
    s = sorted(xs)
    n = len(s)
    if n % 2:
        return s[n // 2]
    return (s[n // 2 - 1] + s[n // 2]) / 2
''',
        ],
        "class": "TestMedian",
        "p2p": {
            "test_odd": "self.assertEqual(median([3, 1, 2]), 2)",
            "test_single": "self.assertEqual(median([5]), 5)",
            "test_empty_raises": "self.assertRaises(ValueError, median, [])",
        },
        "f2p": {
            "test_even": "self.assertEqual(median([1, 2, 3, 4]), 2.5)",
            "test_even_unsorted": "self.assertEqual(median([4, 1, 3, 2]), 2.5)",
        },
        "import": "from median import median",
        "issue": "median([1, 2, 3, 4]) returns 3; with an even number of values the median is the mean "
        "of the two middle ones, 2.5.",
    },
]


def _tests(toy: dict, names: dict) -> str:
    body = "".join(f"    def {name}(self):\n        {code}\n\n" for name, code in names.items())
    return f"{HEADER}{toy['import']}\n\n\nclass {toy['class']}(unittest.TestCase):\n{body.rstrip()}\n"


def _git(repo: Path, *args: str, check: bool = True) -> str:
    env = {**os.environ, **GIT_ENV}
    p = subprocess.run(["git", *args], cwd=repo, env=env, capture_output=True, text=True, check=False)
    if check and p.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {p.stderr}")
    return p.stdout


def _diff(base: Path, path: str, content: str) -> str:
    (base / path).write_text(content)
    diff = _git(base, "diff")
    _git(base, "checkout", "--", ".")
    return diff


def _statuses(repo: Path) -> dict[str, str]:
    p = subprocess.run(
        [sys.executable, "-m", "unittest", "-v"],
        cwd=repo,
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    return dict(re.findall(r"^(test_\w+ \([\w.]+\)) \.\.\. (ok|FAIL|ERROR)$", p.stderr, re.M))


def _check(toy: dict, base: Path, patch: str, test_patch: str, f2p: list[str], p2p: list[str], wrong: list[str]):
    def run(*patches: str) -> dict[str, str]:
        with tempfile.TemporaryDirectory() as tmp:
            repo = Path(tmp) / "repo"
            shutil.copytree(base, repo)
            for p in patches:
                subprocess.run(["git", "apply", "-"], cwd=repo, input=p, text=True, check=True)
            return _statuses(repo)

    before, after = run(test_patch), run(patch, test_patch)
    assert all(before.get(t) != "ok" for t in f2p), (toy["name"], before)
    assert all(before.get(t) == "ok" for t in p2p), (toy["name"], before)
    assert all(after.get(t) == "ok" for t in f2p + p2p), (toy["name"], after)
    for w in wrong:
        got = run(w, test_patch)
        assert any(got.get(t) != "ok" for t in f2p + p2p), (toy["name"], "a wrong patch passes", got)


def main() -> None:
    """Write repos/ and the JSONL, checking every task."""
    shutil.rmtree(REPOS, ignore_errors=True)
    lines = []
    for toy in TOYS:
        name = str(toy["name"])
        repo = REPOS / name
        repo.mkdir(parents=True)
        module, test_file = f"{name}.py", f"test_{name}.py"
        (repo / ".gitignore").write_text(GITIGNORE)
        (repo / module).write_text(str(toy["module"]))
        (repo / test_file).write_text(_tests(toy, toy["p2p"]))  # type: ignore[arg-type]
        with tempfile.TemporaryDirectory() as tmp:
            base = Path(tmp) / name
            shutil.copytree(repo, base)
            _git(base, "init", "-q")
            _git(base, "add", "-A")
            _git(base, "commit", "-q", "-m", "base")
            commit = _git(base, "rev-parse", "HEAD").strip()
            patch = _diff(base, module, str(toy["fixed"]))
            test_patch = _diff(base, test_file, _tests(toy, {**toy["p2p"], **toy["f2p"]}))  # type: ignore[dict-item]
            wrong = [_diff(base, module, w) for w in toy["wrong"]]  # type: ignore[attr-defined]
            mod = f"test_{name}.{toy['class']}"
            f2p = [f"{t} ({mod}.{t})" for t in toy["f2p"]]  # type: ignore[attr-defined]
            p2p = [f"{t} ({mod}.{t})" for t in toy["p2p"]]  # type: ignore[attr-defined]
            _check(toy, base, patch, test_patch, f2p, p2p, wrong)
        lines.append(
            {
                "instance_id": f"toys__{name}-1",
                "repo": f"orchard-toys/{name}",
                "base_commit": commit,
                "problem_statement": toy["issue"],
                "patch": patch,
                "test_patch": test_patch,
                "FAIL_TO_PASS": f2p,
                "PASS_TO_PASS": p2p,
                "version": "1.0",
                "image": IMAGE,
                "workdir": f"/toys/{name}",
                "local_dir": os.path.relpath(repo, OUT.parent),
                "test_cmd": "python3 -m unittest -v",
                "log_parser": "parse_log_django",
                "wrong_patches": wrong,
            }
        )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("".join(json.dumps(line) + "\n" for line in lines))
    print(f"{len(lines)} tasks in {OUT}, repositories in {REPOS}")


if __name__ == "__main__":
    main()
