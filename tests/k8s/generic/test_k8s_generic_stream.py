"""The generic Sandbox tests of tests/test_sandbox_stream.py, on the kubernetes backend."""

import pytest

from test_sandbox_stream import *  # noqa: F403

pytestmark = [pytest.mark.k8s]
