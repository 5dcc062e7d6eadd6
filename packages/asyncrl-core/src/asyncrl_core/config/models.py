"""The configuration of a run, as frozen pydantic models: one section per component.

Every field has a docstring, which is also its description in the JSON Schema (`asyncrl-run --schema`).
Fields whose default is `None` and whose docstring says *derived* are computed once, when the root model
is validated, from other keys; the resolved configuration holds the computed value and
`AsyncRLConfig.derived_keys` names them (the dry run marks them `# derived`). The cross-field rules live in
one validator on the root model (`AsyncRLConfig`), which reports every problem at once as a
`asyncrl_core.errors.ConfigError` with dotted key paths.

This module imports only pydantic and the standard library.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    JsonValue,
    ModelWrapValidatorHandler,
    PrivateAttr,
    Tag,
    ValidationError,
    WithJsonSchema,
    model_validator,
)

from asyncrl_core.config.placement import MAX_DEVICE_ID, parse_device_ids
from asyncrl_core.errors import ConfigError, ConfigProblem

PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]


def _device_ids_as_text(value: object) -> object:
    """Let YAML write `actor: 3` or `actor: [0, 2]` as well as `actor: "0-7"`."""
    if isinstance(value, bool):
        return value  # rejected by the str type, with the input shown
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list) and all(
        isinstance(item, int) and not isinstance(item, bool)
        for item in value  # pyright: ignore[reportUnknownVariableType]
    ):
        return ",".join(str(item) for item in value)  # pyright: ignore[reportUnknownArgumentType]
    return value


ServerArgument = str | int | float | bool
"""The value of one extra server argument."""

_DEVICE_IDS_SCHEMA: dict[str, JsonValue] = {
    "anyOf": [
        {"type": "string", "pattern": r"^\s*\d+(\s*-\s*\d+)?(\s*,\s*\d+(\s*-\s*\d+)?)*\s*$"},
        {"type": "integer", "minimum": 0},
        {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
    ]
}

DeviceIds = Annotated[
    str, BeforeValidator(_device_ids_as_text), WithJsonSchema(_DEVICE_IDS_SCHEMA, mode="validation")
]
"""Device ids as text: `0-7` (a range, both ends included), `0,2,4`, `3`, or a mix such as `0-3,6`."""


class Section(BaseModel):
    """Base of every configuration model: unknown keys are errors, values are frozen, NaN/inf rejected."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=True,
        allow_inf_nan=False,
        validate_default=True,
    )


class RunnerConfig(Section):
    """How the run is driven: mode, length, seed and where its outputs go."""

    async_mode: bool = False
    """Overlap rollout and training: the actor trains while the engines keep generating. False takes
    turns."""
    num_steps: PositiveInt
    """Training steps (actor optimiser steps) to run."""
    seed: Annotated[int, Field(ge=0, le=2**32 - 1)] = 0
    """Seed of every random number generator of the run (workers derive theirs from it)."""
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=200)] = "asyncrl"
    """Name of the run: letters, digits, `.`, `_` and `-`; names the run folder unless `run_dir` is set."""
    run_dir: Annotated[str, Field(min_length=1)] | None = None
    """Folder for `config.yaml`, `warnings.log`, metrics, TensorBoard events and checkpoints.
    Derived: `runs/<name>`, relative to the working directory."""


class ClusterConfig(Section):
    """Which devices each component runs on."""

    component_placement: dict[str, DeviceIds]
    """Device ids per component, e.g. `actor: 0-3` and `rollout: 4-7`; a key may name several components
    that share the devices (`rollout,reward: 8-15`). Components: `actor`, `rollout`, `reward`. Ids are GPU
    ids when `device_type` is `gpu`, CPU core ids when it is `cpu`."""
    device_type: Literal["gpu", "cpu", "auto"] = "auto"
    """Whether placement ids are GPUs or CPU cores. Derived from `auto`: `gpu` where a GPU is visible
    (`CUDA_VISIBLE_DEVICES` or `nvidia-smi -L`), else `cpu`."""
    num_devices: Annotated[int, Field(gt=0, le=MAX_DEVICE_ID + 1)] | None = None
    """Number of devices the ids index (ids run from 0 to `num_devices - 1`). Derived: the GPUs visible
    here, or `os.cpu_count()` for CPU cores; stays unset when GPUs are asked for and none is visible (a dry
    run then skips the device-count checks with a warning; a launch fails)."""

    def devices_of(self, component: str) -> tuple[int, ...]:
        """The sorted device ids of `component`, gathered from every placement key that names it."""
        ids: set[int] = set()
        for key, text in self.component_placement.items():
            if component in (name.strip() for name in key.split(",")):
                ids.update(parse_device_ids(text))
        return tuple(sorted(ids))


