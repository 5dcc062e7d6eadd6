"""The configuration of a run, as frozen pydantic models: one section per component.

Every field has a docstring, which is also its description in the JSON Schema (`asyncrl-run --schema`).
Types are strict: `true` is never a number and a quoted string never a number, except the exponent form
`1e-6` that YAML 1.1 reads as text (accepted as a float, since learning rates are written that way).

Fields whose default is `None` and whose docstring says *derived* are computed once, when the root model
is validated, from other keys; the resolved configuration holds the computed value and
`AsyncRLConfig.derived_keys` names them (the dry run marks them `# derived`).

Each section holds its rules beside its fields: `derive` computes its derived values and `check` reports
what is wrong, both writing to one `Validation` and both reading the whole configuration. The root
validator of `AsyncRLConfig` runs them for every section and reports every problem at once as a
`asyncrl_core.errors.ConfigError` with dotted key paths. Adding a key means adding the field, with its
docstring, and its rule to its section's `check`.

This module imports only pydantic, the standard library and asyncrl_core's light modules.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
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
    ValidatorFunctionWrapHandler,
    WithJsonSchema,
    WrapValidator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from asyncrl_core.config.keys import suggest
from asyncrl_core.config.placement import (
    MAX_DEVICE_ID,
    detect_devices,
    format_device_ids,
    parse_device_ids,
    visible_gpu_count,
)
from asyncrl_core.config.validate import (
    COMPONENTS,
    Validation,
    components,
    derived_max_inflight_groups,
    devices_text,
    divisors,
    problems_from_validation_error,
)
from asyncrl_core.errors import ConfigError, ConfigProblem

PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]

GREEDY_TEMPERATURE = 1e-6
"""A sampling temperature below this samples greedily (SGLang's threshold)."""

_EXPONENT = re.compile(r"^\s*[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+\s*$")
_URL = re.compile(r"^https?://[^\s/:]+(:\d{1,5})?/?$")
_GRPC_ADDRESS = re.compile(r"^[^\s/:]+:\d{1,5}$")


def _exponent_as_float(value: object) -> object:
    """`1e-6` as a float: YAML 1.1 reads an exponent without a dot as text. Other text stays text (and the
    strict float type refuses it)."""
    if isinstance(value, str) and _EXPONENT.match(value):
        return float(value)
    return value


Float = Annotated[float, BeforeValidator(_exponent_as_float)]
"""A float field: a number, or text in exponent form such as `1e-6`; never `true` nor other text."""


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


def _one_server_argument(value: object, handler: ValidatorFunctionWrapHandler) -> object:
    """One error for a value that none of the scalar types accepts (pydantic would list one per type)."""
    try:
        return handler(value)
    except ValidationError:
        raise PydanticCustomError(
            "server_argument",
            "an extra server argument is text, a number or true/false, not a section or a list",
        ) from None


ServerArgument = Annotated[str | int | float | bool, WrapValidator(_one_server_argument)]
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
        strict=True,
    )

    def derive(self, root: AsyncRLConfig, found: Validation) -> None:
        """Record in `found` the derived values of this section's unset keys."""
        del root, found

    def check(self, root: AsyncRLConfig, found: Validation) -> None:
        """Record in `found` what is wrong with this section, given the whole configuration (derived
        values filled in)."""
        del root, found


def _shared_warning(device_ids: tuple[int, ...]) -> str:
    return (
        f"actor and rollout share {format_device_ids(device_ids)} (`cluster.allow_shared_devices`): they "
        "time-share it, so generation and training overlap less than on separate devices"
    )


