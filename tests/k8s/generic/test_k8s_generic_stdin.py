"""The generic Sandbox tests of tests/test_sandbox_stdin.py, on the kubernetes backend."""

import pytest

from test_sandbox_stdin import *  # noqa: F403

pytestmark = [pytest.mark.k8s]
