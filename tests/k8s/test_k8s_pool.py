"""Shared warm pools on Kubernetes: a keeper's pods claimed by other clients, re-keyed, raced for, kept over
a keeper's death, and collected by gc when no keeper is left. Real pods on the dev cluster."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio.client.api_client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

import orchard
from orchard._backends import k8s_pool
from orchard._backends.kubernetes import setup
from orchard._spec import make_spec
from orchard._tls import pin
from orchard.errors import SandboxStartError
from support import eventually

pytestmark = pytest.mark.k8s

BUSYBOX = "orchard-test/busybox:latest"


def config(kubeconfig: str, namespace: str, **options: object) -> orchard.KubernetesConfig:
    return orchard.KubernetesConfig(namespace=namespace, kubeconfig=kubeconfig, **options)  # type: ignore[arg-type]


async def pool_pods(api: ApiClient, namespace: str, pool: str, state: str | None = None) -> dict[str, k8s.V1Pod]:
    selector = f"{k8s_pool.POOL_LABEL}={pool}" + (f",{k8s_pool.POOL_STATE_LABEL}={state}" if state else "")
    listing = await k8s.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=selector)
    return {p.metadata.name: p for p in listing.items if p.metadata.deletion_timestamp is None}


@contextlib.asynccontextmanager
async def keeper(
    cfg: orchard.KubernetesConfig, pool: str, size: int, *, max_starting: int = 4
) -> AsyncIterator[k8s_pool.Keeper]:
    """A keeper running in this process until the block ends, full before it starts."""
    keep = k8s_pool.Keeper(cfg, pool, make_spec(BUSYBOX, {}), size, max_starting=max_starting)
    full = asyncio.Event()
    task = asyncio.create_task(keep.run(ready=full))
    try:
        async with asyncio.timeout(180):
            done, _ = await asyncio.wait([task, asyncio.create_task(full.wait())], return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            task.result()  # the keeper failed: say why
        yield keep
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def pool_key(api: ApiClient, namespace: str, pool: str) -> str:
    secret = await k8s.CoreV1Api(api).read_namespaced_secret(k8s_pool.secret_name(pool), namespace)
    return base64.b64decode(secret.data["key"]).decode()


async def answers(pod: k8s.V1Pod, token: str) -> int:
    """The status the pod's executor gives a request with this token."""
    fingerprint = bytes.fromhex(pod.metadata.annotations[k8s_pool.FINGERPRINT_ANNOTATION])
    async with (
        aiohttp.ClientSession() as http,
        http.get(
            f"https://{pod.status.pod_ip}:8750/v1/info",
            headers={"Authorization": f"Bearer {token}"},
            ssl=pin(fingerprint),
        ) as resp,
    ):
        return resp.status


async def test_a_claim_takes_a_pool_pod_rekeys_it_and_the_keeper_refills(
    k8s_api: ApiClient, k8s_namespace: str, kubeconfig: str
) -> None:
    cfg = config(kubeconfig, k8s_namespace, lease_seconds=10)
    async with keeper(cfg, "swe", 2) as keep:
        ready = await pool_pods(k8s_api, k8s_namespace, "swe", "ready")
        assert len(ready) == 2
        key = await pool_key(k8s_api, k8s_namespace, "swe")
        assert {await answers(p, key) for p in ready.values()} == {200}  # the pool's key opens free pods
        async with orchard.Client(config(kubeconfig, k8s_namespace, pool="swe")) as client:
            async with client.sandbox(BUSYBOX) as sb:
                assert set(sb.timings) == {"listed", "won", "rekeyed", "claim"}
                assert sb.id in ready
                assert (await sb.exec("cat /etc/hostname")).stdout.strip() == sb.id
                pod = await k8s.CoreV1Api(k8s_api).read_namespaced_pod(sb.id, k8s_namespace)
                assert pod.metadata.labels[k8s_pool.POOL_STATE_LABEL] == "claimed"
                assert pod.metadata.labels["orchard.dev/session"] == client.session_id
                assert [o.name for o in pod.metadata.owner_references] == [f"orchard-session-{client.session_id}"]
                # Re-keyed: the key every client of the namespace may read no longer opens it.
                assert await answers(pod, key) == 401
                assert (await sb.exec(["true"])).exit_code == 0
                await eventually(
                    lambda: keep.starts >= 3 and keep.free == 2,
                    timeout=120,
                    what="the keeper started a pod for the one claimed",
                )
                assert keep.starts == 3  # and deleted no pod it had just started (a list read mid-start)
                # Another spec is never served from the pool: a cold start.
                async with client.sandbox(BUSYBOX, env={"A": "1"}) as other:
                    assert "claim" not in other.timings
                    assert other.id not in await pool_pods(k8s_api, k8s_namespace, "swe")
            claimed = sb.id
            await eventually(
                lambda: _gone(k8s_api, k8s_namespace, claimed), timeout=30, what="the claimed pod deleted on close"
            )
    # The keeper stopped: its Lease is deleted, and with it every free pod.
    await eventually(
        lambda: _empty(k8s_api, k8s_namespace, "swe"), timeout=60, what="the free pods deleted with the keeper"
    )