class RunnerConfig(Section):
    """How the run is driven: mode, length, seed and where its outputs go."""

    async_mode: bool = False
    """Overlap rollout and training: the actor trains while the engines keep generating. False takes
    turns."""
    num_steps: PositiveInt
    """Training steps (actor optimiser steps) to run."""
    seed: Annotated[int, Field(ge=0, le=2**32 - 1)] = 0
    """Seed of the run, from which every generator derives: the dataloader's shuffle (`data.seed`, derived
    from it), the warm start, the actor's generators (Python's, numpy's and torch's on every rank, and
    Megatron's model-parallel ones; saved in the actor's checkpoints and restored at resume), and the
    engines' sampling (engine `i` started with `--random-seed seed + i`). An `external` engine keeps its own
    seed."""
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=200)] = "asyncrl"
    """Name of the run: letters, digits, `.`, `_` and `-`; names the run folder unless `run_dir` is set."""
    run_dir: Annotated[str, Field(min_length=1)] | None = None
    """Folder for `config.yaml`, `warnings.log`, metrics, TensorBoard events and checkpoints.
    Derived: `runs/<name>`, relative to the working directory."""
    eval_every_steps: PositiveInt | None = None
    """Evaluate on the task's `test` split every this many steps (one trajectory per prompt, at most 64
    prompts), beside training in async mode; unset never evaluates."""
    ray_address: Annotated[str, Field(min_length=1)] | None = None
    """Address of a Ray cluster started with `ray start` (`host:port`, or `auto`); unset starts a local Ray
    instance for the run and stops it at the end."""
    startup_timeout_s: Annotated[Float, Field(gt=0.0)] = 1800.0
    """Seconds the start of the workers may take: the engines (SGLang's own start-up and the load of a 7B
    model take several minutes each), the actor ranks with their optimiser, the agent loops and the
    buffer."""
    eval_timeout_s: Annotated[Float, Field(gt=0.0)] = 1800.0
    """Seconds one evaluation (`eval_every_steps`) may take once the driver waits for it."""

    def derive(self, root: AsyncRLConfig, found: Validation) -> None:
        if self.run_dir is None:
            found.derive("runner.run_dir", f"runs/{self.name}")


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

    allow_shared_devices: bool = False
    """Let `actor` and `rollout` be placed on the same devices in async mode (then a warning, not an
    error): both run as separate processes and time-share the devices, so async mode overlaps less. For
    one-GPU machines and benchmarks; a real run gives each its own devices."""

    def devices_of(self, component: str) -> tuple[int, ...]:
        """The sorted device ids of `component`, gathered from every placement key that names it."""
        ids: set[int] = set()
        for key, text in self.component_placement.items():
            if component in (name.strip() for name in key.split(",")):
                ids.update(parse_device_ids(text))
        return tuple(sorted(ids))

    def placement(self) -> dict[str, tuple[int, ...]] | None:
        """Device ids per placement key, or `None` when any key's ids cannot be read."""
        parsed: dict[str, tuple[int, ...]] = {}
        for key, text in self.component_placement.items():
            try:
                parsed[key] = parse_device_ids(text)
            except ValueError:
                return None
        return parsed

    def derive(self, root: AsyncRLConfig, found: Validation) -> None:
        device_type = self.device_type
        if device_type == "auto":
            device_type = "gpu" if visible_gpu_count() > 0 else "cpu"
            found.derive("cluster.device_type", device_type)
        present = detect_devices(device_type)
        if self.num_devices is None and present > 0:
            found.derive("cluster.num_devices", present)
        elif present == 0:
            unchecked = (
                "; the placement is checked against no device count (set `cluster.num_devices` to check it)"
                if self.num_devices is None
                else ""
            )
            cpu = (
                ""
                if root.actor.backend == "megatron"
                else ", or write `cluster.device_type: cpu` to run here on CPU cores"
            )
            found.warn(
                "cluster.device_type",
                f"`gpu` is asked for, but this machine has no visible GPU, so a launch here fails"
                f"{unchecked}. "
                f"Fine when preparing a configuration for a machine with GPUs{cpu}",
            )

    def check(self, root: AsyncRLConfig, found: Validation) -> None:
        where = "cluster.component_placement"
        parsed: dict[str, tuple[int, ...]] = {}
        owner: dict[str, str] = {}
        for key, text in self.component_placement.items():
            for name in components(key):
                if name not in COMPONENTS:
                    hint = suggest(name, list(COMPONENTS))
                    found.error(
                        f"{where}.{key}",
                        f"unknown component {name!r}; {hint}components: {', '.join(COMPONENTS)}",
                    )
                elif name in owner:
                    found.error(
                        f"{where}.{key}",
                        f"`{name}` is placed twice (also under `{owner[name]}`); list each component under "
                        "one key",
                    )
                else:
                    owner[name] = key
            try:
                parsed[key] = parse_device_ids(text)
            except ValueError as error:
                found.error(f"{where}.{key}", str(error))
        if len(parsed) != len(self.component_placement):
            return
        if self.num_devices is not None:
            ids_text = f"ids 0-{self.num_devices - 1}" if self.num_devices > 1 else "id 0"
            for key, ids in parsed.items():
                absent = tuple(device_id for device_id in ids if device_id >= self.num_devices)
                if absent:
                    found.error(
                        f"{where}.{key}",
                        f"{devices_text(absent)} not present: there are {self.num_devices} "
                        f"{self.device_type} devices ({ids_text}); use ids below {self.num_devices} or set "
                        "`cluster.num_devices`",
                    )
        async_mode = root.runner.async_mode
        keys = list(parsed)
        for index, first in enumerate(keys):
            for second in keys[index + 1 :]:
                shared = tuple(sorted(set(parsed[first]) & set(parsed[second])))
                if not shared:
                    continue
                if self.allow_shared_devices and {first, second} == {"actor", "rollout"}:
                    found.warn(f"{where}.{second}", _shared_warning(shared))
                    continue
                names = components(first) + components(second)
                fix = "give each key its own devices"
                if not (async_mode and {"actor", "rollout"} <= set(names)):
                    fix += f", or list colocated components under one key (`{','.join(names)}: ...`)"
                found.error(f"{where}.{second}", f"{devices_text(shared)} also placed under `{first}`; {fix}")
        needed = ["actor"]
        if root.rollout.sglang.launch != "external":
            needed.append("rollout")
        free = 0 if self.num_devices is None else self.num_devices
        for component in needed:
            if component not in owner:
                example = f"{component}: {free - 1}" if free else f"{component}: 0"
                found.error(where, f"no devices for `{component}`; add a key such as `{example}`")
        # Under two keys, shared devices are already an overlap error; under one key they are colocated.
        if async_mode and "actor" in owner and owner.get("rollout") == owner["actor"]:
            if self.allow_shared_devices:
                found.warn(f"{where}.{owner['actor']}", _shared_warning(parsed[owner["actor"]]))
                return
            found.error(
                f"{where}.{owner['actor']}",
                "async mode needs the actor and the rollout on different devices, but both use "
                f"{format_device_ids(parsed[owner['actor']])}; place them apart (e.g. `actor: 0-3`, "
                "`rollout: 4-7`) or set `runner.async_mode: false`",
            )

    def launch_problems(self, root: AsyncRLConfig) -> list[ConfigProblem]:
        """Problems that only a launch on this machine has: placement ids beyond the devices present here.

        A dry run skips this, so a cluster's configuration can be prepared on a laptop. With `RAY_ADDRESS`
        set the run joins a Ray cluster whose devices are not all on this machine, and this check is left to
        the runner, which sees the cluster's resources.
        """
        parsed = self.placement()
        if os.environ.get("RAY_ADDRESS") or root.runner.ray_address is not None or not parsed:
            return []
        used = [device_id for ids in parsed.values() for device_id in ids]
        if not used:
            return []
        device_type = "gpu" if self.device_type == "gpu" else "cpu"
        present = detect_devices(device_type)
        needed = max(used) + 1
        if present >= needed:
            return []
        where = "cluster.component_placement"
        if present:
            what = "GPUs are visible" if device_type == "gpu" else "CPU cores are present"
            return [
                ConfigProblem(
                    where,
                    f"the placement uses {device_type} ids up to {needed - 1}, but only {present} {what} on "
                    f"this machine; place the components on ids below {present}, or join a Ray cluster "
                    "(RAY_ADDRESS)",
                )
            ]
        fix = (
            "run it on a machine with GPUs, or join a Ray cluster that has them (RAY_ADDRESS)"
            if root.actor.backend == "megatron"
            else "write `cluster.device_type: cpu` to run on CPU cores, or join a Ray cluster (RAY_ADDRESS)"
        )
        return [
            ConfigProblem(where, f"the placement asks for GPUs, but this machine has no visible GPU; {fix}")
        ]


