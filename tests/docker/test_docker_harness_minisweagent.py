"""mini-swe-agent's DefaultAgent on the docker backend (the Debian task image)."""

import pytest
from docker_support import SWE, inspect

from harness_minisweagent_support import check_run
from orchard.harness.minisweagent import OrchardEnvironment

pytestmark = [pytest.mark.docker]


def test_default_agent_fixes_the_bug_and_submits_on_docker(docker_ready: str) -> None:
    env = OrchardEnvironment(image=SWE, backend="docker", cwd="/tmp", timeout=60)
    try:
        check_run(env, "/tmp/task")
        assert env.get_template_vars()["machine"]  # the container's uname
    finally:
        env.close()
    assert inspect(env.sandbox.id) is None
