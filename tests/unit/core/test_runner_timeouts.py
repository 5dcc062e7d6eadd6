"""The run's timeouts: one key per kind of wait, each read from the configuration and named by its error."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl_core.config import AsyncRLConfig, load_config
from asyncrl_core.runner.timeouts import CONTROL_TIMEOUT_S, TIMEOUT_KEYS, TimeoutKey, timed_out, timeout_of

MINI = Path(__file__).resolve().parents[3] / "examples" / "searchr1-mini.yaml"


def test_each_kind_has_its_own_key_with_a_documented_default() -> None:
    schema = AsyncRLConfig.model_json_schema()
    defaults = load_config(MINI)
    for key in TIMEOUT_KEYS:
        assert timeout_of(defaults, key) > 0
        section, _, name = key.partition(".")
        definitions = schema["$defs"]
        described = [
            definition["properties"][name].get("description", "")
            for definition in definitions.values()
            if name in definition.get("properties", {})
            and section.lower() in str(definition.get("title")).lower()
        ]
        assert described, f"{key} is not in --schema"
        assert all(described), f"{key} has no description in --schema"
    # A start-up of SGLang or the load of a 7B model takes longer than a generation request is allowed.
    startup = timeout_of(defaults, "runner.startup_timeout_s")
    assert startup > timeout_of(defaults, "rollout.request_timeout_s")


@pytest.mark.parametrize("key", TIMEOUT_KEYS)
def test_each_key_is_read_from_the_configuration(key: TimeoutKey) -> None:
    config = load_config(MINI, [f"{key}=1234.5"])
    assert timeout_of(config, key) == 1234.5
    for other in TIMEOUT_KEYS:
        if other != key:
            assert timeout_of(config, other) != 1234.5


@pytest.mark.parametrize("key", TIMEOUT_KEYS)
def test_each_error_names_what_timed_out_and_its_key(key: TimeoutKey) -> None:
    message = str(timed_out("saving a checkpoint", 12.0, key))
    assert "saving a checkpoint" in message
    assert "12 s" in message
    assert f"`{key}`" in message


def test_a_control_call_names_no_key() -> None:
    message = str(timed_out("the buffer's counts", CONTROL_TIMEOUT_S, None))
    assert "the buffer's counts" in message
    assert "_timeout_s" not in message


def test_a_timeout_must_be_positive() -> None:
    from asyncrl_core.errors import ConfigError

    for key in TIMEOUT_KEYS:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(MINI, [f"{key}=0"])
