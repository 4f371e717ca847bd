"""OrchardDeployment: SWE-ReX's deployment lifecycle on the local backend (tests/docker has docker's)."""

from __future__ import annotations

import pytest
from swerex.exceptions import DeploymentNotStartedError
from swerex.runtime.abstract import BashAction, CreateBashSessionRequest

from orchard.errors import SandboxClosed
from orchard.harness.swerex import OrchardDeployment


async def test_start_run_and_stop_deletes_the_sandbox() -> None:
    dep = OrchardDeployment(image="local", backend="local")
    with pytest.raises(DeploymentNotStartedError):
        _ = dep.runtime
    await dep.start()
    assert await dep.is_alive()
    rt = dep.runtime
    await rt.create_session(CreateBashSessionRequest())
    assert (await rt.run_in_session(BashAction(command="echo $((6 * 7))"))).output == "42\n"
    sb = rt.sandbox
    await dep.stop()
    with pytest.raises(SandboxClosed):
        await sb.exec(["true"])
    with pytest.raises(DeploymentNotStartedError):
        await dep.is_alive()
    await dep.stop()  # twice is fine
