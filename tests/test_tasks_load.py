"""orchard.tasks.load: SWE-bench instances and generic tasks, and every malformed input named by file, line and field."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

import orchard
from orchard import tasks
from orchard.errors import ConfigError, TaskError

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
TOYS = ROOT / "examples" / "tasks" / "swe-mini.jsonl"


def swe(**fields: Any) -> dict[str, Any]:
    """A well-formed SWE-bench instance with Orchard's grading fields; ``fields`` override (None removes)."""
    item: dict[str, Any] = {
        "instance_id": "owner__repo-1",
        "repo": "owner/repo",
        "base_commit": "0" * 40,
        "patch": "diff --git a/a.py b/a.py\n",
        "test_patch": "diff --git a/test_a.py b/test_a.py\n",
        "problem_statement": "a bug",
        "FAIL_TO_PASS": ["test_x"],
        "PASS_TO_PASS": [],
        "test_cmd": "python3 -m unittest -v",
        "log_parser": "parse_log_django",
        "image": "img:1",
    }
    item.update(fields)
    return {k: v for k, v in item.items() if v is not None}


def generic(**fields: Any) -> dict[str, Any]:
    """A well-formed generic task; ``fields`` override (None removes)."""
    item: dict[str, Any] = {"id": "t1", "image": "img:1", "instruction": "say 42", "check": "grep -qx 42"}
    item.update(fields)
    return {k: v for k, v in item.items() if v is not None}


def write(tmp_path: Path, *lines: Any) -> Path:
    """A JSONL file of ``lines``: dicts become JSON, strings are written as they are."""
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def refused(source: Any) -> TaskError:
    with pytest.raises(TaskError) as info:
        tasks.load(source)
    return info.value


# The toy tasks and the formats


def test_the_toy_tasks_load_as_swebench_instances() -> None:
    loaded = tasks.load(TOYS)
    assert len(loaded) >= 5
    assert len({t.id for t in loaded}) == len(loaded)
    for task in loaded:
        assert task.instance is not None
        assert task.image == "orchard-test/toys:latest"
        assert task.workdir == f"/toys/{task.instance['repo'].split('/')[1]}"
        assert task.instruction == task.instance["problem_statement"]
        assert task.local_dir is not None
        assert os.path.isabs(task.local_dir)
        assert os.path.isfile(os.path.join(task.local_dir, ".gitignore"))
        assert task.instance["FAIL_TO_PASS"]
        assert task.instance["PASS_TO_PASS"]
        assert task.instance["wrong_patches"]


def test_a_list_of_dicts_loads_like_a_file(tmp_path: Path) -> None:
    items = [swe(), generic()]
    from_list = tasks.load(items)
    from_file = tasks.load(write(tmp_path, *items))
    assert from_list == from_file
    assert tasks.load([]) == []


def test_tests_lists_may_be_json_strings_as_in_the_hf_datasets() -> None:
    (task,) = tasks.load([swe(FAIL_TO_PASS='["a", "b"]', PASS_TO_PASS="[]")])
    assert task.instance is not None
    assert task.instance["FAIL_TO_PASS"] == '["a", "b"]'


def test_a_swebench_instance_without_image_gets_swebench_s_own_image_name() -> None:
    from swebench.image_builder.image_spec import ImageSpec
    from swebench.task.checks import expected_image

    (task,) = tasks.load([swe(instance_id="django__django-11099", image=None)])
    assert task.image == "swebench/sweb.eval.x86_64.django_1776_django-11099:latest"
    assert task.image == expected_image("django__django-11099")
    assert task.image == ImageSpec("django__django-11099", "FROM x", namespace="swebench").name
    assert task.workdir == "/testbed"


def test_an_instance_with_its_own_eval_script_needs_no_test_cmd() -> None:
    (task,) = tasks.load([swe(test_cmd=None, eval_script="pytest -rA", log_parser="parse_log_pytest")])
    assert task.instance is not None
    assert task.instance["eval_script"] == "pytest -rA"


