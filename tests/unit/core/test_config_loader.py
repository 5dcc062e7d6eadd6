"""YAML loading: interpolation, overrides, the rendered resolved configuration, the JSON Schema, and that
importing the configuration stays light."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from asyncrl_core.config import AsyncRLConfig, load_config, render_yaml
from asyncrl_core.config.loader import default_config_text
from asyncrl_core.errors import ConfigError

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
MINI = EXAMPLES / "searchr1-mini.yaml"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def mini_with(tmp_path: Path, old: str, new: str) -> Path:
    text = MINI.read_text()
    assert old in text
    return write(tmp_path, text.replace(old, new))


def only_problem(path: Path | None, *overrides: str) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(path, overrides)
    assert len(caught.value.problems) == 1, caught.value.problems
    return str(caught.value.problems[0])


def test_embedded_default_is_the_mini_example() -> None:
    assert default_config_text() == MINI.read_text()
    assert load_config(None) == load_config(MINI)


def test_sync_example_is_the_default_in_sync_mode() -> None:
    sync = load_config(EXAMPLES / "searchr1-mini-sync.yaml")
    assert sync == load_config(None, ["runner.async_mode=false", "runner.name=searchr1-mini-sync"])


def test_whole_reference_keeps_its_type(tmp_path: Path) -> None:
    path = mini_with(tmp_path, "    max_new_tokens: 48", "    max_new_tokens: ${data.max_response_len}")
    assert load_config(path).rollout.sampling.max_new_tokens == 256


def test_reference_inside_text_and_escape(tmp_path: Path) -> None:
    replacement = "  name: run-s${runner.seed}\n  run_dir: out/\\${literal}/${runner.name}"
    path = mini_with(tmp_path, "  name: searchr1-mini", replacement)
    config = load_config(path)
    assert config.runner.name == "run-s1"
    assert config.runner.run_dir == "out/${literal}/run-s1"


def test_reference_to_a_default(tmp_path: Path) -> None:
    path = mini_with(tmp_path, "  name: searchr1-mini", "  name: ${actor.optimizer}")
    assert load_config(path).runner.name == "adamw"


def test_overrides_feed_interpolation() -> None:
    config = load_config(MINI, ["actor.model_path=/models/tiny"])
    assert config.rollout.model_path == "/models/tiny"


def test_unknown_reference_names_the_key(tmp_path: Path) -> None:
    path = mini_with(tmp_path, "  model_path: ${actor.model_path}", "  model_path: ${actor.model}")
    message = only_problem(path)
    assert message.startswith("rollout.model_path: `${actor.model}` cannot be resolved")
    assert "did you mean `model_path`" in message


def test_reference_to_unset_key_without_default(tmp_path: Path) -> None:
    path = mini_with(tmp_path, "  num_steps: 32", "  run_dir: run-${runner.num_steps}")
    message = only_problem(path)
    assert message.startswith("runner.run_dir: `${runner.num_steps}` cannot be resolved")
    assert "has no default" in message


def test_interpolation_cycle(tmp_path: Path) -> None:
    path = mini_with(tmp_path, "  model_path: tiny-llama:small", "  model_path: ${rollout.model_path}")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    # Both keys of the cycle are named.
    assert {problem.key for problem in caught.value.problems} == {"actor.model_path", "rollout.model_path"}
    assert all("interpolation cycle" in problem.message for problem in caught.value.problems)


def test_environment_variable_resolver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCRL_TEST_MODEL", "/models/tiny")
    assert load_config(MINI, ["actor.model_path=${oc.env:ASYNCRL_TEST_MODEL}"]).actor.model_path == (
        "/models/tiny"
    )


def test_every_unresolvable_reference_is_reported(tmp_path: Path) -> None:
    path = mini_with(tmp_path, "  name: searchr1-mini", "  name: ${runner.nme}\n  run_dir: ${data.dataset_x}")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert [problem.key for problem in caught.value.problems] == ["runner.name", "runner.run_dir"]


def test_section_inside_text_is_refused(tmp_path: Path) -> None:
    path = mini_with(tmp_path, "  name: searchr1-mini", "  name: x${cluster}")
    assert message_key(only_problem(path)) == "runner.name"


def message_key(message: str) -> str:
    return message.split(":", 1)[0]


def test_override_of_unknown_key_suggests() -> None:
    message = only_problem(MINI, "rollout.pausemode=drain")
    assert message.startswith("rollout.pausemode: unknown key `pausemode` in rollout")
    assert "did you mean `pause_mode`" in message


def test_override_below_a_value_is_refused() -> None:
    assert "is a value, not a section" in only_problem(MINI, "runner.seed.x=1")


def test_override_value_that_is_not_yaml() -> None:
    message = only_problem(MINI, "rollout.sglang.urls=[http://a:1")
    assert message.startswith("rollout.sglang.urls: cannot read the value")


def test_override_without_equals() -> None:
    assert "is not `key=value`" in only_problem(MINI, "runner.seed")


def test_all_bad_overrides_are_reported_together() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(MINI, ["runner.sed=1", "actor.lr=[", "nothing"])
    assert [problem.key for problem in caught.value.problems] == ["runner.sed", "actor.lr", "nothing"]


def test_override_values_are_yaml() -> None:
    config = load_config(
        MINI,
        [
            "actor.lr=3e-6",
            "logging.tensorboard=false",
            "agentloop.task_args={split: dev, top_k: 3}",
            "rollout.sglang.extra_args.mem_fraction_static=0.7",
        ],
    )
    assert config.actor.lr == 3e-6
    assert config.logging.tensorboard is False
    assert config.agentloop.task_args == {"split": "dev", "top_k": 3}
    assert config.rollout.sglang.extra_args == {"mem_fraction_static": 0.7}


def test_override_into_a_scalar_in_the_file(tmp_path: Path) -> None:
    path = mini_with(tmp_path, "checkpoint:\n  save_every_steps: 16\n  keep_last: 2", "checkpoint: 3")
    message = only_problem(path, "checkpoint.keep_last=4")
    assert message.startswith("checkpoint: holds 3 in the file")


def test_repeated_yaml_key_is_an_error(tmp_path: Path) -> None:
    path = mini_with(tmp_path, "  num_steps: 32", "  num_steps: 32\n  num_steps: 30")
    message = only_problem(path)
    assert message.startswith(f"{path}, line 15, column 3: found duplicate key num_steps")


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = mini_with(tmp_path, "  max_actor_accept_staleness: 2", "  max_actor_accept_staleness: [2")
    message = only_problem(path)
    assert message.startswith(f"{path}, line ")
    assert "\n" not in message


def test_override_removes_a_key_so_its_default_applies() -> None:
    config = load_config(
        MINI, ["~agentloop.max_actor_accept_staleness", "~rollout.model_path", "~checkpoint"]
    )
    assert config.agentloop.max_actor_accept_staleness is None
    assert config.rollout.model_path == "tiny-llama:small"
    assert "rollout.model_path" in config.derived_keys
    assert config.checkpoint.save_every_steps is None
    assert "takes no value" in only_problem(MINI, "~runner.seed=1")
    assert "unknown key `sed`" in only_problem(MINI, "~runner.sed")


def test_a_mapping_override_replaces_the_section() -> None:
    config = load_config(
        MINI, ["runner.async_mode=false", "cluster.component_placement={'actor,rollout': 0}"]
    )
    assert config.cluster.component_placement == {"actor,rollout": "0"}


def test_empty_section_takes_the_defaults(tmp_path: Path) -> None:
    path = mini_with(tmp_path, "checkpoint:\n  save_every_steps: 16\n  keep_last: 2", "checkpoint:")
    assert load_config(path).checkpoint.keep_last == 2
    path = mini_with(tmp_path, "  name: searchr1-mini\n  async_mode: true\n  num_steps: 32\n  seed: 1\n", "")
    assert only_problem(path) == "runner.num_steps: required key is missing"


# Strict types: a value of the wrong type is refused, never converted.


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("runner.num_steps=true", "runner.num_steps"),
        ("runner.seed='3'", "runner.seed"),
        ("actor.lr=true", "actor.lr"),
        ("actor.lr='0.001'", "actor.lr"),
        ("logging.tensorboard='yes'", "logging.tensorboard"),
        ("logging.tensorboard=1", "logging.tensorboard"),
        ("rollout.max_running_requests=8.0", "rollout.max_running_requests"),
    ],
)
def test_values_are_not_converted_between_types(override: str, key: str) -> None:
    message = only_problem(MINI, override)
    assert message.startswith(f"{key}: ")
    assert "(got " in message


@pytest.mark.parametrize("text", ["1e-6", "1.0e-6", "'1e-6'", '"1E-6"', "1e-06"])
def test_exponent_form_is_a_float(tmp_path: Path, text: str) -> None:
    path = mini_with(tmp_path, "  lr: 1.0e-4", f"  lr: {text}")
    assert load_config(path).actor.lr == pytest.approx(1e-6)
    assert load_config(MINI, [f"actor.lr={text}"]).actor.lr == pytest.approx(1e-6)
    direct = yaml.safe_load(path.read_text())  # PyYAML alone reads `1e-6` as text
    direct["rollout"]["model_path"] = "tiny-llama:small"
    assert AsyncRLConfig.model_validate(direct).actor.lr == pytest.approx(1e-6)


def test_an_integer_is_a_float() -> None:
    assert load_config(MINI, ["rollout.sampling.temperature=1"]).rollout.sampling.temperature == 1.0


def test_nested_server_argument_is_one_problem() -> None:
    message = only_problem(MINI, "rollout.sglang.extra_args={mem: {fraction: 0.8}}")
    assert message.startswith("rollout.sglang.extra_args.mem: an extra server argument is text, a number")


@pytest.mark.parametrize("text", ["- a\n- b\n", "just text", "runner: [1\n", "!!python/object:os.system {}"])
def test_files_that_are_not_a_configuration(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError):
        load_config(write(tmp_path, text))


def test_missing_file(tmp_path: Path) -> None:
    assert "cannot read the configuration file" in only_problem(tmp_path / "absent.yaml")


def test_render_marks_derived_values_and_round_trips(tmp_path: Path) -> None:
    config = load_config(MINI)
    text = render_yaml(config)
    assert "  max_inflight_groups: 5  # derived\n" in text
    assert "  max_buffered_groups: 8  # derived\n" in text
    assert "  num_steps: 32\n" in text
    again = load_config(write(tmp_path, text))
    assert again.model_dump() == config.model_dump()
    assert again.derived_keys == frozenset()  # every value is explicit now
    assert yaml.safe_load(text) == config.model_dump(mode="json")


def test_configuration_pickles_with_its_derived_keys_and_warnings() -> None:
    # Ray sends the configuration to every worker by pickling it.
    config = load_config(
        MINI, ["agentloop.max_actor_accept_staleness=1", "rollout_buffer.max_buffered_groups=8"]
    )
    copy = pickle.loads(pickle.dumps(config))
    assert copy == config
    assert copy.derived_keys == config.derived_keys
    assert copy.warnings == config.warnings != ()


def test_configuration_is_frozen() -> None:
    config = load_config(MINI)
    with pytest.raises(ValidationError):
        config.runner.num_steps = 3  # pyright: ignore[reportAttributeAccessIssue]


def test_schema_describes_every_field() -> None:
    schema = AsyncRLConfig.model_json_schema()
    rollout = schema["$defs"]["RolloutConfig"]["properties"]
    assert "SGLang" in json.dumps(schema["$defs"]["SGLangConfig"])
    assert rollout["pause_mode"]["enum"] == ["retract", "in_place", "drain"]
    undocumented = [
        f"{name}.{field}"
        for name, definition in schema["$defs"].items()
        for field, spec in definition.get("properties", {}).items()
        if not spec.get("description")
    ]
    assert undocumented == []


def test_schema_lets_an_editor_accept_the_examples() -> None:
    schema = AsyncRLConfig.model_json_schema()
    placement = schema["$defs"]["ClusterConfig"]["properties"]["component_placement"]["additionalProperties"]
    assert {"string", "integer", "array"} == {option["type"] for option in placement["anyOf"]}
    # A torch or megatron actor section matches only its own member of the union (oneOf).
    plugin_backend = schema["$defs"]["PluginActorConfig"]["properties"]["backend"]
    assert plugin_backend["not"] == {"enum": ["torch", "megatron"]}
    assert schema["$defs"]["TorchActorConfig"]["properties"]["backend"]["const"] == "torch"


def test_importing_the_configuration_is_light() -> None:
    code = (
        "import sys, asyncrl_core.config, asyncrl_core.plugins, asyncrl_core.cli\n"
        "heavy = ('torch', 'ray', 'transformers', 'megatron', 'sglang', 'numpy')\n"
        "print(','.join(name for name in heavy if name in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == ""