class DataConfig(Section):
    """The prompts: how many per step, from which dataset, and how long prompt and response may be."""

    rollout_batch_size: PositiveInt
    """Groups per training step (B): the actor trains on `rollout_batch_size * algorithm.group_size`
    trajectories per step."""
    dataset: str | None = None
    """Dataset of the task (a name or path the task understands); unset uses the task's own default."""
    split: str = "train"
    """Split of the dataset to train on."""
    shuffle: bool = True
    """Shuffle the prompts at every epoch."""
    seed: Annotated[int, Field(ge=0, le=2**32 - 1)] | None = None
    """Seed of the shuffle. Derived: `runner.seed`."""
    max_prompt_len: PositiveInt = 1024
    """Longest prompt in tokens (system prompt and question, chat template applied); longer prompts are
    skipped by the dataloader."""
    max_response_len: PositiveInt = 1024
    """Most response tokens of one trajectory, summed over all turns (model and tool tokens alike)."""


class SGLangConfig(Section):
    """How the SGLang-protocol engines are reached or started."""

    backend_type: Literal["server", "engine"] = "server"
    """`server`: engines behind the SGLang HTTP protocol (required in async mode). `engine`: an in-process
    engine object, sync mode only."""
    launch: Literal["builtin", "sglang", "external"] = "builtin"
    """`builtin`: asyncrl's torch engine serving the SGLang routes (CPU or GPU). `sglang`: start real
    SGLang servers on the rollout devices. `external`: use the servers at `urls`, started by someone else."""
    urls: list[str] = Field(default_factory=list[str])
    """Base URLs of external servers (`http://host:port`), one per engine instance; `launch: external`
    only."""
    api_key: str | None = None
    """Bearer token the servers expect, if any."""
    host: str = "127.0.0.1"
    """Address launched servers bind to. Loopback unless the engines must be reached from other nodes."""
    base_port: Annotated[int, Field(ge=1024, le=65535)] = 30000
    """First port of launched servers; instance `i` listens on `base_port + i` (or the next free port)."""
    extra_args: dict[str, ServerArgument] = Field(default_factory=dict[str, ServerArgument])
    """Extra server arguments for `launch: sglang`, e.g. `mem_fraction_static: 0.8` (`--mem-fraction-static
    0.8`); `true` passes a bare flag."""


class SamplingConfig(Section):
    """Sampling of each model turn, as SGLang's `sampling_params` names it."""

    temperature: Annotated[float, Field(ge=0.0)] = 1.0
    """Softmax temperature; 0 samples greedily (RL normally keeps 1.0 so logprobs match the policy)."""
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    """Nucleus sampling mass; 1.0 keeps the whole distribution."""
    top_k: Annotated[int, Field(ge=-1)] = -1
    """Sample from the `top_k` most likely tokens; -1 keeps all (0 is not allowed)."""
    max_new_tokens: PositiveInt | None = None
    """Most tokens of one model turn. Derived: `data.max_response_len`."""


