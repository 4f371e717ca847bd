"""The example notebooks run top to bottom in a fresh kernel, as a user runs them; a failing cell fails the suite.

Their cells assert what they show, so a notebook that runs is one that says
what it should. The committed copies carry the outputs of a real run
(examples/notebooks/execute.py writes them); this checks they do. The local
notebooks run here; the docker and kubernetes ones in their tiers
(tests/docker/test_docker_notebooks.py, tests/k8s/test_k8s_notebooks.py).
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

#: The notebooks that need only the local backend.
LOCAL = ["quickstart.ipynb", "rollouts_local.ipynb"]
#: The notebooks that need a Docker engine (run by tests/docker/test_docker_notebooks.py).
DOCKER = ["harnesses_gateway.ipynb", "webshop.ipynb"]
#: The notebooks that need a Kubernetes cluster (run by tests/k8s/test_k8s_notebooks.py).
KUBERNETES = ["rollouts_kubernetes.ipynb"]


def _outputs(nb: nbformat.NotebookNode) -> list[str]:
    return [
        "".join(o.get("text", "") for o in cell.get("outputs", [])) for cell in nb.cells if cell.cell_type == "code"
    ]


def _images(nb: nbformat.NotebookNode) -> int:
    return sum("image/png" in o.get("data", {}) for cell in nb.cells for o in cell.get("outputs", []))


def check_notebook(name: str) -> nbformat.NotebookNode:
    """Run ``name`` in a fresh kernel; it must pass every cell and show what its committed copy shows."""
    committed = nbformat.read(NOTEBOOKS / name, as_version=4)
    assert all(cell.get("execution_count") for cell in committed.cells if cell.cell_type == "code"), (
        f"{name} is committed without its outputs: run examples/notebooks/execute.py {name}"
    )
    ran = execute(NOTEBOOKS / name)
    errors = [o for cell in ran.cells for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    assert errors == []
    assert len(_outputs(ran)) == len(_outputs(committed))
    # A figure that displays as text (a bare Figure without the inline backend) would show no plot.
    assert _images(ran) == _images(committed)
    return ran


def test_every_notebook_is_in_a_tier() -> None:
    # A notebook added without a test would never run in CI.
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(LOCAL + DOCKER + KUBERNETES)


def test_the_rollout_notebooks_show_their_plots() -> None:
    # results.plot() is the cell's value: committed as an image, not as "<Figure size ...>".
    for name in ["rollouts_local.ipynb", "rollouts_kubernetes.ipynb"]:
        assert _images(nbformat.read(NOTEBOOKS / name, as_version=4)) == 1, name


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", LOCAL)
def test_local_notebook_runs(name: str) -> None:
    check_notebook(name)
