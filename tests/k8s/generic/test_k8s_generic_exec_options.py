"""The generic exec-option tests of tests/test_sandbox_exec_options.py, on the kubernetes backend."""

import pytest

from test_sandbox_exec_options import *  # noqa: F403

pytestmark = [pytest.mark.k8s]
