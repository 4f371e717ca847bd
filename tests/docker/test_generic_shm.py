"""The shm tests of tests/test_sandbox_shm.py, on the docker backend (Debian task image)."""

import pytest

from test_sandbox_shm import *  # noqa: F403

pytestmark = [pytest.mark.docker]
