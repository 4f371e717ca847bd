"""The pod manifest builder and the pod-status reader, without a cluster."""

import datetime
import ipaddress
import re
from typing import Any

import msgspec
import pytest
from kubernetes_asyncio import client as k8s

from orchard import _tools
from orchard._backends import KubernetesConfig, make_config
from orchard._backends.k8s_pod import (
    CLIENT_LABEL,
    DEFAULT_CAPABILITIES,
    EXPIRES_ANNOTATION,
    INIT_CONTAINER,
    MANAGED_BY,
    NETWORK_LABEL,
    SANDBOX_LABEL,
    SESSION_LABEL,
    SHM_VOLUME,
    TOOLS_CONTAINER,
    Lease,
    Phase,
    Pod,
    classify,
    client_role,
    egress_exceptions,
    garbage_reason,
    lease_manifest,
    network_policies,
    pod_manifest,
    pod_security_labels,
)
from orchard._backends.kubernetes import pod_options, setup
from orchard._spec import make_spec
from orchard.errors import ConfigError

pytestmark = pytest.mark.unit

TOKEN_HASH = "ab" * 32
POD_OPTIONS = (
    "run_as_user",
    "cap_add",
    "ephemeral_storage",
    "runtime_volume_limit",
    "user_namespaces",
    "tls_pem",
    "image_volumes",
    "owner",
)


def build(**options: Any) -> dict[str, Any]:
    hardening = {k: options.pop(k) for k in list(options) if k in POD_OPTIONS}
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
        **hardening,
    )


def test_secure_defaults() -> None:
    pod = build()
    spec = pod["spec"]
    assert spec["automountServiceAccountToken"] is False
    assert spec["enableServiceLinks"] is False
    assert spec["restartPolicy"] == "Never"
    assert spec["terminationGracePeriodSeconds"] == 1  # README: "a 1 s grace period"
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
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": 8750, "scheme": "HTTP"}


def test_image_volumes_mount_the_runtime_and_tools_from_the_images_with_no_init_container() -> None:
    spec = build(image_volumes=True, tools=["codex"])["spec"]
    assert "initContainers" not in spec
    (container,) = spec["containers"]
    runtime, tools = spec["volumes"]
    assert runtime["image"] == {"reference": "orchard-executor:test", "pullPolicy": "IfNotPresent"}
    assert tools["image"] == {"reference": "orchard-tools:latest", "pullPolicy": "IfNotPresent"}
    # The runtime lands where the launcher looks for it (MOUNT/runtime), read-only, as the copy did.
    assert container["volumeMounts"] == [
        {"name": runtime["name"], "mountPath": "/.orchard/runtime", "subPath": "orchard", "readOnly": True},
        {"name": tools["name"], "mountPath": "/.orchard-tools/bundle", "subPath": "bundle", "readOnly": True},
    ]
    assert container["command"] == ["/.orchard/run"]
    # Without tools, only the runtime's image.
    assert [v["image"]["reference"] for v in build(image_volumes=True)["spec"]["volumes"]] == ["orchard-executor:test"]


def test_the_injection_option_is_checked() -> None:
    assert KubernetesConfig().injection == "auto"
    with pytest.raises(ConfigError, match="injection"):
        make_config("kubernetes", {"injection": "copy"})


