"""The docker backend's pure parts: the container body, quantities, image names, gc verdicts."""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest

import orchard
from orchard._backends import DockerConfig
from orchard._backends.bundle import launcher
from orchard._backends.docker import (
    CAPABILITIES,
    ContainerSummary,
    container_config,
    garbage_reason,
    memory_bytes,
    nano_cpus,
    owner_alive,
    owner_label,
)
from orchard._backends.docker_engine import image_reference
from orchard._spec import make_spec
from orchard.errors import ConfigError

pytestmark = pytest.mark.unit

HASH = "ab" * 32


def body(config: DockerConfig | None = None, **spec: Any) -> dict[str, Any]:
    return container_config(
        make_spec("task:1", spec),
        config=config,
        name="sb-s-1",
        session_id="s",
        token_sha256=HASH,
        volume="orchard-runtime-x",
        port=8750,
        owner="host/1/2",
        created_at=1000.0,
    )


def test_the_launcher_replaces_the_image_command_and_only_the_hash_is_passed() -> None:
    b = body()
    assert b["Image"] == "task:1"
    assert b["Entrypoint"] == launcher()
    assert b["Entrypoint"][0] == "/.orchard/runtime/lib/ld.so"
    assert f"--token-sha256={HASH}" in b["Cmd"]
    assert b["Env"] == []
    assert "WorkingDir" not in b  # the image's own


def test_the_runtime_volume_is_mounted_read_only_and_no_port_is_published() -> None:
    host = body()["HostConfig"]
    assert host["Mounts"] == [
        {
            "Type": "volume",
            "Source": "orchard-runtime-x",
            "Target": "/.orchard",
            "ReadOnly": True,
            "VolumeOptions": {"NoCopy": True},
        }
    ]
    # The executor is reached on Orchard's network, at the container's address.
    assert "PortBindings" not in host


def test_a_network_of_ones_own_is_joined_with_the_port_published_on_loopback_only() -> None:
    host = body(DockerConfig(network="mine"))["HostConfig"]
    assert host["NetworkMode"] == "mine"
    assert host["PortBindings"] == {"8750/tcp": [{"HostIp": "127.0.0.1", "HostPort": ""}]}


def test_hardened_by_default() -> None:
    host = body()["HostConfig"]
    assert host["CapDrop"] == ["ALL"]
    assert host["CapAdd"] == list(CAPABILITIES)
    assert not {"MKNOD", "NET_RAW", "SYS_ADMIN", "SYS_CHROOT", "SETFCAP"} & set(host["CapAdd"])
    assert host["SecurityOpt"] == ["no-new-privileges:true"]
    assert host["PidsLimit"] == DockerConfig().pids_limit
    assert host["Ulimits"] == [{"Name": "nofile", "Soft": 16384, "Hard": 16384}]
    assert host["Memory"] == host["MemorySwap"] == 8 * 2**30
    assert host["IpcMode"] == "private"
    assert "Runtime" not in host


def test_hardening_options() -> None:
    config = DockerConfig(
        cap_add=["sys_ptrace", "CAP_NET_ADMIN", "KILL"],
        no_new_privileges=False,
        pids_limit=None,
        nofile=1024,
        default_memory=None,
        runtime="runsc",
    )
    host = body(config)["HostConfig"]
    assert host["CapAdd"] == [*CAPABILITIES, "SYS_PTRACE", "NET_ADMIN"]
    assert host["SecurityOpt"] == []
    assert "PidsLimit" not in host
    assert host["Ulimits"] == [{"Name": "nofile", "Soft": 1024, "Hard": 1024}]
    assert "Memory" not in host
    assert host["Runtime"] == "runsc"
    assert body(config, memory="1Gi")["HostConfig"]["Memory"] == 2**30


@pytest.mark.parametrize(
    ("options", "option"),
    [
        ({"cap_add": ["sys ptrace"]}, "cap_add"),
        ({"pids_limit": 0}, "pids_limit"),
        ({"nofile": -1}, "nofile"),
        ({"default_memory": "lots"}, "default_memory"),
    ],
)
def test_bad_hardening_options_are_config_errors_naming_the_option(options: dict[str, Any], option: str) -> None:
    with pytest.raises(ConfigError, match=option):
        body(DockerConfig(**options))


