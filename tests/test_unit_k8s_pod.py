"""The pod manifest builder and the pod-status reader, without a cluster."""

from typing import Any

import msgspec
import pytest

from orchard._backends.k8s_pod import (
    INIT_CONTAINER,
    MANAGED_BY,
    SANDBOX_LABEL,
    SESSION_LABEL,
    Pod,
    classify,
    pod_manifest,
)
from orchard._spec import make_spec

pytestmark = pytest.mark.unit

TOKEN_HASH = "ab" * 32


def build(**options: Any) -> dict[str, Any]:
    return pod_manifest(
        make_spec("swebench/django:latest", options),
        name="sb-1234-abcd",
        namespace="rollouts",
        session_id="1234",
        token_sha256=TOKEN_HASH,
        injector_image="orchard-executor:test",
        launcher=["/.orchard/run"],
        install=["/orchard/install", "/.orchard"],
        bundle_path="/.orchard",
        port=8750,
        created_at=1000.0,
    )


def test_secure_defaults() -> None:
    pod = build()
    spec = pod["spec"]
    assert spec["automountServiceAccountToken"] is False
    assert spec["enableServiceLinks"] is False
    assert spec["restartPolicy"] == "Never"
    assert spec["terminationGracePeriodSeconds"] <= 2
    (container,) = spec["containers"]
    # The pod carries the token's hash only.
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["ORCHARD_EXECUTOR_TOKEN_SHA256"] == TOKEN_HASH
    assert "activeDeadlineSeconds" not in spec


def test_injection_and_launcher() -> None:
    spec = build()["spec"]
    (init,) = spec["initContainers"]
    (container,) = spec["containers"]
    assert init["name"] == INIT_CONTAINER
    assert init["image"] == "orchard-executor:test"
    assert init["command"] == ["/orchard/install", "/.orchard"]
    (volume,) = spec["volumes"]
    assert "emptyDir" in volume
    assert init["volumeMounts"][0]["name"] == volume["name"]
    mount = container["volumeMounts"][0]
    assert mount == {"name": volume["name"], "mountPath": "/.orchard", "readOnly": True}
    assert container["image"] == "swebench/django:latest"
    assert container["command"] == ["/.orchard/run"]
    assert "--port=8750" in container["args"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": 8750}


def test_labels_annotations_and_ttl() -> None:
    pod = build(labels={"team": "rl"}, annotations={"note": "x"}, ttl=3600, idle_timeout=60)
    meta = pod["metadata"]
    assert meta["name"] == "sb-1234-abcd"
    assert meta["namespace"] == "rollouts"
    assert meta["labels"][MANAGED_BY] == "orchard"
    assert meta["labels"][SANDBOX_LABEL] == "sb-1234-abcd"
    assert meta["labels"][SESSION_LABEL] == "1234"
    assert meta["labels"]["team"] == "rl"
    assert meta["annotations"]["note"] == "x"
    assert meta["annotations"]["orchard.dev/expires-at"] == "4600"
    assert pod["spec"]["activeDeadlineSeconds"] == 3600
    assert "--idle-timeout=60" in pod["spec"]["containers"][0]["args"]


def test_user_labels_cannot_override_ownership() -> None:
    meta = build(labels={SESSION_LABEL: "other", MANAGED_BY: "me"})["metadata"]
    assert meta["labels"][SESSION_LABEL] == "1234"
    assert meta["labels"][MANAGED_BY] == "orchard"


def test_scheduling_and_resources() -> None:
    spec = build(
        cpu="500m",
        memory="2Gi",
        env={"A": "1"},
        workdir="/testbed",
        node_selector={"pool": "sandboxes"},
        tolerations=[{"key": "sandbox", "operator": "Exists", "effect": "NoSchedule"}],
        runtime_class="gvisor",
        image_pull_secrets=["regcred"],
        image_pull_policy="Never",
    )["spec"]
    container = spec["containers"][0]
    assert container["resources"] == {
        "requests": {"cpu": "500m", "memory": "2Gi"},
        "limits": {"cpu": "500m", "memory": "2Gi"},
    }
    assert {"name": "A", "value": "1"} in container["env"]
    assert container["workingDir"] == "/testbed"
    assert "--workdir=/testbed" in container["args"]
    assert container["imagePullPolicy"] == "Never"
    assert spec["initContainers"][0]["imagePullPolicy"] == "Never"
    assert spec["nodeSelector"] == {"pool": "sandboxes"}
    assert spec["tolerations"][0]["key"] == "sandbox"
    assert spec["runtimeClassName"] == "gvisor"
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]


