"""Reading tasks from a JSONL file or a list of dicts, every field checked before any sandbox starts."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import TaskError
from ._types import Task

#: Where SWE-bench images keep the repository.
SWEBENCH_WORKDIR = "/testbed"

#: Ids become parts of file names (results, traces): a safe alphabet, no leading dot.
_ID = re.compile(r"[A-Za-z0-9_@+=:-][A-Za-z0-9._@+=:-]{0,199}")
_PARSER = re.compile(r"parse_log_[A-Za-z0-9_]+")
_EVAL_TYPES = ("pass_and_fail", "fail_only")

# A SWE-bench instance: the fields grading needs, then Orchard's optional extensions.
_SWE_REQUIRED = ("instance_id", "repo", "base_commit", "patch", "test_patch", "problem_statement")
_SWE_OPTIONAL_STR = ("image", "workdir", "eval_script", "test_cmd", "log_parser", "eval_type", "version", "local_dir")
# A generic task: Orchard's own format, so an unknown field is a typo.
_GENERIC_FIELDS = ("id", "image", "instruction", "workdir", "setup", "check", "local_dir")


def swebench_image(instance_id: str, namespace: str = "swebench") -> str:
    """The image name SWE-bench's harness gives an instance (``swebench.task.checks.expected_image``).

    ``sweb.eval.x86_64.<instance_id>:latest`` in lower case under ``namespace``,
    with ``__`` written ``_1776_`` (Docker Hub allows no double underscore):
    ``django__django-11099`` -> ``swebench/sweb.eval.x86_64.django_1776_django-11099:latest``.
    """
    return f"{namespace}/sweb.eval.x86_64.{instance_id}:latest".lower().replace("__", "_1776_")


def load(source: str | os.PathLike[str] | Iterable[Mapping[str, Any]]) -> list[Task]:
    """Read tasks from a JSONL file (one JSON object a line) or from a list of dicts.

    A dict with ``instance_id`` is a SWE-bench instance, taken as it is (its
    ``FAIL_TO_PASS`` and ``PASS_TO_PASS`` either lists or JSON strings of
    lists, as in the Hugging Face datasets); any other is a generic task
    (``id``, ``image``, ``instruction``, ``setup``, ``check``). See
    docs/tasks.md for every field.

    A relative ``local_dir`` is taken from the JSONL file's directory (from
    the current directory for a list).

    Raises:
        TaskError: a line that is not a JSON object, a field missing or of the
            wrong type, or an id given twice; the message names the file and
            line (or the list index) and the field.
    """
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        entries = list(_read_jsonl(path))
        if not entries:
            raise TaskError(f"{path}: holds no tasks", source=path)
        base = os.path.dirname(os.path.abspath(path))
    else:
        if isinstance(source, Mapping):
            raise TaskError("load() takes a JSONL path or a list of dicts, not one dict: wrap it in a list")
        entries = [(_Where(f"tasks[{i}]", None), item) for i, item in enumerate(source)]
        base = os.getcwd()
    tasks: list[Task] = []
    seen: dict[str, _Where] = {}
    for where, item in entries:
        if not isinstance(item, Mapping):
            raise where.error(f"a task must be a JSON object (a dict), not {_kind(item)}")
        task = _task(where, item, base)
        if task.id in seen:
            field = "instance_id" if task.instance is not None else "id"
            raise where.error(f"duplicate id {task.id!r}, first at {seen[task.id]}", field, task.id)
        seen[task.id] = where
        tasks.append(task)
    return tasks


class _Where:
    """A place in the input: file and line, or list index."""

    def __init__(self, source: str, line: int | None) -> None:
        self.source = source
        self.line = line

    def __str__(self) -> str:
        return self.source if self.line is None else f"{self.source}:{self.line}"

    def error(self, message: str, field: str | None = None, task_id: str | None = None) -> TaskError:
        named = f"field {field!r}: " if field else ""
        return TaskError(f"{self}: {named}{message}", source=self.source, line=self.line, field=field, task_id=task_id)


def _read_jsonl(path: str) -> Iterable[tuple[_Where, Any]]:
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below; opened here so the error names the path
    except OSError as exc:
        raise TaskError(f"cannot read the task file {path}: {exc.strerror or exc}", source=path) from None
    with f:
        # Decoded line by line, so a byte that is not UTF-8 is placed on its own line.
        for number, raw in enumerate(f, 1):
            where = _Where(path, number)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise where.error(f"not UTF-8 text ({exc.reason} at column {exc.start + 1})") from None
            if not text.strip():
                continue
            try:
                yield where, json.loads(text)
            except json.JSONDecodeError as exc:
                raise where.error(f"not valid JSON: {exc.msg} at column {exc.colno}") from None


def _kind(value: object) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), f"a {type(value).__name__}"
    )


def _string(where: _Where, item: Mapping[str, Any], field: str, *, required: bool, task_id: str | None) -> str | None:
    if field not in item or (not required and item[field] is None):
        if required:
            raise where.error("missing", field, task_id)
        return None
    value = item[field]
    if not isinstance(value, str):
        raise where.error(f"must be a string, not {_kind(value)}", field, task_id)
    return value


def _task_id(where: _Where, item: Mapping[str, Any], field: str) -> str:
    value = _string(where, item, field, required=True, task_id=None)
    assert value is not None
    if not _ID.fullmatch(value):
        raise where.error(
            f"{value!r} is not a usable id (1 to 200 of A-Z a-z 0-9 . _ @ + = : -, not starting with a dot)", field
        )
    return value


def _tests(where: _Where, item: Mapping[str, Any], field: str, task_id: str) -> list[str]:
    if field not in item:
        raise where.error("missing", field, task_id)
    value = item[field]
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise where.error("a string here must be a JSON list of test names", field, task_id) from None
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise where.error("must be a list of test names (strings), or a JSON string of one", field, task_id)
    return value


def _workdir(where: _Where, item: Mapping[str, Any], task_id: str, default: str | None) -> str | None:
    workdir = _string(where, item, "workdir", required=False, task_id=task_id)
    if workdir is None:
        return default
    if not workdir.startswith("/"):
        raise where.error(f"{workdir!r} must be an absolute path", "workdir", task_id)
    return workdir


def _local_dir(where: _Where, item: Mapping[str, Any], task_id: str, base: str) -> str | None:
    local_dir = _string(where, item, "local_dir", required=False, task_id=task_id)
    if local_dir is None:
        return None
    full = os.path.normpath(os.path.join(base, os.path.expanduser(local_dir)))
    if not os.path.isdir(full):
        raise where.error(f"{local_dir!r} is not a directory (looked for {full})", "local_dir", task_id)
    return full


def _task(where: _Where, item: Mapping[str, Any], base: str) -> Task:
    return _swebench(where, item, base) if "instance_id" in item else _generic(where, item, base)


def _swebench(where: _Where, item: Mapping[str, Any], base: str) -> Task:
    task_id = _task_id(where, item, "instance_id")
    for field in _SWE_REQUIRED[1:]:
        _string(where, item, field, required=True, task_id=task_id)
    for field in _SWE_OPTIONAL_STR:
        _string(where, item, field, required=False, task_id=task_id)
    for field in ("FAIL_TO_PASS", "PASS_TO_PASS"):
        _tests(where, item, field, task_id)
    if not item.get("eval_script") and not item.get("test_cmd"):
        raise where.error(
            "missing: grading needs the instance's eval_script (SWE-bench 5 datasets carry one) "
            "or Orchard's test_cmd (a shell command run in the repository after the test_patch)",
            "test_cmd",
            task_id,
        )
    parser = item.get("log_parser")
    if not parser:
        raise where.error(
            "missing: the name of one of swebench's log parsers, such as parse_log_pytest", "log_parser", task_id
        )
    if not _PARSER.fullmatch(parser) or parser not in _known_parsers(parser):
        raise where.error(f"{parser!r} is not one of swebench's log parsers", "log_parser", task_id)
    eval_type = item.get("eval_type")
    if eval_type is not None and eval_type not in _EVAL_TYPES:
        raise where.error(f"{eval_type!r} must be one of {', '.join(_EVAL_TYPES)}", "eval_type", task_id)
    wrong = item.get("wrong_patches")
    if wrong is not None and (not isinstance(wrong, list) or not all(isinstance(p, str) and p for p in wrong)):
        raise where.error("must be a list of non-empty patches (strings)", "wrong_patches", task_id)
    if item.get("image") == "":
        raise where.error("must not be empty (leave it out for SWE-bench's own image name)", "image", task_id)
    image = item.get("image") or swebench_image(task_id)
    local_dir = _local_dir(where, item, task_id, base)
    instance = dict(item)
    if local_dir is not None:
        instance["local_dir"] = local_dir
    return Task(
        id=task_id,
        image=image,
        instruction=item["problem_statement"],
        workdir=_workdir(where, item, task_id, SWEBENCH_WORKDIR),
        instance=instance,
        local_dir=local_dir,
    )


def _generic(where: _Where, item: Mapping[str, Any], base: str) -> Task:
    if "id" not in item:
        raise where.error("missing (or instance_id, for a SWE-bench instance)", "id")
    task_id = _task_id(where, item, "id")
    unknown = sorted(set(item) - set(_GENERIC_FIELDS))
    if unknown:
        raise where.error(
            f"not a field of a generic task (those are {', '.join(_GENERIC_FIELDS)})", unknown[0], task_id
        )
    image = _string(where, item, "image", required=True, task_id=task_id)
    assert image is not None
    if not image:
        raise where.error("must not be empty", "image", task_id)
    setup = item.get("setup", [])
    if not isinstance(setup, list) or not all(isinstance(c, str) for c in setup):
        raise where.error("must be a list of shell commands (strings)", "setup", task_id)
    return Task(
        id=task_id,
        image=image,
        instruction=_string(where, item, "instruction", required=False, task_id=task_id) or "",
        workdir=_workdir(where, item, task_id, None),
        setup=tuple(setup),
        check=_string(where, item, "check", required=False, task_id=task_id),
        local_dir=_local_dir(where, item, task_id, base),
    )


def _known_parsers(name: str) -> set[str] | tuple[str]:
    """The swebench package's log parser names, or just ``name`` when swebench is not installed (checked when grading)."""
    try:
        from swebench.harness.log_parsers import PARSER_REGISTRY  # type: ignore[import-untyped]
    except ImportError:
        return (name,)
    return set(PARSER_REGISTRY)
