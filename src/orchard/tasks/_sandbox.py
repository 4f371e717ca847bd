"""A sandbox ready for a task: its image and workdir, its repository on the local backend, its setup run."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from ..errors import TaskError

if TYPE_CHECKING:
    from .._client import Client
    from .._sandbox import Sandbox
    from ._types import Task

#: Commits a copied directory as the task's base, the same way the toys image does (images/tasks/toys/Dockerfile):
#: fixed author, committer and dates, so the same files give the same commit (the task's base_commit) everywhere.
COMMIT_BASE = (
    "test -e .git || { git init -q"
    " && git add -A"
    " && GIT_AUTHOR_NAME=orchard GIT_AUTHOR_EMAIL=orchard@localhost GIT_AUTHOR_DATE=2000-01-01T00:00:00Z"
    " GIT_COMMITTER_NAME=orchard GIT_COMMITTER_EMAIL=orchard@localhost GIT_COMMITTER_DATE=2000-01-01T00:00:00Z"
    " git commit -q -m base; }"
)

#: Seconds each setup command, and the base commit, may take.
SETUP_TIMEOUT = 600.0


def _is_local(client: Client) -> bool:
    from .._backends import LocalConfig

    return isinstance(client.config, LocalConfig)


@contextlib.asynccontextmanager
async def task_sandbox(client: Client, task: Task, **spec: Any) -> AsyncIterator[Sandbox]:
    """A fresh sandbox for ``task``, deleted when the block exits.

    It starts from ``task.image`` in ``task.workdir``. On the ``local``
    backend, which has no images, ``task.local_dir`` is copied into the
    sandbox's own working directory instead (and committed if it holds no
    ``.git``); a SWE-bench task without one cannot run there. Then the task's
    ``setup`` commands run, in order. ``spec`` adds sandbox options
    (``cpu=``, ``memory=``, ``trace=`` ...).

    Raises:
        TaskError: a SWE-bench task without ``local_dir`` on the local backend,
            or a setup command that exits non-zero.
    """
    local = _is_local(client)
    options: dict[str, Any] = {}
    if task.workdir is not None and not (local and task.local_dir is not None):
        options["workdir"] = task.workdir
    if local and task.local_dir is None and task.instance is not None:
        raise TaskError(
            f"task {task.id}: the local backend has no images, so a SWE-bench task needs local_dir "
            "(a directory holding its repository); or use the docker or kubernetes backend",
            field="local_dir",
            task_id=task.id,
        )
    async with client.sandbox(task.image, **(options | spec)) as sb:
        if local and task.local_dir is not None:
            await sb.upload(task.local_dir, ".")
            await _run(sb, task, COMMIT_BASE, "committing local_dir")
        for i, command in enumerate(task.setup):
            await _run(sb, task, command, f"setup[{i}]")
        yield sb


async def _run(sb: Sandbox, task: Task, command: str, what: str) -> None:
    result = await sb.exec(command, timeout=SETUP_TIMEOUT, merge_output=True)
    if result.exit_code != 0:
        why = f"timed out after {SETUP_TIMEOUT:g} s" if result.timed_out else f"exited {result.exit_code}"
        raise TaskError(
            f"task {task.id}: {what} {why}: {result.output[-2000:]}",
            field="setup" if what.startswith("setup") else "local_dir",
            task_id=task.id,
        )