def test_a_tls_executor_gets_its_identity_and_an_https_probe() -> None:
    (container,) = build(tls_pem="PEM")["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["ORCHARD_EXECUTOR_TLS"] == "PEM"
    # The kubelet probes over TLS (a plain HTTP probe would find the executor never ready).
    assert container["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"


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


def test_shm_is_a_memory_emptydir_at_dev_shm() -> None:
    spec = build(shm="96Mi")["spec"]
    volume = next(v for v in spec["volumes"] if v["name"] == SHM_VOLUME)
    assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": str(96 * 1024 * 1024)}
    mounts = spec["containers"][0]["volumeMounts"]
    assert {"name": SHM_VOLUME, "mountPath": "/dev/shm"} in mounts
    # Only the task container: the init containers need none.
    assert all(m["name"] != SHM_VOLUME for c in spec["initContainers"] for m in c["volumeMounts"])
    image_volumes = build(shm="1Gi", image_volumes=True)["spec"]
    assert any(v["name"] == SHM_VOLUME for v in image_volumes["volumes"])


def test_no_shm_no_volume() -> None:
    spec = build()["spec"]
    assert all(v["name"] != SHM_VOLUME for v in spec["volumes"])
    assert all(m["mountPath"] != "/dev/shm" for m in spec["containers"][0]["volumeMounts"])


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


def test_a_failed_pod_still_says_how_far_it_got() -> None:
    # Bound to a node (spec.nodeName, no PodScheduled condition yet), initialized, with an IP: then OOM-killed.
    oom = msgspec.convert(
        {
            "spec": {"nodeName": "node-1"},
            "status": {
                "phase": "Failed",
                "podIP": "10.88.0.7",
                "conditions": [{"type": "Initialized", "status": "True"}],
                "containerStatuses": [{"state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}],
            },
        },
        Pod,
    )
    phase = classify(oom)
    assert (phase.state, phase.reason) == ("failed", "OOMKilled")
    assert (phase.pod_ip, phase.scheduled, phase.initialized) == ("10.88.0.7", True, True)


@pytest.mark.parametrize(("name", "which"), [(TOOLS_CONTAINER, "tools init container"), ("inject", "injector")])
def test_an_init_container_image_that_cannot_be_pulled_fails_the_pod_and_names_the_container(
    name: str, which: str
) -> None:
    waiting = {"waiting": {"reason": "ImagePullBackOff", "message": "pull access denied"}}
    phase = classify(pod({"initContainerStatuses": [{"name": name, "state": waiting}]}))
    assert (phase.state, phase.reason) == ("failed", "ImagePullBackOff")
    assert phase.message.startswith(which)
    assert phase.message.endswith(": pull access denied")


def test_init_containers_that_run_or_succeeded_and_a_container_without_an_ip_are_still_pending() -> None:
    status = {
        "phase": "Pending",
        "initContainerStatuses": [
            {"name": "inject", "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}},
            {"name": TOOLS_CONTAINER, "state": {"running": {"startedAt": "now"}}},
        ],
    }
    assert classify(pod(status)).state == "pending"
    no_ip = {"phase": "Pending", "containerStatuses": [{"state": {"running": {"startedAt": "now"}}}]}
    assert classify(pod(no_ip)).state == "pending"


DELETING = {"deletionTimestamp": "2026-01-01T00:00:00Z"}


def terminated(exit_code: int, **fields: str) -> dict[str, Any]:
    return {"state": {"terminated": {"exitCode": exit_code, **fields}}}


@pytest.mark.parametrize(
    ("status", "metadata", "reason", "message"),
    [
        # Deleted under the client: by an eviction (its reason and message, or a default), or by someone else.
        (
            {
                "phase": "Running",
                "conditions": [{"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}],
            },
            DELETING,
            "Evicted",
            "PreemptionByScheduler: the pod was evicted",
        ),
        (
            {
                "phase": "Running",
                "conditions": [
                    {
                        "type": "DisruptionTarget",
                        "status": "True",
                        "reason": "TerminationByKubelet",
                        "message": "The node was low on resource: memory.",
                    }
                ],
            },
            DELETING,
            "Evicted",
            "TerminationByKubelet: The node was low on resource: memory.",
        ),
        ({"phase": "Running"}, DELETING, "Deleted", "the pod is being deleted"),
        (
            {"phase": "Running", "conditions": [{"type": "DisruptionTarget", "status": "False", "reason": "X"}]},
            DELETING,
            "Deleted",
            "the pod is being deleted",
        ),
        # Ended: the pod's own reason and message, or its phase.
        ({"phase": "Failed", "reason": "DeadlineExceeded"}, {}, "DeadlineExceeded", "the pod is Failed"),
        (
            {"phase": "Failed", "reason": "Evicted", "message": "The node was low on resource: memory."},
            {},
            "Evicted",
            "The node was low on resource: memory.",
        ),
        ({"phase": "Succeeded"}, {}, "Succeeded", "the pod is Succeeded"),
        ({"phase": "Failed"}, {}, "Failed", "the pod is Failed"),
        (
            {"phase": "Failed", "message": "Pod was rejected: node(s) had taints"},
            {},
            "Failed",
            "Pod was rejected: node(s) had taints",
        ),
        # Ended with the sandbox container: its reason and termination message.
        (
            {"phase": "Failed", "containerStatuses": [terminated(1, reason="Error")]},
            {},
            "Error",
            "the sandbox container ended (Error, exit code 1)",
        ),
        (
            {"phase": "Failed", "containerStatuses": [terminated(1, reason="Error", message="panic: boom")]},
            {},
            "Error",
            "panic: boom",
        ),
        # The container ended before the pod's phase says so.
        (
            {"phase": "Running", "containerStatuses": [terminated(2, reason="Error")]},
            {},
            "Error",
            "the sandbox container ended (Error, exit code 2)",
        ),
        (
            {"phase": "Running", "containerStatuses": [terminated(2, reason="Error", message="panic: boom")]},
            {},
            "Error",
            "panic: boom",
        ),
        # Never scheduled.
        (
            {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]},
            {},
            "Unschedulable",
            "no node can run this pod",
        ),
        (
            {
                "conditions": [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": "0/3 nodes are available: 3 Insufficient cpu.",
                    }
                ]
            },
            {},
            "Unschedulable",
            "0/3 nodes are available: 3 Insufficient cpu.",
        ),
        # An init container failed: which one, its exit code, and what it said.
        (
            {"initContainerStatuses": [{"name": "inject", **terminated(3)}]},
            {},
            "InitFailed",
            "injector init container exited 3",  # it said nothing: no dangling colon
        ),
        (
            {"initContainerStatuses": [{"name": "inject", **terminated(1, reason="Error")}]},
            {},
            "InitFailed",
            "injector init container exited 1: Error",
        ),
        (
            {
                "initContainerStatuses": [
                    {"name": "inject", **terminated(1, reason="Error", message="cp: No space left")}
                ]
            },
            {},
            "InitFailed",
            "injector init container exited 1: cp: No space left",
        ),
        (
            {"initContainerStatuses": [{"name": TOOLS_CONTAINER, **terminated(1, message="cp: No space left")}]},
            {},
            "InitFailed",
            "tools init container (tools=[...]) exited 1: cp: No space left",
        ),
        (
            {"initContainerStatuses": [{"name": "inject", "state": {"waiting": {"reason": "ErrImagePull"}}}]},
            {},
            "ErrImagePull",
            "injector init container: ErrImagePull",
        ),
        # The sandbox container cannot start: the kubelet's message, or its reason.
        (
            {"containerStatuses": [{"state": {"waiting": {"reason": "ErrImagePull", "message": "manifest unknown"}}}]},
            {},
            "ErrImagePull",
            "manifest unknown",
        ),
        (
            {"containerStatuses": [{"state": {"waiting": {"reason": "ImagePullBackOff"}}}]},
            {},
            "ImagePullBackOff",
            "ImagePullBackOff",
        ),
    ],
)
def test_a_failed_pod_says_why_in_words(
    status: dict[str, Any], metadata: dict[str, Any], reason: str, message: str
) -> None:
    assert classify(pod(status, metadata=metadata)) == Phase("failed", reason, message)


def test_a_container_that_ended_without_a_reason_is_named_by_its_exit_code() -> None:
    for phase in ("Failed", "Running"):
        got = classify(pod({"phase": phase, "containerStatuses": [terminated(137)]}))
        # The exit code once: the reason falls back to it, and the message does not repeat it.
        assert (got.state, got.reason, got.message) == (
            "failed",
            "exit code 137",
            "the sandbox container ended (exit code 137)",
        )


def test_running_and_pending_say_whether_the_pod_was_scheduled_and_initialized() -> None:
    conditions = [{"type": "PodScheduled", "status": "True"}, {"type": "Initialized", "status": "True"}]
    running = {"phase": "Running", "podIP": "10.88.0.7", "conditions": conditions}
    running["containerStatuses"] = [{"name": "sandbox", "state": {"running": {"startedAt": "now"}}}]
    assert classify(pod(running)) == Phase("running", pod_ip="10.88.0.7", scheduled=True, initialized=True)
    creating = {"containerStatuses": [{"name": "sandbox", "state": {"waiting": {"reason": "ContainerCreating"}}}]}
    assert classify(pod({"conditions": conditions, **creating})) == Phase("pending", scheduled=True, initialized=True)
    assert classify(pod(creating)) == Phase("pending", scheduled=False, initialized=False)


def test_gc_deletes_finished_expired_and_orphaned_pods_and_keeps_the_rest() -> None:
    def reason(phase: str = "Running", expires: str | None = None, session: str | None = "live") -> str | None:
        labels = {SESSION_LABEL: session} if session is not None else {}
        annotations = {EXPIRES_ANNOTATION: expires} if expires is not None else {}
        p = pod({"phase": phase}, metadata={"labels": labels, "annotations": annotations})
        return garbage_reason(p, now=1000.0, live_sessions={"live"})

    assert reason() is None
    assert reason(phase="Succeeded") == reason(phase="Failed") == "finished"
    assert reason(expires="999.5") == "expired"
    assert reason(expires="1000.5") is None
    assert reason(session="gone") == reason(session=None) == "orphaned"
    # Finished wins over the rest; expired over orphaned.
    assert reason(phase="Failed", expires="1", session="gone") == "finished"
    assert reason(expires="1", session="gone") == "expired"


# -- Hardening: what a pod may do, and what the setup policies let through --

BASELINE_CAPS = {
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
}


def hardened(config: KubernetesConfig | None = None, **options: Any) -> dict[str, Any]:
    """The manifest the backend builds with this config."""
    return build(**options, **pod_options(config or KubernetesConfig()))


def test_pod_runs_under_runtime_default_seccomp_without_privilege_escalation() -> None:
    spec = hardened()["spec"]
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for c in spec["initContainers"] + spec["containers"]:
        assert c["securityContext"]["allowPrivilegeEscalation"] is False, c["name"]
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], c["name"]
    assert "hostUsers" not in spec  # user namespaces are opt-in


def test_root_task_container_keeps_only_the_documented_capabilities() -> None:
    (container,) = hardened()["spec"]["containers"]
    added = set(container["securityContext"]["capabilities"]["add"])
    assert added == set(DEFAULT_CAPABILITIES)
    assert added <= BASELINE_CAPS  # the default pod passes Pod Security "baseline"
    assert not added & {"NET_RAW", "MKNOD", "SYS_ADMIN", "SYS_CHROOT", "SETFCAP", "SETPCAP"}
    assert "runAsNonRoot" not in container["securityContext"]


def test_cap_add_adds_to_the_default_list_normalised() -> None:
    (container,) = hardened(KubernetesConfig(cap_add=["net_raw", "CAP_SYS_PTRACE"]))["spec"]["containers"]
    added = container["securityContext"]["capabilities"]["add"]
    assert set(added) == {*DEFAULT_CAPABILITIES, "NET_RAW", "SYS_PTRACE"}


@pytest.mark.parametrize("bad", [{"run_as_user": 0}, {"run_as_user": -5}, {"cap_add": ["ALL"]}, {"cap_add": ["x y"]}])
def test_bad_hardening_options_are_config_errors(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        make_config("kubernetes", bad)


def test_init_container_is_fully_restricted() -> None:
    spec = hardened()["spec"]
    (init,) = spec["initContainers"]
    ctx = init["securityContext"]
    assert ctx["runAsNonRoot"] is True
    assert ctx["runAsUser"] > 0
    assert ctx["runAsGroup"] > 0
    assert ctx["readOnlyRootFilesystem"] is True
    assert ctx["capabilities"] == {"drop": ["ALL"]}
    assert init["resources"]["limits"]["memory"]


def test_run_as_user_makes_every_container_non_root_without_capabilities() -> None:
    spec = hardened(KubernetesConfig(run_as_user=1000))["spec"]
    (container,) = spec["containers"]
    ctx = container["securityContext"]
    assert (ctx["runAsNonRoot"], ctx["runAsUser"], ctx["runAsGroup"]) == (True, 1000, 1000)
    assert ctx["capabilities"] == {"drop": ["ALL"]}
    assert all(c["securityContext"]["runAsNonRoot"] for c in spec["initContainers"])


def test_default_resources_limit_the_disk() -> None:
    spec = hardened()["spec"]
    (container,) = spec["containers"]
    assert container["resources"]["limits"]["ephemeral-storage"] == KubernetesConfig().ephemeral_storage
    # No disk request: scheduling is unchanged (a request would default to the limit).
    assert container["resources"]["requests"]["ephemeral-storage"] == "0"
    (volume,) = spec["volumes"]
    assert volume["emptyDir"]["sizeLimit"] == KubernetesConfig().runtime_volume_limit
    # The sandbox's own cpu and memory still set requests and limits.
    container = hardened(cpu=1, memory="1Gi")["spec"]["containers"][0]
    assert container["resources"]["limits"] == {"cpu": "1", "memory": "1Gi", "ephemeral-storage": "8Gi"}
    unlimited = hardened(KubernetesConfig(ephemeral_storage=None))["spec"]["containers"][0]
    assert "resources" not in unlimited


def test_user_namespaces_option_sets_host_users_false() -> None:
    assert hardened(KubernetesConfig(user_namespaces=True))["spec"]["hostUsers"] is False


def test_namespace_labels_enforce_baseline_and_warn_restricted() -> None:
    labels = pod_security_labels("baseline")
    assert labels["pod-security.kubernetes.io/enforce"] == "baseline"
    assert labels["pod-security.kubernetes.io/warn"] == "restricted"
    assert labels["pod-security.kubernetes.io/audit"] == "restricted"
    assert pod_security_labels("restricted")["pod-security.kubernetes.io/enforce"] == "restricted"


def _policies(**options: Any) -> dict[str, dict[str, Any]]:
    return {p["metadata"]["name"]: p["spec"] for p in network_policies("ns", port=8750, **options)}


def test_executor_ingress_only_from_labelled_clients_and_client_cidrs() -> None:
    spec = _policies(client_cidrs=["192.0.2.0/24"], client_namespaces=["trainers"])["orchard-sandboxes"]
    (rule,) = spec["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8750}]
    peers = rule["from"]
    assert {"podSelector": {"matchLabels": {CLIENT_LABEL: "true"}}} in peers
    assert {"ipBlock": {"cidr": "192.0.2.0/24"}} in peers
    assert {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "trainers"}},
        "podSelector": {"matchLabels": {CLIENT_LABEL: "true"}},
    } in peers
    assert all(peers), "an empty peer would admit everyone"
    assert spec["egress"] == []  # network=False sandboxes: no egress at all


def _covered(address: str, cidrs: list[str]) -> bool:
    return any(ipaddress.ip_address(address) in ipaddress.ip_network(c) for c in cidrs)


def test_network_egress_excludes_metadata_api_server_and_cluster_ranges() -> None:
    excepts = egress_exceptions(api_server=["10.0.0.5"], cluster_cidrs=["10.244.0.0/16", "10.96.0.0/12", "fd00:1::/64"])
    spec = _policies(egress_except=excepts, dns={"k8s-app": "kube-dns"})["orchard-sandbox-egress"]
    blocks = [peer["ipBlock"] for rule in spec["egress"] for peer in rule.get("to", []) if "ipBlock" in peer]
    by_cidr = {b["cidr"]: b.get("except", []) for b in blocks}
    assert set(by_cidr) == {"0.0.0.0/0", "::/0"}
    v4, v6 = by_cidr["0.0.0.0/0"], by_cidr["::/0"]
    for address in ("169.254.169.254", "10.0.0.5", "10.244.3.7", "10.96.0.1"):
        assert _covered(address, v4), address
    assert _covered("fd00:ec2::254", v6)
    assert _covered("fd00:1::9", v6)
    assert not _covered("8.8.8.8", v4)
    assert all(rule.get("to") for rule in spec["egress"]), "a rule without peers would allow everything"
    dns = [rule for rule in spec["egress"] if any("podSelector" in p for p in rule["to"])]
    assert dns[0]["ports"] == [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]
    assert dns[0]["to"][0]["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}}
    # Each exclusion can be lifted.
    lifted = egress_exceptions(api_server=["10.0.0.5"], cluster_cidrs=["10.244.0.0/16"], allow_metadata=True)
    assert not _covered("169.254.169.254", lifted)
    assert _covered("10.0.0.5", lifted)
    assert (
        egress_exceptions(api_server=["10.0.0.5"], cluster_cidrs=[], allow_api_server=True, allow_metadata=True) == []
    )
    # A cluster CIDR written with host bits (as a cluster may report it) is the network it names.
    assert egress_exceptions(api_server=[], cluster_cidrs=["10.96.0.1/12"], allow_metadata=True) == ["10.96.0.0/12"]


def test_pool_names_are_dns_labels_short_enough_for_every_name_built_from_them() -> None:
    from orchard._backends import k8s_pool

    assert k8s_pool.check_name("rollouts-swe") == "rollouts-swe"
    for bad in ["", "Swe", "-swe", "swe-", "a" * 41, "swe.x", "swe/x", 3]:
        with pytest.raises(ConfigError, match="pool name"):
            k8s_pool.check_name(bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="pool name"):
        KubernetesConfig(pool="Not_A_Label")


def test_pool_spec_hash_is_the_same_whatever_the_order_and_differs_with_the_spec() -> None:
    from orchard._backends.k8s_pool import spec_hash

    a = make_spec("img", {"env": {"A": "1", "B": "2"}, "labels": {"x": "y"}})
    b = make_spec("img", {"labels": {"x": "y"}, "env": {"B": "2", "A": "1"}})
    assert spec_hash(a) == spec_hash(b)
    assert len(spec_hash(a)) <= 63
    for other in [make_spec("img2", {}), make_spec("img", {"env": {"A": "1"}}), make_spec("img", {"cpu": "1"})]:
        assert spec_hash(other) != spec_hash(a)


def test_a_claim_is_a_test_and_set_of_the_state_label_that_moves_the_pod_to_the_claimer() -> None:
    from orchard._backends.k8s_pool import claim_patch

    owner = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "name": "orchard-session-s1", "uid": "u"}
    patch = claim_patch(session_id="s1", owner=owner)
    assert patch[0] == {"op": "test", "path": "/metadata/labels/orchard.dev~1pool-state", "value": "ready"}
    assert {"op": "replace", "path": "/metadata/labels/orchard.dev~1pool-state", "value": "claimed"} in patch
    assert {"op": "replace", "path": "/metadata/labels/orchard.dev~1session", "value": "s1"} in patch
    assert {"op": "replace", "path": "/metadata/ownerReferences", "value": [owner]} in patch


def test_the_client_role_reads_only_the_named_pool_secrets() -> None:
    from orchard._backends.k8s_pod import client_role

    assert not [r for r in client_role("ns")["rules"] if "secrets" in r["resources"]]
    rules = [r for r in client_role("ns", ["orchard-pool-a"])["rules"] if "secrets" in r["resources"]]
    assert rules == [
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"], "resourceNames": ["orchard-pool-a"]}
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--spec", "[1]"], "--spec must be a JSON object"),
        (["--spec", "{"], "Expecting property name"),
        (["--spec", '{"cpuz": 1}'], "invalid sandbox option"),
        (["--size", "-1"], "the pool size must be a whole number"),
        (["--name", "Bad_Name"], "pool name"),
        (["--max-starting", "0"], "max_starting=0 must be a whole number >= 1"),
    ],
)
def test_pool_keep_refuses_bad_options_before_touching_a_cluster(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from orchard._cli import main

    options = {"--name": "swe", "--size": "2", "--spec": "{}", "--max-starting": "4"}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        options[flag] = value
    argv = [
        "pool",
        "keep",
        options["--name"],
        "--image",
        "img",
        "--size",
        options["--size"],
        "--spec",
        options["--spec"],
    ]
    argv += ["--max-starting", options["--max-starting"], "--kubeconfig", "/nonexistent"]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


# -- Every object Orchard writes is one the Kubernetes API takes as meant --


def api_object(data: Any, kind: str) -> Any:
    """``data`` as the Kubernetes client's model ``kind`` (such as "V1Pod").

    A key that is no field of the API's object (which the API server would
    drop, and with it what the field was for), a value of another type than
    the API's, or a missing required field fails.
    """
    if kind.startswith("list["):
        assert isinstance(data, list), (kind, data)
        return [api_object(item, kind[5:-1]) for item in data]
    if kind.startswith("dict("):
        assert isinstance(data, dict), (kind, data)
        value_kind = kind[5:-1].split(", ", 1)[1]
        return {key: api_object(value, value_kind) for key, value in data.items()}
    if kind == "datetime":
        return datetime.datetime.fromisoformat(data)
    primitive = {"str": str, "int": int, "bool": bool, "object": object}.get(kind)
    if primitive is not None:
        assert isinstance(data, primitive), (kind, data)
        assert kind != "int" or not isinstance(data, bool), (kind, data)
        return data
    model = getattr(k8s, kind)
    assert isinstance(data, dict), (kind, data)
    fields = {key: attr for attr, key in model.attribute_map.items()}
    unknown = sorted(set(data) - set(fields))
    assert not unknown, f"{kind} has no field {unknown}"
    return model(**{fields[key]: api_object(value, model.openapi_types[fields[key]]) for key, value in data.items()})


#: The API group and version of each kind Orchard writes, as the API serves it.
API_VERSIONS = {
    "Pod": "v1",
    "Namespace": "v1",
    "Secret": "v1",
    "Role": "rbac.authorization.k8s.io/v1",
    "RoleBinding": "rbac.authorization.k8s.io/v1",
    "NetworkPolicy": "networking.k8s.io/v1",
    "Lease": "coordination.k8s.io/v1",
}


def kubernetes_object(data: dict[str, Any]) -> Any:
    """A whole object: a kind of its API version, and its model as ``api_object`` checks it."""
    assert data["apiVersion"] == API_VERSIONS[data["kind"]]
    return api_object(data, f"V1{data['kind']}")


OWNER = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "name": "orchard-session-1234", "uid": "u-1"}


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"owner": OWNER},
        {"tools": ["codex", "mini"], "workdir": "/testbed", "shm": "64Mi", "ttl": 60, "idle_timeout": 30},
        {"image_volumes": True, "tools": ["codex"], "tls_pem": "PEM"},
        {"image_volumes": True},
        {"cpu": 2, "memory": "1Gi", "node_selector": {"pool": "sb"}, "image_pull_secrets": ["regcred"]},
        {"tolerations": [{"key": "sandbox", "operator": "Exists", "effect": "NoSchedule"}], "runtime_class": "gvisor"},
        {**pod_options(KubernetesConfig(run_as_user=1000, cap_add=["NET_RAW"], user_namespaces=True))},
        {**pod_options(KubernetesConfig()), "tools": ["claude"]},
    ],
)
def test_the_pod_is_a_pod_the_api_takes_and_mounts_only_its_own_volumes(options: dict[str, Any]) -> None:
    manifest = build(**options)
    pod = kubernetes_object(manifest)
    assert pod.kind == "Pod"
    volumes = {v.name for v in pod.spec.volumes}
    assert len(volumes) == len(pod.spec.volumes)
    for c in (pod.spec.init_containers or []) + pod.spec.containers:
        # A mount of a volume the pod does not have is refused by the API server.
        assert {m.name for m in c.volume_mounts} <= volumes, c.name
        for quantities in (c.resources.requests or {}, c.resources.limits or {}) if c.resources else ():
            for value in quantities.values():
                assert re.fullmatch(r"[0-9]+(\.[0-9]+)?(m|Ki|Mi|Gi|Ti|k|M|G|T)?", value), (c.name, value)
    (port,) = pod.spec.containers[0].ports
    # An IANA service name (lowercase, at most 15 characters), and a protocol as the API spells it.
    assert re.fullmatch(r"[a-z0-9]([a-z0-9-]{0,13}[a-z0-9])?", port.name)
    assert (port.name, port.container_port, port.protocol) == ("executor", 8750, "TCP")