class DataConfig(Section):
    """The prompts: how many per step, from which dataset, and how long prompt and response may be."""

    rollout_batch_size: PositiveInt
    """Groups per training step (B): the actor trains on `rollout_batch_size * algorithm.group_size`
    trajectories per step."""
    dataset: str | None = None
    """Not read yet: a run uses its task's own data, which the task takes from `agentloop.task_args`
    (e.g. `searchr1`'s `data_path`)."""
    split: str = "train"
    """Not read yet: a run trains on its task's `train` split (and evaluates on `test`) whatever this
    says."""
    shuffle: bool = True
    """Shuffle the prompts at every epoch."""
    seed: Annotated[int, Field(ge=0, le=2**32 - 1)] | None = None
    """Seed of the shuffle. Derived: `runner.seed`."""
    max_prompt_len: PositiveInt = 1024
    """Longest prompt in tokens (system prompt and question, chat template applied); longer prompts are
    skipped by the dataloader."""
    max_response_len: PositiveInt = 1024
    """Most response tokens of one trajectory, summed over all turns (model and tool tokens alike)."""

    def derive(self, root: AsyncRLConfig, found: Validation) -> None:
        if self.seed is None:
            found.derive("data.seed", root.runner.seed)


class SGLangConfig(Section):
    """How the SGLang-protocol engines are reached or started."""

    backend_type: Literal["server", "engine"] = "server"
    """`server`: engines behind the SGLang HTTP protocol, the only kind the runner starts (required in
    async mode). `engine` (an in-process engine object) is accepted in sync mode but not implemented: the
    runner uses servers either way."""
    launch: Literal["builtin", "sglang", "external"] = "builtin"
    """`builtin`: asyncrl's torch engine serving the SGLang routes (CPU or GPU). `sglang`: start real
    SGLang servers on the rollout devices. `external`: use the servers at `urls`, started by someone else."""
    urls: list[str] = Field(default_factory=list[str])
    """Base URLs of external servers (`http://host:port`), one per engine instance; `launch: external`
    only."""
    api_key: str | None = None
    """Bearer token the servers expect, if any."""
    host: Annotated[str, Field(min_length=1)] | None = None
    """Address launched servers bind to (`0.0.0.0`: every interface). Unset: loopback (`127.0.0.1`) when the
    Ray cluster has one node, and each engine's node address when it has several, so the actor and the
    agent loops on other nodes reach it. An engine's URL carries the address it binds, or its node's address
    when it binds every interface."""
    base_port: Annotated[int, Field(ge=1024, le=65535)] = 30000
    """First port of launched servers; instance `i` listens on `base_port + i` (or the next free port)."""
    extra_args: dict[str, ServerArgument] = Field(default_factory=dict[str, ServerArgument])
    """Extra server arguments for launched servers, e.g. `mem_fraction_static: 0.8` (`--mem-fraction-static
    0.8`); `true` passes a bare flag. With `launch: builtin`, the SGLang flags the built-in engine takes
    (`disable_radix_cache: true`, `disable_overlap_schedule: true`, ...); another is refused before any engine
    starts."""
    weight_transport: Literal["tensor", "distributed"] = "tensor"
    """How weight syncs reach the engines. `tensor`: each bucket travels in the body of
    `/update_weights_from_tensor` as safetensors bytes (`load_format: "safetensors"`), which only the built-in
    engine accepts (SGLang 0.5.23 takes CUDA-IPC handles there). `distributed`: the trainer broadcasts each
    bucket over a torch process group the engines join (`/update_weights_from_distributed`; NCCL between
    GPUs, gloo on CPUs and where actor and rollout share a GPU), the route real SGLang servers take."""
    transport: Literal["http", "grpc"] = "http"
    """How generation reaches the engines: `http` (`/generate`, JSON) or `grpc` (SGLang's `SglangScheduler`
    service, token ids as protobuf). Pause, weight sync and versions always use HTTP."""
    grpc_base_port: Annotated[int, Field(ge=1024, le=65535)] = 31000
    """First gRPC port of launched servers with `transport: grpc`; instance `i` listens on
    `grpc_base_port + i` (or the next free port)."""
    grpc_urls: list[str] = Field(default_factory=list[str])
    """gRPC addresses (`host:port`) of external servers with `transport: grpc`, one per entry of `urls`
    and in the same order; `launch: external` only."""

    def check(self, root: AsyncRLConfig, found: Validation) -> None:
        if root.runner.async_mode and self.backend_type != "server":
            found.error(
                "rollout.sglang.backend_type",
                "async mode needs the rollout behind the SGLang server protocol; write `server` "
                "(or set `runner.async_mode: false`)",
            )
        if self.launch == "sglang" and root.cluster.device_type == "cpu":
            found.error(
                "rollout.sglang.launch",
                "`sglang` starts real SGLang servers, which need GPUs; write `builtin` on CPU "
                "(or set `cluster.device_type: gpu`)",
            )
        if self.launch == "sglang" and self.weight_transport == "tensor":
            found.error(
                "rollout.sglang.weight_transport",
                "`tensor` sends safetensors bytes, which SGLang's /update_weights_from_tensor does not "
                "accept (0.5.23 takes CUDA-IPC handles: load_format null, `direct` or `flattened_bucket`); "
                "write `distributed` with `launch: sglang`",
            )
        if self.launch == "external":
            if not self.urls:
                found.error(
                    "rollout.sglang.urls",
                    "`launch: external` needs the servers' base URLs, e.g. `urls: [http://10.0.0.2:30000]`",
                )
        elif self.urls:
            found.error(
                "rollout.sglang.urls",
                f"URLs are used only with `launch: external` (launch is `{self.launch}`); remove them or "
                "write `rollout.sglang.launch: external`",
            )
        for index, url in enumerate(self.urls):
            if not _URL.match(url):
                found.error(
                    f"rollout.sglang.urls[{index}]", f"{url!r} is not a base URL; write `http://host:port`"
                )
        if len(set(self.urls)) != len(self.urls):
            found.error("rollout.sglang.urls", "a URL is listed twice; list each server once")
        self._check_transport(found)

    def _check_transport(self, found: Validation) -> None:
        if self.transport == "grpc" and self.launch == "sglang":
            found.error(
                "rollout.sglang.transport",
                "`grpc` is served by the built-in engine; the launcher starts SGLang's HTTP server only. "
                "Write `http`, or start SGLang's gRPC server beside its HTTP one yourself and use "
                "`launch: external` with `grpc_urls`",
            )
        if self.grpc_urls and (self.transport != "grpc" or self.launch != "external"):
            found.error(
                "rollout.sglang.grpc_urls",
                "gRPC addresses are used only with `transport: grpc` and `launch: external`; remove them or "
                "set both",
            )
        if self.transport == "grpc" and self.launch == "external" and len(self.grpc_urls) != len(self.urls):
            found.error(
                "rollout.sglang.grpc_urls",
                f"`transport: grpc` with `launch: external` needs one gRPC address per URL "
                f"({len(self.urls)}), got {len(self.grpc_urls)}; e.g. `grpc_urls: [10.0.0.2:31000]`",
            )
        for index, address in enumerate(self.grpc_urls):
            if not _GRPC_ADDRESS.match(address):
                found.error(
                    f"rollout.sglang.grpc_urls[{index}]",
                    f"{address!r} is not a gRPC address; write `host:port`",
                )