def test_cpu_as_a_number() -> None:
    assert build(cpu=2)["spec"]["containers"][0]["resources"]["limits"]["cpu"] == "2"


def pod(status: dict[str, Any], **extra: Any) -> Pod:
    return msgspec.convert({"metadata": {"name": "p", **extra.get("metadata", {})}, "status": status}, Pod)


def test_classify_pending_then_running() -> None:
    assert classify(pod({"phase": "Pending"})).state == "pending"
    scheduled = pod({"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "True"}]})
    assert classify(scheduled).scheduled
    assert classify(scheduled).state == "pending"
    running = pod(
        {
            "phase": "Running",
            "podIP": "10.88.0.7",
            "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Initialized", "status": "True"}],
            "containerStatuses": [{"name": "sandbox", "state": {"running": {"startedAt": "now"}}}],
        }
    )
    phase = classify(running)
    assert phase.state == "running"
    assert phase.pod_ip == "10.88.0.7"
    assert phase.initialized


@pytest.mark.parametrize(
    ("status", "reason"),
    [
        (
            {"containerStatuses": [{"state": {"waiting": {"reason": "ErrImagePull", "message": "not found"}}}]},
            "ErrImagePull",
        ),
        ({"containerStatuses": [{"state": {"waiting": {"reason": "ImagePullBackOff"}}}]}, "ImagePullBackOff"),
        (
            {
                "conditions": [
                    {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/1 nodes"}
                ]
            },
            "Unschedulable",
        ),
        ({"initContainerStatuses": [{"state": {"terminated": {"exitCode": 3}}}]}, "InitFailed"),
        (
            {
                "phase": "Failed",
                "containerStatuses": [{"state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}],
            },
            "OOMKilled",
        ),
        ({"phase": "Failed", "reason": "Evicted", "message": "low on memory"}, "Evicted"),
        ({"phase": "Failed", "reason": "DeadlineExceeded"}, "DeadlineExceeded"),
        (
            {
                "phase": "Failed",
                "reason": "DeadlineExceeded",
                "containerStatuses": [{"state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}],
            },
            "DeadlineExceeded",
        ),
    ],
)
def test_classify_failures(status: dict[str, Any], reason: str) -> None:
    phase = classify(pod({"phase": "Pending", **status}))
    assert phase.state == "failed"
    assert phase.reason == reason


def test_classify_deleting() -> None:
    phase = classify(pod({"phase": "Running"}, metadata={"deletionTimestamp": "2026-01-01T00:00:00Z"}))
    assert (phase.state, phase.reason) == ("failed", "Deleted")


def test_a_waiting_container_that_may_recover_is_still_pending() -> None:
    phase = classify(pod({"containerStatuses": [{"state": {"waiting": {"reason": "ContainerCreating"}}}]}))
    assert phase.state == "pending"


def test_classify_evicted_through_the_eviction_api() -> None:
    evicting = pod(
        {
            "phase": "Running",
            "conditions": [{"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}],
        },
        metadata={"deletionTimestamp": "2026-01-01T00:00:00Z"},
    )
    phase = classify(evicting)
    assert (phase.state, phase.reason) == ("failed", "Evicted")
    assert "EvictionByEvictionAPI" in phase.message
