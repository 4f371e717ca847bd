"""The generic executor HTTP tests of tests/test_executor_http.py, on the kubernetes backend."""

import pytest

from test_executor_http import *  # noqa: F403

pytestmark = [pytest.mark.k8s]
