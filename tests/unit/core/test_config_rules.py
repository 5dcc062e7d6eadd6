"""Every validation rule of the configuration, each with a configuration that breaks it.

Each test asserts that the problem names the key and says what to write instead.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl_core.config import AsyncRLConfig, derived_max_inflight_groups, load_config
from asyncrl_core.errors import ConfigError, ConfigProblem

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
MINI = EXAMPLES / "searchr1-mini.yaml"
GPU = EXAMPLES / "searchr1-gpu.yaml"
PLACEMENT = "cluster.component_placement"


def problems(path: Path, *overrides: str) -> tuple[ConfigProblem, ...]:
    with pytest.raises(ConfigError) as caught:
        load_config(path, overrides)
    return caught.value.problems


def problem_at(key: str, path: Path, *overrides: str) -> str:
    """The message of the problem at `key`, failing when the configuration is valid or lacks one there."""
    found = problems(path, *overrides)
    for problem in found:
        if problem.key == key:
            return problem.message
    raise AssertionError(f"no problem at {key!r}; problems: {[str(problem) for problem in found]}")


def warning_at(key: str, config: AsyncRLConfig) -> str:
    for warning in config.warnings:
        if warning.key == key:
            return warning.message
    raise AssertionError(f"no warning at {key!r}; warnings: {[str(warning) for warning in config.warnings]}")


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda path: path.name)
def test_every_example_is_valid(path: Path) -> None:
    config = load_config(path)
    assert config.rollout_buffer.max_inflight_groups is not None
    assert config.agentloop.task_name is not None


def test_derived_inflight_limit_of_the_issue() -> None:
    assert derived_max_inflight_groups(128, 4, 8) == 77
    config = load_config(GPU, ["rollout_buffer.max_buffered_groups=null"])
    assert config.rollout.num_instances == 4
    assert config.rollout_buffer.max_inflight_groups == 77
    # 2 x 32 is below the 77 groups in flight + 32: the derived limit leaves the engines busy.
    assert config.rollout_buffer.max_buffered_groups == 77 + 32
    assert config.rollout_buffer.max_dropped_groups_per_step == 320
    assert {
        "rollout.num_instances",
        "rollout_buffer.max_inflight_groups",
        "rollout_buffer.max_buffered_groups",
        "rollout_buffer.max_dropped_groups_per_step",
    } <= config.derived_keys


def test_explicit_values_are_kept_and_not_marked_derived() -> None:
    config = load_config(
        MINI, ["rollout_buffer.max_inflight_groups=2", "rollout_buffer.max_buffered_groups=9"]
    )
    assert config.rollout_buffer.max_inflight_groups == 2
    assert "rollout_buffer.max_inflight_groups" not in config.derived_keys
    assert "rollout_buffer.max_dropped_groups_per_step" in config.derived_keys


def test_instances_of_external_servers_are_the_urls() -> None:
    config = load_config(
        MINI,
        [
            "rollout.sglang.launch=external",
            "rollout.sglang.urls=[http://10.0.0.2:30000, http://10.0.0.3:30000]",
            "cluster.component_placement={actor: 0}",
        ],
    )
    assert config.rollout.num_instances == 2
    assert config.rollout_buffer.max_inflight_groups == derived_max_inflight_groups(16, 2, 4)


# Async-mode rules (ARCHITECTURE.md section 4).


def test_async_rejects_actor_and_rollout_on_one_device() -> None:
    message = problem_at(
        "cluster.component_placement.actor,rollout",
        MINI,
        "cluster.component_placement={'actor,rollout': 0-1}",
    )
    assert "different devices" in message
    assert "runner.async_mode: false" in message
    # Sync mode may colocate them.
    load_config(MINI, ["runner.async_mode=false", "cluster.component_placement={'actor,rollout': 0-1}"])


def test_async_needs_a_server_rollout() -> None:
    message = problem_at("rollout.sglang.backend_type", MINI, "rollout.sglang.backend_type=engine")
    assert "write `server`" in message
    load_config(MINI, ["runner.async_mode=false", "rollout.sglang.backend_type=engine"])


def test_task_name_is_required() -> None:
    message = problem_at("agentloop.task_name", MINI, "agentloop.task_name=null")
    assert "--list-tasks" in message
    assert "searchr1-mini" in message  # the installed tasks are listed


def test_placement_must_hold_actor_and_rollout() -> None:
    message = problem_at("cluster.component_placement", MINI, "cluster.component_placement={actor: 0}")
    assert "no devices for `rollout`" in message
    assert "rollout: " in message
    message = problem_at("cluster.component_placement", MINI, "cluster.component_placement={rollout: 1}")
    assert "no devices for `actor`" in message


def test_staleness_cap_below_buffer_age_is_a_warning() -> None:
    config = load_config(
        MINI, ["agentloop.max_actor_accept_staleness=1", "rollout_buffer.max_buffered_groups=8"]
    )
    message = warning_at("agentloop.max_actor_accept_staleness", config)
    assert "8/4" in message
    assert "raise it to 2" in message


def test_staleness_cap_is_not_checked_in_sync_mode() -> None:
    config = load_config(MINI, ["runner.async_mode=false", "agentloop.max_actor_accept_staleness=1"])
    assert config.warnings == ()


@pytest.mark.parametrize(
    "overrides",
    [
        ["rollout.max_running_requests=64"],
        ["cluster.num_devices=8", "cluster.component_placement={actor: 0, rollout: 1-6}"],
        ["agentloop.num_workers=3"],
    ],
)
def test_derived_values_never_warn_about_themselves(overrides: list[str]) -> None:
    # With a staleness cap, the derived buffer limit stays within it.
    config = load_config(MINI, overrides)
    assert config.warnings == ()
    assert config.rollout_buffer.max_buffered_groups == 2 * config.data.rollout_batch_size
    # Without one, it leaves room for every group in flight plus a batch.
    config = load_config(MINI, [*overrides, "~agentloop.max_actor_accept_staleness"])
    assert config.warnings == ()
    buffer = config.rollout_buffer
    assert buffer.max_inflight_groups is not None
    assert buffer.max_buffered_groups is not None
    batch = config.data.rollout_batch_size
    assert buffer.max_buffered_groups == max(2 * batch, buffer.max_inflight_groups + batch)


def test_buffer_below_inflight_plus_batch_is_a_warning() -> None:
    config = load_config(
        MINI, ["rollout_buffer.max_buffered_groups=5", "agentloop.max_actor_accept_staleness=2"]
    )
    message = warning_at("rollout_buffer.max_buffered_groups", config)
    assert "raise it to 9" in message


# Sizes and batches.


@pytest.mark.parametrize(
    "key",
    [
        "runner.num_steps",
        "data.rollout_batch_size",
        "algorithm.group_size",
        "actor.micro_batch_size",
        "rollout.max_running_requests",
        "rollout.tensor_parallel_size",
        "rollout_buffer.max_inflight_groups",
        "agentloop.num_workers",
        "data.max_response_len",
    ],
)
@pytest.mark.parametrize("value", [0, -3])
def test_sizes_must_be_positive(key: str, value: int) -> None:
    message = problem_at(key, MINI, f"{key}={value}")
    assert "greater than 0" in message
    assert f"got {value}" in message


def test_buffer_must_hold_a_batch() -> None:
    message = problem_at("rollout_buffer.max_buffered_groups", MINI, "rollout_buffer.max_buffered_groups=3")
    assert "write at least 4" in message


def test_micro_batches_must_divide_the_step() -> None:
    message = problem_at("actor.micro_batch_size", MINI, "actor.micro_batch_size=3")
    assert "16 trajectories" in message
    assert "choose one of 1, 2, 4, 8, 16" in message


def test_step_must_split_over_data_parallel_ranks() -> None:
    message = problem_at(
        "data.rollout_batch_size",
        GPU,
        "cluster.component_placement={actor: 0-2, rollout: 4-7}",
        "actor.tensor_parallel_size=1",
        "data.rollout_batch_size=31",
    )
    assert "3 data-parallel ranks" in message
    assert "multiple of 3" in message


def test_the_actor_temperature_is_the_sampling_temperature() -> None:
    config = load_config(MINI, ["rollout.sampling.temperature=0.7"])
    assert config.actor.temperature == 0.7
    assert "actor.temperature" in config.derived_keys
    # Greedy engines report the raw logprobs, at temperature 1.
    assert load_config(MINI, ["rollout.sampling.temperature=0"]).actor.temperature == 1.0
    same = load_config(MINI, ["rollout.sampling.temperature=0.7", "actor.temperature=0.7"])
    assert "actor.temperature" not in same.derived_keys


def test_an_actor_temperature_other_than_the_engines_is_refused() -> None:
    message = problem_at(
        "actor.temperature", MINI, "rollout.sampling.temperature=0.7", "actor.temperature=1.0"
    )
    assert "rollout.sampling.temperature 0.7" in message
    assert "remove the key" in message


def test_mini_batches_are_derived_and_must_divide_the_step() -> None:
    config = load_config(MINI)
    assert config.actor.ppo_mini_batch_size == config.data.rollout_batch_size
    assert config.actor.ppo_epochs == 1
    assert "actor.ppo_mini_batch_size" in config.derived_keys
    message = problem_at(
        "actor.ppo_mini_batch_size", MINI, "data.rollout_batch_size=4", "actor.ppo_mini_batch_size=3"
    )
    assert "choose one of 1, 2, 4" in message


def test_micro_batches_must_divide_a_mini_batch() -> None:
    # 2 groups of 4 per update: 8 trajectories, which micro batches of 3 do not divide.
    message = problem_at(
        "actor.micro_batch_size", MINI, "actor.ppo_mini_batch_size=2", "actor.micro_batch_size=3"
    )
    assert "trajectories of an update (actor.ppo_mini_batch_size 2" in message


def test_group_size_one_is_a_warning() -> None:
    config = load_config(MINI, ["algorithm.group_size=1", "actor.micro_batch_size=1"])
    assert "use 2 or more" in warning_at("algorithm.group_size", config)


# Placement.


def test_overlapping_placements() -> None:
    message = problem_at(
        "cluster.component_placement.rollout",
        MINI,
        "runner.async_mode=false",
        "cluster.component_placement={actor: 0-1, rollout: 1}",
    )
    assert "device 1 is also placed under `actor`" in message
    assert "list colocated components under one key (`actor,rollout: ...`)" in message
    # In async mode colocating them is no fix, so it is not offered.
    message = problem_at(f"{PLACEMENT}.rollout", MINI, f"{PLACEMENT}={{actor: 0-1, rollout: 1}}")
    assert message.endswith("give each key its own devices")


def test_placement_beyond_the_devices_present() -> None:
    message = problem_at(
        "cluster.component_placement.rollout", MINI, "cluster.component_placement.rollout=1-5"
    )
    assert "devices 2-5 are not present" in message
    assert "cluster.num_devices" in message


@pytest.mark.parametrize(
    ("text", "fix"),
    [
        ("8-3", "write `3-8`"),
        ("a-b", "`0-7`"),
        ("0,,1", "`0-7`"),
        ("1,1", "more than once"),
        ("99999999", "above"),
    ],
)
def test_malformed_device_ids(text: str, fix: str) -> None:
    message = problem_at(
        "cluster.component_placement.rollout", MINI, f"cluster.component_placement.rollout={text}"
    )
    assert fix in message


def test_unknown_component() -> None:
    message = problem_at(
        "cluster.component_placement.rolout", MINI, "cluster.component_placement={actor: 0, rolout: 1}"
    )
    assert "did you mean `rollout`" in message


def test_component_placed_twice() -> None:
    message = problem_at(
        "cluster.component_placement.rollout,reward",
        MINI,
        "cluster.num_devices=4",
        "cluster.component_placement={actor: 0, rollout: 1, 'rollout,reward': 2-3}",
    )
    assert "placed twice" in message


def test_gpu_placement_without_a_gpu_is_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    config = load_config(GPU)
    assert config.actor.backend == "megatron"
    message = warning_at("cluster.device_type", config)
    assert message.startswith(
        "`gpu` is asked for, but this machine has no visible GPU, so a launch here fails"
    )
    assert "device_type: cpu" not in message  # Megatron on CPU cores is for tests, not a suggestion
    config = load_config(GPU, ["cluster.num_devices=null"])
    assert config.cluster.num_devices is None
    assert "set `cluster.num_devices` to check it" in warning_at("cluster.device_type", config)
    torch_on_gpu = load_config(MINI, ["cluster.device_type=gpu", "cluster.num_devices=2"])
    assert "write `cluster.device_type: cpu`" in warning_at("cluster.device_type", torch_on_gpu)


def test_auto_device_type_is_derived(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    config = load_config(MINI, ["cluster.device_type=auto"])
    assert config.cluster.device_type == "cpu"
    assert "cluster.device_type" in config.derived_keys
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    config = load_config(GPU, ["cluster.device_type=auto", "cluster.num_devices=null"])
    assert (config.cluster.device_type, config.cluster.num_devices) == ("gpu", 8)


# Names, backends and lengths.


def test_unknown_task_name() -> None:
    message = problem_at("agentloop.task_name", MINI, "agentloop.task_name=serchr1")
    assert "no plugin named 'serchr1'" in message
    assert "searchr1-mini" in message


def test_task_as_module_attribute() -> None:
    load_config(
        MINI, ["agentloop.task_name=json:loads"]
    )  # importability of the attribute is checked at launch
    assert "not installed" in problem_at(
        "agentloop.task_name", MINI, "agentloop.task_name=no_such_module:Task"
    )
    assert "module:attr" in problem_at("agentloop.task_name", MINI, "agentloop.task_name=a b:c")


def test_lengths_must_fit_the_context() -> None:
    message = problem_at("rollout.context_length", MINI, "rollout.context_length=700")
    assert "512 + data.max_response_len 256 = 768" in message
    assert "raise it" in message


def test_megatron_parallel_sizes_must_divide_the_actor_devices() -> None:
    message = problem_at("actor.tensor_parallel_size", GPU, "actor.tensor_parallel_size=3")
    assert "does not divide the 4 actor devices" in message
    assert "1, 2, 4" in message


def test_megatron_runs_on_cpu_cores_tensor_parallel_but_not_pipeline_parallel() -> None:
    # On CPU cores every tensor-parallel rank shares the actor's cores: one core holds two ranks.
    config = load_config(MINI, ["actor.backend=megatron", "actor.tensor_parallel_size=2"])
    assert (config.actor.backend, config.actor.tensor_parallel_size) == ("megatron", 2)
    message = problem_at("actor.pipeline_parallel_size", GPU, "actor.pipeline_parallel_size=2")
    assert "not pipeline parallel; write 1" in message
    message = problem_at(
        "actor.sequence_parallel",
        MINI,
        "actor.backend=megatron",
        "actor.tensor_parallel_size=2",
        "actor.sequence_parallel=true",
    )
    assert "and GPUs" in message


def test_torch_actor_is_data_parallel_only() -> None:
    message = problem_at("actor.pipeline_parallel_size", MINI, "actor.pipeline_parallel_size=2")
    assert "actor.backend: megatron" in message


def test_sequence_parallel_needs_tensor_parallel() -> None:
    message = problem_at(
        "actor.sequence_parallel", GPU, "actor.sequence_parallel=true", "actor.tensor_parallel_size=1"
    )
    assert "write false" in message


def test_real_sglang_needs_gpus() -> None:
    assert "write `builtin`" in problem_at("rollout.sglang.launch", MINI, "rollout.sglang.launch=sglang")


def test_the_weight_transport_must_be_one_the_engine_kind_accepts() -> None:
    message = problem_at("rollout.sglang.weight_transport", GPU, "rollout.sglang.weight_transport=tensor")
    assert "write `distributed`" in message
    assert load_config(GPU, ["rollout.sglang.weight_transport=distributed"])
    # The built-in engine takes both.
    for transport in ("tensor", "distributed"):
        assert load_config(MINI, [f"rollout.sglang.weight_transport={transport}"])


def test_external_launch_needs_urls() -> None:
    message = problem_at("rollout.sglang.urls", MINI, "rollout.sglang.launch=external")
    assert "urls: [http://" in message


def test_urls_need_external_launch_and_must_be_urls() -> None:
    assert "launch: external" in problem_at("rollout.sglang.urls", MINI, "rollout.sglang.urls=[http://a:1]")
    message = problem_at(
        "rollout.sglang.urls[1]",
        MINI,
        "rollout.sglang.launch=external",
        "rollout.sglang.urls=[http://a:1, ftp://b]",
    )
    assert "http://host:port" in message


def test_rollout_tensor_parallel_must_divide_its_devices() -> None:
    message = problem_at("rollout.tensor_parallel_size", GPU, "rollout.tensor_parallel_size=3")
    assert "choose one of 1, 2, 4" in message


def test_num_instances_must_agree_with_the_placement() -> None:
    message = problem_at("rollout.num_instances", GPU, "rollout.num_instances=3")
    assert "give 4" in message
    assert "remove the key" in message


def test_top_k_zero() -> None:
    assert "write -1" in problem_at("rollout.sampling.top_k", MINI, "rollout.sampling.top_k=0")


def test_unknown_actor_plugin() -> None:
    message = problem_at("actor.backend", MINI, "actor.backend=deepspeed")
    assert "asyncrl.actors" in message
    assert "torch" in message


def test_unknown_rollout_backend() -> None:
    assert "asyncrl.rollout_backends" in problem_at(
        "rollout.rollout_backend", MINI, "rollout.rollout_backend=vllm"
    )


# Field errors.


def test_unknown_key_suggests_the_right_one() -> None:
    message = problem_at("rollout.pause_mod", MINI, "rollout.pause_mod=drain")
    assert "did you mean `pause_mode`" in message


def test_unknown_key_in_the_file(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(MINI.read_text().replace("  micro_batch_size: 8", "  micro_batchsize: 8"))
    message = problem_at("actor.micro_batchsize", path)
    assert "did you mean `micro_batch_size`" in message


def test_wrong_choice_names_the_choices() -> None:
    message = problem_at("rollout.pause_mode", MINI, "rollout.pause_mode=pause")
    assert "'retract', 'in_place' or 'drain'" in message


def test_every_problem_is_listed_at_once() -> None:
    found = problems(
        MINI,
        "actor.micro_batch_size=3",
        "rollout.context_length=100",
        "rollout.sglang.backend_type=engine",
        "cluster.component_placement.rollout=5",
    )
    keys = {problem.key for problem in found}
    assert keys >= {
        "actor.micro_batch_size",
        "rollout.context_length",
        "rollout.sglang.backend_type",
        "cluster.component_placement.rollout",
    }
    field_errors = problems(MINI, "runner.num_steps=0", "data.rollout_batch_size=x", "actor.lr=-1")
    assert {problem.key for problem in field_errors} == {
        "runner.num_steps",
        "data.rollout_batch_size",
        "actor.lr",
    }


def test_model_validate_raises_config_error_only() -> None:
    with pytest.raises(ConfigError) as caught:
        AsyncRLConfig.model_validate({"runner": {"num_steps": 1}})
    assert {"cluster", "data", "rollout", "actor", "algorithm"} <= {
        problem.key for problem in caught.value.problems
    }


def test_run_without_any_checkpoint_is_a_warning() -> None:
    config = load_config(MINI, ["checkpoint.save_at_end=false", "checkpoint.save_every_steps=50"])
    assert "set it to at most 32" in warning_at("checkpoint.save_every_steps", config)
    assert load_config(MINI, ["checkpoint.save_at_end=false"]).warnings == ()


def test_resume_from_must_exist(tmp_path: Path) -> None:
    absent = tmp_path / "checkpoints" / "step-10"
    message = problem_at("checkpoint.resume_from", MINI, f"checkpoint.resume_from={absent}")
    assert "is not a folder" in message
    absent.mkdir(parents=True)
    assert load_config(MINI, [f"checkpoint.resume_from={absent}"]).checkpoint.resume_from == str(absent)
    assert load_config(MINI, ["checkpoint.resume_from=latest"]).checkpoint.resume_from == "latest"


def test_grpc_transport_is_validated() -> None:
    assert load_config(MINI, ["rollout.sglang.transport=grpc"]).rollout.sglang.transport == "grpc"
    assert "http" in problem_at("rollout.sglang.transport", MINI, "rollout.sglang.transport=udp")
    assert "launch: external" in problem_at(
        "rollout.sglang.transport", GPU, "rollout.sglang.transport=grpc", "rollout.sglang.launch=sglang"
    )
    external = ("rollout.sglang.launch=external", "rollout.sglang.urls=[http://a:1, http://b:1]")
    assert "one gRPC address per URL" in problem_at(
        "rollout.sglang.grpc_urls",
        MINI,
        *external,
        "rollout.sglang.transport=grpc",
        "rollout.sglang.grpc_urls=[a:2]",
    )
    assert "host:port" in problem_at(
        "rollout.sglang.grpc_urls[1]",
        MINI,
        *external,
        "rollout.sglang.transport=grpc",
        "rollout.sglang.grpc_urls=[a:2, http://b:2]",
    )
    assert "transport: grpc" in problem_at(
        "rollout.sglang.grpc_urls", MINI, *external, "rollout.sglang.grpc_urls=[a:2, b:2]"
    )
    config = load_config(
        MINI, [*external, "rollout.sglang.transport=grpc", "rollout.sglang.grpc_urls=[a:2, b:2]"]
    )
    assert config.rollout.sglang.grpc_urls == ["a:2", "b:2"]
