"""Real harness CLIs solve a task inside a sandbox with no network, their model reached through the gateway.

claude (Claude Code), codex, opencode, pi, openclaw and hermes, from the tools bundle,
run in the Debian SWE image on the docker backend with ``tools=[...]`` and
``model=gateway``, each with its plain one-shot command (no endpoint or model
on the command line): each calls its own API at the gateway (claude Anthropic
Messages, codex OpenAI Responses, the others Chat Completions), through the
reverse tunnel; the gateway translates to the Chat Completions of a scripted
model in this process, which asks for two shell tool calls in the harness's
own tool format (fix the bug, run the tests) and then answers. A scripted
model that never stops asking for tool calls is cut off by the gateway's
``max_calls``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from docker_support import SWE, WORKDIR, networks_of

import orchard
from gateway_support import Turn, Upstream, upstream

pytestmark = pytest.mark.docker

Json = dict[str, Any]

CALC = "def add(a, b):\n    return a - b\n"
TESTS = "from calc import add\n\nassert add(2, 3) == 5, add(2, 3)\nprint('all tests pass')\n"
FIX = "sed -i 's/a - b/a + b/' calc.py"
RUN_TESTS = "python3 test_calc.py"
NO_PYC = {"PYTHONDONTWRITEBYTECODE": "1"}
FINAL = "Fixed: add returns a + b now, and the tests pass."


def claude_bash(command: str) -> Json:
    """Arguments of claude's ``Bash`` tool."""
    return {"command": command, "description": "Run a command"}


def codex_exec(command: str) -> Json:
    """Arguments of codex's ``exec_command`` tool (codex 0.171.0: ``cmd``, run under the login shell)."""
    return {"cmd": command}


def command_only(command: str) -> Json:
    """Arguments of the ``bash`` tool of opencode and pi, the ``exec`` tool of openclaw, hermes's ``terminal``."""
    return {"command": command}


#: Per harness: its one-shot command line (acting without asking; codex outside a git repository),
#: the environment it needs for that, its shell tool's name, and that tool's arguments for a command.
HARNESSES: dict[str, tuple[list[str], dict[str, str], str, Callable[[str], Json]]] = {
    "claude": (
        ["claude", "-p", "{prompt}", "--dangerously-skip-permissions"],
        {"IS_SANDBOX": "1"},  # claude refuses that flag as root outside a declared sandbox
        "Bash",
        claude_bash,
    ),
    "codex": (
        ["codex", "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", "{prompt}"],
        {},
        "exec_command",
        codex_exec,
    ),
    "opencode": (["opencode", "run", "{prompt}"], {}, "bash", command_only),
    "pi": (["pi", "-p", "{prompt}"], {}, "bash", command_only),
    "openclaw": (
        ["sh", "-c", 'exec openclaw agent exec --config "$ORCHARD_OPENCLAW_CONFIG" "$1"', "openclaw", "{prompt}"],
        {},
        "exec",
        command_only,
    ),
    # -Q: only the final answer on stdout; --yolo: run commands without asking.
    "hermes": (["hermes", "chat", "-q", "{prompt}", "-Q", "--yolo"], {}, "terminal", command_only),
}


def command(harness: str, prompt: str) -> list[str]:
    return [prompt if arg == "{prompt}" else arg for arg in HARNESSES[harness][0]]


def tool_names(body: Json) -> set[str]:
    """The function tools a request offered (as the gateway passed them upstream)."""
    return {t.get("function", {}).get("name") for t in body.get("tools") or []}


def tool_results(body: Json) -> list[str]:
    """The tool outputs the harness sent back so far, as the gateway passed them upstream."""
    return [str(m.get("content")) for m in body.get("messages", []) if m.get("role") == "tool"]


def scripted(harness: str) -> Callable[[Json], Turn]:
    """The model: the task's two steps, then the answer; any side request (a title, say) gets plain text."""
    _, _, tool, args = HARNESSES[harness]
    steps = [
        Turn(tool_calls=[("call_fix", tool, args(FIX))]),
        Turn(tool_calls=[("call_test", tool, args(RUN_TESTS))]),
        Turn(text=FINAL),
    ]

    def choose(body: Json) -> Turn:
        if tool not in tool_names(body):
            return Turn(text="Fix calc")
        return steps[min(len(tool_results(body)), 2)]

    return choose


