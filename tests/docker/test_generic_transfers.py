"""The generic Sandbox tests of tests/test_sandbox_transfers.py, on the docker backend (Debian task image)."""

import pytest

from test_sandbox_transfers import *  # noqa: F403

pytestmark = [pytest.mark.docker]
