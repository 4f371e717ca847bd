"""Harness CLIs in any image: ``tools=[...]`` mounts the tools bundle and puts the chosen ones on PATH.

Real harness binaries (images/tools, built by scripts/docker-setup.sh) in the
busybox-only image, the image with no shell at all, and the Debian SWE image.
"""

from __future__ import annotations

import pytest
from docker_support import BUSYBOX, NOSHELL, SWE, SandboxFactory

import orchard
from orchard import _tools, errors
from support import bundle_versions, check_tool

pytestmark = pytest.mark.docker


@pytest.mark.parametrize("image", [BUSYBOX, NOSHELL, SWE])
async def test_every_harness_starts_in_any_image(tools_image: None, sandbox: SandboxFactory, image: str) -> None:
    sb = await sandbox(image, tools=list(_tools.KNOWN))
    pinned = await bundle_versions(sb)
    assert set(_tools.KNOWN) <= set(pinned)
    for name in _tools.KNOWN:
        # An argv, found on PATH by the executor: no shell is needed (the no-shell image has none).
        await check_tool(sb, name, pinned)


async def test_only_the_chosen_harnesses_are_on_path_after_the_images_own(
    tools_image: None, sandbox: SandboxFactory
) -> None:
    sb = await sandbox(SWE, tools=["claude", "pi", "claude"])
    path = (await sb.exec(["printenv", "PATH"])).stdout.strip().split(":")
    assert path[-2:] == [f"{_tools.BUNDLE}/claude/bin", f"{_tools.BUNDLE}/pi/bin"]
    assert path[:-2], "the image's own PATH comes first"
    assert (await sb.exec("command -v claude")).stdout.strip() == f"{_tools.BUNDLE}/claude/bin/claude"
    missing = await sb.exec("command -v codex opencode openclaw")
    assert (missing.exit_code, missing.stdout) != (0, ""), missing
    assert missing.stdout == ""
    # The image's own program of the same name wins.
    await sb.write_file("/usr/local/bin/pi", "#!/bin/sh\necho the image pi\n", mode=0o755)
    assert (await sb.exec("pi --version")).stdout == "the image pi\n"
    # Sessions and background processes get the same PATH.
    sh = await sb.shell()
    assert (await sh.exec("command -v claude")).stdout.strip() == f"{_tools.BUNDLE}/claude/bin/claude"


async def test_a_sandbox_cannot_change_the_bundle_other_sandboxes_share(
    tools_image: None, sandbox: SandboxFactory
) -> None:
    a = await sandbox(SWE, tools=["claude"])
    b = await sandbox(BUSYBOX, tools=["claude"])
    claude = f"{_tools.BUNDLE}/claude/bin/claude"
    for attack in (
        f"echo 'echo pwned' > {claude}",
        f"rm -f {claude}",
        f"mv {_tools.BUNDLE}/claude {_tools.BUNDLE}/moved",
        f"ln -sf /bin/true {claude}",
        f"chmod 777 {claude}",
        f"touch {_tools.ROOT}/planted",
        f"mount -o remount,rw {_tools.ROOT}",
    ):
        r = await a.exec(attack)
        assert r.exit_code != 0, (attack, r.stdout)
    r = await b.exec(["claude", "--version"], env={"HOME": "/tmp"})
    assert r.exit_code == 0, r.stderr
    assert "Claude Code" in r.stdout


async def test_without_tools_nothing_is_mounted_and_path_is_the_images(
    tools_image: None, sandbox: SandboxFactory
) -> None:
    sb = await sandbox(SWE)
    assert not await sb.exists(_tools.ROOT)
    path = (await sb.exec(["printenv", "PATH"])).stdout.strip()
    assert ".orchard" not in path


async def test_an_unknown_harness_is_a_config_error_naming_the_known_ones(
    tools_image: None, client: orchard.Client
) -> None:
    with pytest.raises(errors.ConfigError, match=r"'vim'.*codex, claude, opencode, pi, openclaw") as info:
        await client.create(SWE, tools=["claude", "vim"])
    assert "no such harness" in str(info.value)
    assert not client._live


async def test_a_missing_tools_image_is_a_start_error_with_the_reason(docker_ready: str) -> None:
    config = orchard.DockerConfig(tools_image="orchard-test/no-such-tools:latest")
    async with orchard.Client(config) as client:
        with pytest.raises(errors.SandboxStartError, match="no-such-tools.*docker-setup") as info:
            await client.create(SWE, tools=["codex"])
        assert info.value.reason == "ToolsImageNotFound"
        # Sandboxes without tools do not need it.
        async with client.sandbox(SWE) as sb:
            assert (await sb.exec(["true"])).exit_code == 0
