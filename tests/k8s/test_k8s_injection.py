"""How the executor runtime gets into a pod: mounted as an image volume, or copied by an init container.

The dev cluster runs containerd 2 with the ImageVolume gate on, so "auto"
mounts; the copy is what clusters without image volumes get.
"""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio.client.api_client import ApiClient
from test_k8s_backend import BUSYBOX, config

import orchard
from orchard._backends.kubernetes import KubernetesBackend
from orchard.errors import SandboxStartError

pytestmark = pytest.mark.k8s


async def pod_spec(api: ApiClient, namespace: str, name: str) -> Any:
    return (await k8s.CoreV1Api(api).read_namespaced_pod(name, namespace)).spec


async def check_runtime_is_read_only(sb: orchard.Sandbox) -> None:
    r = await sb.exec("echo $((6 * 7)); touch /.orchard/runtime/planted; rm -rf /.orchard/runtime/bin")
    assert r.stdout == "42\n"
    assert "Read-only file system" in r.stderr
    assert (await sb.exec(["test", "-x", "/.orchard/runtime/bin/python3"])).exit_code == 0


async def test_auto_mounts_the_runtime_as_an_image_volume_asking_the_api_server_once(
    kubeconfig: str, k8s_namespace: str, k8s_api: ApiClient
) -> None:
    async with orchard.Client(config(kubeconfig, k8s_namespace)) as c:
        backend: KubernetesBackend = c._backend  # type: ignore[assignment]
        for _ in range(2):
            async with c.sandbox(BUSYBOX, memory="64Mi") as sb:
                spec = await pod_spec(k8s_api, k8s_namespace, sb.id)
                assert not spec.init_containers
                (volume,) = spec.volumes
                assert volume.image.reference == "orchard-executor:latest"
                (mount,) = spec.containers[0].volume_mounts
                assert (mount.mount_path, mount.sub_path, mount.read_only) == ("/.orchard/runtime", "orchard", True)
                await check_runtime_is_read_only(sb)
        assert backend.image_volumes is True
        assert backend.api_requests["dry-run"] == 1


async def test_init_container_injection_copies_the_runtime(
    kubeconfig: str, k8s_namespace: str, k8s_api: ApiClient
) -> None:
    async with orchard.Client(config(kubeconfig, k8s_namespace, injection="init-container")) as c:
        async with c.sandbox(BUSYBOX, memory="64Mi") as sb:
            spec = await pod_spec(k8s_api, k8s_namespace, sb.id)
            (init,) = spec.init_containers
            assert init.image == "orchard-executor:latest"
            assert spec.volumes[0].empty_dir is not None
            assert spec.volumes[0].image is None
            await check_runtime_is_read_only(sb)
            # The copy is the init container's (uid 65532), not the image's.
            assert (await sb.exec(["stat", "-c", "%u", "/.orchard/runtime"])).stdout == "65532\n"
        backend: KubernetesBackend = c._backend  # type: ignore[assignment]
        assert backend.api_requests["dry-run"] == 0


async def test_auto_falls_back_to_init_containers_when_the_first_image_volume_pod_cannot_start(
    kubeconfig: str, k8s_namespace: str, k8s_api: ApiClient, caplog: pytest.LogCaptureFixture
) -> None:
    # What a runtime without image volumes does to the first pod, for real: its container cannot be created
    # (here the mount of a directory the injector image does not have fails in containerd).
    async with orchard.Client(config(kubeconfig, k8s_namespace)) as c:
        backend: KubernetesBackend = c._backend  # type: ignore[assignment]
        backend._runtime_subpath = "no-such-dir"
        async with c.sandbox(BUSYBOX, memory="64Mi") as sb:
            assert (await sb.exec("echo fell back")).stdout == "fell back\n"
            assert (await pod_spec(k8s_api, k8s_namespace, sb.id)).init_containers
        assert backend.image_volumes is False
        assert "using init containers from now on" in caplog.text
        assert "CreateContainerError" in caplog.text
        # For good: the next sandbox is copied in from the start, with one create.
        creates = backend.api_requests["create"]
        async with c.sandbox(BUSYBOX, memory="64Mi") as sb:
            assert (await pod_spec(k8s_api, k8s_namespace, sb.id)).init_containers
        assert backend.api_requests["create"] == creates + 1


async def test_forced_image_volumes_do_not_fall_back_and_say_which_image(kubeconfig: str, k8s_namespace: str) -> None:
    # An "injector" without the runtime: the image-volume mount fails, and nothing falls back.
    cfg = config(kubeconfig, k8s_namespace, injection="image-volume", injector_image=BUSYBOX)
    async with orchard.Client(cfg) as c:
        with pytest.raises(SandboxStartError) as info:
            await c.create(BUSYBOX, start_timeout=60)
        assert info.value.reason == "CreateContainerError"
        assert "image volume" in str(info.value)
    # A missing injector image is named as such, not as the task's image.
    cfg = config(kubeconfig, k8s_namespace, injection="image-volume", injector_image="orchard-test/no-such:1")
    async with orchard.Client(cfg) as c:
        with pytest.raises(SandboxStartError) as info:
            await c.create(BUSYBOX, image_pull_policy="Never", start_timeout=60)
        assert info.value.reason == "ErrImageNeverPull"
        assert "injector image, KubernetesConfig.injector_image, mounted as an image volume" in str(info.value)