def test_the_pod_belongs_to_the_sessions_lease_without_blocking_its_deletion() -> None:
    meta = build(owner=OWNER)["metadata"]
    # blockOwnerDeletion=true would need the right to update the Lease's finalizers, which the client Role lacks.
    assert meta["ownerReferences"] == [{**OWNER, "blockOwnerDeletion": False}]
    assert "ownerReferences" not in build()["metadata"]


def test_the_network_label_says_whether_the_sandbox_has_network() -> None:
    assert build(network=True)["metadata"]["labels"][NETWORK_LABEL] == "on"
    assert build()["metadata"]["labels"][NETWORK_LABEL] == "off"


def test_user_namespaces_are_off_unless_asked_for() -> None:
    assert "hostUsers" not in build()["spec"]


def test_the_readiness_probe_reports_a_listening_executor_within_two_seconds() -> None:
    probe = build()["spec"]["containers"][0]["readinessProbe"]
    assert probe["periodSeconds"] <= 2
    assert probe["failureThreshold"] == 1  # unready at the first failed check


def test_init_containers_reserve_little_and_are_capped() -> None:
    spec = build(tools=["codex"])["spec"]
    for init in spec["initContainers"]:
        # Reserved on the node for every sandbox: 10 millicores and 32 MiB; a runaway copy stops at 256 MiB.
        assert init["resources"] == {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "256Mi"}}


