"""mini-swe-agent's DefaultAgent on Orchard's local backend (tests/docker and tests/k8s run it on theirs)."""

from __future__ import annotations

import gc

import pytest

import orchard
import orchard.sync
from harness_minisweagent_support import check_run
from orchard.harness.minisweagent import OrchardEnvironment


def test_default_agent_fixes_the_bug_and_submits_on_the_local_backend() -> None:
    env = OrchardEnvironment(image="local", backend="local", timeout=60)
    try:
        check_run(env, "/tmp/task")
    finally:
        env.close()


def test_template_vars_timeouts_and_close() -> None:
    env = OrchardEnvironment(backend="local", timeout=1, env={"GREETING": "hi"})
    sandbox = env.sandbox
    assert env.get_template_vars()["system"] == "Linux"
    assert env.execute({"command": "echo $GREETING; echo err >&2"}) == {
        "output": "hi\nerr\n",
        "returncode": 0,
        "exception_info": "",
    }
    slow = env.execute({"command": "echo started; sleep 30"})
    assert slow["returncode"] == -1
    assert slow["output"] == "started\n"
    assert "timed out after 1 seconds" in slow["exception_info"]
    assert env.serialize()["info"]["config"]["environment_type"].endswith("OrchardEnvironment")
    # A backend given as a config object still serializes (mini-swe-agent saves trajectories as JSON).
    configured = OrchardEnvironment(backend=orchard.LocalConfig())
    try:
        assert configured.serialize()["info"]["config"]["environment"]["backend"].startswith("LocalConfig(")
    finally:
        configured.close()
    env.close()
    with pytest.raises(orchard.errors.SandboxClosed):
        sandbox.exec("true")
    env.close()  # twice is fine


def test_garbage_collection_deletes_the_sandbox() -> None:
    env = OrchardEnvironment(backend="local")
    sandbox = env.sandbox
    del env
    gc.collect()
    with pytest.raises(orchard.errors.SandboxClosed):
        sandbox.exec("true")
