"""model=gateway when the sandbox goes away in the middle of a model call.

A client in the sandbox calls the gateway through the tunnel; the scripted
upstream holds the call. Deleting the sandbox then closes the tunnel and the
gateway's upstream request, and the record says why.
"""

from __future__ import annotations

import asyncio

import pytest
from docker_support import SWE

import orchard
from gateway_support import Turn, Upstream
from support import eventually

pytestmark = pytest.mark.docker

#: Calls the gateway from inside the sandbox, as a harness would, and waits for the answer.
CALL = r"""
import json, os, urllib.request
body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", body,
                             {"Content-Type": "application/json", "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
print(urllib.request.urlopen(req, timeout=600).read())
"""


async def test_deleting_the_sandbox_mid_call_closes_the_upstream_request_and_is_recorded(
    client: orchard.Client, up: Upstream, docker_ready: str
) -> None:
    up.script(Turn(text="never sent", stall=3600))
    async with orchard.ModelGateway(up.url, model="policy") as gateway:
        sb = await client.create(SWE, model=gateway)
        try:
            await sb.write_file("/tmp/call.py", CALL)
            await sb.start_process(["python3", "/tmp/call.py"])
            await eventually(lambda: len(up.requests) == 1, what="the call reached the upstream")
        finally:
            await sb.aclose()
        await asyncio.wait_for(up.hung_up.wait(), 10)
        [record] = gateway.calls(sb)
    assert record["sandbox"] == sb.id
    assert record["status"] == 0, record  # the harness got no answer
    # The tunnel closes first (the gateway sees its client go), then the key is revoked.
    assert record["error"]["type"] in ("client_disconnected", "sandbox_unregistered"), record