class RolloutConfig(Section):
    """The rollout engines: backend, model, number of instances, and how they pause for weight syncs."""

    rollout_backend: Annotated[str, Field(min_length=1)] = "sglang"
    """Engine family: `sglang` (built in), a name in the entry-point group `asyncrl.rollout_backends`, or
    `module:attr`."""
    sglang: SGLangConfig = Field(default_factory=SGLangConfig)
    """Settings of the `sglang` backend."""
    backend_args: dict[str, JsonValue] = Field(default_factory=dict[str, JsonValue])
    """Arguments passed to a plugin rollout backend's factory; unused by `sglang`."""
    model_path: str | None = None
    """Model the engines serve at start (a HuggingFace folder, or `smollm2-135m`). Derived:
    `actor.model_path`."""
    max_running_requests: PositiveInt
    """Requests one engine instance decodes at once."""
    tensor_parallel_size: PositiveInt = 1
    """Devices per engine instance."""
    num_instances: PositiveInt | None = None
    """Engine instances. Derived: the `rollout` devices of the placement divided by
    `tensor_parallel_size`, or the number of `sglang.urls` for `launch: external`."""
    pause_mode: Literal["retract", "in_place", "drain"] = "retract"
    """What in-flight requests do during a weight sync: `retract` (requeue, keep tokens, recompute KV),
    `in_place` (freeze, keep KV, resume with new weights) or `drain` (finish first, then sync)."""
    context_length: PositiveInt | None = None
    """Most tokens of one sequence (prompt plus whole response) the engines accept. Derived:
    `data.max_prompt_len + data.max_response_len`."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """Sampling settings of every model turn."""
    request_timeout_s: Annotated[float, Field(gt=0.0)] = 600.0
    """Seconds one generation request may take, pauses for weight syncs included."""


class ActorCommon(Section):
    """Settings every actor backend shares."""

    model_path: Annotated[str, Field(min_length=1)]
    """Model to train: a HuggingFace folder, or `smollm2-135m` for the offline SmolLM2-135M-Instruct from
    `asyncrl_core.models.smollm2_135m()`."""
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Parameter and compute dtype (the optimiser keeps float32 master weights with bfloat16)."""
    micro_batch_size: PositiveInt = 1
    """Trajectories per forward/backward pass on one data-parallel rank; gradients accumulate over the
    micro batches of a step."""
    optimizer: Literal["adamw", "sgd"] = "adamw"
    """Optimiser."""
    lr: Annotated[float, Field(gt=0.0)] = 1e-6
    """Learning rate."""
    weight_decay: Annotated[float, Field(ge=0.0)] = 0.0
    """Decoupled weight decay (AdamW) or L2 penalty (SGD)."""
    adam_beta1: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.9
    """Adam's first-moment decay."""
    adam_beta2: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.999
    """Adam's second-moment decay."""
    adam_eps: Annotated[float, Field(gt=0.0)] = 1e-8
    """Adam's denominator epsilon."""
    grad_clip: Annotated[float, Field(ge=0.0)] = 1.0
    """Largest global gradient L2 norm; larger gradients are scaled down to it. 0 turns clipping off."""
    tensor_parallel_size: PositiveInt = 1
    """Devices a layer is split over (Megatron only; the torch actor needs 1)."""
    pipeline_parallel_size: PositiveInt = 1
    """Pipeline stages (Megatron only; the torch actor needs 1)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass, trading compute for memory."""
    weight_export_bucket_mb: PositiveInt = 512
    """Size of one bucket of weights sent to the engines after each step, in MiB."""


class TorchActorConfig(ActorCommon):
    """The PyTorch actor (asyncrl_core): data parallel over its devices, CPU or GPU."""

    backend: Literal["torch"] = "torch"
    """Training backend."""


class MegatronActorConfig(ActorCommon):
    """The Megatron-Core actor (asyncrl_megatron): tensor, pipeline and data parallel, GPUs only."""

    backend: Literal["megatron"] = "megatron"
    """Training backend."""
    sequence_parallel: bool = False
    """Split layer norms and dropout over the tensor-parallel group (needs `tensor_parallel_size > 1`)."""
    use_distributed_optimizer: bool = True
    """Shard optimiser state over the data-parallel group."""


class PluginActorConfig(ActorCommon):
    """An actor from the entry-point group `asyncrl.actors`, or `module:attr`."""

    # The schema excludes the built-in names, so an editor matches exactly one member of the union.
    backend: Annotated[str, Field(min_length=1, json_schema_extra={"not": {"enum": ["torch", "megatron"]}})]
    """A name in the entry-point group `asyncrl.actors`, or `module:attr` of the actor factory."""
    backend_args: dict[str, JsonValue] = Field(default_factory=dict[str, JsonValue])
    """Arguments passed to the plugin actor's factory."""


