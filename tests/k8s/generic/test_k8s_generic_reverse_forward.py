"""The reverse_forward() tests of tests/test_reverse_forward.py, on the kubernetes backend, through pod IP and port-forward."""

import pytest

from test_reverse_forward import *  # noqa: F403

pytestmark = [pytest.mark.k8s]
