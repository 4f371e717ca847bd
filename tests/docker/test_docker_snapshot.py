"""The snapshot tests of tests/test_sandbox_snapshot.py and tests/container_snapshot.py, on the docker backend."""

import pytest

from container_snapshot import *  # noqa: F403
from test_sandbox_snapshot import *  # noqa: F403

pytestmark = [pytest.mark.docker]
