"""NetworkPolicy is enforced on the dev cluster, not only written.

The dev cluster runs kube-router's policy controller (``hack/devcluster``).
Each test writes policies, starts real sandboxes and pods, and connects from
inside them: a denied connect must fail and the same connect under an
allowing policy must work, so each test fails on a cluster that only stores
policies. Every connection goes to a pod or to the CNI bridge's address on
this host, never further.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shlex
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio.client.api_client import ApiClient

import orchard
from orchard._backends.k8s_pod import NETWORK_LABEL, SANDBOX_LABEL
from orchard._backends.kubernetes import setup

pytestmark = pytest.mark.k8s

SWE = "orchard-test/swe:latest"
HTTPD_IMAGE = "orchard.local/devcluster/httpd:1"
EXECUTOR_PORT = 8750
TEST_LABEL = "orchard.test/pytest"

#: Connect once with a 3 s deadline; print "connected" or the error's name.
PROBE = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close()
except OSError as e:
    print(type(e).__name__)
    sys.exit(1)
print("connected")
"""


def canonical_policies(client_cidr: str) -> list[dict[str, Any]]:
    """Sandboxes: ingress only from the client to the executor port, no egress; ``network=on`` ones: any egress."""
    sandboxes = {"matchExpressions": [{"key": SANDBOX_LABEL, "operator": "Exists"}]}
    return [
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "sandboxes-default-deny"},
            "spec": {
                "podSelector": sandboxes,
                "policyTypes": ["Ingress", "Egress"],
                "ingress": [
                    {
                        "from": [{"ipBlock": {"cidr": client_cidr}}],
                        "ports": [{"protocol": "TCP", "port": EXECUTOR_PORT}],
                    }
                ],
                "egress": [],
            },
        },
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "sandbox-egress"},
            "spec": {
                "podSelector": {**sandboxes, "matchLabels": {NETWORK_LABEL: "on"}},
                "policyTypes": ["Egress"],
                "egress": [{"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}]}],
            },
        },
    ]


async def apply(api: ApiClient, namespace: str, policies: list[dict[str, Any]]) -> None:
    net = k8s.NetworkingV1Api(api)
    for policy in policies:
        await net.create_namespaced_network_policy(namespace, policy)


def bridge_address(pod_ip: str) -> str:
    """This host's address on the pod network: where the client's packets to pods come from."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((pod_ip, 9))  # a UDP connect sends nothing: it only picks the route and source address
        return str(s.getsockname()[0])


async def pod_ip(api: ApiClient, namespace: str, name: str) -> str:
    pod = await k8s.CoreV1Api(api).read_namespaced_pod(name, namespace)
    assert pod.status.pod_ip, f"pod {name} has no IP: {pod.status}"
    return str(pod.status.pod_ip)


async def start_httpd(api: ApiClient, namespace: str, name: str = "httpd") -> str:
    """A plain pod no policy selects, serving HTTP on :8080; returns its IP once Ready."""
    core = k8s.CoreV1Api(api)
    pod = k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(name=name, labels={TEST_LABEL: "1"}),
        spec=k8s.V1PodSpec(
            automount_service_account_token=False,
            enable_service_links=False,
            termination_grace_period_seconds=1,
            containers=[
                k8s.V1Container(
                    name="main",
                    image=HTTPD_IMAGE,
                    image_pull_policy="Never",
                    readiness_probe=k8s.V1Probe(http_get=k8s.V1HTTPGetAction(path="/", port=8080), period_seconds=1),
                )
            ],
        ),
    )
    await core.create_namespaced_pod(namespace, pod)
    deadline = time.monotonic() + 60
    while True:
        got = await core.read_namespaced_pod(name, namespace)
        if any(c.type == "Ready" and c.status == "True" for c in got.status.conditions or []):
            return str(got.status.pod_ip)
        if time.monotonic() > deadline:
            pytest.fail(f"pod {name} not Ready in 60 s: {got.status}")
        await asyncio.sleep(0.3)


async def connect_from(sb: orchard.Sandbox, host: str, port: int) -> str:
    """Connect from inside the sandbox: "connected", or the error's name (ConnectionRefusedError, TimeoutError)."""
    r = await sb.exec(["python3", "-c", PROBE, host, str(port)], timeout=15)
    return r.stdout.strip() or f"exit {r.exit_code}: {r.stderr.strip()}"


