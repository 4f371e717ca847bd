"""mini-swe-agent's DefaultAgent on the kubernetes backend."""

import pytest

import orchard
from harness_minisweagent_support import check_run
from orchard.harness.minisweagent import OrchardEnvironment

pytestmark = [pytest.mark.k8s]

SWE = "orchard-test/swe:latest"


def test_default_agent_fixes_the_bug_and_submits_on_kubernetes(kubeconfig: str, k8s_namespace: str) -> None:
    backend = orchard.KubernetesConfig(namespace=k8s_namespace, kubeconfig=kubeconfig)
    env = OrchardEnvironment(image=SWE, backend=backend, cwd="/tmp", timeout=60)
    try:
        check_run(env, "/tmp/task")
    finally:
        env.close()
