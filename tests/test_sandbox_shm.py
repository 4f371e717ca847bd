"""SandboxSpec.shm: the size of the sandbox's own /dev/shm, on every backend that can give one."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

import orchard
from orchard.errors import ConfigError

pytestmark = pytest.mark.executor

SandboxFactory = Callable[..., Awaitable[orchard.Sandbox]]

SIZE = 96 * 1024 * 1024


def unisolated(client: orchard.Client) -> bool:
    return isinstance(client.config, orchard.LocalConfig) and client.config.isolation == "none"


async def shm_bytes(sb: orchard.Sandbox) -> int:
    r = await sb.exec(["stat", "-f", "-c", "%S %b", "/dev/shm"])
    assert r.exit_code == 0, r.stderr
    block, blocks = map(int, r.stdout.split())
    return block * blocks


async def test_shm_sizes_dev_shm_and_a_write_past_it_fails(client: orchard.Client, sandbox: SandboxFactory) -> None:
    if unisolated(client):
        # No private /dev/shm to give: refused, not started with the host's.
        with pytest.raises(ConfigError, match=r"shm='96Mi'.*isolation='none'.*isolation='bwrap'"):
            await sandbox(shm="96Mi")
        return
    sb = await sandbox(shm="96Mi")
    default = await sandbox()
    assert await shm_bytes(sb) == SIZE
    assert await shm_bytes(default) != SIZE
    # 90 MiB fits (more than docker's and containerd's 64 MB default); 10 MiB more does not.
    fill = await sb.exec(["dd", "if=/dev/zero", "of=/dev/shm/a", "bs=1M", "count=90"])
    assert fill.exit_code == 0, fill.stderr
    over = await sb.exec(["dd", "if=/dev/zero", "of=/dev/shm/b", "bs=1M", "count=10"])
    assert over.exit_code != 0
    assert "No space left on device" in over.stderr
    # Another sandbox's /dev/shm is its own: none of this is there.
    ls = await default.exec(["ls", "-A", "/dev/shm"])
    assert ls.exit_code == 0
    assert ls.stdout == ""