class SamplingConfig(Section):
    """Sampling of each model turn, as SGLang's `sampling_params` names it."""

    temperature: Annotated[Float, Field(ge=0.0)] = 1.0
    """Softmax temperature; 0 samples greedily (RL normally keeps 1.0 so logprobs match the policy)."""
    top_p: Annotated[Float, Field(gt=0.0, le=1.0)] = 1.0
    """Nucleus sampling mass; 1.0 keeps the whole distribution."""
    top_k: Annotated[int, Field(ge=-1)] = -1
    """Sample from the `top_k` most likely tokens; -1 keeps all (0 is not allowed)."""
    max_new_tokens: PositiveInt | None = None
    """Most tokens of one model turn. Derived: `data.max_response_len`."""

    @property
    def logprob_temperature(self) -> float:
        """The temperature of the distribution the engines report logprobs under: `temperature`, or 1 for
        greedy sampling (below 1e-6, as SGLang decides), whose logprobs are the raw `log_softmax(logits)`."""
        return self.temperature if self.temperature >= GREEDY_TEMPERATURE else 1.0

    def derive(self, root: AsyncRLConfig, found: Validation) -> None:
        if self.max_new_tokens is None:
            found.derive("rollout.sampling.max_new_tokens", root.data.max_response_len)

    def check(self, root: AsyncRLConfig, found: Validation) -> None:
        if self.top_k == 0:
            found.error("rollout.sampling.top_k", "0 keeps no token; write -1 to keep all")


class RolloutConfig(Section):
    """The rollout engines: backend, model, number of instances, and how they pause for weight syncs."""

    rollout_backend: Annotated[str, Field(min_length=1)] = "sglang"
    """Engine family: a name in the entry-point group `asyncrl.rollout_backends` (`sglang`, declared by
    asyncrl-sglang), or `module:attr` of a backend factory (`asyncrl_core.protocols.RolloutBackend`)."""
    sglang: SGLangConfig = Field(default_factory=SGLangConfig)
    """Settings of the `sglang` backend."""
    backend_args: dict[str, JsonValue] = Field(default_factory=dict[str, JsonValue])
    """Settings of a plugin rollout backend, which its factory reads from the configuration it is called
    with; unused by `sglang`."""
    model_path: str | None = None
    """Model the engines serve at start: a HuggingFace folder, `smollm2-135m` or `tiny-llama:<preset>`
    (as `actor.model_path`). Derived: `actor.model_path`."""
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
    request_timeout_s: Annotated[Float, Field(gt=0.0)] = 600.0
    """Seconds one generation request may take, pauses for weight syncs included; also the longest the
    driver waits for the next batch of finished groups."""
    drain_timeout_s: Annotated[Float, Field(gt=0.0)] = 600.0
    """Seconds the requests in flight may take to finish when the agent loops are drained: before each
    weight sync in `pause_mode: drain`, and when the run stops generating at its end."""
    max_engine_restarts: NonNegativeInt = 3
    """Times over the run a dead engine process (or one that stopped answering `/health`) is restarted,
    all engines together; one more failure stops the run. 0: the first failure stops it. With
    `sglang.weight_transport: distributed` the first failure stops the run (a restarted engine cannot join
    the weight-update group)."""
    engine_unresponsive_s: Annotated[Float, Field(gt=0.0)] = 15.0
    """Seconds an engine process may leave `/health` unanswered before it counts as failed (it is then
    killed and restarted)."""
    max_worker_restarts: NonNegativeInt = 3
    """Times over the run a dead rollout worker (the process that owns an engine and watches it) is
    restarted, all rollout workers together: its engine goes with it and is started again on its address
    with the actor's current weights. One more death stops the run. With `sglang.weight_transport:
    distributed` the first death stops the run (a restarted engine cannot join the weight-update group)."""

    def instances_from_placement(self, root: AsyncRLConfig) -> int | None:
        """Instances the placement and parallel sizes give, or `None` when they give none."""
        if self.sglang.launch == "external":
            return len(self.sglang.urls) or None
        if root.cluster.placement() is None:
            return None
        return len(root.cluster.devices_of("rollout")) // self.tensor_parallel_size or None

    def derive(self, root: AsyncRLConfig, found: Validation) -> None:
        data = root.data
        if self.model_path is None:
            found.derive("rollout.model_path", root.actor.model_path)
        if self.context_length is None:
            found.derive("rollout.context_length", data.max_prompt_len + data.max_response_len)
        if self.num_instances is None:
            num_instances = self.instances_from_placement(root)
            if num_instances is not None:
                found.derive("rollout.num_instances", num_instances)
        self.sampling.derive(root, found)

    def check(self, root: AsyncRLConfig, found: Validation) -> None:
        self.sglang.check(root, found)
        self.sampling.check(root, found)
        launch = self.sglang.launch
        placement = root.cluster.placement()
        if launch != "external" and placement is not None:
            num_devices = len(root.cluster.devices_of("rollout"))
            if num_devices and num_devices % self.tensor_parallel_size:
                found.error(
                    "rollout.tensor_parallel_size",
                    f"{self.tensor_parallel_size} does not divide the {num_devices} rollout devices; "
                    f"choose one of {divisors(num_devices)}",
                )
        if launch == "external" and any("rollout" in components(key) for key in placement or {}):
            found.warn(
                "cluster.component_placement",
                "`rollout` devices are unused with `rollout.sglang.launch: external`; remove them",
            )
        computed = self.instances_from_placement(root)
        if self.num_instances is not None and computed is not None and self.num_instances != computed:
            source = (
                "the number of `rollout.sglang.urls`"
                if launch == "external"
                else "the rollout devices divided by `rollout.tensor_parallel_size`"
            )
            found.error(
                "rollout.num_instances",
                f"{self.num_instances} disagrees with {source}, which give {computed}; remove the key "
                "(it is derived)",
            )
        data = root.data
        wanted = data.max_prompt_len + data.max_response_len
        if self.context_length is not None and wanted > self.context_length:
            found.error(
                "rollout.context_length",
                f"{self.context_length} tokens cannot hold data.max_prompt_len {data.max_prompt_len} + "
                f"data.max_response_len {data.max_response_len} = {wanted}; raise it or shorten those "
                "lengths",
            )
        from asyncrl_core import plugins

        problem = plugins.check_selectable("asyncrl.rollout_backends", self.rollout_backend)
        if problem is not None:
            found.error("rollout.rollout_backend", problem)


