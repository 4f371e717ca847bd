"""The dev cluster is a real Kubernetes: real pods under containerd, real pod IPs.

These are the proofs for ``hack/devcluster``: a locally built image runs in a
scheduled pod whose IP answers HTTP from this host, ``kubectl logs`` and
``kubectl exec`` work through the apiserver and kubelet, and init containers
with an emptyDir work.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
import urllib.request

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.api_client import ApiClient

pytestmark = pytest.mark.k8s

#: Built by ``hack/devcluster/devcluster up`` without a registry and imported into the node's containerd.
HTTPD_IMAGE = "orchard.local/devcluster/httpd:1"
TEST_LABEL = "orchard.test/pytest"


def httpd_pod(name: str, *, init: bool = False) -> client.V1Pod:
    """A busybox httpd pod on :8080; with ``init``, an init container writes the page into an emptyDir."""
    volumes = None
    init_containers = None
    mounts = None
    www = "/www"
    if init:
        volumes = [client.V1Volume(name="data", empty_dir=client.V1EmptyDirVolumeSource())]
        mounts = [client.V1VolumeMount(name="data", mount_path="/data")]
        init_containers = [
            client.V1Container(
                name="prepare",
                image=HTTPD_IMAGE,
                image_pull_policy="Never",
                command=["/bin/sh", "-c", "echo written-by-init > /data/index.html"],
                volume_mounts=mounts,
            )
        ]
        www = "/data"
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, labels={TEST_LABEL: "1"}),
        spec=client.V1PodSpec(
            automount_service_account_token=False,
            enable_service_links=False,
            termination_grace_period_seconds=1,
            init_containers=init_containers,
            volumes=volumes,
            containers=[
                client.V1Container(
                    name="main",
                    image=HTTPD_IMAGE,
                    image_pull_policy="Never",
                    # A line of our own on stdout, then httpd -v logs every request on stderr.
                    command=["/bin/sh", "-c", f"echo orchard-httpd-started; exec /bin/httpd -f -v -p 8080 -h {www}"],
                    ports=[client.V1ContainerPort(container_port=8080)],
                    readiness_probe=client.V1Probe(
                        http_get=client.V1HTTPGetAction(path="/", port=8080), period_seconds=1
                    ),
                    volume_mounts=mounts,
                )
            ],
        ),
    )


async def run_until_ready(api: ApiClient, namespace: str, pod: client.V1Pod, timeout: float = 60) -> client.V1Pod:
    """Create the pod and wait until it is Running and Ready; fail with its status otherwise."""
    core = client.CoreV1Api(api)
    await core.create_namespaced_pod(namespace, pod)
    deadline = time.monotonic() + timeout
    while True:
        got = await core.read_namespaced_pod(pod.metadata.name, namespace)
        conds = {c.type: c.status for c in got.status.conditions or []}
        if got.status.phase == "Running" and conds.get("Ready") == "True":
            return got
        if got.status.phase in ("Failed", "Succeeded") or time.monotonic() > deadline:
            events = await core.list_namespaced_event(namespace)
            lines = [f"{e.reason}: {e.message}" for e in events.items]
            pytest.fail(f"pod {pod.metadata.name} not ready: {got.status}\nevents:\n" + "\n".join(lines))
        await asyncio.sleep(0.2)


def http_get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


async def test_pod_from_local_image_runs_and_its_ip_answers(k8s_api: ApiClient, k8s_namespace: str) -> None:
    pod = await run_until_ready(k8s_api, k8s_namespace, httpd_pod("web"))
    assert pod.spec.node_name, "the scheduler placed the pod"
    ip = pod.status.pod_ip
    assert ip, pod.status
    assert not ip.startswith("127."), ip
    body = await asyncio.to_thread(http_get, f"http://{ip}:8080/")
    assert body == "orchard devcluster httpd\n"


async def test_kubectl_logs_and_exec(k8s_api: ApiClient, k8s_namespace: str, kubectl: list[str]) -> None:
    pod = await run_until_ready(k8s_api, k8s_namespace, httpd_pod("web"))
    await asyncio.to_thread(http_get, f"http://{pod.status.pod_ip}:8080/index.html")

    def kubectl_run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*kubectl, "-n", k8s_namespace, *args], capture_output=True, text=True, timeout=60)

    exe = await asyncio.to_thread(kubectl_run, "exec", "web", "--", "cat", "/www/index.html")
    assert exe.returncode == 0, exe.stderr
    assert exe.stdout == "orchard devcluster httpd\n"

    exit3 = await asyncio.to_thread(kubectl_run, "exec", "web", "--", "sh", "-c", "echo oops >&2; exit 3")
    assert exit3.returncode == 3, (exit3.returncode, exit3.stderr)
    assert "oops" in exit3.stderr

    # stdout and stderr of the container, through the apiserver from the kubelet.
    deadline = time.monotonic() + 20
    while True:
        logs = await asyncio.to_thread(kubectl_run, "logs", "web")
        assert logs.returncode == 0, logs.stderr
        if "orchard-httpd-started" in logs.stdout and "response:200" in logs.stdout:
            break
        assert time.monotonic() < deadline, f"request not in kubectl logs: {logs.stdout!r}"
        await asyncio.sleep(0.5)


async def test_init_container_fills_empty_dir(k8s_api: ApiClient, k8s_namespace: str) -> None:
    pod = await run_until_ready(k8s_api, k8s_namespace, httpd_pod("init", init=True))
    (init_status,) = pod.status.init_container_statuses
    assert init_status.state.terminated is not None
    assert init_status.state.terminated.exit_code == 0
    body = await asyncio.to_thread(http_get, f"http://{pod.status.pod_ip}:8080/")
    assert body == "written-by-init\n"


async def test_namespace_fixture_gives_a_fresh_namespace(k8s_api: ApiClient, k8s_namespace: str) -> None:
    core = client.CoreV1Api(k8s_api)
    ns = await core.read_namespace(k8s_namespace)
    assert ns.status.phase == "Active"
    assert (await core.list_namespaced_pod(k8s_namespace)).items == []


async def test_node_has_the_locally_built_images(k8s_api: ApiClient, k8s_namespace: str) -> None:
    """``up`` imported the pause and test images, and the injector and task images of scripts/docker-setup.sh.

    Each image is used by a container with pull policy Never: the kubelet finds it on the node (the
    container gets an image id) instead of failing with ErrImageNeverPull. The command does not
    exist, so the test does not depend on what is inside the images.
    """
    images = [
        HTTPD_IMAGE,
        "orchard-executor:latest",
        "orchard-test/busybox:latest",
        "orchard-test/swe:latest",
        "orchard-test/noshell:latest",
    ]
    containers = [
        client.V1Container(name=f"c{i}", image=img, image_pull_policy="Never", command=["/orchard-no-such-command"])
        for i, img in enumerate(images)
    ]
    pod = client.V1Pod(
        metadata=client.V1ObjectMeta(name="images", labels={TEST_LABEL: "1"}),
        spec=client.V1PodSpec(restart_policy="Never", termination_grace_period_seconds=1, containers=containers),
    )
    core = client.CoreV1Api(k8s_api)
    await core.create_namespaced_pod(k8s_namespace, pod)
    deadline = time.monotonic() + 60
    while True:
        got = await core.read_namespaced_pod("images", k8s_namespace)
        statuses = {s.image: s for s in got.status.container_statuses or []}
        missing = [
            img
            for img, s in statuses.items()
            if s.state.waiting is not None and s.state.waiting.reason in ("ErrImageNeverPull", "InvalidImageName")
        ]
        assert not missing, f"images not on the node: {missing}"
        if len(statuses) == len(images) and all(s.image_id for s in statuses.values()):
            break
        assert time.monotonic() < deadline, got.status
        await asyncio.sleep(0.3)
