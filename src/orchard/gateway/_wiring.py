"""``model=gateway`` on a sandbox: what each bundled harness reads to reach the gateway.

Inside the sandbox the gateway is at ``http://127.0.0.1:PORT`` (a reverse
tunnel over the executor's connection; no egress is opened). Each harness is
pointed there by environment variables, and the four that read their
endpoint only from a file (codex, pi, openclaw, hermes) get one under ``CONFIG_DIR``,
written when the sandbox has started. Every harness carries the sandbox's own
key, which the gateway checks; the model name is the gateway's ``model``.
"""

from __future__ import annotations

import contextlib
import json
from typing import TYPE_CHECKING

from ..errors import ConfigError, OrchardError
from ._server import ModelGateway

if TYPE_CHECKING:
    from .._sandbox import Sandbox

#: The port inside the sandbox where the gateway answers.
PORT = 4319
#: Where the harness config files go in the sandbox (written by the executor, so any image has it).
CONFIG_DIR = "/tmp/orchard-model"
#: The variable holding the sandbox's gateway key, for harnesses configured to read a named variable.
KEY_ENV = "ORCHARD_MODEL_KEY"


def environment(key: str, model: str, port: int = PORT) -> dict[str, str]:
    """The environment variables of a sandbox whose harnesses call the gateway."""
    base = f"http://127.0.0.1:{port}"
    provider = {
        "npm": "@ai-sdk/openai-compatible",
        "options": {"baseURL": f"{base}/v1", "apiKey": "{env:" + KEY_ENV + "}"},
    }
    opencode = {"provider": {"orchard": {**provider, "models": {model: {}}}}, "model": f"orchard/{model}"}
    return {
        KEY_ENV: key,
        "ORCHARD_MODEL": model,
        "ORCHARD_MODEL_BASE_URL": f"{base}/v1",
        # OpenAI SDKs and most harnesses that speak Chat Completions.
        "OPENAI_BASE_URL": f"{base}/v1",
        "OPENAI_API_KEY": key,
        # claude (Claude Code): Messages at base/v1/messages.
        "ANTHROPIC_BASE_URL": base,
        "ANTHROPIC_API_KEY": key,
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        # codex: its config.toml (model provider "orchard", Responses API).
        "CODEX_HOME": f"{CONFIG_DIR}/codex",
        # opencode: its whole config inline; no model list or update fetched.
        "OPENCODE_CONFIG_CONTENT": json.dumps(opencode),
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        # pi: its models.json and settings.json (the default model); no update or package checks.
        "PI_CODING_AGENT_DIR": f"{CONFIG_DIR}/pi",
        "PI_OFFLINE": "1",
        # openclaw: `openclaw agent exec --config "$ORCHARD_OPENCLAW_CONFIG" ...`
        "ORCHARD_OPENCLAW_CONFIG": f"{CONFIG_DIR}/openclaw.json",
        # mini (mini-swe-agent): litellm's OpenAI provider, which reads OPENAI_BASE_URL and OPENAI_API_KEY; no
        # setup wizard, no cost map fetched at import, and no error for a model litellm has no prices for.
        "MSWEA_MODEL_NAME": f"openai/{model}",
        "MSWEA_CONFIGURED": "true",
        "MSWEA_COST_TRACKING": "ignore_errors",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        # hermes (hermes-agent): its config.yaml under HERMES_HOME, where it also keeps its state; nothing
        # pip-installed at run time (its config says so too).
        "HERMES_HOME": f"{CONFIG_DIR}/hermes",
        "HERMES_DISABLE_LAZY_INSTALLS": "1",
    }


