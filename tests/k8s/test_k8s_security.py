"""Sandbox pods against Pod Security admission and from inside, and what ``orchard k8s setup`` writes.

Admission, not string compares: each namespace is labelled for Pod Security
and the API server itself admits or refuses the pods. The NetworkPolicies are
read back from the API; the dev cluster has no policy agent, so nothing here
claims they are enforced.
"""

from __future__ import annotations

import asyncio
import ipaddress
import secrets
import subprocess
import sys
from typing import Any

import pytest
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio.client.api_client import ApiClient

import orchard
from orchard.errors import SandboxLost, SandboxStartError
from support import captured_tcp, to_executor

pytestmark = pytest.mark.k8s

SWE = "orchard-test/swe:latest"
BUSYBOX = "orchard-test/busybox:latest"
PSA = "pod-security.kubernetes.io"
#: The dev cluster's pod range: its CNI allocates addresses, so no node has a podCIDR to discover.
DEVCLUSTER_PODS = "10.234.0.0/16"

# Capability numbers (linux/capability.h).
CAPS = {"CHOWN": 0, "DAC_OVERRIDE": 1, "KILL": 5, "SETUID": 7, "NET_RAW": 13, "SYS_ADMIN": 21, "MKNOD": 27}


def config(kubeconfig: str, namespace: str, **extra: Any) -> orchard.KubernetesConfig:
    return orchard.KubernetesConfig(namespace=namespace, kubeconfig=kubeconfig, **extra)


async def enforce(api: ApiClient, namespace: str, level: str) -> None:
    """Label the namespace so Pod Security admission enforces ``level`` on every pod created in it."""
    labels = {f"{PSA}/enforce": level, f"{PSA}/enforce-version": "latest"}
    await k8s.CoreV1Api(api).patch_namespace(namespace, {"metadata": {"labels": labels}})


def status_fields(text: str) -> dict[str, str]:
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


@pytest.mark.parametrize("injection", ["image-volume", "init-container"])
async def test_restricted_namespace_admits_the_non_root_sandbox(
    kubeconfig: str, k8s_namespace: str, k8s_api: ApiClient, injection: str
) -> None:
    await enforce(k8s_api, k8s_namespace, "restricted")
    cfg = config(kubeconfig, k8s_namespace, run_as_user=1000, injection=injection)
    async with orchard.Client(cfg) as c, c.sandbox(BUSYBOX) as sb:
        r = await sb.exec("id -u; id -g")
        assert (r.exit_code, r.stdout) == (0, "1000\n1000\n")
        await sb.write_file("/tmp/mine.txt", "written as 1000")
        assert await sb.read_file("/tmp/mine.txt") == b"written as 1000"
        status = status_fields((await sb.exec(["cat", "/proc/self/status"])).stdout)
        assert status["CapEff"] == status["CapPrm"] == "0000000000000000"
        assert (status["NoNewPrivs"], status["Seccomp"]) == ("1", "2")
        # The init container (non-root, read-only root) still filled the runtime volume; an image volume is
        # the image's own files (root's), mounted read-only.
        owner = "65532" if injection == "init-container" else "0"
        assert (await sb.exec(["stat", "-c", "%u", "/.orchard/runtime"])).stdout == f"{owner}\n"


async def test_restricted_namespace_refuses_the_root_pod_with_a_typed_error(
    kubeconfig: str, k8s_namespace: str, k8s_api: ApiClient
) -> None:
    await enforce(k8s_api, k8s_namespace, "restricted")
    async with orchard.Client(config(kubeconfig, k8s_namespace)) as c:
        with pytest.raises(SandboxStartError) as info:
            await c.create(BUSYBOX, start_timeout=600)  # the refusal comes from the create, not a wait
    assert info.value.reason == "PodSecurity"
    assert "restricted" in str(info.value)
    assert "run_as_user" in str(info.value)  # the message names the option that fixes it
    listing = await k8s.CoreV1Api(k8s_api).list_namespaced_pod(k8s_namespace)
    assert not listing.items


async def test_baseline_refuses_capabilities_beyond_its_list(
    kubeconfig: str, k8s_namespace: str, k8s_api: ApiClient
) -> None:
    await enforce(k8s_api, k8s_namespace, "baseline")
    async with orchard.Client(config(kubeconfig, k8s_namespace, cap_add=["NET_RAW"])) as c:
        with pytest.raises(SandboxStartError) as info:
            await c.create(BUSYBOX)
    assert info.value.reason == "PodSecurity"
    assert "NET_RAW" in str(info.value)


