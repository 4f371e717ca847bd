"""Handles on the kubernetes backend: attach from a real subprocess on both transports, who deletes."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio.client.api_client import ApiClient
from test_k8s_backend import BUSYBOX, config, pods, wait_no_pods

import orchard
from handles_support import attach_in_child, token_of
from orchard import _handle
from orchard.errors import AuthError, ConfigError, InvalidHandle, SandboxLost
from support import eventually

pytestmark = pytest.mark.k8s


def _reencoded(handle: str, **changes: Any) -> str:
    return _handle.encode(msgspec.structs.replace(_handle.parse(handle), **changes))


@pytest.mark.parametrize("transport", ["direct", "port-forward"])
async def test_attach_from_another_process_runs_there_and_the_creator_still_deletes(
    kubeconfig: str, k8s_namespace: str, k8s_api: ApiClient, transport: str
) -> None:
    options = {"namespace": k8s_namespace, "kubeconfig": kubeconfig, "transport": transport}
    async with orchard.Client("kubernetes", **options) as creator:
        sb = await creator.create(BUSYBOX, memory="64Mi")
        await sb.write_file("note.txt", "from the creator\n")
        handle = sb.handle()
        assert handle.backend == "kubernetes"
        assert token_of(handle) not in repr(handle)

        # A port-forward child makes its own forward: the creator's listens in the creator's process.
        child = await attach_in_child(handle, "kubernetes", options)
        assert child["exit_code"] == 0, child
        assert child["stdout"] == "from the creator\n"
        assert await sb.read_file("child.txt") == b"from-child\n"
        assert [p.metadata.name for p in await pods(k8s_api, k8s_namespace)] == [sb.id]
    await wait_no_pods(k8s_api, k8s_namespace)
    child = await attach_in_child(handle, "kubernetes", options)
    assert child["error"] == "SandboxLost", child


async def test_an_owner_deletes_the_pod_when_it_closes(kubeconfig: str, k8s_namespace: str, k8s_api: ApiClient) -> None:
    options = {"namespace": k8s_namespace, "kubeconfig": kubeconfig}
    async with orchard.Client("kubernetes", **options) as creator:
        sb = await creator.create(BUSYBOX, memory="64Mi")
        await sb.write_file("note.txt", "x\n")
        child = await attach_in_child(sb.handle(), "kubernetes", options, owner=True)
        assert child["exit_code"] == 0, child
        await wait_no_pods(k8s_api, k8s_namespace, timeout=30)

        async def lost() -> bool:
            # Deleted with no grace period, the pod's object goes at once; its container a moment later.
            try:
                await sb.exec("true")
            except SandboxLost:
                return True
            return False

        await eventually(lost, what="the creator sees its sandbox lost")


async def test_a_wrong_token_another_namespace_and_a_deleted_pod_fail_typed(
    kubeconfig: str, k8s_namespace: str
) -> None:
    async with (
        orchard.Client(config(kubeconfig, k8s_namespace)) as creator,
        orchard.Client(config(kubeconfig, k8s_namespace)) as other,
        orchard.Client(config(kubeconfig, "default")) as elsewhere,
    ):
        sb = await creator.create(BUSYBOX, memory="64Mi")
        handle = sb.handle()
        with pytest.raises(AuthError):
            await other.attach(_reencoded(handle, token="x" * 43))
        with pytest.raises(ConfigError, match=f"namespace={k8s_namespace!r}"):
            await elsewhere.attach(handle)
        assert (await sb.exec("true")).exit_code == 0
        await sb.aclose()
        with pytest.raises(SandboxLost):
            await other.attach(handle)


async def test_a_handle_naming_another_pod_deletes_nothing(
    kubeconfig: str, k8s_namespace: str, k8s_api: ApiClient
) -> None:
    # A handle edited to name some other pod of the namespace, attached with owner=True,
    # must not let the attaching client delete that pod.
    core = k8s.CoreV1Api(k8s_api)
    foreign = {
        "metadata": {"name": "not-orchard"},
        "spec": {
            "containers": [{"name": "c", "image": BUSYBOX, "imagePullPolicy": "Never", "command": ["sleep", "300"]}],
            "terminationGracePeriodSeconds": 0,
        },
    }
    await core.create_namespaced_pod(k8s_namespace, foreign)
    async with (
        orchard.Client(config(kubeconfig, k8s_namespace)) as creator,
        orchard.Client(config(kubeconfig, k8s_namespace)) as other,
    ):
        sb = await creator.create(BUSYBOX, memory="64Mi")
        forged = _reencoded(sb.handle(), sandbox_id="not-orchard")
        # (Attached with owner=True, it would be deleted when ``other`` closes.)
        with pytest.raises(InvalidHandle, match="not an Orchard sandbox"):
            await other.attach(forged, owner=True)
    pod = await core.read_namespaced_pod("not-orchard", k8s_namespace)
    assert pod.metadata.deletion_timestamp is None