def test_generic_task_fields(tmp_path: Path) -> None:
    (tmp_path / "repo").mkdir()
    (task,) = tasks.load(write(tmp_path, generic(setup=["echo a", "echo b"], workdir="/w", local_dir="repo")))
    assert task == orchard.tasks.Task(
        id="t1",
        image="img:1",
        instruction="say 42",
        workdir="/w",
        setup=("echo a", "echo b"),
        check="grep -qx 42",
        local_dir=str(tmp_path / "repo"),
    )


def test_blank_lines_are_skipped_and_still_counted(tmp_path: Path) -> None:
    err = refused(write(tmp_path, generic(), "", "   ", "{not json"))
    assert err.line == 4


# Malformed input: the file, the line and the field, in the message and as attributes


def test_task_error_is_a_config_error() -> None:
    assert issubclass(TaskError, ConfigError)
    assert issubclass(TaskError, ValueError)


def test_a_line_that_is_not_json(tmp_path: Path) -> None:
    path = write(tmp_path, swe(), '{"instance_id": "x",')
    err = refused(path)
    assert str(err).startswith(f"{path}:2: not valid JSON")
    assert (err.source, err.line, err.field) == (str(path), 2, None)


@pytest.mark.parametrize(("line", "kind"), [("[1, 2]", "a list"), ('"text"', "a string"), ("null", "null")])
def test_a_line_that_is_not_an_object(tmp_path: Path, line: str, kind: str) -> None:
    path = write(tmp_path, line)
    assert str(refused(path)) == f"{path}:1: a task must be a JSON object (a dict), not {kind}"


@pytest.mark.parametrize("field", ["repo", "base_commit", "patch", "test_patch", "problem_statement"])
def test_a_missing_swebench_field(tmp_path: Path, field: str) -> None:
    path = write(tmp_path, generic(), swe(**{field: None}))
    err = refused(path)
    assert str(err) == f"{path}:2: field {field!r}: missing"
    assert (err.line, err.field, err.task_id) == (2, field, "owner__repo-1")


@pytest.mark.parametrize("field", ["repo", "base_commit", "patch", "image", "workdir", "test_cmd", "version"])
def test_a_swebench_field_of_the_wrong_type(tmp_path: Path, field: str) -> None:
    path = write(tmp_path, swe(**{field: 7}))
    assert str(refused(path)) == f"{path}:1: field {field!r}: must be a string, not a int"


@pytest.mark.parametrize("field", ["FAIL_TO_PASS", "PASS_TO_PASS"])
@pytest.mark.parametrize(
    ("value", "message"),
    [
        (None, "missing"),
        ("test_x", "a string here must be a JSON list of test names"),
        ('{"a": 1}', "must be a list of test names (strings), or a JSON string of one"),
        (["a", 3], "must be a list of test names (strings), or a JSON string of one"),
        (5, "must be a list of test names (strings), or a JSON string of one"),
    ],
)
def test_bad_test_lists(tmp_path: Path, field: str, value: Any, message: str) -> None:
    path = write(tmp_path, swe(**{field: value}))
    err = refused(path)
    assert str(err) == f"{path}:1: field {field!r}: {message}"
    assert err.field == field


def test_an_instance_with_no_way_to_run_its_tests(tmp_path: Path) -> None:
    err = refused(write(tmp_path, swe(test_cmd=None)))
    assert err.field == "test_cmd"
    assert "eval_script" in str(err)
    assert ":1:" in str(err)


def test_a_log_parser_missing_or_unknown_to_swebench(tmp_path: Path) -> None:
    assert refused(write(tmp_path, swe(log_parser=None))).field == "log_parser"
    err = refused(write(tmp_path, swe(log_parser="parse_log_nonesuch")))
    assert str(err).endswith("field 'log_parser': 'parse_log_nonesuch' is not one of swebench's log parsers")


def test_an_unknown_eval_type(tmp_path: Path) -> None:
    err = refused(write(tmp_path, swe(eval_type="mostly")))
    assert str(err).endswith("field 'eval_type': 'mostly' must be one of pass_and_fail, fail_only")


@pytest.mark.parametrize("value", ["a patch", [""], [3]])
def test_bad_wrong_patches(tmp_path: Path, value: Any) -> None:
    assert refused(write(tmp_path, swe(wrong_patches=value))).field == "wrong_patches"