class ActorCommon(Section):
    """Settings every actor backend shares."""

    model_path: Annotated[str, Field(min_length=1)]
    """Model to train: a HuggingFace folder; `smollm2-135m` for the offline SmolLM2-135M-Instruct
    (`asyncrl_core.models.smollm2_135m()`); or `tiny-llama:<preset>` (`test`, `small`, `medium`) for a
    random-initialised Llama with SmolLM2's tokenizer, built once into the cache."""
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Compute dtype, and the dtype of the weights sent to the engines. `bfloat16`: the torch actor keeps
    float32 parameters and runs forward and backward under bfloat16 autocast (float32 where the device has no
    native bfloat16), the Megatron actor keeps bfloat16 parameters with float32 master weights in its
    optimiser (Megatron's optimiser on a GPU, `torch.optim` on a CPU). `float32`: everything in float32."""
    micro_batch_size: PositiveInt = 1
    """Trajectories per forward/backward pass on one data-parallel rank, each right-padded to the longest
    (rounded up to a multiple of 64 tokens); gradients accumulate over the micro batches of a step. Not
    read when `max_tokens_per_micro_batch` is set."""
    max_tokens_per_micro_batch: PositiveInt | None = None
    """Tokens per forward/backward pass on one data-parallel rank (verl's `ppo_max_token_len_per_gpu`):
    a rank's trajectories are grouped into as few micro batches of at most this many tokens as fit, each
    packed into one row by the torch actor (attention never crosses trajectories; no padding but the
    row's last few tokens) and padded to a bucketed width by the Megatron actor (which then counts the
    padding). The gradient is the one of any other cut. Must hold the longest trajectory,
    `rollout.context_length`. Unset: micro batches of `micro_batch_size` trajectories."""
    optimizer: Literal["adamw", "sgd"] = "adamw"
    """Optimiser."""
    lr: Annotated[Float, Field(gt=0.0)] = 1e-6
    """Learning rate."""
    weight_decay: Annotated[Float, Field(ge=0.0)] = 0.0
    """Decoupled weight decay (AdamW) or L2 penalty (SGD)."""
    adam_beta1: Annotated[Float, Field(ge=0.0, lt=1.0)] = 0.9
    """Adam's first-moment decay."""
    adam_beta2: Annotated[Float, Field(ge=0.0, lt=1.0)] = 0.999
    """Adam's second-moment decay."""
    adam_eps: Annotated[Float, Field(gt=0.0)] = 1e-8
    """Adam's denominator epsilon."""
    grad_clip: Annotated[Float, Field(ge=0.0)] = 1.0
    """Largest global gradient L2 norm; larger gradients are scaled down to it. 0 turns clipping off."""
    tensor_parallel_size: PositiveInt = 1
    """Devices a layer is split over (Megatron only; the torch actor needs 1)."""
    pipeline_parallel_size: PositiveInt = 1
    """Pipeline stages: must be 1 (neither actor is pipeline parallel; `--dry-run` refuses another value)."""
    data_parallel_size: PositiveInt | None = None
    """Data-parallel ranks of the actor, one process each (times the tensor and pipeline parallel size).
    Derived: on GPUs, the actor devices divided by `tensor_parallel_size x pipeline_parallel_size` (another
    value is refused); on a CPU 1, one process training with threads on all the actor's cores. On a CPU a
    larger value starts that many processes joined over gloo, each pinned to its share of the actor's cores
    (all of them when there are fewer cores than processes)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass, trading compute for memory."""
    weight_export_bucket_mb: PositiveInt = 512
    """Size of one bucket of weights sent to the engines after each step, in MiB."""
    temperature: Annotated[Float, Field(gt=0.0)] | None = None
    """Temperature of the logprobs the actor trains on, `softmax(logits / temperature)`: it must be the
    engines' sampling temperature, so that they and the rollout logprobs describe one distribution.
    Derived: `rollout.sampling.temperature` (1.0 when that is 0: the engines report greedy logprobs at
    temperature 1); another value is refused."""
    ppo_mini_batch_size: PositiveInt | None = None
    """Groups per optimiser update, as verl's `ppo_mini_batch_size` counts prompts (slime's
    `global_batch_size` is this times `algorithm.group_size`): a step's groups are cut, in order, into
    mini-batches of this many, each one update. Must divide `data.rollout_batch_size`. Derived:
    `data.rollout_batch_size` (one update per epoch)."""
    ppo_epochs: PositiveInt = 1
    """Passes over a step's mini-batches (verl's `ppo_epochs`). A step makes `ppo_epochs x
    data.rollout_batch_size / ppo_mini_batch_size` optimiser updates and bumps the weight version once."""
    train_timeout_s: Annotated[Float, Field(gt=0.0)] = 1800.0
    """Seconds one training step may take on every rank; the push of the new weights into the engines that
    follows it may take as long again."""

    def derive(self, root: AsyncRLConfig, found: Validation) -> None:
        if self.temperature is None:
            found.derive("actor.temperature", root.rollout.sampling.logprob_temperature)
        if self.data_parallel_size is None and root.cluster.placement() is not None:
            found.derive("actor.data_parallel_size", root.data_parallel_size_from_placement())
        if self.ppo_mini_batch_size is None:
            found.derive("actor.ppo_mini_batch_size", root.data.rollout_batch_size)

    def check(self, root: AsyncRLConfig, found: Validation) -> None:
        """The rules of every backend: the logprobs' temperature is the engines', and a step's groups cut
        into mini-batches whose trajectories split evenly into ranks and micro batches."""
        sampling = root.rollout.sampling.temperature
        if self.temperature is not None and self.temperature != root.rollout.sampling.logprob_temperature:
            found.error(
                "actor.temperature",
                f"{self.temperature} differs from the engines' rollout.sampling.temperature {sampling}, so "
                "the actor's logprobs and the rollout logprobs would describe different distributions and "
                "every importance ratio would be off; remove the key (it is derived)",
            )
        longest = root.rollout.context_length or root.data.max_prompt_len + root.data.max_response_len
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch < longest:
            found.error(
                "actor.max_tokens_per_micro_batch",
                f"{self.max_tokens_per_micro_batch} tokens cannot hold a trajectory of "
                f"rollout.context_length {longest} tokens; write at least {longest}",
            )
        batch, group_size = root.data.rollout_batch_size, root.algorithm.group_size
        mini_batch = batch if self.ppo_mini_batch_size is None else self.ppo_mini_batch_size
        if batch % mini_batch:
            found.error(
                "actor.ppo_mini_batch_size",
                f"{mini_batch} groups per update do not divide data.rollout_batch_size {batch}; choose one "
                f"of {divisors(batch)}",
            )
            return
        if root.cluster.placement() is None or not root.cluster.devices_of("actor"):
            return
        placed = root.data_parallel_size_from_placement()
        if root.cluster.device_type == "gpu" and self.data_parallel_size not in (None, placed):
            found.error(
                "actor.data_parallel_size",
                f"{self.data_parallel_size} disagrees with the actor's GPUs divided by tensor_parallel_size "
                f"x pipeline_parallel_size, which give {placed}; remove the key (it is derived)",
            )
            return
        trajectories = mini_batch * group_size
        data_parallel = root.actor_data_parallel_size
        per_rank, remainder = divmod(trajectories, data_parallel)
        if mini_batch == batch:
            key, sizes = "data.rollout_batch_size", f"data.rollout_batch_size {batch}"
            described = (
                f"the {trajectories} trajectories of a step ({sizes} x algorithm.group_size {group_size})"
            )
        else:
            key, sizes = "actor.ppo_mini_batch_size", f"actor.ppo_mini_batch_size {mini_batch}"
            described = (
                f"the {trajectories} trajectories of an update ({sizes} x algorithm.group_size {group_size})"
            )
        if remainder:
            found.error(
                key,
                f"{described} do not split evenly over the actor's {data_parallel} data-parallel ranks; "
                f"make {key.split('.')[1]} x group_size a multiple of {data_parallel}",
            )
        elif self.max_tokens_per_micro_batch is None and per_rank % self.micro_batch_size:
            found.error(
                "actor.micro_batch_size",
                f"{described} give {per_rank} per data-parallel rank ({data_parallel} ranks), which micro "
                f"batches of {self.micro_batch_size} do not divide; choose one of {divisors(per_rank)}",
            )


class TorchActorConfig(ActorCommon):
    """The PyTorch actor (asyncrl_core): data parallel over its devices, CPU or GPU."""

    backend: Literal["torch"] = "torch"
    """Training backend."""

    def check(self, root: AsyncRLConfig, found: Validation) -> None:
        super().check(root, found)
        for key in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, key) != 1:
                found.error(
                    f"actor.{key}",
                    "the torch actor is data parallel only; write 1, or `actor.backend: megatron`",
                )