def test_the_tools_init_container_copies_into_the_volume_the_sandbox_reads_them_from() -> None:
    spec = build(tools=["codex"])["spec"]
    inject, tools = spec["initContainers"]
    assert inject["name"] == INIT_CONTAINER
    assert tools["name"] == TOOLS_CONTAINER
    assert tools["image"] == "orchard-tools:latest"
    assert tools["command"] == _tools.copy(["codex"])
    assert tools["securityContext"] == inject["securityContext"]
    (target,) = tools["volumeMounts"]
    assert target["mountPath"] == "/target"  # _tools.copy writes /target/bundle
    assert {"name": target["name"], "emptyDir": {}} in spec["volumes"]
    (container,) = spec["containers"]
    # ... which the sandbox sees, read-only, at ROOT: the bundle at ROOT/bundle, where its launchers look.
    assert {"name": target["name"], "mountPath": _tools.ROOT, "readOnly": True} in container["volumeMounts"]
    assert _tools.BUNDLE == f"{_tools.ROOT}/bundle"
    assert f"--path-append={_tools.path_dirs(['codex'])}" in container["args"]


def test_image_volumes_without_tools_mount_the_runtime_only() -> None:
    (container,) = build(image_volumes=True)["spec"]["containers"]
    assert [m["mountPath"] for m in container["volumeMounts"]] == ["/.orchard/runtime"]