def _actor_tag(value: Any) -> str | None:
    """The union member of an actor section: `torch` when `backend` is absent, `plugin` for other names."""
    backend = value.get("backend", "torch") if isinstance(value, dict) else getattr(value, "backend", None)
    if not isinstance(backend, str) or not backend:
        return None
    return backend if backend in ("torch", "megatron") else "plugin"


ActorConfig = Annotated[
    Annotated[TorchActorConfig, Tag("torch")]
    | Annotated[MegatronActorConfig, Tag("megatron")]
    | Annotated[PluginActorConfig, Tag("plugin")],
    Discriminator(
        _actor_tag,
        custom_error_type="invalid_actor_backend",
        custom_error_message="actor.backend must be `torch`, `megatron`, an `asyncrl.actors` name or "
        "`module:attr`",
    ),
]
"""The actor section, chosen by `backend` (default `torch`)."""


class AlgorithmConfig(Section):
    """The policy-gradient objective: group-relative advantages, a clipped surrogate, optional KL/entropy."""

    group_size: PositiveInt
    """Trajectories per prompt; advantages are relative to the group's mean reward."""
    normalize_advantage_std: bool = True
    """Divide advantages by the group's reward standard deviation (GRPO); False keeps only the mean
    baseline."""
    loss_aggregation: Literal["token_mean", "sequence_mean"] = "token_mean"
    """`token_mean`: average over all trained tokens of the batch; `sequence_mean`: average per trajectory
    first, then over trajectories."""
    clip_eps_low: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.2
    """Lower clip of the importance ratio: `1 - clip_eps_low`."""
    clip_eps_high: Annotated[float, Field(ge=0.0)] = 0.2
    """Upper clip of the importance ratio: `1 + clip_eps_high` (raise it for clip-higher)."""
    kl_coef: Annotated[float, Field(ge=0.0)] = 0.0
    """Weight of the KL penalty against the initial (reference) model; 0 loads no reference model."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Estimator of the KL divergence per token (Schulman's k1, k2, k3)."""
    entropy_coef: Annotated[float, Field(ge=0.0)] = 0.0
    """Weight of the entropy bonus."""
    off_policy_correction: Literal["none", "decoupled"] = "none"
    """`decoupled`: decoupled PPO, which clips against a proximal logprob recomputed by the actor before the
    update and weights each token by the truncated ratio of proximal to behaviour probability.
    `none`: clip against the behaviour logprobs the engines returned."""
    off_policy_max_weight: Annotated[float, Field(ge=1.0)] = 2.0
    """Truncation of the decoupled importance weight (e.g. 2.0 or 5.0)."""


class RolloutBufferConfig(Section):
    """Admission limits of the buffer between rollout and actor."""

    max_inflight_groups: PositiveInt | None = None
    """Groups being generated at once (engine load). Derived: `ceil(rollout.max_running_requests *
    rollout.num_instances * 1.2 / algorithm.group_size)`."""
    max_buffered_groups: PositiveInt | None = None
    """Groups in flight plus finished and waiting for the actor (data age). Derived:
    `2 * data.rollout_batch_size`."""
    max_dropped_groups_per_step: NonNegativeInt | None = None
    """Groups one step may drop as too stale before the run stops with an error. Derived:
    `10 * data.rollout_batch_size`."""


class AgentLoopConfig(Section):
    """The agent loop: which task runs the trajectories, and how many at once."""

    task_name: Annotated[str, Field(min_length=1)] | None = None
    """The task: a name in the entry-point group `asyncrl.tasks` (`asyncrl-run --list-tasks`) or
    `module:attr` of a task factory. Required."""
    task_args: dict[str, JsonValue] = Field(default_factory=dict[str, JsonValue])
    """Keyword arguments of the task factory."""
    max_actor_accept_staleness: NonNegativeInt | None = None
    """Drop a finished group when the actor's version exceeds the group's earliest version by more than
    this; unset keeps every group."""
    max_turns: PositiveInt | None = None
    """Most model turns of one trajectory; unset uses the task's default."""
    num_workers: PositiveInt = 1
    """Agent-loop workers (processes); groups are spread over them."""
    max_concurrent_groups: PositiveInt | None = None
    """Groups one worker runs at once. Derived: `ceil(rollout_buffer.max_inflight_groups / num_workers)`."""