def files(model: str, port: int = PORT) -> dict[str, str]:
    """The harness config files to write in the sandbox: path -> content."""
    base = f"http://127.0.0.1:{port}/v1"
    codex = "\n".join(
        [
            f"model = {json.dumps(model)}",
            'model_provider = "orchard"',
            "",
            "[model_providers.orchard]",
            'name = "orchard"',
            f"base_url = {json.dumps(base)}",
            f'env_key = "{KEY_ENV}"',
            'wire_api = "responses"',
            "",
            "[features]",
            "plugins = false",
            "",
            "[analytics]",
            "enabled = false",
            "",
        ]
    )
    pi = {
        "providers": {
            "orchard": {"baseUrl": base, "api": "openai-completions", "apiKey": KEY_ENV, "models": [{"id": model}]}
        }
    }
    # Without a default, `pi -p` without --model picks a built-in provider whose key variable is set:
    # anthropic (ANTHROPIC_API_KEY, above), at api.anthropic.com.
    pi_settings = {"defaultProvider": "orchard", "defaultModel": model}
    openclaw = {
        "models": {
            "providers": {
                "orchard": {
                    "baseUrl": base,
                    "apiKey": "${" + KEY_ENV + "}",
                    "api": "openai-completions",
                    # openclaw refuses a model without a name ("Invalid config").
                    "models": [{"id": model, "name": model, "contextWindow": 128000, "maxTokens": 8192}],
                }
            }
        },
        "agents": {"defaults": {"model": {"primary": f"orchard/{model}"}}},
    }
    # hermes: a "custom" provider at the gateway (OPENAI_BASE_URL is not what it uses: with --provider custom it
    # went to openrouter.ai), the key expanded from the environment when it loads the file; context_length
    # given, or it looks the model up (openrouter.ai, then the endpoint's /api/show and /v1/models); no lazy
    # pip installs and no download of the tirith command scanner. JSON scalars are YAML scalars.
    hermes = "\n".join(
        [
            "model:",
            "  provider: custom",
            f"  base_url: {json.dumps(base)}",
            f"  default: {json.dumps(model)}",
            '  api_key: "${' + KEY_ENV + '}"',
            "  context_length: 128000",
            "security:",
            "  allow_lazy_installs: false",
            "  tirith_enabled: false",
            "",
        ]
    )
    return {
        f"{CONFIG_DIR}/codex/config.toml": codex,
        f"{CONFIG_DIR}/pi/models.json": json.dumps(pi, indent=2) + "\n",
        f"{CONFIG_DIR}/pi/settings.json": json.dumps(pi_settings, indent=2) + "\n",
        f"{CONFIG_DIR}/openclaw.json": json.dumps(openclaw, indent=2) + "\n",
        f"{CONFIG_DIR}/hermes/config.yaml": hermes,
    }


class Wiring:
    """One sandbox's link to a gateway: its key and environment before it starts, its tunnel once it has."""

    def __init__(self, gateway: ModelGateway, sandbox_id: str) -> None:
        if not isinstance(gateway, ModelGateway):
            raise ConfigError(f"model= takes an orchard.ModelGateway, not {gateway!r}")
        if gateway.model is None:
            raise ConfigError(
                "model=gateway needs ModelGateway(model=...): the model name the sandbox's harnesses ask for "
                "and the upstream is sent"
            )
        url = gateway.url  # GatewayClosed outside its async with: before anything is registered
        self.gateway = gateway
        self.sandbox_id = sandbox_id
        self.env = environment(gateway.register(sandbox_id), gateway.model)
        self._url = url
        self._files = files(gateway.model)

    def forget(self) -> None:
        """Revoke the sandbox's key (its calls in flight are cancelled)."""
        self.gateway.unregister(self.sandbox_id)

    async def connect(self, sb: Sandbox) -> None:
        """Write the harness configs and open the tunnel, for as long as ``sb`` is open.

        On failure the key is revoked; the caller deletes the sandbox.
        """
        stack = contextlib.AsyncExitStack()
        try:
            for path, content in self._files.items():
                await sb.write_file(path, content)
            await stack.enter_async_context(sb.reverse_forward(PORT, self._url))
        except BaseException:
            with contextlib.suppress(Exception):
                await stack.aclose()
            self.forget()
            raise

        async def close() -> None:
            try:
                with contextlib.suppress(OrchardError):  # a sandbox that died: its tunnel is gone already
                    await stack.aclose()
            finally:
                self.forget()

        sb._on_close.append(close)