def runaway(harness: str) -> Callable[[Json], Turn]:
    """A model that never stops: every reply asks for one more shell command."""
    _, _, tool, args = HARNESSES[harness]

    def choose(body: Json) -> Turn:
        if tool not in tool_names(body):
            return Turn(text="Keep going")
        step = len(tool_results(body))
        return Turn(tool_calls=[(f"call_{step}", tool, args(f"echo step {step}"))])

    return choose


@pytest.fixture
async def model() -> AsyncIterator[Upstream]:
    async with upstream() as up:
        yield up


async def fix_with(client: orchard.Client, gateway: orchard.ModelGateway, harness: str) -> tuple[str, list[Json]]:
    """Run the harness on the task in a fresh sandbox with the network closed; its stdout and records."""
    _, env, _, _ = HARNESSES[harness]
    async with client.sandbox(SWE, workdir=WORKDIR, tools=[harness], model=gateway) as sb:
        await sb.write_file("calc.py", CALC)
        await sb.write_file("test_calc.py", TESTS)
        # No bytecode from this run: the fix keeps calc.py's size and may land in the same second, so Python
        # would trust a stale calc.pyc and the fixed tests would still fail.
        assert (await sb.exec(RUN_TESTS, env=NO_PYC)).exit_code != 0
        # No route out (the engine says: no network, only the loopback): the gateway is reached only through the tunnel.
        assert networks_of(sb.id) == {"none": False}
        r = await sb.exec(command(harness, "Fix the failing test in calc.py"), env=env, timeout=180)
        assert r.exit_code == 0, (r.stdout, r.stderr)
        check = await sb.exec(RUN_TESTS)
        assert (check.exit_code, check.stdout) == (0, "all tests pass\n")
        calls = gateway.calls(sb)
    assert all(c["sandbox"] == sb.id for c in calls)
    return r.stdout, calls


async def test_claude_fixes_a_bug_with_the_network_closed(
    client: orchard.Client, model: Upstream, docker_ready: str
) -> None:
    model.choose = scripted("claude")
    async with orchard.ModelGateway(model.url, model="policy") as gateway:
        stdout, calls = await fix_with(client, gateway, "claude")
    assert FINAL in stdout
    # Every call of the rollout is recorded, in order, with the tool outputs the harness sent back.
    agent = [c for c in calls if "Bash" in json.dumps(c["request"].get("tools", []))]
    assert len(agent) == 3, [c["status"] for c in calls]
    assert all(c["api"] == "messages" and c["status"] == 200 for c in calls)
    assert "all tests pass" in json.dumps(agent[-1]["request"]["messages"])
    assert FINAL in json.dumps(agent[-1]["response"])
    # The upstream saw the same three steps, translated to Chat Completions.
    assert [len(tool_results(b)) for b in model.requests if b.get("tools")] == [0, 1, 2]


def items(body: Json, kind: str) -> list[Json]:
    """The Responses items of one type in a request's ``input`` or a response's ``output``."""
    return [i for i in body.get("input", body.get("output")) or [] if i.get("type") == kind]


async def test_codex_fixes_a_bug_with_the_network_closed(
    client: orchard.Client, model: Upstream, docker_ready: str
) -> None:
    model.choose = scripted("codex")
    async with orchard.ModelGateway(model.url, model="policy") as gateway:
        stdout, calls = await fix_with(client, gateway, "codex")
    assert FINAL in stdout
    # codex makes no side calls: three Responses calls, streamed, all recorded.
    assert [(c["api"], c["stream"], c["status"], c["error"]) for c in calls] == [("responses", True, 200, None)] * 3
    # In the order they ran: each carries the previous calls' tool calls and their outputs, as codex ran them.
    ran = [items(c["response"], "function_call") for c in calls]
    assert [[(f["call_id"], f["name"], json.loads(f["arguments"])) for f in fs] for fs in ran] == [
        [("call_fix", "exec_command", {"cmd": FIX})],
        [("call_test", "exec_command", {"cmd": RUN_TESTS})],
        [],
    ]
    outputs = [[(o["call_id"], str(o["output"])) for o in items(c["request"], "function_call_output")] for c in calls]
    assert [[cid for cid, _ in out] for out in outputs] == [[], ["call_fix"], ["call_fix", "call_test"]]
    assert "Process exited with code 0" in outputs[2][0][1]
    assert "all tests pass" in outputs[2][1][1]
    assert items(calls[2]["response"], "message")[0]["content"][0]["text"] == FINAL
    # The upstream saw the same three steps, translated to Chat Completions with codex's function tools.
    assert [len(tool_results(b)) for b in model.requests] == [0, 1, 2]
    assert "exec_command" in tool_names(model.requests[0])


