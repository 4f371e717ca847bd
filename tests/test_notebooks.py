"""The example notebooks run top to bottom in a fresh kernel, as a user runs them; a failing cell fails the suite.

Their cells assert what they show, so a notebook that runs is one that says
what it should. The committed copies carry the outputs of a real run
(examples/notebooks/execute.py writes them); this checks they do.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
import pytest

pytestmark = pytest.mark.executor

NOTEBOOKS = Path(__file__).resolve().parent.parent / "examples" / "notebooks"
sys.path.insert(0, str(NOTEBOOKS))
from execute import execute  # noqa: E402

#: The notebooks that need only the local backend; the others run in the docker and kubernetes tiers.
LOCAL = ["quickstart.ipynb"]


def _outputs(nb: nbformat.NotebookNode) -> list[str]:
    return [
        "".join(o.get("text", "") for o in cell.get("outputs", [])) for cell in nb.cells if cell.cell_type == "code"
    ]


def test_every_notebook_is_in_a_tier() -> None:
    # A notebook added without a test would never run in CI.
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(LOCAL)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", LOCAL)
def test_local_notebook_runs(name: str) -> None:
    committed = nbformat.read(NOTEBOOKS / name, as_version=4)
    assert all(cell.get("execution_count") for cell in committed.cells if cell.cell_type == "code"), (
        f"{name} is committed without its outputs: run examples/notebooks/execute.py {name}"
    )
    ran = execute(NOTEBOOKS / name)
    errors = [o for cell in ran.cells for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    assert errors == []
    assert len(_outputs(ran)) == len(_outputs(committed))