class LoggingConfig(Section):
    """Where per-step metrics go."""

    tensorboard: bool = True
    """Write TensorBoard events under `<run_dir>/tensorboard`."""
    jsonl: bool = True
    """Append one JSON object per logged step to `<run_dir>/metrics.jsonl`."""
    progress_bar: bool = True
    """Show a progress bar with step, reward and staleness (on a terminal)."""
    log_every_steps: PositiveInt = 1
    """Log metrics every this many steps."""
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Level of the text log."""


class CheckpointConfig(Section):
    """When to save model, optimiser and buffer state, and what to resume from."""

    save_every_steps: PositiveInt | None = None
    """Save a checkpoint every this many steps; unset saves none on the way."""
    save_at_end: bool = True
    """Save a checkpoint after the last step."""
    keep_last: PositiveInt = 2
    """Checkpoints kept under `<run_dir>/checkpoints`; older ones are deleted."""
    resume_from: str | None = None
    """Resume from this checkpoint folder, or `latest` for the newest one under `<run_dir>/checkpoints`."""


class AsyncRLConfig(Section):
    """The whole configuration of a run (the root of the YAML file)."""

    runner: RunnerConfig
    """How the run is driven."""
    cluster: ClusterConfig
    """Device placement."""
    data: DataConfig
    """Prompts and lengths."""
    rollout: RolloutConfig
    """Rollout engines."""
    rollout_buffer: RolloutBufferConfig = Field(default_factory=RolloutBufferConfig)
    """Admission limits of the buffer."""
    agentloop: AgentLoopConfig = Field(default_factory=AgentLoopConfig)
    """The agent loop and its task."""
    actor: ActorConfig
    """The training backend."""
    algorithm: AlgorithmConfig
    """The objective."""
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    """Metrics output."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpoints."""

    _derived_keys: frozenset[str] = PrivateAttr(default=frozenset())
    _warnings: tuple[ConfigProblem, ...] = PrivateAttr(default=())

    @property
    def derived_keys(self) -> frozenset[str]:
        """Dotted keys whose value was computed from other keys when this configuration was validated."""
        return self._derived_keys

    @property
    def warnings(self) -> tuple[ConfigProblem, ...]:
        """Problems that do not stop a run but probably make it worse than intended."""
        return self._warnings

    @property
    def actor_data_parallel_size(self) -> int:
        """Data-parallel ranks of the actor: its devices over `tensor * pipeline` parallel size on GPUs;
        1 on CPU, where one process trains with threads on all of its cores."""
        if self.cluster.device_type == "cpu":
            return 1
        model_parallel = self.actor.tensor_parallel_size * self.actor.pipeline_parallel_size
        return max(1, len(self.cluster.devices_of("actor")) // model_parallel)

    @model_validator(mode="wrap")
    @classmethod
    def _resolve_and_check(cls, data: Any, handler: ModelWrapValidatorHandler[Self]) -> Self:
        """Validate fields, fill derived values, then apply every cross-field rule at once.

        Raises `ConfigError` (never pydantic's `ValidationError`) listing every problem with its key path.
        """
        from asyncrl_core.config.validate import derive, problems_from_validation_error, run_rules

        try:
            parsed = handler(data)
        except ValidationError as error:
            raise ConfigError(problems_from_validation_error(error)) from None
        errors: list[ConfigProblem] = []
        warnings: list[ConfigProblem] = []
        derived = derive(parsed, warnings)
        resolved = parsed
        if derived:
            tree = parsed.model_dump(mode="python")
            for key, value in derived.items():
                section, _, leaf = key.rpartition(".")
                node = tree
                for part in section.split("."):
                    node = node[part]
                node[leaf] = value
            try:
                resolved = handler(tree)
            except ValidationError as error:  # a derived value out of its field's range
                raise ConfigError(problems_from_validation_error(error)) from None
        run_rules(resolved, errors, warnings)
        if errors:
            raise ConfigError(errors)
        resolved._derived_keys = frozenset(derived)
        resolved._warnings = tuple(warnings)
        return resolved
