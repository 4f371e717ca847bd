"""The forward() tests of tests/test_forward.py, on the docker backend (Debian task image, TLS to the executor)."""

import pytest

from test_forward import *  # noqa: F403

pytestmark = [pytest.mark.docker]