class MegatronActorConfig(ActorCommon):
    """The Megatron-Core actor (asyncrl_megatron): tensor and data parallel. Built for GPUs; on CPU cores it
    runs with gloo, one process per tensor-parallel rank sharing the actor's cores (for tests)."""

    backend: Literal["megatron"] = "megatron"
    """Training backend."""
    sequence_parallel: bool = False
    """Split layer norms and dropout over the tensor-parallel group (needs `tensor_parallel_size > 1` and
    GPUs)."""
    use_distributed_optimizer: bool = True
    """Shard optimiser state over the data-parallel group (GPUs)."""

    def check(self, root: AsyncRLConfig, found: Validation) -> None:
        super().check(root, found)
        if self.pipeline_parallel_size != 1:
            found.error(
                "actor.pipeline_parallel_size",
                "the Megatron actor is tensor and data parallel, not pipeline parallel; write 1 and split "
                "the model over more devices with `actor.tensor_parallel_size`",
            )
        gpu = root.cluster.device_type == "gpu"
        model_parallel = self.tensor_parallel_size * self.pipeline_parallel_size
        num_devices = len(root.cluster.devices_of("actor")) if root.cluster.placement() else 0
        # On CPU cores every rank runs on all of the actor's cores: no count to divide.
        if gpu and num_devices and num_devices % model_parallel:
            found.error(
                "actor.tensor_parallel_size",
                f"tensor_parallel_size {self.tensor_parallel_size} x pipeline_parallel_size "
                f"{self.pipeline_parallel_size} = {model_parallel} does not divide the {num_devices} actor "
                f"devices; their product must be one of {divisors(num_devices)}",
            )
        if self.sequence_parallel and (self.tensor_parallel_size == 1 or not gpu):
            found.error(
                "actor.sequence_parallel",
                "needs `actor.tensor_parallel_size` above 1 and GPUs (gloo cannot reduce-scatter); write "
                "false",
            )


class PluginActorConfig(ActorCommon):
    """An actor from the entry-point group `asyncrl.actors`, or `module:attr`."""

    # The schema excludes the built-in names, so an editor matches exactly one member of the union.
    backend: Annotated[str, Field(min_length=1, json_schema_extra={"not": {"enum": ["torch", "megatron"]}})]
    """A name in the entry-point group `asyncrl.actors`, or `module:attr` of the actor factory."""
    backend_args: dict[str, JsonValue] = Field(default_factory=dict[str, JsonValue])
    """Settings of the plugin actor, which its factory reads from the configuration it is called with."""

    def check(self, root: AsyncRLConfig, found: Validation) -> None:
        super().check(root, found)
        from asyncrl_core import plugins

        problem = plugins.check_selectable("asyncrl.actors", self.backend)
        if problem is not None:
            found.error("actor.backend", problem)


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
    clip_eps_low: Annotated[Float, Field(ge=0.0, lt=1.0)] = 0.2
    """Lower clip of the importance ratio: `1 - clip_eps_low`."""
    clip_eps_high: Annotated[Float, Field(ge=0.0)] = 0.2
    """Upper clip of the importance ratio: `1 + clip_eps_high` (raise it for clip-higher)."""
    kl_coef: Annotated[Float, Field(ge=0.0)] = 0.0
    """Weight of the KL penalty against the initial (reference) model; 0 loads no reference model."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Estimator of the KL divergence per token (Schulman's k1, k2, k3)."""
    entropy_coef: Annotated[Float, Field(ge=0.0)] = 0.0
    """Weight of the entropy bonus."""
    off_policy_correction: Literal["none", "decoupled"] = "none"
    """`decoupled`: decoupled PPO, which clips against a proximal logprob recomputed by the actor before the
    update and weights each token by the truncated ratio of proximal to behaviour probability.
    `none`: clip against the behaviour logprobs the engines returned."""
    off_policy_max_weight: Annotated[Float, Field(ge=1.0)] = 2.0
    """Truncation of the decoupled importance weight (e.g. 2.0 or 5.0)."""

    def check(self, root: AsyncRLConfig, found: Validation) -> None:
        if self.group_size == 1:
            found.warn(
                "algorithm.group_size",
                "1 trajectory per prompt makes every group-relative advantage 0, so nothing is learnt; "
                "use 2 or more",
            )


