"""SWE-ReX on the docker backend: the generic runtime tests, and the deployment's own lifecycle."""

import pytest
from docker_support import SWE, inspect
from swerex.exceptions import DeploymentStartupError
from swerex.runtime.abstract import BashAction, CreateBashSessionRequest

from orchard.harness.swerex import OrchardDeployment
from test_harness_swerex import *  # noqa: F403

pytestmark = [pytest.mark.docker]


async def test_the_deployment_runs_a_session_on_docker_and_removes_its_container(docker_ready: str) -> None:
    dep = OrchardDeployment(image=SWE, backend="docker")
    await dep.start()
    rt = dep.runtime
    await rt.create_session(CreateBashSessionRequest())
    obs = await rt.run_in_session(BashAction(command="cd /tmp && python3 -c 'print(6 * 7)'"))
    assert obs.output == "42\n"
    sandbox_id = rt.sandbox.id
    assert inspect(sandbox_id) is not None
    await dep.stop()
    assert inspect(sandbox_id) is None


async def test_an_image_that_does_not_exist_is_a_deployment_startup_error(docker_ready: str) -> None:
    dep = OrchardDeployment(image="orchard-test/no-such-image:latest", backend="docker")
    with pytest.raises(DeploymentStartupError, match="no-such-image"):
        await dep.start()
