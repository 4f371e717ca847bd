"""mini-swe-agent on Orchard: an ``Environment`` whose commands run in an Orchard sandbox.

mini-swe-agent's agents are synchronous; this environment is built on
``orchard.sync``, so it works from plain scripts, notebooks and threads::

    from minisweagent.agents.default import DefaultAgent
    from orchard.harness.minisweagent import OrchardEnvironment

    env = OrchardEnvironment(image="orchard-test/swe", backend="kubernetes", cwd="/testbed")
    agent = DefaultAgent(model, env, **agent_config)
    agent.run(task)
    env.close()  # deletes the sandbox (so do ``cleanup()`` and garbage collection)

Its configuration keys are those of mini-swe-agent's own docker environment
(``image``, ``cwd``, ``env``, ``forward_env``, ``timeout``) plus ``backend``
(``"local"``, ``"docker"``, ``"kubernetes"``), ``login`` (commands run under
``bash -l``, as mini-swe-agent's ``bash -lc`` interpreter; default true) and
``sandbox`` (``SandboxSpec`` options such as ``cpu``, ``memory``, ``ttl``). A
YAML config selects it with
``environment_class: orchard.harness.minisweagent.OrchardEnvironment``.

Each command's stdout and stderr come back interleaved in true order, as
mini-swe-agent's ``stderr=STDOUT`` gives them; a command over its timeout is
killed with its children and reported as mini-swe-agent reports a timeout.
The first line ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` of a successful
command's output submits the rest, as in mini-swe-agent's environments.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from minisweagent.exceptions import Submitted
from minisweagent.utils.serialize import recursive_merge
from pydantic import BaseModel, field_serializer

from .. import sync
from .._backends import BackendConfig
from ..errors import OrchardError

__all__ = ["OrchardEnvironment", "OrchardEnvironmentConfig"]

#: The output line with which mini-swe-agent's agents submit.
SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


class OrchardEnvironmentConfig(BaseModel):
    """Settings of an ``OrchardEnvironment`` (mini-swe-agent's docker environment's names, plus Orchard's)."""

    image: str = "local"
    """The sandbox's image (``"local"`` on the local backend)."""
    backend: str | Any = "local"
    """``"local"``, ``"docker"``, ``"kubernetes"``, or an Orchard backend config."""
    cwd: str = ""
    """Working directory of commands (empty: the sandbox's own)."""
    env: dict[str, str] = {}
    """Environment variables of the sandbox."""
    forward_env: list[str] = []
    """Variables of this process to pass on, if set (``env`` wins on conflict)."""
    timeout: int = 30
    """Seconds a command may run."""
    login: bool = True
    """Run commands under a login shell (``bash -l``), so profile scripts load."""
    sandbox: dict[str, Any] = {}
    """More ``SandboxSpec`` options: cpu, memory, ttl, idle_timeout, ..."""

    @field_serializer("backend")
    def _backend_name(self, backend: Any) -> str:
        # A backend config object goes into saved trajectories (JSON) as its repr.
        return backend if isinstance(backend, str) else repr(backend)


class OrchardEnvironment:
    """mini-swe-agent's ``Environment`` on one Orchard sandbox, started at construction."""

    def __init__(
        self, *, config_class: type = OrchardEnvironmentConfig, logger: logging.Logger | None = None, **kwargs: Any
    ) -> None:
        self.logger = logger or logging.getLogger("minisweagent.environment")
        self.config = config_class(**kwargs)
        env = {k: v for k in self.config.forward_env if (v := os.environ.get(k)) is not None} | self.config.env
        backend: str | BackendConfig = self.config.backend
        self._client: sync.Client | None = sync.Client(backend)
        try:
            self.sandbox: sync.Sandbox = self._client.create(self.config.image, env=env, **self.config.sandbox)
            # The sandbox's own system, for the templates (mini-swe-agent's local environments give the host's).
            names = ("system", "node", "release", "version", "machine")
            r = self.sandbox.exec("; ".join(f"uname -{f}" for f in "snrvm"))
            self._uname = dict(zip(names, r.stdout.splitlines(), strict=False)) if r.exit_code == 0 else {}
        except BaseException:
            self.close()
            raise

    def execute(self, action: dict[str, Any], cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        """Run ``action["command"]`` and return mini-swe-agent's output dict."""
        command = action.get("command", "")
        timeout = timeout or self.config.timeout
        try:
            r = self.sandbox.exec(
                command,
                cwd=cwd or self.config.cwd or None,
                timeout=timeout,
                login=self.config.login,
                merge_output=True,
            )
        except OrchardError as exc:
            output = self._failed("", exc)
        else:
            if r.timed_out:
                error = TimeoutError(f"Command '{command}' timed out after {timeout} seconds")
                output = self._failed(r.output, error)
            else:
                code = r.exit_code if r.exit_code is not None else 128 + (r.signal or 0)
                output = {"output": r.output, "returncode": code, "exception_info": ""}
        self._check_finished(output)
        return output

    @staticmethod
    def _failed(text: str, exc: BaseException) -> dict[str, Any]:
        return {
            "output": text,
            "returncode": -1,
            "exception_info": f"An error occurred while executing the command: {exc}",
            "extra": {"exception_type": type(exc).__name__, "exception": str(exc)},
        }

    def _check_finished(self, output: dict[str, Any]) -> None:
        """Raise ``Submitted`` if the output submits, as mini-swe-agent's environments do."""
        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_MARKER and output["returncode"] == 0:
            submission = "".join(lines[1:])
            raise Submitted(
                {"role": "exit", "content": submission, "extra": {"exit_status": "Submitted", "submission": submission}}
            )

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        """The config, the sandbox's uname fields and ``kwargs``, for the agent's templates."""
        result: dict[str, Any] = recursive_merge(self.config.model_dump(), self._uname, kwargs)
        return result

    def serialize(self) -> dict[str, Any]:
        """The environment's part of a saved trajectory."""
        return {
            "info": {
                "config": {
                    "environment": self.config.model_dump(mode="json"),
                    "environment_type": f"{type(self).__module__}.{type(self).__name__}",
                }
            }
        }

    def close(self) -> None:
        """Delete the sandbox; safe to call twice."""
        client, self._client = getattr(self, "_client", None), None
        if client is not None:
            client.close()

    #: mini-swe-agent's name for it.
    cleanup = close

    def __del__(self) -> None:
        self.close()
