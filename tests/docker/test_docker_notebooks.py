"""The example notebooks that need Docker run top to bottom in a fresh kernel (see tests/test_notebooks.py)."""

from __future__ import annotations

import pytest

from test_notebooks import DOCKER, check_notebook

pytestmark = pytest.mark.docker


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", DOCKER)
def test_docker_notebook_runs(name: str, tools_image: None) -> None:
    check_notebook(name)
