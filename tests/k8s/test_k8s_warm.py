"""Warm pools on Kubernetes: real pods started ahead, claimed at once, refilled, and all deleted at the end."""

from __future__ import annotations

import asyncio

import pytest
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio.client.api_client import ApiClient

import orchard
from support import cancel_twice

pytestmark = pytest.mark.k8s

BUSYBOX = "orchard-test/busybox:latest"


async def pods(api: ApiClient, namespace: str, session: str) -> set[str]:
    listing = await k8s.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=f"orchard.dev/session={session}")
    return {p.metadata.name for p in listing.items if p.metadata.deletion_timestamp is None}


async def test_claims_take_pooled_pods_and_close_deletes_every_one(
    k8s_api: ApiClient, k8s_namespace: str, kubeconfig: str
) -> None:
    config = orchard.KubernetesConfig(namespace=k8s_namespace, kubeconfig=kubeconfig)
    async with orchard.Client(config, warm={BUSYBOX: 2}) as client:
        await client.wait_warm(timeout=180)
        pooled = await pods(k8s_api, k8s_namespace, client.session_id)
        assert len(pooled) == 2
        async with client.sandbox(BUSYBOX) as a, client.sandbox(BUSYBOX) as b:
            assert "claim" in a.timings
            assert "claim" in b.timings
            names = {(await sb.exec("cat /etc/hostname")).stdout.strip() for sb in (a, b)}
            assert names == pooled
        await client.wait_warm(timeout=180)
        assert not await pods(k8s_api, k8s_namespace, client.session_id) & pooled
        session = client.session_id
    assert await pods(k8s_api, k8s_namespace, session) == set()


async def test_a_start_cancelled_twice_has_deleted_its_pod_when_it_returns(
    k8s_api: ApiClient, k8s_namespace: str, kubeconfig: str
) -> None:
    """A second cancel, landing while the first one's cleanup runs, does not cut that cleanup short."""
    config = orchard.KubernetesConfig(namespace=k8s_namespace, kubeconfig=kubeconfig)
    async with orchard.Client(config) as client:
        for delay in (0.2, 0.6, 1.2):
            # The first cancel at a different step of the start each time, the second at the next loop turn.
            await cancel_twice(asyncio.create_task(client.create(BUSYBOX)), delay, 0)
            assert await pods(k8s_api, k8s_namespace, client.session_id) == set(), f"cancelled after {delay} s"