#: What each harness says when the gateway refuses a call past ``max_calls`` (429, ``insufficient_quota``):
#: claude shows the gateway's message, codex its own; hermes the gateway's, after three tries of the call
#: (about 8 s of backoff).
REFUSED = {
    "claude": "API Error: Request rejected (429) · this sandbox reached the gateway's max_calls={limit}",
    "codex": "ERROR: Quota exceeded.",
    "hermes": "API call failed after 3 retries: HTTP 429: this sandbox reached the gateway's max_calls={limit}",
}


# hermes starts in seconds and backs off about 8 s before it gives up: on a loaded 2-core machine the run
# took most of a minute, so the deadlines leave room.
@pytest.mark.timeout(240)
@pytest.mark.parametrize("harness", ["claude", "codex", "hermes"])
async def test_max_calls_cuts_off_a_harness_that_never_stops(
    client: orchard.Client, model: Upstream, harness: str, docker_ready: str
) -> None:
    limit = 3
    model.choose = runaway(harness)
    _, env, tool, _ = HARNESSES[harness]
    async with orchard.ModelGateway(model.url, model="policy", max_calls=limit) as gateway:
        async with client.sandbox(SWE, workdir=WORKDIR, tools=[harness], model=gateway) as sb:
            r = await sb.exec(command(harness, "Keep going until you are stopped"), env=env, timeout=120)
            calls = gateway.calls(sb)
    # The harness gave up on the refusal, with its own error, well within its timeout.
    assert not r.timed_out
    assert r.exit_code == 1, (r.exit_code, r.stdout, r.stderr)
    assert REFUSED[harness].format(limit=limit) in r.stdout + r.stderr, (r.stdout, r.stderr)
    # Its agent loop reached the upstream exactly `limit` times, each with one more tool output than before.
    assert all(tool in tool_names(b) for b in model.requests)
    assert [len(tool_results(b)) for b in model.requests] == list(range(limit))
    # The record: those calls, then the refused one(s), answered 429 with the limit named.
    admitted, refused = calls[:limit], calls[limit:]
    assert [c["status"] for c in admitted] == [200] * limit
    assert refused, [c["status"] for c in calls]
    assert all(c["status"] == 429 for c in refused), [c["status"] for c in calls]
    assert all(c["error"]["type"] == "insufficient_quota" for c in refused)
    assert all(f"max_calls={limit}" in json.dumps(c["response"]) for c in refused)
    assert all(c["upstream_request"] is None for c in refused)  # never sent upstream
    # The refused call carried the last command's output: the loop ran on until the gateway stopped it.
    assert f"step {limit - 1}" in json.dumps(refused[0]["request"])


@pytest.mark.parametrize("harness", ["opencode", "pi", "openclaw", "hermes"])
async def test_chat_harness_fixes_a_bug_with_the_network_closed(
    client: orchard.Client, model: Upstream, harness: str, docker_ready: str
) -> None:
    model.choose = scripted(harness)
    async with orchard.ModelGateway(model.url, model="policy") as gateway:
        stdout, calls = await fix_with(client, gateway, harness)
    assert FINAL in stdout
    # Chat Completions passed through: every call recorded, the agent loop's three (a title call aside) in order.
    assert all((c["api"], c["status"], c["error"], c["model"]) == ("chat", 200, None, "policy") for c in calls)
    tool = HARNESSES[harness][2]
    agent = [c for c in calls if tool in tool_names(c["request"])]
    assert [len(tool_results(c["request"])) for c in agent] == [0, 1, 2]
    assert [
        [t["function"]["name"] for t in c["response"]["choices"][0]["message"].get("tool_calls") or []] for c in agent
    ] == [[tool], [tool], []]
    assert "all tests pass" in json.dumps(agent[-1]["request"]["messages"])
    assert agent[-1]["response"]["choices"][0]["message"]["content"] == FINAL
    assert len(model.requests) == len(calls)