def test_an_empty_image(tmp_path: Path) -> None:
    assert refused(write(tmp_path, swe(image=""))).field == "image"
    assert refused(write(tmp_path, generic(image=""))).field == "image"


@pytest.mark.parametrize("bad", ["", "a/b", "../x", ".hidden", "sp ace", "x" * 201, "tab\t"])
def test_ids_that_cannot_name_a_file(tmp_path: Path, bad: str) -> None:
    err = refused(write(tmp_path, swe(instance_id=bad)))
    assert err.field == "instance_id"
    assert "not a usable id" in str(err)
    assert refused(write(tmp_path, generic(id=bad))).field == "id"


def test_an_id_of_the_wrong_type(tmp_path: Path) -> None:
    path = write(tmp_path, swe(instance_id=12))
    assert str(refused(path)) == f"{path}:1: field 'instance_id': must be a string, not a int"


def test_a_duplicate_id_names_both_lines(tmp_path: Path) -> None:
    path = write(tmp_path, swe(), generic(), swe(patch="other"))
    err = refused(path)
    assert str(err) == f"{path}:3: field 'instance_id': duplicate id 'owner__repo-1', first at {path}:1"
    assert (err.line, err.task_id) == (3, "owner__repo-1")


def test_a_duplicate_id_across_the_two_kinds(tmp_path: Path) -> None:
    err = refused([swe(instance_id="same"), generic(id="same")])
    assert str(err) == "tasks[1]: field 'id': duplicate id 'same', first at tasks[0]"


def test_a_generic_task_without_an_id(tmp_path: Path) -> None:
    assert (
        str(refused([generic(id=None)])) == "tasks[0]: field 'id': missing (or instance_id, for a SWE-bench instance)"
    )


def test_a_generic_task_with_an_unknown_field(tmp_path: Path) -> None:
    path = write(tmp_path, generic(chek="true"))
    err = refused(path)
    assert str(err).startswith(f"{path}:1: field 'chek': not a field of a generic task")


@pytest.mark.parametrize(
    ("field", "value"),
    [("image", None), ("image", 3), ("setup", "echo hi"), ("setup", ["ok", 1]), ("check", ["true"])],
)
def test_generic_fields_missing_or_mistyped(tmp_path: Path, field: str, value: Any) -> None:
    err = refused(write(tmp_path, generic(**{field: value})))
    assert (err.line, err.field) == (1, field)


def test_a_relative_workdir(tmp_path: Path) -> None:
    path = write(tmp_path, swe(workdir="testbed"))
    assert str(refused(path)) == f"{path}:1: field 'workdir': 'testbed' must be an absolute path"


def test_a_local_dir_that_is_not_a_directory(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    for value in ("nowhere", "file"):
        err = refused(write(tmp_path, swe(local_dir=value)))
        assert err.field == "local_dir"
        assert str(tmp_path / value) in str(err)


def test_a_local_dir_is_taken_from_the_file_s_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "repo").mkdir()
    monkeypatch.chdir(ROOT)
    (task,) = tasks.load(write(tmp_path, swe(local_dir="repo")))
    assert task.local_dir == str(tmp_path / "repo")
    assert task.instance is not None
    assert task.instance["local_dir"] == str(tmp_path / "repo")


def test_text_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_bytes(json.dumps(generic()).encode() + b"\n" + b'{"id": "\xff"}\n')
    err = refused(path)
    assert err.line == 2
    assert "not UTF-8" in str(err)


def test_a_file_that_cannot_be_read_or_holds_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "none.jsonl"
    assert str(refused(missing)) == f"cannot read the task file {missing}: No such file or directory"
    assert str(refused(write(tmp_path, "", " "))) == f"{tmp_path / 'tasks.jsonl'}: holds no tasks"


def test_one_dict_instead_of_a_list() -> None:
    assert "not one dict" in str(refused(generic()))  # type: ignore[arg-type]


def test_list_entries_are_named_by_index() -> None:
    err = refused([generic(id="a"), generic(id="b"), swe(base_commit=None)])
    assert str(err) == "tasks[2]: field 'base_commit': missing"
    assert (err.source, err.line) == ("tasks[2]", None)
