"""Local isolation for a client that is not root: the path most users take.

The suite runs as root, so this test runs a client script as a throwaway
unprivileged uid (setpriv), with a HOME it makes holding a planted
credential, and checks from inside that user's isolated sandboxes what they
must not see. bubblewrap must be able to make user namespaces unprivileged
here: if it cannot, the test fails and says so.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import msgspec
import pytest

import orchard
import orchard_executor

pytestmark = pytest.mark.executor

CLIENT = """
import asyncio, json, os, socket
import orchard

CONNECT = '''
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.settimeout(5)
try:
    s.connect(sys.argv[1])
except OSError as exc:
    print("refused", type(exc).__name__)
else:
    print("CONNECTED")
'''

async def main():
    home = os.environ["HOME"]
    config = orchard.LocalConfig(root=os.path.join(home, "sandboxes"), isolation="bwrap")
    async with orchard.Client(config) as client, client.sandbox() as a, client.sandbox() as b:
        other = os.path.join(os.path.dirname((await b.info()).cwd), "run", "executor.sock")
        # The host side: the other sandbox's socket is there, and this user can reach it.
        probe = socket.socket(socket.AF_UNIX)
        try:
            probe.connect(other)
            out = {"other_on_host": True}
        except OSError as exc:
            out = {"other_on_host": repr(exc)}
        probe.close()
        for name, cmd in {
            "id": ["id", "-u"],
            "name": ["id", "-un"],
            "kube": ["cat", os.path.join(home, ".kube", "config")],
            "home": ["ls", "-a", home],
            "shadow": ["test", "-e", "/etc/shadow"],
            "env": ["env"],
            "other": ["python3", "-c", CONNECT, other],
            # The executor (the parent of the sandbox's commands, same uid): its /proc files are closed to them.
            "executor": ["sh", "-c", "E=$PPID; for f in exe cwd root; do readlink /proc/$E/$f >/dev/null 2>&1 && "
                         "echo open-$f; done; for f in environ maps; do head -c1 /proc/$E/$f >/dev/null 2>&1 && "
                         "echo open-$f; done; (exec 3</proc/$E/mem) 2>/dev/null && echo open-mem; "
                         "grep -E '^(CapBnd|NoNewPrivs):' /proc/$E/status"],
        }.items():
            r = await a.exec(cmd)
            out[name] = [r.exit_code, r.stdout]
    print(json.dumps(out), flush=True)

asyncio.run(main())
"""


@pytest.fixture
def user_home() -> Iterator[tuple[int, Path]]:
    """A throwaway uid and a HOME it owns, with a credential planted where kubectl keeps one."""
    uid = 40000 + secrets.randbelow(20000)
    # Under /home, where users' homes are (a private /tmp in the sandbox would hide one under /tmp anyway).
    home = Path(tempfile.mkdtemp(prefix="orchard-nonroot-", dir="/home"))
    try:
        (home / ".kube").mkdir()
        (home / ".kube" / "config").write_text("token: kube-secret-of-the-user\n")
        for path in (home, home / ".kube", home / ".kube" / "config"):
            os.chown(path, uid, uid)
        yield uid, home
    finally:
        shutil.rmtree(home)


def as_user(uid: int) -> list[str]:
    setpriv = shutil.which("setpriv")
    assert setpriv, "util-linux's setpriv is needed to run a client as an unprivileged user"
    return [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]


async def test_a_non_root_clients_sandbox_sees_nothing_of_the_user(user_home: tuple[int, Path]) -> None:
    uid, home = user_home
    bwrap = shutil.which("bwrap")
    assert bwrap, "bubblewrap is not installed"
    probe = subprocess.run(
        [*as_user(uid), bwrap, "--unshare-all", "--ro-bind", "/", "/", "true"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.returncode == 0, f"bwrap cannot make namespaces as an unprivileged user here: {probe.stderr}"
    # The system's Python with the packages on PYTHONPATH, as a user without a virtualenv of their own runs
    # it (this suite's virtualenv points into /root, which the user cannot read).
    python = f"/usr/bin/python{sys.version_info[0]}.{sys.version_info[1]}"
    assert os.path.exists(python), f"{python} (the suite's Python version, from /usr) is needed"
    paths = {str(Path(m.__file__ or "").parent.parent) for m in (orchard, orchard_executor, aiohttp, msgspec)}
    env = {
        "HOME": str(home),
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "PYTHONPATH": os.pathsep.join(sorted(paths)),
        "CLIENT_SECRET": "client-env-secret",
    }
    client = await asyncio.create_subprocess_exec(
        *as_user(uid),
        python,
        "-c",
        textwrap.dedent(CLIENT),
        env=env,
        cwd=home,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        stdout, stderr = await asyncio.wait_for(client.communicate(), 120)
    finally:
        if client.returncode is None:
            client.kill()
            await client.wait()
    assert client.returncode == 0, stderr.decode()
    out = json.loads(stdout)
    assert out["kube"][0] != 0, out["kube"]
    assert ".kube" not in out["home"][1].split(), out["home"]
    assert out["shadow"][0] == 1, out["shadow"]
    assert "client-env-secret" not in out["env"][1], out["env"]
    assert out["other_on_host"] is True, out["other_on_host"]
    assert out["other"][1].startswith("refused"), out["other"]
    # Forked from the client's zygote, the executor is not dumpable: nothing of it (the host's interpreter, its
    # memory, descriptors, environment) is open to the sandbox; it has no capability, and no new privileges.
    assert "open-" not in out["executor"][1], out["executor"]
    assert out["executor"][1].split() == ["CapBnd:", "0000000000000000", "NoNewPrivs:", "1"], out["executor"]
    # The sandbox runs as the user (in a user namespace), so the user's own files are what it must not reach.
    assert out["id"] == [0, f"{uid}\n"], out["id"]
    # The sandbox's own /etc/passwd names it (and is readable by it).
    assert out["name"] == [0, "sandbox\n"], out["name"]
    # The sandboxes' directories went with them.
    assert list((home / "sandboxes").iterdir()) == []