ROOT_WORK = r"""
import os, signal, socket, subprocess
os.makedirs("/srv/work", exist_ok=True)
open("/srv/work/secret", "w").write("s")
os.chown("/srv/work/secret", 1000, 1000)           # CHOWN
os.chmod("/srv/work/secret", 0)
assert open("/srv/work/secret").read() == "s"      # DAC_OVERRIDE: root reads a 000 file of another user
os.chmod("/srv/work/secret", 0o640)                # FOWNER
child = subprocess.Popen(["sleep", "60"], user=1000, group=1000)  # SETUID, SETGID
os.kill(child.pid, signal.SIGKILL)                 # KILL: signal another user's process
child.wait()
s = socket.socket(); s.bind(("127.0.0.1", 80)); s.close()  # NET_BIND_SERVICE
refused = []
try:
    os.mknod("/srv/work/dev", 0o600 | 0o060000, os.makedev(8, 0))
except PermissionError:
    refused.append("mknod")
try:
    socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
except PermissionError:
    refused.append("raw")
print(" ".join(refused))
"""


async def test_baseline_admits_the_default_root_sandbox_which_keeps_only_harmless_capabilities(
    kubeconfig: str, k8s_namespace: str, k8s_api: ApiClient
) -> None:
    await enforce(k8s_api, k8s_namespace, "baseline")
    async with orchard.Client(config(kubeconfig, k8s_namespace)) as c, c.sandbox(SWE) as sb:
        assert (await sb.exec(["id", "-u"])).stdout == "0\n"
        await sb.write_file("/srv/root_work.py", ROOT_WORK)
        r = await sb.exec(["python3", "/srv/root_work.py"])
        assert (r.exit_code, r.stderr) == (0, "")
        assert r.stdout == "mknod raw\n"
        status = status_fields((await sb.exec(["cat", "/proc/self/status"])).stdout)
        effective, bounding = int(status["CapEff"], 16), int(status["CapBnd"], 16)
        for name in ("CHOWN", "DAC_OVERRIDE", "KILL", "SETUID"):
            assert effective >> CAPS[name] & 1, name
        for name in ("NET_RAW", "MKNOD", "SYS_ADMIN"):
            assert not bounding >> CAPS[name] & 1, f"{name} is in the bounding set: {status['CapBnd']}"
        assert (status["NoNewPrivs"], status["Seccomp"]) == ("1", "2")
        pod = await k8s.CoreV1Api(k8s_api).read_namespaced_pod(sb.id, k8s_namespace)
        # The runtime is mounted from the injector image: no init container runs at all.
        assert not pod.spec.init_containers
        assert pod.spec.volumes[0].image.reference == "orchard-executor:latest"


async def test_code_in_the_sandbox_cannot_signal_its_executor(kubeconfig: str, k8s_namespace: str) -> None:
    """`kill 1` from a command would end the sandbox, and a rollout would count its attempt an infra fault."""
    async with orchard.Client(config(kubeconfig, k8s_namespace)) as client, client.sandbox(BUSYBOX) as sb:
        r = await sb.exec(
            "for s in TERM INT HUP QUIT USR1 USR2 ALRM KILL STOP; do kill -$s 1; done; sleep 1; echo alive"
        )
        assert r.stdout == "alive\n"
        assert (await sb.exec(["true"])).exit_code == 0
        assert (await sb.info()).pid == 1


async def until_lost(sb: orchard.Sandbox) -> None:
    """Keep running commands until the sandbox is lost (raises SandboxLost) or about 90 s pass."""
    for _ in range(90):  # the kubelet measures disk use every 10 s or so
        await sb.exec(["true"])
        await asyncio.sleep(1)


@pytest.mark.timeout(240)
async def test_a_sandbox_that_fills_its_disk_limit_is_evicted(
    kubeconfig: str, k8s_namespace: str, k8s_api: ApiClient
) -> None:
    async with orchard.Client(config(kubeconfig, k8s_namespace, ephemeral_storage="32Mi")) as c:
        async with c.sandbox(BUSYBOX) as sb:
            r = await sb.exec("dd if=/dev/zero of=/tmp/fill bs=1M count=96 2>&1; sync", timeout=60)
            assert r.exit_code == 0, r.stdout
            with pytest.raises(SandboxLost):
                await until_lost(sb)
    # The kubelet's eviction ends the pod; its final status (all containers exited 0)
    # keeps no reason, so the eviction is read from the pod's Events.
    events = await k8s.CoreV1Api(k8s_api).list_namespaced_event(
        k8s_namespace, field_selector=f"involvedObject.name={sb.id},reason=Evicted"
    )
    assert [e.message for e in events.items if "ephemeral local storage" in e.message], events.items


def covered(address: str, cidrs: list[str]) -> bool:
    return any(ipaddress.ip_address(address) in ipaddress.ip_network(c) for c in cidrs)