def test_a_sub_second_ttl_still_sets_the_shortest_deadline_the_api_takes() -> None:
    assert build(ttl=0.5)["spec"]["activeDeadlineSeconds"] == 1
    assert build(ttl=2.9)["spec"]["activeDeadlineSeconds"] == 2


def test_run_as_user_keeps_only_the_capabilities_asked_for() -> None:
    config = KubernetesConfig(run_as_user=1000, cap_add=["NET_BIND_SERVICE"])
    (container,) = hardened(config)["spec"]["containers"]
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}


def test_the_session_lease_is_named_and_held_by_the_session() -> None:
    now = "2026-12-07T17:00:00.000000Z"
    data = lease_manifest(session_id="1234", namespace="rollouts", duration=30, now=now)
    lease = kubernetes_object(data)
    assert lease.kind == "Lease"
    assert (lease.metadata.name, lease.metadata.namespace) == ("orchard-session-1234", "rollouts")
    assert lease.metadata.labels == {MANAGED_BY: "orchard", SESSION_LABEL: "1234"}
    assert (lease.spec.holder_identity, lease.spec.lease_duration_seconds) == ("1234", 30)
    assert lease.spec.acquire_time == lease.spec.renew_time == datetime.datetime(2026, 12, 7, 17, tzinfo=datetime.UTC)
    # gc reads it back as a live session's Lease until its duration has passed.
    read = msgspec.convert(data, Lease)
    renewed = lease.spec.renew_time.timestamp()
    assert read.alive(renewed + 30)
    assert not read.alive(renewed + 30.001)


