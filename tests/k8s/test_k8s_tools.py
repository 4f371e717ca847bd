"""Harness CLIs in any image on kubernetes: ``tools=[...]`` copies the chosen ones in by an init container.

Real harness binaries from orchard-tools:latest (imported into the dev
cluster by hack/devcluster with the other images) in real pods.
"""

from __future__ import annotations

import pytest
from kubernetes_asyncio.client.api_client import ApiClient
from test_k8s_backend import BUSYBOX, NOSHELL, SWE, config

import orchard
from orchard import _tools, errors
from support import bundle_versions, check_tool

pytestmark = pytest.mark.k8s

#: Each harness in one bare image (a pod copies only what it chose: all of them is ~1.9 GiB), all in SWE.
CHOSEN = {
    BUSYBOX: ["codex", "claude", "opencode", "hermes"],
    NOSHELL: ["pi", "openclaw", "mini"],
    SWE: list(_tools.KNOWN),
}


# The copy reads up to 1.9 GiB of the tools image: on a node whose page cache is cold (CI, right after the
# image import) it took over 120 s, so the test's deadline is the sandbox's start_timeout and a minute more.
@pytest.mark.timeout(360)
@pytest.mark.parametrize("image", list(CHOSEN))
async def test_chosen_harnesses_start_in_any_image_and_only_they_are_copied(
    kubeconfig: str, k8s_namespace: str, image: str
) -> None:
    chosen = CHOSEN[image]
    async with (
        orchard.Client(config(kubeconfig, k8s_namespace)) as client,
        client.sandbox(image, tools=chosen, memory="1Gi", start_timeout=300) as sb,
    ):
        pinned = await bundle_versions(sb)
        for name in chosen:
            await check_tool(sb, name, pinned)
        copied = sorted(e.name for e in await sb.list_dir(_tools.BUNDLE))
        assert copied == sorted(_tools.parts(chosen))
        env = dict(line.split("=", 1) for line in (await sb.exec(["env"])).stdout.splitlines())
        path = env["PATH"].split(":")
        assert path[-len(chosen) :] == [f"{_tools.BUNDLE}/{n}/bin" for n in chosen]
        # Read-only to the sandbox, root or not.
        victim = chosen[0]
        r = await sb.exec(["rm", "-rf", f"{_tools.BUNDLE}/{victim}"])
        assert r.exit_code != 0
        assert (await sb.exec([victim, "--version"], env={"HOME": "/tmp/h"})).exit_code == 0


async def test_a_missing_tools_image_is_a_start_error_naming_the_init_container(
    kubeconfig: str, k8s_namespace: str, k8s_api: ApiClient
) -> None:
    cfg = config(kubeconfig, k8s_namespace, tools_image="orchard-test/no-such-tools:latest")
    async with orchard.Client(cfg) as client:
        with pytest.raises(errors.SandboxStartError, match="tools init container") as info:
            await client.create(BUSYBOX, tools=["codex"], image_pull_policy="Never", start_timeout=60)
        assert info.value.reason == "ErrImageNeverPull"