class RolloutBufferConfig(Section):
    """Admission limits of the buffer between rollout and actor."""

    max_inflight_groups: PositiveInt | None = None
    """Groups being generated at once (engine load). Derived: `ceil(rollout.max_running_requests *
    rollout.num_instances * 1.2 / algorithm.group_size)`."""
    max_buffered_groups: PositiveInt | None = None
    """Groups in flight plus finished and waiting for the actor (data age). Derived:
    `2 * data.rollout_batch_size`, or `max_inflight_groups + data.rollout_batch_size` when that is larger (so
    the buffer limit does not cap what the engines generate); in async mode at most
    `agentloop.max_actor_accept_staleness * data.rollout_batch_size` (so a full buffer's last group is
    trained within the staleness cap), and never below `data.rollout_batch_size`."""
    max_dropped_groups_per_step: NonNegativeInt | None = None
    """Groups one step may drop as too stale before the run stops with an error. Derived:
    `10 * data.rollout_batch_size`."""
    max_failed_groups_per_step: NonNegativeInt | None = None
    """Groups whose generation may fail in one step (issued again, or dropped for good) before the run stops
    with an error: failures beyond it are systematic. Derived: `10 * data.rollout_batch_size`."""

    def derive(self, root: AsyncRLConfig, found: Validation) -> None:
        batch = root.data.rollout_batch_size
        inflight = self.max_inflight_groups
        num_instances = found.value("rollout.num_instances", root.rollout.num_instances)
        if inflight is None and num_instances is not None:
            inflight = derived_max_inflight_groups(
                root.rollout.max_running_requests, num_instances, root.algorithm.group_size
            )
            found.derive("rollout_buffer.max_inflight_groups", inflight)
        if self.max_buffered_groups is None:
            buffered = max(2 * batch, (inflight or 0) + batch)
            cap = root.agentloop.max_actor_accept_staleness
            if root.runner.async_mode and cap is not None:
                # A full buffer empties in buffered / batch steps: keep that within the staleness cap.
                buffered = max(batch, min(buffered, cap * batch))
            found.derive("rollout_buffer.max_buffered_groups", buffered)
        if self.max_dropped_groups_per_step is None:
            found.derive("rollout_buffer.max_dropped_groups_per_step", 10 * batch)
        if self.max_failed_groups_per_step is None:
            found.derive("rollout_buffer.max_failed_groups_per_step", 10 * batch)

    def check(self, root: AsyncRLConfig, found: Validation) -> None:
        batch = root.data.rollout_batch_size
        inflight, buffered = self.max_inflight_groups, self.max_buffered_groups
        if buffered is not None and buffered < batch:
            found.error(
                "rollout_buffer.max_buffered_groups",
                f"{buffered} is below data.rollout_batch_size {batch}, so a training batch could never fill; "
                f"write at least {batch} (the default is {2 * batch})",
            )
        elif (
            buffered is not None
            and inflight is not None
            and buffered < inflight + batch
            and not found.is_derived("rollout_buffer.max_buffered_groups")
        ):
            found.warn(
                "rollout_buffer.max_buffered_groups",
                f"{buffered} is below max_inflight_groups {inflight} + data.rollout_batch_size {batch}, so "
                f"the buffer limit, not the engines, caps generation; raise it to {inflight + batch} to keep "
                "the engines busy",
            )


