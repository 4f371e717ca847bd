"""Snapshots on the container backends (tests/docker and tests/k8s import these).

With no paths, a snapshot takes what changed anywhere on the container's root
file system since it started, and none of the image's own files; a restore
into a read-only path is a typed error naming it, and the fork is deleted.
"""

from __future__ import annotations

import io
import tarfile

import pytest

from orchard import errors
from orchard._snapshot import Part, Snapshot
from test_sandbox_snapshot import SandboxFactory, crafted, sh


async def test_changes_anywhere_on_the_root_are_taken_and_the_image_is_not(sandbox: SandboxFactory) -> None:
    base = await sandbox()
    await sh(base, "mkdir -p /opt/prepared && echo ready > /opt/prepared/state && echo conf > /etc/orchard-test.conf")
    snap = await base.snapshot()
    assert snap.data is not None
    with tarfile.open(fileobj=io.BytesIO(snap.data)) as tar:
        names = set(tar.getnames())
    assert {"opt/prepared", "opt/prepared/state", "etc/orchard-test.conf"} <= names
    # Only what changed: no file of the image itself (its /usr, /bin, /lib), nothing of other file systems.
    assert not {n for n in names if n.split("/")[0] in ("usr", "bin", "lib", "proc", "sys", "dev")}
    fork = await sandbox(restore=snap)
    assert await fork.read_file("/opt/prepared/state") == b"ready\n"
    assert await fork.read_file("/etc/orchard-test.conf") == b"conf\n"


async def test_a_restore_into_a_read_only_path_is_a_typed_error_naming_it(sandbox: SandboxFactory) -> None:
    data = crafted(("state", "file", "x"))
    snap = Snapshot((Part("/sys/fs/orchard-test", 0, len(data)),), "/nowhere", len(data), data=data)
    with pytest.raises(errors.PermissionDenied) as info:
        await sandbox(restore=snap)
    assert info.value.path == "/sys/fs/orchard-test"
