"""The pod manifest builder and the pod-status reader, without a cluster."""

import ipaddress
from typing import Any

import msgspec
import pytest

from orchard._backends import KubernetesConfig, make_config
from orchard._backends.k8s_pod import (
    CLIENT_LABEL,
    DEFAULT_CAPABILITIES,
    EXPIRES_ANNOTATION,
    INIT_CONTAINER,
    MANAGED_BY,
    SANDBOX_LABEL,
    SESSION_LABEL,
    SHM_VOLUME,
    TOOLS_CONTAINER,
    Phase,
    Pod,
    classify,
    egress_exceptions,
    garbage_reason,
    network_policies,
    pod_manifest,
    pod_security_labels,
)
from orchard._backends.kubernetes import pod_options
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
            "injector init container exited 3: ",
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
        assert (got.state, got.reason) == ("failed", "exit code 137")
        assert got.message.startswith("the sandbox container ended (exit code 137")


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
