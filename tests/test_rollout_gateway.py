"""orchard.rollout with a ModelGateway (``sandbox={"model": gateway}``): each record carries its sandbox's model calls.

A small harness in each sandbox (a Python script) runs a tool loop against the
gateway, over Chat Completions or Anthropic Messages; a scripted upstream plays
the model, choosing a right or wrong command by the attempt's seed. Local
backend with bwrap isolation: each sandbox has its own loopback, so the
gateway's port inside it (4319) does not collide between sandboxes in flight.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import orchard
import orchard.rollout
from gateway_support import Json, Turn, Upstream
from orchard.tasks import Reward, Task

pytestmark = pytest.mark.executor

#: A harness: a tool loop over Chat Completions (``chat``) or Anthropic Messages (``messages``), one tool (bash).
HARNESS = r"""
import json, os, subprocess, sys, urllib.request

api, instruction = sys.argv[1], sys.argv[2]

def post(url, body, headers):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json", **headers})
    return json.loads(urllib.request.urlopen(req, timeout=60).read())

def bash(command):
    return subprocess.run(command, shell=True, capture_output=True, text=True).stdout

ran = []
if api == "chat":
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
    messages = [{"role": "system", "content": "You fix things."}, {"role": "user", "content": instruction}]
    while True:
        reply = post(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
                     {"model": "any", "messages": messages, "tools": tools},
                     {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
        message = reply["choices"][0]["message"]
        messages.append(message)
        if not message.get("tool_calls"):
            break
        for call in message["tool_calls"]:
            command = json.loads(call["function"]["arguments"])["command"]
            ran.append(command)
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": bash(command)})
else:
    tools = [{"name": "bash", "description": "run a command", "input_schema": {"type": "object"}}]
    messages = [{"role": "user", "content": instruction}]
    while True:
        reply = post(os.environ["ANTHROPIC_BASE_URL"] + "/v1/messages",
                     {"model": "any", "max_tokens": 100, "system": "You fix things.", "messages": messages,
                      "tools": tools},
                     {"x-api-key": os.environ["ANTHROPIC_API_KEY"], "anthropic-version": "2023-06-01"})
        messages.append({"role": "assistant", "content": reply["content"]})
        uses = [b for b in reply["content"] if b["type"] == "tool_use"]
        if not uses:
            break
        results = []
        for use in uses:
            ran.append(use["input"]["command"])
            results.append({"type": "tool_result", "tool_use_id": use["id"], "content": bash(use["input"]["command"])})
        messages.append({"role": "user", "content": results})
print(json.dumps(ran))
"""

#: Each task's chance that the model runs the right command, and the API its harness speaks.
CHANCE = {"always": 1.0, "half": 0.5}
API = {"always": "chat", "half": "messages"}


def right(task_id: str, attempt: int) -> bool:
    return random.Random(f"{task_id}:{attempt}").random() < CHANCE[task_id]


def model(body: Json) -> Turn:
    """The scripted model: a bash call (right or wrong by the seed in the user's message), then a last word."""
    if body["messages"][-1]["role"] == "tool":
        return Turn(text="I wrote the answer.")
    first_user = next(m for m in body["messages"] if m["role"] == "user")
    match = re.search(r"task (\w+) attempt (\d+)", str(first_user["content"]))
    assert match is not None, body
    command = "echo 42 > answer.txt" if right(match[1], int(match[2])) else "echo 41 > answer.txt"
    return Turn(tool_calls=[("call_1", "bash", {"command": command})])


async def harness_agent(sb: orchard.Sandbox, task: Task, *, attempt: int) -> str:
    """Runs the harness in the sandbox; the answer is the command the model ran."""
    await sb.write_file("/tmp/harness.py", HARNESS)
    instruction = f"task {task.id} attempt {attempt}: write 42 to answer.txt"
    result = await sb.exec(["python3", "/tmp/harness.py", API[task.id], instruction], timeout=60)
    assert result.exit_code == 0, result.stderr
    [command] = json.loads(result.stdout)
    return str(command)


async def check_reward(client: orchard.Client, task: Task, answer: Any) -> Reward:
    async with client.sandbox() as sb:
        await sb.exec(str(answer), timeout=30)
        solved = (await sb.exec('test "$(cat answer.txt)" = 42', timeout=30)).exit_code == 0
    return Reward(value=float(solved), solved=solved)


@pytest.fixture
async def bwrap_client(local_root: Path) -> AsyncIterator[orchard.Client]:
    async with orchard.Client(orchard.LocalConfig(root=str(local_root), isolation="bwrap")) as client:
        yield client


async def test_each_record_carries_its_own_sandboxs_model_calls_and_the_chat_export_uses_them(
    bwrap_client: orchard.Client, up: Upstream, local_root: Path, tmp_path: Path
) -> None:
    up.choose = model
    tasks = [Task(id=name, image="local", instruction=f"write 42 to answer.txt ({name})") for name in CHANCE]
    faulted: list[tuple[str, int]] = []

    async def agent(sb: orchard.Sandbox, task: Task, *, attempt: int) -> str:
        answer = await harness_agent(sb, task, attempt=attempt)
        if attempt == 1 and (task.id, attempt) not in faulted:
            faulted.append((task.id, attempt))
            await sb.aclose()  # lost after its model calls: the retry's calls are the record's
            await sb.exec("true")
        return answer

    out = tmp_path / "run"
    async with orchard.ModelGateway(up.url, model="policy") as gateway:
        results = await orchard.rollout.run(
            bwrap_client,
            tasks,
            agent=agent,
            reward=check_reward,
            n=3,
            concurrency=6,
            out=out,
            sandbox={"model": gateway, "env": {"SECRET_TOKEN": "hunter2"}},
            progress=False,
        )
        assert len(gateway.calls()) == 2 * (6 + 2)  # two calls per try, two tries lost
    assert results.counts["ok"] == 6
    assert results.pass_rate == {tid: sum(right(tid, a) for a in range(3)) / 3 for tid in CHANCE}
    for r in results.records:
        calls = r["calls"]
        assert [c["sandbox"] for c in calls] == [r["sandbox_id"]] * 2, r  # this try's sandbox only
        assert [c["api"] for c in calls] == [API[r["task"]]] * 2
        assert [c["status"] for c in calls] == [200, 200]
        if r["attempt"] == 1:
            assert r["tries"] == 2
            [lost] = r["infra"]
            assert (lost["error"], lost["calls"]) == ("SandboxClosed", 2)
            assert lost["sandbox_id"] != r["sandbox_id"]
    # The records on disk carry the calls too; run.json names the gateway's upstream and no env value.
    assert orchard.rollout.Results.load(out).records == json.loads(json.dumps(results.records, default=repr))
    params = (out / "run.json").read_text()
    assert "hunter2" not in params
    assert json.loads(params)["sandbox"] == {"model": {"upstream": up.url, "model": "policy"}, "env": ["SECRET_TOKEN"]}

    # The chat export: the last call's request messages and its reply, as Chat Completions.
    chat = {(row["task"], row["attempt"]): row for row in results.to_chat()}
    assert len(chat) == 6
    for attempt in range(3):
        command = "echo 42 > answer.txt" if right("always", attempt) else "echo 41 > answer.txt"
        row = chat[("always", attempt)]
        messages = row["messages"]
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
        assert messages[1]["content"] == f"task always attempt {attempt}: write 42 to answer.txt"
        [call] = messages[2]["tool_calls"]
        assert json.loads(call["function"]["arguments"]) == {"command": command}
        assert messages[4] == {"role": "assistant", "content": "I wrote the answer."}
        assert row["tools"][0]["function"]["name"] == "bash"
        assert row["reward"] == 1.0
    for attempt in range(3):
        # Messages API: the gateway's Chat Completions translation of the request, the reply turned into chat too.
        row = chat[("half", attempt)]
        messages = row["messages"]
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
        assert messages[0]["content"] == "You fix things."
        [call] = messages[2]["tool_calls"]
        assert call["function"]["name"] == "bash"
        assert messages[3]["tool_call_id"] == call["id"]
        assert messages[4] == {"role": "assistant", "content": "I wrote the answer."}
        assert row["reward"] == float(right("half", attempt))
    assert not local_root.exists() or not any(local_root.iterdir())


async def test_without_a_gateway_records_have_no_calls_and_the_chat_export_is_the_answer(
    bwrap_client: orchard.Client,
) -> None:
    async def agent(sb: orchard.Sandbox, task: Task, *, attempt: int) -> str:
        await sb.exec("echo 42 > answer.txt")
        return "echo 42 > answer.txt"

    results = await orchard.rollout.run(
        bwrap_client, [Task(id="t", image="local", instruction="do")], agent=agent, reward=check_reward, progress=False
    )
    [record] = results.records
    assert record["calls"] is None
    assert results.to_chat()[0]["messages"] == [
        {"role": "user", "content": "do"},
        {"role": "assistant", "content": "echo 42 > answer.txt"},
    ]
