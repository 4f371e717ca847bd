"""Validation of sandbox specs and backend configs; option errors name the option."""

from __future__ import annotations

import pytest

import orchard
from orchard._backends import LocalConfig, make_config
from orchard._spec import SandboxSpec, make_spec, quantity_bytes
from orchard.errors import ConfigError
from orchard_executor.app import Settings, create_app

pytestmark = pytest.mark.unit


def test_make_spec_takes_every_option() -> None:
    spec = make_spec(
        "python:3.12",
        {
            "cpu": "500m",
            "memory": "1Gi",
            "env": {"A": "1"},
            "workdir": "/w",
            "labels": {"team": "rl"},
            "ttl": 60,
            "idle_timeout": 5.5,
            "start_timeout": 10,
        },
    )
    assert spec == SandboxSpec(
        image="python:3.12",
        cpu="500m",
        memory="1Gi",
        env={"A": "1"},
        workdir="/w",
        labels={"team": "rl"},
        ttl=60,
        idle_timeout=5.5,
        start_timeout=10,
    )


def test_make_spec_defaults() -> None:
    spec = make_spec("img", {})
    assert spec.image == "img"
    assert spec.env == {}
    assert spec.ttl is None
    assert spec.idle_timeout == 600.0


def test_cpu_may_be_a_number() -> None:
    assert make_spec("img", {"cpu": 1.5}).cpu == 1.5


@pytest.mark.parametrize("name", ["ttl", "idle_timeout", "start_timeout"])
@pytest.mark.parametrize("value", [0, -1])
def test_durations_must_be_positive(name: str, value: float) -> None:
    with pytest.raises(ConfigError, match=name):
        make_spec("img", {name: value})


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"env": {"A": 1}}, "env"),
        ({"memory": 2}, "memory"),
        ({"ttl": "long"}, "ttl"),
        ({"labels": ["a"]}, "labels"),
        ({"tools": "codex"}, "tools"),
        ({"tools": [1]}, "tools"),
    ],
)
def test_wrongly_typed_options_are_rejected_by_name(options: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=named) as info:
        make_spec("img", options)
    assert isinstance(info.value, ValueError)


def test_a_misspelt_option_is_rejected_not_ignored() -> None:
    with pytest.raises(ConfigError, match="idle_timout"):
        make_spec("img", {"idle_timout": 5})


def test_specs_are_frozen() -> None:
    spec = make_spec("img", {})
    with pytest.raises(AttributeError):
        spec.ttl = 5  # type: ignore[misc]


def test_make_config_by_name() -> None:
    assert make_config("local", {}) == LocalConfig()
    assert make_config("local", {"root": "/r", "python": "/usr/bin/python3"}) == LocalConfig(
        root="/r", python="/usr/bin/python3"
    )


def test_a_misspelt_backend_option_is_rejected_not_ignored() -> None:
    with pytest.raises(ConfigError, match="rooot"):
        make_config("local", {"rooot": "/r"})


def test_make_config_passes_a_config_object_through() -> None:
    config = LocalConfig(root="/r")
    assert make_config(config, {}) is config


def test_options_beside_a_config_object_are_refused() -> None:
    with pytest.raises(ConfigError, match="inside the config object"):
        make_config(LocalConfig(), {"root": "/r"})


def test_an_unknown_backend_is_named() -> None:
    with pytest.raises(ConfigError, match="'nebula'"):
        make_config("nebula", {})


def test_a_wrongly_typed_backend_option_is_named() -> None:
    with pytest.raises(ConfigError, match="root"):
        make_config("local", {"root": 5})


def test_client_validates_without_starting_anything() -> None:
    with pytest.raises(ConfigError, match="max_concurrent_starts"):
        orchard.Client(max_concurrent_starts=0)
    with pytest.raises(ConfigError):
        orchard.Client("nebula")


def test_executor_refuses_a_malformed_token_hash() -> None:
    with pytest.raises(ValueError, match="64 hex digits"):
        create_app(Settings(token_sha256="ab" * 16))


@pytest.mark.parametrize(
    ("shm", "expected"),
    [
        ("96Mi", 96 * 1024**2),
        ("1Gi", 1024**3),
        ("1.5Gi", 3 * 1024**3 // 2),
        ("2G", 2 * 10**9),
        ("64k", 64_000),
        ("1048576", 1024**2),
        ("1e6", 10**6),
        (" 64Mi ", 64 * 1024**2),
        ("0.5", 1),  # rounded up to a whole byte
        ("7Ei", 7 * 1024**6),
        (str(2**63 - 1), 2**63 - 1),
    ],
)
def test_shm_is_a_quantity_of_bytes(shm: str, expected: int) -> None:
    assert make_spec("img", {"shm": shm}).shm == shm
    assert quantity_bytes("shm", shm) == expected


@pytest.mark.parametrize(
    ("shm", "says"),
    [
        ("lots", "not a quantity"),
        ("", "not a quantity"),
        ("1 Gi", "not a quantity"),
        ("1GiB", "not a quantity"),
        ("1gi", "not a quantity"),
        ("nan", "not a quantity"),
        ("0", "must be positive"),
        ("-1Gi", "must be positive"),
        ("8Ei", "too large"),
        (str(2**63), "too large"),
        ("1e400", "too large"),
    ],
)
def test_bad_shm_is_refused_by_name(shm: str, says: str) -> None:
    with pytest.raises(ConfigError, match=f"shm={shm!r}.*{says}") as info:
        make_spec("img", {"shm": shm})
    assert isinstance(info.value, ValueError)


def test_shm_must_be_a_string() -> None:
    with pytest.raises(ConfigError, match="shm"):
        make_spec("img", {"shm": 1024})
