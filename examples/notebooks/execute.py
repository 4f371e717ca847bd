"""Run the example notebooks and save them with their outputs, as they are committed.

    python examples/notebooks/execute.py [NAME.ipynb ...]    # default: every notebook here

Each runs top to bottom in a fresh kernel of this Python (ipykernel), from
this directory; a cell that raises stops it with the cell's error and leaves
the file as it was. tests/test_notebooks.py runs them the same way in the
suite, without writing.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent


def execute(path: Path, timeout: int = 600) -> nbformat.NotebookNode:
    """``path`` run in a fresh kernel, with its outputs; raises ``CellExecutionError`` on a failing cell."""
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}).execute()
    return nb


def main(names: list[str]) -> None:
    for path in [HERE / n for n in names] or sorted(HERE.glob("*.ipynb")):
        nb = execute(path)
        nbformat.write(nb, path)
        print(f"{path.name}: {len(nb.cells)} cells run and saved")


if __name__ == "__main__":
    main(sys.argv[1:])