def test_a_lease_never_renewed_is_dead() -> None:
    assert not Lease().alive(0.0)


async def test_setup_writes_objects_the_api_takes_all_labelled_as_orchards() -> None:
    objects = await setup(
        KubernetesConfig(namespace="rollouts"),
        dry_run=True,
        service_account="trainer",
        pools=["swe"],
        cluster_cidrs=["10.96.0.0/12"],
    )
    kinds = [o["kind"] for o in objects]
    assert kinds == ["Namespace", "Role", "RoleBinding", "NetworkPolicy", "NetworkPolicy", "Secret"]
    for data in objects:
        obj = kubernetes_object(data)
        if obj.kind != "Namespace":
            assert obj.metadata.namespace == "rollouts", obj.kind
            assert obj.metadata.labels[MANAGED_BY] == "orchard", obj.kind
    binding = objects[2]
    assert binding["metadata"]["name"] == "orchard-client-trainer"
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "orchard-client"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "trainer", "namespace": "rollouts"}]
    assert objects[1]["metadata"]["name"] == "orchard-client"  # what the binding binds


def test_the_namespace_enforces_the_level_asked_for_and_warns_and_audits_restricted_at_the_latest_version() -> None:
    assert pod_security_labels("baseline") == {
        "pod-security.kubernetes.io/enforce": "baseline",
        "pod-security.kubernetes.io/enforce-version": "latest",
        "pod-security.kubernetes.io/warn": "restricted",
        "pod-security.kubernetes.io/warn-version": "latest",
        "pod-security.kubernetes.io/audit": "restricted",
        "pod-security.kubernetes.io/audit-version": "latest",
    }


