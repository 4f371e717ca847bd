"""Exec options in images without bash: a login shell falls back to ``sh -l``, and to a clear error without a shell."""

from __future__ import annotations

import pytest
from docker_support import BUSYBOX, NOSHELL, SandboxFactory

from orchard import errors

pytestmark = pytest.mark.docker


async def test_without_bash_login_falls_back_to_a_login_sh(sandbox: SandboxFactory) -> None:
    sb = await sandbox(BUSYBOX)
    assert not await sb.exists("/bin/bash")
    await sb.write_file("/etc/profile", "export ORCHARD_LOGIN_MARK=from-etc-profile\n")
    r = await sb.exec('echo "[$ORCHARD_LOGIN_MARK] ${BASH_VERSION:-no bash}"', login=True)
    assert (r.exit_code, r.stdout) == (0, "[from-etc-profile] no bash\n")
    assert (await sb.exec('echo "[$ORCHARD_LOGIN_MARK]"')).stdout == "[]\n"
    # (This busybox has no printenv applet.)
    r = await sb.exec(["env"], login=True)
    assert "ORCHARD_LOGIN_MARK=from-etc-profile" in r.stdout.splitlines()
    r = await sb.exec('echo "$ORCHARD_LOGIN_MARK"; echo err >&2', login=True, merge_output=True)
    assert r.output == "from-etc-profile\nerr\n"


async def test_without_any_shell_login_is_a_clear_error(sandbox: SandboxFactory) -> None:
    sb = await sandbox(NOSHELL)
    for cmd in ("echo hi", ["echo", "hi"]):
        with pytest.raises(errors.CommandNotFound, match="login=True needs a shell"):
            await sb.exec(cmd, login=True)
    # merge_output needs no shell.
    r = await sb.exec(["ls", "/no-such-path", "/"], merge_output=True)
    assert r.exit_code != 0
    assert "no-such-path" in r.output
    assert (r.stdout, r.stderr) == ("", "")