async def _gone(api: ApiClient, namespace: str, name: str) -> bool:
    try:
        pod = await k8s.CoreV1Api(api).read_namespaced_pod(name, namespace)
    except ApiException as exc:
        return exc.status == 404
    return pod.metadata.deletion_timestamp is not None


async def _empty(api: ApiClient, namespace: str, pool: str) -> bool:
    return not await pool_pods(api, namespace, pool)


async def test_many_claimers_racing_each_pod_goes_to_exactly_one(
    k8s_api: ApiClient, k8s_namespace: str, kubeconfig: str
) -> None:
    cfg = config(kubeconfig, k8s_namespace, pool="race")
    async with keeper(cfg, "race", 3):
        ready = set(await pool_pods(k8s_api, k8s_namespace, "race", "ready"))
        clients = [orchard.Client(cfg) for _ in range(8)]
        try:
            sandboxes = await asyncio.gather(*(c.create(BUSYBOX) for c in clients))
            claimed = [sb.id for sb in sandboxes if "claim" in sb.timings]
            assert len(claimed) == len(set(claimed))  # never handed out twice
            assert len(claimed) < 8  # 3 pods for 8 claimers: the others started cold
            assert ready <= set(claimed)  # and a claimer that went cold had lost every race
            for c, sb in zip(clients, sandboxes, strict=True):
                pod = await k8s.CoreV1Api(k8s_api).read_namespaced_pod(sb.id, k8s_namespace)
                assert pod.metadata.labels["orchard.dev/session"] == c.session_id
                assert (await sb.exec(["hostname"])).stdout.strip() == sb.id
        finally:
            await asyncio.gather(*(c.aclose() for c in clients))
        # The compare-and-swap itself: 16 patches at once on one free pod, one passes.
        await eventually(lambda: _has_ready(k8s_api, k8s_namespace, "race"), timeout=120, what="a refilled pod")
        name = next(iter(await pool_pods(k8s_api, k8s_namespace, "race", "ready")))
        owner = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "name": "nobody",
            "uid": "00000000-0000-0000-0000-000000000000",
        }
        core = k8s.CoreV1Api(k8s_api)
        results = await asyncio.gather(
            *(
                core.patch_namespaced_pod(name, k8s_namespace, k8s_pool.claim_patch(session_id=f"s{i}", owner=owner))
                for i in range(16)
            ),
            return_exceptions=True,
        )
        won = [r for r in results if not isinstance(r, BaseException)]
        lost = [r for r in results if isinstance(r, ApiException)]
        assert len(won) == 1
        assert len(lost) == 15
        assert {e.status for e in lost} == {422}
        await core.delete_namespaced_pod(name, k8s_namespace, grace_period_seconds=0)


async def _has_ready(api: ApiClient, namespace: str, pool: str) -> bool:
    return bool(await pool_pods(api, namespace, pool, "ready"))


async def test_without_a_keeper_or_secret_claims_start_cold(k8s_namespace: str, kubeconfig: str) -> None:
    async with orchard.Client(config(kubeconfig, k8s_namespace, pool="nobody")) as client:
        async with client.sandbox(BUSYBOX) as sb:
            assert "claim" not in sb.timings
            assert (await sb.exec(["true"])).exit_code == 0


def keep_cli(kubeconfig: str, namespace: str, pool: str, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "orchard", "pool", "keep", pool, "--image", BUSYBOX, "--size", "1"]
        + ["--lease-seconds", "4", "-n", namespace, "--kubeconfig", kubeconfig],
        stdout=subprocess.DEVNULL,
        stderr=log.open("wb"),
    )