class AgentLoopConfig(Section):
    """The agent loop: which loop and task run the trajectories, and how many at once."""

    agent_loop: Annotated[str, Field(min_length=1)] = "multi-turn"
    """How trajectories are run: a name in the entry-point group `asyncrl.agent_loops` (`multi-turn`,
    declared by asyncrl-agents: multi-turn, tool-using trajectories in one assistant message) or
    `module:attr` of an agent-loop factory (`asyncrl_core.protocols.AgentLoopFactory`)."""
    task_name: Annotated[str, Field(min_length=1)] | None = None
    """The task: a name in the entry-point group `asyncrl.tasks` (`asyncrl-run --list-tasks`) or
    `module:attr` of a task factory. Required."""
    task_args: dict[str, JsonValue] = Field(default_factory=dict[str, JsonValue])
    """Keyword arguments of the task factory."""
    max_actor_accept_staleness: NonNegativeInt | None = None
    """Drop a finished group when the actor's version exceeds the group's earliest version by more than
    this; unset keeps every group."""
    max_turns: PositiveInt | None = None
    """Most model turns of one trajectory, the last included, whatever the task's own count; unset uses the
    task's limit. (`searchr1` sets its own in `task_args.max_turns`, counted as Search-R1 does: that many
    turns that may search, then one answer turn.)"""
    num_workers: PositiveInt = 1
    """Agent-loop workers (processes); groups are spread over them."""
    max_concurrent_groups: PositiveInt | None = None
    """Groups one worker runs at once. Derived: `ceil(rollout_buffer.max_inflight_groups / num_workers)`."""
    max_worker_restarts: NonNegativeInt = 3
    """Times over the run a dead agent-loop worker is restarted (its groups are issued again), all workers
    together; one more death stops the run."""

    def derive(self, root: AsyncRLConfig, found: Validation) -> None:
        inflight = found.value("rollout_buffer.max_inflight_groups", root.rollout_buffer.max_inflight_groups)
        if self.max_concurrent_groups is None and inflight is not None:
            found.derive("agentloop.max_concurrent_groups", -(-inflight // self.num_workers))

    def check(self, root: AsyncRLConfig, found: Validation) -> None:
        from asyncrl_core import plugins

        problem = plugins.check_selectable("asyncrl.agent_loops", self.agent_loop)
        if problem is not None:
            found.error("agentloop.agent_loop", problem)
        if self.task_name is None:
            names = plugins.names("asyncrl.tasks")
            found.error(
                "agentloop.task_name",
                "no task selected; every run needs one (async mode included): write a name from "
                f"`asyncrl-run --list-tasks` ({', '.join(names) or 'none is installed'}) or `module:attr`",
            )
        else:
            problem = plugins.check_selectable("asyncrl.tasks", self.task_name)
            if problem is not None:
                found.error("agentloop.task_name", problem)
        batch = root.data.rollout_batch_size
        buffered = root.rollout_buffer.max_buffered_groups
        cap = self.max_actor_accept_staleness
        # Staleness exists only when rollout and training overlap.
        if root.runner.async_mode and cap is not None and buffered is not None and cap * batch < buffered:
            found.warn(
                "agentloop.max_actor_accept_staleness",
                f"{cap} is below max_buffered_groups / rollout_batch_size = {buffered}/{batch}, so groups "
                f"the buffer admits can wait longer than the cap and be dropped; raise it to "
                f"{-(-buffered // batch)} or lower rollout_buffer.max_buffered_groups",
            )
        inflight = root.rollout_buffer.max_inflight_groups
        if (
            inflight is not None
            and self.max_concurrent_groups is not None
            and self.max_concurrent_groups * self.num_workers < inflight
            and not found.is_derived("agentloop.max_concurrent_groups")
        ):
            found.warn(
                "agentloop.max_concurrent_groups",
                f"{self.num_workers} worker(s) x {self.max_concurrent_groups} groups run fewer groups than "
                f"rollout_buffer.max_inflight_groups {inflight}; raise it or remove it (it is derived)",
            )


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
    """When to save the run's state (actor, buffer with its groups, dataloader, ledger, random generators),
    and what to resume from."""

    save_every_steps: PositiveInt | None = None
    """Save a checkpoint every this many steps; unset saves none on the way."""
    save_at_end: bool = True
    """Save a checkpoint after the last step."""
    keep_last: PositiveInt = 2
    """Checkpoints kept under `<run_dir>/checkpoints`; older ones are deleted."""
    resume_from: str | None = None
    """Resume from this checkpoint folder, or `latest` for the newest intact one under
    `<run_dir>/checkpoints` (a damaged one is passed over with a warning naming the file)."""
    timeout_s: Annotated[Float, Field(gt=0.0)] = 1800.0
    """Seconds that saving or loading one checkpoint (actor, buffer state) may take before the run stops
    with an error naming it."""

    def check(self, root: AsyncRLConfig, found: Validation) -> None:
        num_steps = root.runner.num_steps
        periodic = self.save_every_steps is not None and self.save_every_steps <= num_steps
        if not periodic and not self.save_at_end:
            found.warn(
                "checkpoint.save_every_steps",
                f"no checkpoint is saved in {num_steps} steps; set it to at most {num_steps}, or "
                "`checkpoint.save_at_end: true`",
            )
        if self.resume_from not in (None, "latest") and not Path(self.resume_from).is_dir():
            found.error(
                "checkpoint.resume_from",
                f"{self.resume_from!r} is not a folder; give a checkpoint folder "
                "(`<run_dir>/checkpoints/...`) or `latest`",
            )


class WarmStartConfig(Section):
    """Supervised fine-tuning of `actor.model_path` on the task's demonstrations before RL starts
    (`asyncrl_core.actor.warm_start`); actor and engines then load the fine-tuned model. Off by default."""

    num_steps: NonNegativeInt = 0
    """Optimiser steps of the fine-tuning; 0 turns the warm start off."""
    lr: Annotated[float, Field(gt=0.0)] = 1e-3
    """Peak learning rate (AdamW): a linear warm-up over the first tenth of the steps, then a cosine decay
    to a tenth of it."""
    batch_size: PositiveInt = 16
    """Demonstrations per optimiser step."""
    max_len: PositiveInt = 1024
    """Most tokens of one demonstration (prompt and response); longer ones are cut at the end."""
    weight_decay: Annotated[float, Field(ge=0.0)] = 0.0
    """Decoupled weight decay of AdamW."""


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
    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig)
    """Supervised fine-tuning on the task's demonstrations before RL."""

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
        """Data-parallel ranks of the actor: `actor.data_parallel_size`, or what the placement gives."""
        if self.actor.data_parallel_size is not None:
            return self.actor.data_parallel_size
        return self.data_parallel_size_from_placement()

    def data_parallel_size_from_placement(self) -> int:
        """The actor's devices over `tensor * pipeline` parallel size on GPUs; 1 on a CPU, where one process
        trains with threads on all of its cores unless `actor.data_parallel_size` asks for more."""
        if self.cluster.device_type == "cpu":
            return 1
        model_parallel = self.actor.tensor_parallel_size * self.actor.pipeline_parallel_size
        return max(1, len(self.cluster.devices_of("actor")) // model_parallel)

    def sections(self) -> tuple[Section, ...]:
        """The sections, in the order their values are derived (a section may read values derived before
        it)."""
        return (
            self.cluster,
            self.runner,
            self.data,
            self.rollout,
            self.actor,
            self.algorithm,
            self.rollout_buffer,
            self.agentloop,
            self.logging,
            self.checkpoint,
        )

    @model_validator(mode="wrap")
    @classmethod
    def _resolve_and_check(cls, data: Any, handler: ModelWrapValidatorHandler[Self]) -> Self:
        """Validate fields, fill derived values, then apply every section's rules at once.

        Raises `ConfigError` (never pydantic's `ValidationError`) listing every problem with its key path.
        """
        try:
            parsed = handler(data)
        except ValidationError as error:
            raise ConfigError(problems_from_validation_error(error, cls)) from None
        found = Validation()
        for section in parsed.sections():
            section.derive(parsed, found)
        resolved = parsed
        if found.derived:
            tree = parsed.model_dump(mode="python")
            for key, value in found.derived.items():
                section_key, _, leaf = key.rpartition(".")
                node = tree
                for part in section_key.split("."):
                    node = node[part]
                node[leaf] = value
            try:
                resolved = handler(tree)
            except ValidationError as error:  # a derived value out of its field's range
                raise ConfigError(problems_from_validation_error(error, cls)) from None
        for section in resolved.sections():
            section.check(resolved, found)
        if not found.errors:
            for key, value in (
                ("rollout.num_instances", resolved.rollout.num_instances),
                ("rollout_buffer.max_inflight_groups", resolved.rollout_buffer.max_inflight_groups),
                ("agentloop.max_concurrent_groups", resolved.agentloop.max_concurrent_groups),
            ):
                if value is None:
                    found.error(key, "could not be derived from the other keys; set it explicitly")
        if found.errors:
            raise ConfigError(found.errors)
        resolved._derived_keys = frozenset(found.derived)
        resolved._warnings = tuple(found.warnings)
        return resolved
