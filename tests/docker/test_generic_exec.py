"""The generic Sandbox tests of tests/test_sandbox_exec.py, on the docker backend (Debian task image)."""

import pytest

from test_sandbox_exec import *  # noqa: F403

pytestmark = [pytest.mark.docker]