async def test_a_sigkilled_keeper_is_replaced_and_gc_collects_a_pool_with_none(
    k8s_api: ApiClient, k8s_namespace: str, kubeconfig: str, tmp_path: Path
) -> None:
    coord = k8s.CoordinationV1Api(k8s_api)
    lease = k8s_pool.lease_name("fo")

    async def holder() -> str | None:
        try:
            return (await coord.read_namespaced_lease(lease, k8s_namespace)).spec.holder_identity
        except ApiException:
            return None

    first = keep_cli(kubeconfig, k8s_namespace, "fo", tmp_path / "first.log")
    second: subprocess.Popen[bytes] | None = None
    try:
        await eventually(lambda: _count_ready(k8s_api, k8s_namespace, "fo", 1), timeout=120, what="first keeper full")
        first_holder = await holder()
        pod = next(iter(await pool_pods(k8s_api, k8s_namespace, "fo", "ready")))
        second = keep_cli(kubeconfig, k8s_namespace, "fo", tmp_path / "second.log")
        await eventually(
            lambda: "standing by" in (tmp_path / "second.log").read_text(), timeout=30, what="second keeper waits"
        )
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        await eventually(lambda: _changed(holder, first_holder), timeout=30, what="the second keeper takes over")
        # The pool's pods stayed with its Lease: the same free pod, and no second one.
        await asyncio.sleep(3)
        assert set(await pool_pods(k8s_api, k8s_namespace, "fo")) == {pod}
        second.send_signal(signal.SIGKILL)
        second.wait(10)
        # No keeper is left: once the Lease expires, gc deletes the pool's pod and its Lease.
        await asyncio.sleep(5)
        gc = subprocess.run(
            [sys.executable, "-m", "orchard", "gc", "-n", k8s_namespace, "--kubeconfig", kubeconfig],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert gc.returncode == 0, gc.stderr
        assert f"deleted {pod} (orphaned)" in gc.stdout
        assert f"deleted {lease} (session lease expired)" in gc.stdout
        await eventually(lambda: _empty(k8s_api, k8s_namespace, "fo"), timeout=60, what="no pool pod left")
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_a_keeper_stopped_by_a_signal_deletes_its_lease_and_its_free_pods(
    k8s_api: ApiClient, k8s_namespace: str, kubeconfig: str, tmp_path: Path, stop: signal.Signals
) -> None:
    coord = k8s.CoordinationV1Api(k8s_api)
    pool = f"stop-{stop.name.lower()}"

    async def lease_gone() -> bool:
        try:
            await coord.read_namespaced_lease(k8s_pool.lease_name(pool), k8s_namespace)
        except ApiException as exc:
            return exc.status == 404
        return False

    log = tmp_path / "keeper.log"
    keeper = keep_cli(kubeconfig, k8s_namespace, pool, log)
    try:
        await eventually(lambda: _count_ready(k8s_api, k8s_namespace, pool, 1), timeout=120, what="the pool is full")
        assert not await lease_gone()
        keeper.send_signal(stop)
        assert await asyncio.to_thread(keeper.wait, 60) == 0, log.read_text()
        assert f"stopped; the free pods of pool {pool} are deleted" in log.read_text()
        # Its Lease is deleted at once, not left to expire (4 s here, 15 by default): another keeper may start.
        assert await lease_gone()
        await eventually(lambda: _empty(k8s_api, k8s_namespace, pool), timeout=60, what="no pool pod left")
    finally:
        if keeper.poll() is None:
            keeper.kill()
            keeper.wait(10)


@pytest.mark.parametrize("max_starting", [1, 3])
async def test_a_keeper_starts_at_most_max_starting_pods_at_once(
    k8s_api: ApiClient, k8s_namespace: str, kubeconfig: str, max_starting: int
) -> None:
    pool = f"limit-{max_starting}"
    most = 0

    async def watch() -> None:
        nonlocal most
        while True:
            most = max(most, len(await pool_pods(k8s_api, k8s_namespace, pool, "starting")))
            await asyncio.sleep(0.02)

    watching = asyncio.create_task(watch())
    try:
        async with keeper(config(kubeconfig, k8s_namespace), pool, 3, max_starting=max_starting):
            assert len(await pool_pods(k8s_api, k8s_namespace, pool, "ready")) == 3
    finally:
        watching.cancel()
    # One at a time with 1; with 3, the three of an empty pool at once (seen starting together).
    assert most == max_starting


async def _count_ready(api: ApiClient, namespace: str, pool: str, n: int) -> bool:
    return len(await pool_pods(api, namespace, pool, "ready")) == n


async def _changed(holder: object, before: str | None) -> bool:
    now = await holder()  # type: ignore[operator]
    return now is not None and now != before


async def test_the_client_role_is_enough_to_claim(
    k8s_api: ApiClient,
    k8s_namespace: str,
    kubeconfig: str,
    service_account_kubeconfig: Callable[[str], Awaitable[str]],
) -> None:
    """Claims made with a service account's token bound only to the Role ``orchard k8s setup --pool`` writes."""
    core = k8s.CoreV1Api(k8s_api)
    await core.create_namespaced_service_account(
        k8s_namespace, k8s.V1ServiceAccount(metadata=k8s.V1ObjectMeta(name="trainer"))
    )
    admin = config(kubeconfig, k8s_namespace)
    written = await setup(admin, service_account="trainer", pools=["rb"], pod_security=None)
    assert [o["kind"] for o in written][-1] == "Secret"
    role = await k8s.RbacAuthorizationV1Api(k8s_api).read_namespaced_role("orchard-client", k8s_namespace)
    assert [r.resource_names for r in role.rules if r.resources == ["secrets"]] == [["orchard-pool-rb"]]
    trainer = await service_account_kubeconfig("trainer")
    async with keeper(admin, "rb", 1):
        key_before = await pool_key(k8s_api, k8s_namespace, "rb")
        async with orchard.Client(config(trainer, k8s_namespace, pool="rb")) as client:
            async with client.sandbox(BUSYBOX) as sb:
                assert "claim" in sb.timings
                assert (await sb.exec(["true"])).exit_code == 0
        # The keeper, and setup run again, keep the key setup wrote (pods already in the pool accept it).
        await setup(admin, pools=["rb"], pod_security=None)
        assert await pool_key(k8s_api, k8s_namespace, "rb") == key_before


async def test_a_pool_whose_image_cannot_start_backs_off_and_claims_fail_as_cold_starts(
    k8s_namespace: str, kubeconfig: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="orchard.pool")
    options = {"image_pull_policy": "Never"}
    cfg = config(kubeconfig, k8s_namespace)
    keep = k8s_pool.Keeper(cfg, "bad", make_spec("orchard-test/does-not-exist:1", options), 2, max_starting=1)
    task = asyncio.create_task(keep.run())
    try:
        await eventually(
            lambda: sum("next in" in r.getMessage() for r in caplog.records) >= 2,
            timeout=120,
            what="two failed starts",
        )
        assert isinstance(keep.last_error, SandboxStartError)
        assert keep.last_error.reason == "ErrImageNeverPull"
        assert keep.free == 0
        # Each failure doubles the wait before the next start, instead of looping.
        delays = [r.getMessage().rsplit("next in ", 1)[1] for r in caplog.records if "next in" in r.getMessage()]
        assert delays[:2] == ["0.5s", "1.0s"]
        async with orchard.Client(config(kubeconfig, k8s_namespace, pool="bad")) as client:
            with pytest.raises(SandboxStartError) as info:
                await client.create("orchard-test/does-not-exist:1", **options)
        assert info.value.reason == "ErrImageNeverPull"  # the cold start's own typed error
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# No key at all; a key that is not text.
@pytest.mark.parametrize("data", [{"other": "eA=="}, {"key": "//4="}])
async def test_a_malformed_pool_secret_is_a_typed_error_for_the_keeper_and_a_cold_start_for_claims(
    k8s_api: ApiClient, k8s_namespace: str, kubeconfig: str, data: dict[str, str]
) -> None:
    await k8s.CoreV1Api(k8s_api).create_namespaced_secret(
        k8s_namespace, k8s.V1Secret(metadata=k8s.V1ObjectMeta(name=k8s_pool.secret_name("mal")), data=data)
    )
    keep = k8s_pool.Keeper(config(kubeconfig, k8s_namespace), "mal", make_spec(BUSYBOX, {}), 1)
    with pytest.raises(orchard.errors.ConfigError, match="holds no valid 'key'"):
        await asyncio.wait_for(keep.run(), 60)
    async with orchard.Client(config(kubeconfig, k8s_namespace, pool="mal")) as client:
        async with client.sandbox(BUSYBOX) as sb:
            assert "claim" not in sb.timings
