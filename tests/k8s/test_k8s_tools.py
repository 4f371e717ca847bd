"""Harness CLIs in any image on kubernetes: ``tools=[...]`` mounts the tools image's bundle as an image volume,
or (``injection="init-container"``) an init container copies the chosen harnesses in.

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
# The copy is tried with one image (the others' harnesses are the same files); image volumes with all three.
@pytest.mark.timeout(360)
@pytest.mark.parametrize(
    ("image", "injection"), [(image, "image-volume") for image in CHOSEN] + [(NOSHELL, "init-container")]
)
async def test_chosen_harnesses_start_in_any_image_and_only_they_are_on_path(
    kubeconfig: str, k8s_namespace: str, image: str, injection: str
) -> None:
    chosen = CHOSEN[image]
    async with (
        orchard.Client(config(kubeconfig, k8s_namespace, injection=injection)) as client,
        client.sandbox(image, tools=chosen, memory="1Gi", start_timeout=300) as sb,
    ):
        pinned = await bundle_versions(sb)
        for name in chosen:
            await check_tool(sb, name, pinned)
        there = sorted(e.name for e in await sb.list_dir(_tools.BUNDLE))
        if injection == "init-container":  # only the chosen parts are copied
            assert there == sorted(_tools.parts(chosen))
        else:  # the whole bundle is mounted, as it is on docker
            assert set(there) >= set(_tools.parts(_tools.KNOWN))
        env = dict(line.split("=", 1) for line in (await sb.exec(["env"])).stdout.splitlines())
        path = env["PATH"].split(":")
        assert path[-len(chosen) :] == [f"{_tools.BUNDLE}/{n}/bin" for n in chosen]
        # Read-only to the sandbox, root or not.
        victim = chosen[0]
        r = await sb.exec(["rm", "-rf", f"{_tools.BUNDLE}/{victim}"])
        assert r.exit_code != 0
        assert (await sb.exec([victim, "--version"], env={"HOME": "/tmp/h"})).exit_code == 0


@pytest.mark.parametrize(
    ("injection", "named"),
    [
        ("init-container", "tools init container"),
        ("image-volume", "the tools image of tools=[...], KubernetesConfig.tools_image, mounted as an image volume"),
    ],
)
async def test_a_missing_tools_image_is_a_start_error_naming_it(
    kubeconfig: str, k8s_namespace: str, k8s_api: ApiClient, injection: str, named: str
) -> None:
    cfg = config(kubeconfig, k8s_namespace, tools_image="orchard-test/no-such-tools:latest", injection=injection)
    async with orchard.Client(cfg) as client:
        with pytest.raises(errors.SandboxStartError) as info:
            await client.create(BUSYBOX, tools=["codex"], image_pull_policy="Never", start_timeout=60)
        assert info.value.reason == "ErrImageNeverPull"
        assert named in str(info.value)
