"""The reverse_forward() tests of tests/test_reverse_forward.py, on the docker backend (Debian task image, TLS)."""

import pytest

from test_reverse_forward import *  # noqa: F403

pytestmark = [pytest.mark.docker]