def grants(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in role["rules"]
        if "resourceNames" not in rule
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_the_client_role_grants_what_the_client_does_and_nothing_more() -> None:
    pods = {("", "pods", v) for v in ("create", "delete", "get", "list", "watch")}
    claim = {("", "pods", "patch")}  # a claim of a shared pool's pod
    forward = {("", "pods/portforward", v) for v in ("create", "get")}  # reaching an executor from outside
    leases = {("coordination.k8s.io", "leases", v) for v in ("create", "delete", "get", "list", "patch")}
    keeper = {("coordination.k8s.io", "leases", "update")}  # a pool keeper taking over an expired Lease
    assert grants(client_role("ns")) == pods | claim | forward | leases | keeper
    role = kubernetes_object(client_role("ns", ["orchard-pool-a"]))
    assert (role.metadata.name, role.metadata.namespace, role.metadata.labels) == (
        "orchard-client",
        "ns",
        {MANAGED_BY: "orchard"},
    )


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) == {"matchLabels"}
    return selector["matchLabels"].items() <= labels.items()


def test_the_policies_select_every_sandbox_for_ingress_and_only_network_sandboxes_for_egress() -> None:
    policies = {p["metadata"]["name"]: p["spec"] for p in network_policies("ns", port=8750)}
    online = build(network=True)["metadata"]["labels"]
    offline = build()["metadata"]["labels"]
    sandboxes, egress = policies["orchard-sandboxes"], policies["orchard-sandbox-egress"]
    # Every sandbox: ingress from clients only, and (its egress rules empty) no egress at all.
    assert selects(sandboxes["podSelector"], online)
    assert selects(sandboxes["podSelector"], offline)
    assert sorted(sandboxes["policyTypes"]) == ["Egress", "Ingress"]
    # network=True sandboxes only: egress; their ingress stays as the first policy has it.
    assert selects(egress["podSelector"], online)
    assert not selects(egress["podSelector"], offline)
    assert egress["policyTypes"] == ["Egress"]
    assert not selects(egress["podSelector"], {NETWORK_LABEL: "on"})  # not someone else's pod


