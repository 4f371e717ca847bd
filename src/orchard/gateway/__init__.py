"""The model gateway: harnesses in sandboxes call it; it forwards to the policy server and records every call.

Example::

    async with orchard.ModelGateway("http://127.0.0.1:8000/v1", model="Qwen/Qwen3-8B", record="calls.jsonl") as gw:
        key = gw.register("sb-1", harness="codex")
        env = gw.environment("sb-1")  # OPENAI_BASE_URL, OPENAI_API_KEY, ANTHROPIC_BASE_URL, ...
        ...
        print(gw.calls("sb-1"))

The record schema is in docs/gateway.md (``SCHEMA_VERSION``).
"""

from ._record import SCHEMA_VERSION
from ._server import ModelGateway

__all__ = ["SCHEMA_VERSION", "ModelGateway"]