def test_limits_env_workdir_labels_and_expiry() -> None:
    b = body(
        cpu="500m",
        memory="256Mi",
        env={"A": "1", "B": "x=y"},
        workdir="/w",
        labels={"team": "rl", "orchard.dev/role": "spoofed"},
        annotations={"note": "n"},
        ttl=60,
        idle_timeout=30,
    )
    host = b["HostConfig"]
    assert host["NanoCpus"] == 500_000_000
    assert host["Memory"] == host["MemorySwap"] == 256 * 1024 * 1024
    assert b["Env"] == ["A=1", "B=x=y"]
    assert b["WorkingDir"] == "/w"
    assert "--workdir=/w" in b["Cmd"]
    assert "--idle-timeout=30" in b["Cmd"]
    labels = b["Labels"]
    assert labels["team"] == "rl"
    assert labels["note"] == "n"
    assert labels["orchard.dev/role"] == "sandbox"
    assert labels["orchard.dev/sandbox"] == "sb-s-1"
    assert labels["orchard.dev/session"] == "s"
    assert labels["orchard.dev/expires-at"] == "1060"


def test_shm_is_the_size_of_dev_shm() -> None:
    assert body(shm="96Mi")["HostConfig"]["ShmSize"] == 96 * 1024 * 1024
    assert "ShmSize" not in body()["HostConfig"]


def test_a_relative_workdir_is_refused() -> None:
    with pytest.raises(ConfigError, match="workdir"):
        body(workdir="relative")


@pytest.mark.parametrize(
    ("quantity", "expected"),
    [
        ("512Mi", 512 * 2**20),
        ("2Gi", 2 * 2**30),
        ("1G", 10**9),
        ("1.5Gi", 3 * 2**29),
        ("1048576", 2**20),
        ("100k", 10**5),
    ],
)
def test_memory_quantities(quantity: str, expected: int) -> None:
    assert memory_bytes(quantity) == expected


@pytest.mark.parametrize("quantity", ["", "lots", "-1Gi", "0", "1 GB"])
def test_bad_memory_quantities(quantity: str) -> None:
    with pytest.raises(ConfigError, match="memory"):
        memory_bytes(quantity)


@pytest.mark.parametrize(
    ("quantity", "expected"), [("500m", 5 * 10**8), ("2", 2 * 10**9), (1.5, 15 * 10**8), ("0.25", 25 * 10**7)]
)
def test_cpu_quantities(quantity: str | float, expected: int) -> None:
    assert nano_cpus(quantity) == expected


@pytest.mark.parametrize("quantity", ["fast", "-1", "0m"])
def test_bad_cpu_quantities(quantity: str) -> None:
    with pytest.raises(ConfigError, match="cpu"):
        nano_cpus(quantity)


@pytest.mark.parametrize(
    ("image", "expected"),
    [
        ("debian", ("debian", "latest")),
        ("debian:12", ("debian", "12")),
        ("localhost:5000/team/img", ("localhost:5000/team/img", "latest")),
        ("localhost:5000/team/img:v2", ("localhost:5000/team/img", "v2")),
        ("img@sha256:" + "0" * 64, ("img", "sha256:" + "0" * 64)),
    ],
)
def test_image_references_for_pulls(image: str, expected: tuple[str, str]) -> None:
    assert image_reference(image) == expected


def test_the_owner_label_names_this_live_process() -> None:
    me = owner_label()
    host = socket.gethostname()
    assert me.startswith(f"{host}/{os.getpid()}/")
    assert owner_alive(me, host) is True
    pid_gone = f"{host}/{os.getpid()}/1"  # same pid, another start time: a recycled pid
    assert owner_alive(pid_gone, host) is False
    assert owner_alive(me, "another-host") is None
    assert owner_alive("garbage", host) is None


def test_garbage_verdicts() -> None:
    host = socket.gethostname()
    alive = {"orchard.dev/owner": owner_label()}
    dead = {"orchard.dev/owner": f"{host}/{os.getpid()}/1"}

    def c(state: str, **labels: str) -> ContainerSummary:
        return ContainerSummary(id="x", state=state, labels=labels)

    now = 2000.0
    assert garbage_reason(c("exited", **alive), now, host) == "finished"
    assert garbage_reason(c("running", **alive, **{"orchard.dev/expires-at": "1999"}), now, host) == "expired"
    assert garbage_reason(c("running", **alive, **{"orchard.dev/expires-at": "2001"}), now, host) is None
    assert garbage_reason(c("running", **dead), now, host) == "orphaned"
    assert garbage_reason(c("running", **{"orchard.dev/owner": "elsewhere/1/2"}), now, host) is None


def test_a_misspelt_docker_option_is_rejected() -> None:
    with pytest.raises(ConfigError, match="injector_img"):
        orchard.Client("docker", injector_img="x")


async def test_an_unknown_engine_address_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="DockerConfig"):
        async with orchard.Client(orchard.DockerConfig(host="ftp://example")):
            pass