def test_with_every_exclusion_lifted_network_egress_goes_anywhere() -> None:
    excepts = egress_exceptions(
        api_server=["10.0.0.5"],
        cluster_cidrs=["10.96.0.0/12"],
        allow_metadata=True,
        allow_api_server=True,
        allow_cluster=True,
    )
    spec = _policies(egress_except=excepts)["orchard-sandbox-egress"]
    assert spec["egress"] == [{"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}, {"ipBlock": {"cidr": "::/0"}}]}]


def test_a_client_cidr_written_with_host_bits_is_the_network_it_names() -> None:
    spec = _policies(client_cidrs=["192.0.2.7/24"])["orchard-sandboxes"]
    assert {"ipBlock": {"cidr": "192.0.2.0/24"}} in spec["ingress"][0]["from"]


def test_network_sandboxes_may_ask_the_cluster_dns_and_nothing_else_in_kube_system() -> None:
    policies = network_policies("ns", port=8750, egress_except=["10.0.0.0/8"], dns={"k8s-app": "kube-dns"})
    for policy in policies:
        kubernetes_object(policy)
    egress = {p["metadata"]["name"]: p["spec"] for p in policies}["orchard-sandbox-egress"]["egress"]
    (dns,) = [rule for rule in egress if rule["to"][0].get("podSelector")]
    (peer,) = dns["to"]
    assert selects(peer["podSelector"], {"k8s-app": "kube-dns", "pod-template-hash": "abc"})
    assert not selects(peer["podSelector"], {"k8s-app": "metrics-server"})
    assert selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": "kube-system"})