async def connect_from_host(host: str, port: int) -> str:
    """A new connection from this host (the client's side), with a 3 s deadline."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 3)
    except (OSError, TimeoutError) as e:
        return type(e).__name__
    writer.close()
    return "connected"


@contextlib.asynccontextmanager
async def listener(host: str) -> AsyncIterator[tuple[int, list[str]]]:
    """A TCP listener on ``host``: yields its port and the peer addresses it accepted."""
    peers: list[str] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peers.append(writer.get_extra_info("peername")[0])
        writer.close()

    server = await asyncio.start_server(accept, host, 0)
    try:
        yield server.sockets[0].getsockname()[1], peers
    finally:
        server.close()
        await server.wait_closed()


async def programmed(namespace: str, expected: dict[str, set[str]], timeout: float = 60) -> None:
    """Wait until the policy agent filters each pod through exactly the named policies.

    kube-router writes a chain per pod, asynchronously after pods and policies
    change; connecting before it has would test timing, not enforcement. Its
    rules name the pod and each policy in comments, which ``iptables-save``
    shows (one atomic snapshot).
    """
    deadline = time.monotonic() + timeout
    while True:
        proc = await asyncio.create_subprocess_exec(
            "iptables-save", "-t", "filter", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, err = await proc.communicate()
        assert proc.returncode == 0, f"iptables-save failed (tests run as root): {err.decode()}"
        pod_chain: dict[str, str] = {}
        chain_policies: dict[str, set[str]] = {}
        for line in out.decode(errors="replace").splitlines():
            if not line.startswith("-A ") or "--comment" not in line:
                continue
            args = shlex.split(line)
            comment = args[args.index("--comment") + 1]
            m = re.fullmatch(
                r"rule to jump traffic destined to POD name:(\S+) namespace: (\S+) to chain (\S+)", comment
            )
            if m and m[2] == namespace:
                pod_chain[m[1]] = m[3]
            m = re.fullmatch(r"run through nw policy (\S+)", comment)
            if m:
                chain_policies.setdefault(args[1], set()).add(m[1])
        seen = {pod: chain_policies.get(pod_chain[pod], set()) if pod in pod_chain else None for pod in expected}
        if seen == expected:
            return
        if time.monotonic() > deadline:
            pytest.fail(
                f"the NetworkPolicy agent did not program the pods in {timeout:g} s: want {expected}, have {seen}"
                " (None: no chain for the pod). Is kube-router running? `hack/devcluster/devcluster status`",
                pytrace=False,
            )
        await asyncio.sleep(0.2)


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a label selector (matchLabels, matchExpressions) selects a pod with these labels."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        have, op = e["key"] in labels, e["operator"]
        value = labels.get(e["key"])
        if not {
            "Exists": have,
            "DoesNotExist": not have,
            "In": have and value in e.get("values", []),
            "NotIn": not have or value not in e.get("values", []),
        }[op]:
            return False
    return True


async def selecting(
    api: ApiClient, namespace: str, pods: list[str], policies: list[dict[str, Any]]
) -> dict[str, set[str]]:
    """For each pod, the names of the policies that select it."""
    core = k8s.CoreV1Api(api)
    result = {}
    for name in pods:
        labels = (await core.read_namespaced_pod(name, namespace)).metadata.labels or {}
        result[name] = {p["metadata"]["name"] for p in policies if selects(p["spec"]["podSelector"], labels)}
    return result


async def until_seen(peers: list[str], address: str) -> bool:
    """Whether the listener records ``address`` within 5 s (its accept runs on this loop, after the connect)."""
    for _ in range(50):
        if address in peers:
            return True
        await asyncio.sleep(0.1)
    return False


def kconfig(kubeconfig: str, namespace: str) -> orchard.KubernetesConfig:
    return orchard.KubernetesConfig(namespace=namespace, kubeconfig=kubeconfig)


async def test_a_sandbox_cannot_reach_another_sandboxes_executor_while_the_host_client_can(
    kubeconfig: str, k8s_namespace: str, k8s_api: ApiClient
) -> None:
    async with orchard.Client(kconfig(kubeconfig, k8s_namespace)) as c:
        a, b = await asyncio.gather(c.create(SWE), c.create(SWE))
        async with a, b:
            b_ip = await pod_ip(k8s_api, k8s_namespace, b.id)
            await apply(k8s_api, k8s_namespace, canonical_policies(f"{bridge_address(b_ip)}/32"))
            await programmed(k8s_namespace, {a.id: {"sandboxes-default-deny"}, b.id: {"sandboxes-default-deny"}})

            assert await connect_from(a, b_ip, EXECUTOR_PORT) != "connected"
            # The executor listens: this host opens a new connection to it, and the client still drives B.
            assert await connect_from_host(b_ip, EXECUTOR_PORT) == "connected"
            assert (await b.exec(["echo", "ok"])).stdout == "ok\n"


async def test_a_sandbox_without_egress_reaches_neither_the_host_nor_a_pod_and_one_with_egress_reaches_both(
    kubeconfig: str, k8s_namespace: str, k8s_api: ApiClient
) -> None:
    httpd_ip = await start_httpd(k8s_api, k8s_namespace)
    gateway = bridge_address(httpd_ip)
    await apply(k8s_api, k8s_namespace, canonical_policies(f"{gateway}/32"))
    async with orchard.Client(kconfig(kubeconfig, k8s_namespace)) as c, listener(gateway) as (port, peers):
        closed, open_ = await asyncio.gather(c.create(SWE), c.create(SWE, network=True))
        async with closed, open_:
            deny = "sandboxes-default-deny"
            await programmed(k8s_namespace, {"httpd": set(), closed.id: {deny}, open_.id: {deny, "sandbox-egress"}})

            assert await connect_from(closed, gateway, port) != "connected"
            assert await connect_from(closed, httpd_ip, 8080) != "connected"
            # The same connects under a policy that allows egress: the listeners answer.
            assert await connect_from(open_, gateway, port) == "connected"
            assert await until_seen(peers, await pod_ip(k8s_api, k8s_namespace, open_.id))
            assert await connect_from(open_, httpd_ip, 8080) == "connected"
            assert await pod_ip(k8s_api, k8s_namespace, closed.id) not in peers


async def test_orchard_k8s_setup_policies_are_enforced(kubeconfig: str, k8s_namespace: str, k8s_api: ApiClient) -> None:
    httpd_ip = await start_httpd(k8s_api, k8s_namespace)
    gateway = bridge_address(httpd_ip)
    cfg = kconfig(kubeconfig, k8s_namespace)
    written = await setup(cfg, client_cidrs=[f"{gateway}/32"])
    policies = [o for o in written if o["kind"] == "NetworkPolicy"]
    async with orchard.Client(cfg) as c, listener(gateway) as (port, peers):
        a, b = await asyncio.gather(c.create(SWE), c.create(SWE))
        async with a, b:
            expected = await selecting(k8s_api, k8s_namespace, ["httpd", a.id, b.id], policies)
            assert expected[a.id], f"no policy of orchard k8s setup selects a sandbox: {policies}"
            await programmed(k8s_namespace, expected)
            b_ip = await pod_ip(k8s_api, k8s_namespace, b.id)

            assert await connect_from(a, b_ip, EXECUTOR_PORT) != "connected"
            assert await connect_from(a, gateway, port) != "connected"
            assert await connect_from(a, httpd_ip, 8080) != "connected"
            assert peers == []
            assert await connect_from_host(b_ip, EXECUTOR_PORT) == "connected"
            assert (await b.exec(["echo", "ok"])).stdout == "ok\n"