async def test_k8s_setup_labels_the_namespace_and_writes_client_only_policies(
    kubeconfig: str, k8s_namespace: str, k8s_api: ApiClient
) -> None:
    cli = [sys.executable, "-m", "orchard", "k8s", "setup", "-n", k8s_namespace, f"--kubeconfig={kubeconfig}"]
    cli += ["--client-cidr", "198.51.100.0/24", "--client-namespace", "trainers", "--cluster-cidr", DEVCLUSTER_PODS]
    done = subprocess.run(cli, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert f"Namespace/{k8s_namespace}" in done.stdout
    core = k8s.CoreV1Api(k8s_api)
    labels = (await core.read_namespace(k8s_namespace)).metadata.labels
    assert labels[f"{PSA}/enforce"] == "baseline"
    assert labels[f"{PSA}/warn"] == labels[f"{PSA}/audit"] == "restricted"
    assert labels["orchard.test/pytest"] == "1"  # a merge: the namespace's own labels stay

    policies = await k8s.NetworkingV1Api(k8s_api).list_namespaced_network_policy(k8s_namespace)
    by_name = {p.metadata.name: k8s_api.sanitize_for_serialization(p.spec) for p in policies.items}
    client = {"matchLabels": {"orchard.dev/client": "true"}}
    assert by_name["orchard-sandboxes"]["ingress"] == [
        {
            "from": [
                {"podSelector": client},
                {
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "trainers"}},
                    "podSelector": client,
                },
                {"ipBlock": {"cidr": "198.51.100.0/24"}},
            ],
            "ports": [{"port": 8750, "protocol": "TCP"}],
        }
    ]
    assert by_name["orchard-sandboxes"].get("egress", []) == []  # Egress in policyTypes, no rule: none

    egress = by_name["orchard-sandbox-egress"]
    assert egress["podSelector"]["matchLabels"]["orchard.dev/network"] == "on"
    blocks = {
        p["ipBlock"]["cidr"]: p["ipBlock"].get("except", [])
        for r in egress["egress"]
        for p in r["to"]
        if "ipBlock" in p
    }
    v4 = blocks["0.0.0.0/0"]
    slices = await k8s.DiscoveryV1Api(k8s_api).list_namespaced_endpoint_slice(
        "default", label_selector="kubernetes.io/service-name=kubernetes"
    )
    api_ips = [a for s in slices.items for e in s.endpoints or [] for a in e.addresses]
    service_ip = (await core.read_namespaced_service("kubernetes", "default")).spec.cluster_ip
    nodes = (await core.list_node()).items
    node_ips = [a.address for n in nodes for a in n.status.addresses if a.type == "InternalIP"]
    for address in ["169.254.169.254", service_ip, *api_ips, *node_ips]:
        assert covered(address, v4), (address, v4)
    for n in nodes:
        for cidr in n.spec.pod_cidrs or []:
            assert covered(str(ipaddress.ip_network(cidr)[1]), v4), (cidr, v4)
    assert not covered("198.51.100.7", v4)

    # The labelled namespace (enforcing baseline) admits the default sandbox.
    async with orchard.Client(config(kubeconfig, k8s_namespace)) as c, c.sandbox(BUSYBOX, network=True) as sb:
        assert (await sb.exec(["echo", "admitted"])).stdout == "admitted\n"
        pod = await core.read_namespaced_pod(sb.id, k8s_namespace)
        assert pod.metadata.labels["orchard.dev/network"] == "on"
        assert covered(pod.status.pod_ip, v4)  # sandboxes cannot reach one another through the egress rule


async def test_the_token_and_the_data_cross_the_pod_network_only_encrypted(kubeconfig: str, k8s_namespace: str) -> None:
    secret = secrets.token_hex(16).encode()
    async with orchard.Client(config(kubeconfig, k8s_namespace, transport="direct")) as client:
        with captured_tcp() as segments:
            async with client.sandbox(BUSYBOX) as sb:
                assert (await sb.exec(["echo", secret.decode()])).stdout == secret.decode() + "\n"
                await sb.write_file("/tmp/secret", secret)
                assert await sb.read_file("/tmp/secret") == secret
                await asyncio.sleep(0.5)  # the capture thread catches up
    token = sb._rpc._headers["Authorization"].removeprefix("Bearer ").encode()
    sent = to_executor(segments, sb)
    # The capture saw the requests to the pod, yet neither the token nor the data is in any segment.
    assert len(sent) >= 4, f"only {len(sent)} segments to the executor captured"
    assert not [s for s in segments if token in s.payload], "the bearer token crossed the pod network in clear"
    assert not [s for s in segments if secret in s.payload], "a command's data crossed the pod network in clear"
    assert sent[0].payload[:1] == b"\x16", sent[0].payload[:64]  # a TLS handshake record
