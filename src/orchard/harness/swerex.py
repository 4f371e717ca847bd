"""SWE-ReX on Orchard: an ``AbstractDeployment`` whose runtime is an Orchard sandbox.

SWE-agent, and anything else built on SWE-ReX, runs on Orchard by swapping
its deployment::

    from orchard.harness.swerex import OrchardDeployment

    dep = OrchardDeployment(image="orchard-test/swe", backend="docker")
    await dep.start()
    rt = dep.runtime
    await rt.create_session(CreateBashSessionRequest())
    obs = await rt.run_in_session(BashAction(command="cd /testbed && ls"))
    await dep.stop()

How SWE-ReX's calls map onto Orchard:

- sessions are Orchard shells (``Sandbox.shell``): cwd, environment and
  variables persist between ``run_in_session`` calls; the output is stdout
  and stderr interleaved, as SWE-ReX's terminal gives it.
- ``execute`` is ``Sandbox.exec``: ``Command.env`` adds to the sandbox's
  environment (SWE-ReX's local runtime replaces it).
- files are Orchard files; ``upload`` copies a local file or tree.
- failures are SWE-ReX's own exceptions: ``CommandTimeoutError``,
  ``NonZeroExitCodeError``, ``SessionExistsError``,
  ``SessionDoesNotExistError``, ``DeploymentNotStartedError``,
  ``DeploymentStartupError``; a missing file is ``FileNotFoundError``.

Interactive programs (``is_interactive_command``, ``is_interactive_quit``)
are not supported (Orchard's shells run one command to completion); they
raise ``SwerexException`` saying so. A ``BashInterruptAction`` has nothing
to interrupt, since a command that times out is already killed.
"""

from __future__ import annotations

import logging
import os
import shlex
from typing import Any

from swerex.deployment.abstract import AbstractDeployment
from swerex.deployment.hooks.abstract import CombinedDeploymentHook, DeploymentHook
from swerex.exceptions import (
    CommandTimeoutError,
    DeploymentNotStartedError,
    DeploymentStartupError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
    SwerexException,
)
from swerex.runtime.abstract import (
    AbstractRuntime,
    BashAction,
    BashInterruptAction,
    BashObservation,
    CloseBashSessionResponse,
    CloseResponse,
    Command,
    CommandResponse,
    CreateBashSessionResponse,
    IsAliveResponse,
    ReadFileRequest,
    ReadFileResponse,
    UploadRequest,
    UploadResponse,
    WriteFileRequest,
    WriteFileResponse,
)

from .. import _client
from .._backends import BackendConfig
from .._sandbox import Sandbox, Shell
from ..errors import OrchardError, SandboxStartError, SandboxTimeout

__all__ = ["OrchardDeployment", "OrchardRuntime"]

log = logging.getLogger("orchard.harness.swerex")


def _text(data: bytes) -> str:
    return data.decode(errors="backslashreplace")


