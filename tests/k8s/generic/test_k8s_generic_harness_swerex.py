"""The generic SWE-ReX runtime tests of tests/test_harness_swerex.py, on the kubernetes backend."""

import pytest

from test_harness_swerex import *  # noqa: F403

pytestmark = [pytest.mark.k8s]
