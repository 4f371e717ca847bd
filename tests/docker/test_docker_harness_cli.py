"""A real harness CLI solves a task inside a sandbox with no network, its model reached through the gateway.

claude (Claude Code, from the tools bundle) runs in the Debian SWE image on
the docker backend with ``tools=["claude"]`` and ``model=gateway``: it calls
Anthropic Messages at the gateway, through the reverse tunnel; the gateway
translates to the Chat Completions of a scripted model in this process, which
asks for two Bash tool calls (fix the bug, run the tests) and then answers.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from docker_support import SWE, WORKDIR

import orchard
from gateway_support import Turn, Upstream, upstream

pytestmark = pytest.mark.docker

CALC = "def add(a, b):\n    return a - b\n"
TESTS = "from calc import add\n\nassert add(2, 3) == 5, add(2, 3)\nprint('all tests pass')\n"
FINAL = "Fixed: add returns a + b now, and the tests pass."


def tool_results(body: dict[str, Any]) -> list[str]:
    """The tool outputs the harness sent back so far, as the gateway passed them upstream."""
    return [str(m.get("content")) for m in body.get("messages", []) if m.get("role") == "tool"]


def scripted(body: dict[str, Any]) -> Turn:
    """The model: the task's two steps, then the answer; any side request (a title, say) gets plain text."""
    if "Bash" not in {t.get("function", {}).get("name") for t in body.get("tools") or []}:
        return Turn(text="Fix calc")
    steps = [
        Turn(
            tool_calls=[("call_fix", "Bash", {"command": "sed -i 's/a - b/a + b/' calc.py", "description": "Fix add"})]
        ),
        Turn(tool_calls=[("call_test", "Bash", {"command": "python3 test_calc.py", "description": "Run the tests"})]),
        Turn(text=FINAL),
    ]
    return steps[min(len(tool_results(body)), 2)]


@pytest.fixture
async def model() -> AsyncIterator[Upstream]:
    async with upstream() as up:
        up.choose = scripted
        yield up


async def test_claude_fixes_a_bug_with_the_network_closed(
    client: orchard.Client, model: Upstream, docker_ready: str
) -> None:
    async with orchard.ModelGateway(model.url, model="policy") as gateway:
        async with client.sandbox(SWE, workdir=WORKDIR, tools=["claude"], model=gateway) as sb:
            await sb.write_file("calc.py", CALC)
            await sb.write_file("test_calc.py", TESTS)
            assert (await sb.exec("python3 test_calc.py")).exit_code != 0
            # No route out: the gateway is reached only through the tunnel.
            out = await sb.exec(["python3", "-c", "import socket; socket.create_connection(('1.1.1.1', 80), 3)"])
            assert out.exit_code != 0
            r = await sb.exec(
                ["claude", "-p", "Fix the failing test in calc.py", "--dangerously-skip-permissions"],
                env={"IS_SANDBOX": "1"},  # claude refuses that flag as root outside a declared sandbox
                timeout=300,
            )
            assert r.exit_code == 0, (r.stdout, r.stderr)
            assert FINAL in r.stdout
            check = await sb.exec("python3 test_calc.py")
            assert (check.exit_code, check.stdout) == (0, "all tests pass\n")
            calls = gateway.calls(sb)
    # Every call of the rollout is recorded, in order, with the tool outputs the harness sent back.
    agent = [c for c in calls if "Bash" in json.dumps(c["request"].get("tools", []))]
    assert len(agent) == 3, [c["status"] for c in calls]
    assert all(c["api"] == "messages" and c["status"] == 200 and c["sandbox"] == sb.id for c in calls)
    assert "all tests pass" in json.dumps(agent[-1]["request"]["messages"])
    assert FINAL in json.dumps(agent[-1]["response"])
    # The upstream saw the same three steps, translated to Chat Completions.
    assert [len(tool_results(b)) for b in model.requests if b.get("tools")] == [0, 1, 2]