class OrchardRuntime(AbstractRuntime):
    """SWE-ReX's runtime interface over one Orchard sandbox."""

    def __init__(self, sandbox: Sandbox, *, logger: logging.Logger | None = None) -> None:
        super().__init__()
        self.sandbox = sandbox
        self.logger = logger or log
        self._sessions: dict[str, Shell] = {}

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        """Whether the sandbox's executor answers."""
        try:
            await self.sandbox.info()
        except OrchardError as exc:
            return IsAliveResponse(is_alive=False, message=str(exc))
        return IsAliveResponse(is_alive=True)

    async def create_session(self, request: Any) -> CreateBashSessionResponse:
        """Open a shell; ``startup_source`` files are sourced in it."""
        if request.session in self._sessions:
            raise SessionExistsError(f"session {request.session} already exists")
        shell = await self.sandbox.shell()
        self._sessions[request.session] = shell
        output = []
        for path in request.startup_source:
            r = await shell.exec(f"source {shlex.quote(path)}", timeout=request.startup_timeout, merge_output=True)
            output.append(r.output)
        return CreateBashSessionResponse(output="".join(output))

    def _session(self, name: str) -> Shell:
        try:
            return self._sessions[name]
        except KeyError:
            raise SessionDoesNotExistError(f"session {name!r} does not exist") from None

    async def run_in_session(self, action: Any) -> BashObservation:
        """Run a command in a session, by SWE-ReX's ``check`` rules."""
        shell = self._session(action.session)
        if isinstance(action, BashInterruptAction):
            return BashObservation(output="", exit_code=None, expect_string="")
        assert isinstance(action, BashAction)
        if action.is_interactive_command or action.is_interactive_quit:
            raise SwerexException("interactive commands are not supported on Orchard sessions")
        r = await shell.exec(action.command, timeout=action.timeout, merge_output=True)
        if r.timed_out:
            raise CommandTimeoutError(f"timeout ({action.timeout}s) exceeded while running {action.command!r}")
        code = None if action.check == "ignore" else r.exit_code
        if action.check == "raise" and code != 0:
            msg = f"Command {action.command!r} failed with exit code {code}. Here is the output:\n{r.output!r}"
            raise NonZeroExitCodeError(f"{action.error_msg}: {msg}" if action.error_msg else msg)
        return BashObservation(output=r.output, exit_code=code)

    async def close_session(self, request: Any) -> CloseBashSessionResponse:
        """Close a session's shell."""
        shell = self._session(request.session)
        del self._sessions[request.session]
        await shell.aclose()
        return CloseBashSessionResponse()

    async def execute(self, command: Command) -> CommandResponse:
        """Run a command on its own (no session), as ``subprocess.run`` would."""
        cmd: str | list[str] = command.command
        if isinstance(cmd, str) and not command.shell:
            cmd = [cmd]  # subprocess semantics: a string without shell=True names the program
        r = await self.sandbox.exec(
            cmd, cwd=command.cwd, env=command.env, timeout=command.timeout, merge_output=command.merge_output_streams
        )
        if r.timed_out:
            raise CommandTimeoutError(f"Timeout ({command.timeout}s) exceeded while running command")
        if command.merge_output_streams:
            resp = CommandResponse(stdout=_text(r.output_bytes), stderr="", exit_code=r.exit_code)
        else:
            resp = CommandResponse(stdout=_text(r.stdout_bytes), stderr=_text(r.stderr_bytes), exit_code=r.exit_code)
        if command.check and r.exit_code != 0:
            msg = (
                f"Command {command.command!r} failed with exit code {r.exit_code}. "
                f"Stdout:\n{resp.stdout!r}\nStderr:\n{resp.stderr!r}"
            )
            raise NonZeroExitCodeError(f"{command.error_msg}: {msg}" if command.error_msg else msg)
        return resp

    async def read_file(self, request: ReadFileRequest) -> ReadFileResponse:
        """A file's text (``encoding`` and ``errors`` as ``Path.read_text``)."""
        data = await self.sandbox.read_file(request.path)
        return ReadFileResponse(content=data.decode(request.encoding or "utf-8", request.errors or "strict"))

    async def write_file(self, request: WriteFileRequest) -> WriteFileResponse:
        """Write a text file, creating its parent directories."""
        await self.sandbox.write_file(request.path, request.content)
        return WriteFileResponse()

    async def upload(self, request: UploadRequest) -> UploadResponse:
        """Copy a local file or directory into the sandbox."""
        if not os.path.exists(request.source_path):
            raise FileNotFoundError(request.source_path)
        await self.sandbox.upload(request.source_path, request.target_path)
        return UploadResponse()

    async def close(self) -> CloseResponse:
        """Close every session (the sandbox stays: its deployment ends it)."""
        sessions, self._sessions = list(self._sessions.values()), {}
        for shell in sessions:
            try:
                await shell.aclose()
            except OrchardError as exc:  # a dead sandbox has no sessions left to close
                self.logger.debug("closing a session: %s", exc)
        return CloseResponse()


class OrchardDeployment(AbstractDeployment):
    """A SWE-ReX deployment that starts one Orchard sandbox.

    Args:
        image: the sandbox's image (``"local"`` on the local backend).
        backend: ``"local"``, ``"docker"``, ``"kubernetes"`` or a backend config.
        logger: SWE-ReX's logger convention.
        **spec: ``SandboxSpec`` options (cpu, memory, env, workdir, ttl, ...).
    """

    def __init__(
        self,
        *,
        image: str = "local",
        backend: str | BackendConfig = "local",
        logger: logging.Logger | None = None,
        **spec: Any,
    ) -> None:
        self.logger = logger or log
        self._image = image
        self._backend = backend
        self._spec = spec
        self._hooks = CombinedDeploymentHook()
        self._client: _client.Client | None = None
        self._runtime: OrchardRuntime | None = None

    def add_hook(self, hook: DeploymentHook) -> None:
        """Add a hook (told of startup steps)."""
        self._hooks.add_hook(hook)

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        """Whether the sandbox answers.

        Raises:
            DeploymentNotStartedError: if ``start`` was not called.
        """
        return await self.runtime.is_alive(timeout=timeout)

    async def start(self) -> None:
        """Start the sandbox."""
        if self._runtime is not None:
            return
        self._hooks.on_custom_step(f"Starting an Orchard sandbox ({self._image})")
        client = _client.Client(self._backend)
        try:
            sandbox = await client.create(self._image, **self._spec)
        except (SandboxStartError, SandboxTimeout) as exc:
            await client.aclose()
            raise DeploymentStartupError(str(exc)) from exc
        except BaseException:
            await client.aclose()
            raise
        self._client = client
        self._runtime = OrchardRuntime(sandbox, logger=self.logger)

    async def stop(self) -> None:
        """Close the sessions and delete the sandbox; safe to call twice."""
        runtime, client = self._runtime, self._client
        self._runtime = self._client = None
        if runtime is not None:
            await runtime.close()
        if client is not None:
            await client.aclose()  # deletes the sandbox

    @property
    def runtime(self) -> OrchardRuntime:
        """The runtime, once started.

        Raises:
            DeploymentNotStartedError: if ``start`` was not called.
        """
        if self._runtime is None:
            raise DeploymentNotStartedError("Deployment not started")  # type: ignore[no-untyped-call]
        return self._runtime

    def __del__(self) -> None:
        # SWE-ReX's base stops a deployment from __del__ on whatever loop is current; the
        # Client's own close (and its atexit cleanup) own that here.
        pass
