"""mini (mini-swe-agent) from the tools bundle: a Python harness on the bundle's own CPython, in any image.

``mini --help`` (it has no --version) runs in the busybox-only image, the image
with no shell at all, and the Debian SWE image. Then mini solves a task in the
SWE image on the docker backend with the network closed and ``model=gateway``:
litellm calls Chat Completions (not streamed) at the gateway through the
reverse tunnel, and the gateway passes them to a scripted model in this
process, which asks for three ``bash`` tool calls (fix the bug, run the tests,
submit).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from docker_support import BUSYBOX, NOSHELL, SWE, WORKDIR, SandboxFactory, networks_of

import orchard
from gateway_support import Turn, Upstream, upstream
from orchard import _tools
from support import bundle_versions

pytestmark = pytest.mark.docker

CALC = "def add(a, b):\n    return a - b\n"
TESTS = "from calc import add\n\nassert add(2, 3) == 5, add(2, 3)\nprint('all tests pass')\n"
#: What mini hands in: the first output line of a command ends the task, the rest is the submission.
SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


@pytest.mark.parametrize("image", [BUSYBOX, NOSHELL, SWE])
async def test_mini_starts_in_any_image(tools_image: None, sandbox: SandboxFactory, image: str) -> None:
    sb = await sandbox(image, tools=["mini"])
    versions = await bundle_versions(sb)
    # An argv, found on PATH by the executor: no shell is needed (the no-shell image has none).
    r = await sb.exec(["mini", "--help"], timeout=120, env={"HOME": "/tmp/home-mini"}, merge_output=True)
    assert r.exit_code == 0, r.output
    assert f"This is mini-swe-agent version {versions['mini']}." in r.output, r.output
    assert "Run mini-SWE-agent in your local environment." in r.output, r.output
    # The bundle's Python ignores the image's: its own stdlib only (python3._pth), no PYTHON* variable.
    probe = "import json, sys; print(json.dumps([sys.version.split()[0], sys.flags.isolated, sys.path]))"
    lib = f"{_tools.BUNDLE}/lib"
    argv = [f"{lib}/ld-linux-x86-64.so.2", "--library-path", lib, f"{_tools.BUNDLE}/python/bin/python3", "-c", probe]
    r = await sb.exec(argv, env={"PYTHONPATH": "/nowhere", "PYTHONHOME": "/nowhere"})
    assert r.exit_code == 0, r.stderr
    version, isolated, path = json.loads(r.stdout)
    assert (version, isolated) == (versions["python"], 1), r.stdout
    assert path == [f"{_tools.BUNDLE}/python/lib/python3.11", f"{_tools.BUNDLE}/python/lib/python3.11/lib-dynload"]


def tool_results(body: dict[str, Any]) -> list[str]:
    """The tool outputs mini sent back so far, as the gateway passed them upstream."""
    return [str(m.get("content")) for m in body.get("messages", []) if m.get("role") == "tool"]


def scripted(body: dict[str, Any]) -> Turn:
    """The model: fix, test, submit, one bash tool call per turn."""
    commands = ["sed -i 's/a - b/a + b/' calc.py", "python3 test_calc.py", f"echo {SUBMIT}; echo fixed add"]
    step = min(len(tool_results(body)), 2)
    return Turn(tool_calls=[(f"call_{step}", "bash", {"command": commands[step]})])


@pytest.fixture
async def model() -> AsyncIterator[Upstream]:
    async with upstream() as up:
        up.choose = scripted
        yield up


async def test_mini_fixes_a_bug_with_the_network_closed(
    client: orchard.Client, model: Upstream, tools_image: None
) -> None:
    async with orchard.ModelGateway(model.url, model="policy") as gateway:
        async with client.sandbox(SWE, workdir=WORKDIR, tools=["mini"], model=gateway) as sb:
            await sb.write_file("calc.py", CALC)
            await sb.write_file("test_calc.py", TESTS)
            # No bytecode from this run: a same-size fix in the same second would leave a stale calc.pyc trusted.
            assert (await sb.exec("python3 test_calc.py", env={"PYTHONDONTWRITEBYTECODE": "1"})).exit_code != 0
            # No route out (the engine says: no network, only the loopback): the gateway is reached only through the tunnel.
            assert networks_of(sb.id) == {"none": False}
            # model=gateway put the model, its address and key, and mini's settings in the environment.
            r = await sb.exec(
                "mini -y --exit-immediately -t 'Fix the failing test in calc.py' -o /tmp/traj.json", timeout=300
            )
            assert r.exit_code == 0, (r.stdout, r.stderr)
            check = await sb.exec("python3 test_calc.py")
            assert (check.exit_code, check.stdout) == (0, "all tests pass\n")
            trajectory = json.loads(await sb.read_file("/tmp/traj.json"))
            calls = gateway.calls(sb)
    assert trajectory["info"]["exit_status"] == "Submitted", trajectory["info"]
    assert trajectory["info"]["submission"] == "fixed add\n"
    # Every call of the rollout is recorded, in order, with the tool outputs mini sent back.
    assert [(c["api"], c["status"], c["sandbox"]) for c in calls] == [("chat", 200, sb.id)] * 3
    assert [len(tool_results(c["request"])) for c in calls] == [0, 1, 2]
    assert all(not c["request"].get("stream") for c in calls)
    assert "all tests pass" in tool_results(calls[2]["request"])[1]
    assert [len(tool_results(b)) for b in model.requests] == [0, 1, 2]
