"""Derived defaults and the cross-field rules of a configuration.

`derive` computes the values left unset (`None`) from other keys; `run_rules` checks every rule and
collects all problems, errors and warnings, each with its dotted key and the fix. Both are called by the
root validator of `AsyncRLConfig`, so any way of building a configuration runs them.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

from pydantic import ValidationError

from asyncrl_core.config.keys import field_names, suggest
from asyncrl_core.config.placement import (
    detect_devices,
    format_device_ids,
    parse_device_ids,
    visible_gpu_count,
)
from asyncrl_core.errors import ConfigProblem

if TYPE_CHECKING:
    from asyncrl_core.config.models import AsyncRLConfig, ClusterConfig

COMPONENTS = ("actor", "rollout", "reward")
"""Components that take devices in `cluster.component_placement`."""

INFLIGHT_HEADROOM_NUMERATOR, INFLIGHT_HEADROOM_DENOMINATOR = 12, 10
"""`max_inflight_groups` keeps 1.2x the engines' request slots busy, so a finished request is replaced at
once; exact integer arithmetic (no float rounding at large sizes)."""

_URL = re.compile(r"^https?://[^\s/:]+(:\d{1,5})?/?$")
_ACTOR_TAGS = ("torch", "megatron", "plugin")


def derived_max_inflight_groups(max_running_requests: int, num_instances: int, group_size: int) -> int:
    """`ceil(max_running_requests * num_instances * 1.2 / group_size)`: 128 requests, 4 instances and
    groups of 8 give 77."""
    numerator = max_running_requests * num_instances * INFLIGHT_HEADROOM_NUMERATOR
    return -(-numerator // (INFLIGHT_HEADROOM_DENOMINATOR * group_size))


def placement(cluster: ClusterConfig) -> dict[str, tuple[int, ...]] | None:
    """Device ids per placement key, or `None` when any key's ids cannot be read."""
    parsed: dict[str, tuple[int, ...]] = {}
    for key, text in cluster.component_placement.items():
        try:
            parsed[key] = parse_device_ids(text)
        except ValueError:
            return None
    return parsed


def _components(key: str) -> list[str]:
    return [name.strip() for name in key.split(",")]


def _rollout_instances(config: AsyncRLConfig) -> int | None:
    """Instances the placement and parallel sizes give, or `None` when they give none."""
    rollout = config.rollout
    if rollout.sglang.launch == "external":
        return len(rollout.sglang.urls) or None
    if placement(config.cluster) is None:
        return None
    return len(config.cluster.devices_of("rollout")) // rollout.tensor_parallel_size or None


def derive(config: AsyncRLConfig, warnings: list[ConfigProblem]) -> dict[str, object]:
    """The values of unset derived keys, by dotted key. Keys that cannot be derived (because of a problem
    `run_rules` reports) are left out."""
    derived: dict[str, object] = {}
    cluster, data, rollout, buffer = config.cluster, config.data, config.rollout, config.rollout_buffer
    device_type = cluster.device_type
    if device_type == "auto":
        device_type = "gpu" if visible_gpu_count() > 0 else "cpu"
        derived["cluster.device_type"] = device_type
    present = detect_devices(device_type)
    if cluster.num_devices is None and present > 0:
        derived["cluster.num_devices"] = present
    elif present == 0:
        unchecked = (
            "the placement is not checked against a device count; set `cluster.num_devices` to check it. "
            if cluster.num_devices is None
            else ""
        )
        warnings.append(
            ConfigProblem(
                "cluster.device_type",
                f"`gpu` is asked for but no GPU is visible on this machine: {unchecked}A launch here will "
                "fail (fine when preparing a configuration for another machine).",
            )
        )
    if config.runner.run_dir is None:
        derived["runner.run_dir"] = f"runs/{config.runner.name}"
    if data.seed is None:
        derived["data.seed"] = config.runner.seed
    if rollout.model_path is None:
        derived["rollout.model_path"] = config.actor.model_path
    if rollout.context_length is None:
        derived["rollout.context_length"] = data.max_prompt_len + data.max_response_len
    if rollout.sampling.max_new_tokens is None:
        derived["rollout.sampling.max_new_tokens"] = data.max_response_len
    num_instances = rollout.num_instances
    if num_instances is None:
        num_instances = _rollout_instances(config)
        if num_instances is not None:
            derived["rollout.num_instances"] = num_instances
    max_inflight_groups = buffer.max_inflight_groups
    if max_inflight_groups is None and num_instances is not None:
        max_inflight_groups = derived_max_inflight_groups(
            rollout.max_running_requests, num_instances, config.algorithm.group_size
        )
        derived["rollout_buffer.max_inflight_groups"] = max_inflight_groups
    if buffer.max_buffered_groups is None:
        derived["rollout_buffer.max_buffered_groups"] = 2 * data.rollout_batch_size
    if buffer.max_dropped_groups_per_step is None:
        derived["rollout_buffer.max_dropped_groups_per_step"] = 10 * data.rollout_batch_size
    if config.agentloop.max_concurrent_groups is None and max_inflight_groups is not None:
        derived["agentloop.max_concurrent_groups"] = -(-max_inflight_groups // config.agentloop.num_workers)
    return derived


def run_rules(config: AsyncRLConfig, errors: list[ConfigProblem], warnings: list[ConfigProblem]) -> None:
    """Check every cross-field rule, appending to `errors` and `warnings`."""
    _check_placement(config, errors)
    _check_rollout(config, errors, warnings)
    _check_actor(config, errors)
    _check_batches(config, errors, warnings)
    _check_lengths(config, errors)
    _check_buffer(config, errors, warnings)
    _check_plugins(config, errors)
    _check_checkpoint(config, warnings)
    if not errors:
        _check_resolved(config, errors)


def _check_placement(config: AsyncRLConfig, errors: list[ConfigProblem]) -> None:
    cluster = config.cluster
    root = "cluster.component_placement"
    parsed: dict[str, tuple[int, ...]] = {}
    owner: dict[str, str] = {}
    for key, text in cluster.component_placement.items():
        names = _components(key)
        for name in names:
            if name not in COMPONENTS:
                hint = suggest(name, list(COMPONENTS))
                errors.append(
                    ConfigProblem(
                        f"{root}.{key}",
                        f"unknown component {name!r}; {hint}components: {', '.join(COMPONENTS)}",
                    )
                )
            elif name in owner:
                errors.append(
                    ConfigProblem(
                        f"{root}.{key}",
                        f"`{name}` is placed twice (also under `{owner[name]}`); list each component under "
                        "one key",
                    )
                )
            else:
                owner[name] = key
        try:
            parsed[key] = parse_device_ids(text)
        except ValueError as error:
            errors.append(ConfigProblem(f"{root}.{key}", str(error)))
    if len(parsed) != len(cluster.component_placement):
        return
    if cluster.num_devices is not None:
        ids_text = f"ids 0-{cluster.num_devices - 1}" if cluster.num_devices > 1 else "id 0"
        for key, ids in parsed.items():
            absent = tuple(device_id for device_id in ids if device_id >= cluster.num_devices)
            if absent:
                errors.append(
                    ConfigProblem(
                        f"{root}.{key}",
                        f"{_devices(absent)} not present: there are "
                        f"{cluster.num_devices} {cluster.device_type} devices ({ids_text}); use ids below "
                        f"{cluster.num_devices} or set `cluster.num_devices`",
                    )
                )
    keys = list(parsed)
    for index, first in enumerate(keys):
        for second in keys[index + 1 :]:
            shared = tuple(sorted(set(parsed[first]) & set(parsed[second])))
            if not shared:
                continue
            names = _components(first) + _components(second)
            fix = "give each key its own devices"
            if not (config.runner.async_mode and {"actor", "rollout"} <= set(names)):
                fix += f", or list colocated components under one key (`{','.join(names)}: ...`)"
            errors.append(
                ConfigProblem(f"{root}.{second}", f"{_devices(shared)} also placed under `{first}`; {fix}")
            )
    needed = ["actor"]
    if config.rollout.sglang.launch != "external":
        needed.append("rollout")
    free = 0 if cluster.num_devices is None else cluster.num_devices
    for component in needed:
        if component not in owner:
            example = f"{component}: {free - 1}" if free else f"{component}: 0"
            errors.append(ConfigProblem(root, f"no devices for `{component}`; add a key such as `{example}`"))
    # Under two keys, shared devices are already an overlap error; under one key they are colocated.
    if config.runner.async_mode and "actor" in owner and owner.get("rollout") == owner["actor"]:
        errors.append(
            ConfigProblem(
                f"{root}.{owner['actor']}",
                f"async mode needs the actor and the rollout on different devices, but both use "
                f"{format_device_ids(parsed[owner['actor']])}; place them apart (e.g. `actor: 0-3`, "
                "`rollout: 4-7`) or set `runner.async_mode: false`",
            )
        )


def _check_rollout(config: AsyncRLConfig, errors: list[ConfigProblem], warnings: list[ConfigProblem]) -> None:
    rollout, sglang = config.rollout, config.rollout.sglang
    if config.runner.async_mode and sglang.backend_type != "server":
        errors.append(
            ConfigProblem(
                "rollout.sglang.backend_type",
                "async mode needs the rollout behind the SGLang server protocol; write `server` "
                "(or set `runner.async_mode: false`)",
            )
        )
    if sglang.launch == "sglang" and config.cluster.device_type == "cpu":
        errors.append(
            ConfigProblem(
                "rollout.sglang.launch",
                "`sglang` starts real SGLang servers, which need GPUs; write `builtin` on CPU "
                "(or set `cluster.device_type: gpu`)",
            )
        )
    if sglang.launch == "external":
        if not sglang.urls:
            errors.append(
                ConfigProblem(
                    "rollout.sglang.urls",
                    "`launch: external` needs the servers' base URLs, e.g. `urls: [http://10.0.0.2:30000]`",
                )
            )
    elif sglang.urls:
        errors.append(
            ConfigProblem(
                "rollout.sglang.urls",
                f"URLs are used only with `launch: external` (launch is `{sglang.launch}`); remove them or "
                "write `rollout.sglang.launch: external`",
            )
        )
    for index, url in enumerate(sglang.urls):
        if not _URL.match(url):
            errors.append(
                ConfigProblem(
                    f"rollout.sglang.urls[{index}]", f"{url!r} is not a base URL; write `http://host:port`"
                )
            )
    if len(set(sglang.urls)) != len(sglang.urls):
        errors.append(ConfigProblem("rollout.sglang.urls", "a URL is listed twice; list each server once"))
    if sglang.launch != "external" and placement(config.cluster) is not None:
        num_devices = len(config.cluster.devices_of("rollout"))
        if num_devices and num_devices % rollout.tensor_parallel_size:
            errors.append(
                ConfigProblem(
                    "rollout.tensor_parallel_size",
                    f"{rollout.tensor_parallel_size} does not divide the {num_devices} rollout devices; "
                    f"choose one of {_divisors(num_devices)}",
                )
            )
    if sglang.launch == "external" and "rollout" in {
        name for key in config.cluster.component_placement for name in _components(key)
    }:
        warnings.append(
            ConfigProblem(
                "cluster.component_placement",
                "`rollout` devices are unused with `rollout.sglang.launch: external`; remove them",
            )
        )
    computed = _rollout_instances(config)
    if rollout.num_instances is not None and computed is not None and rollout.num_instances != computed:
        source = (
            "the number of `rollout.sglang.urls`"
            if sglang.launch == "external"
            else "the rollout devices divided by `rollout.tensor_parallel_size`"
        )
        errors.append(
            ConfigProblem(
                "rollout.num_instances",
                f"{rollout.num_instances} disagrees with {source}, which give {computed}; remove the key "
                "(it is derived)",
            )
        )
    if rollout.sampling.top_k == 0:
        errors.append(ConfigProblem("rollout.sampling.top_k", "0 keeps no token; write -1 to keep all"))


def _check_actor(config: AsyncRLConfig, errors: list[ConfigProblem]) -> None:
    actor = config.actor
    if actor.backend == "megatron" and config.cluster.device_type == "cpu":
        errors.append(ConfigProblem("actor.backend", "Megatron needs GPUs; write `torch` to train on CPU"))
    if actor.backend == "torch":
        for key in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(actor, key) != 1:
                errors.append(
                    ConfigProblem(
                        f"actor.{key}",
                        "the torch actor is data parallel only; write 1, or `actor.backend: megatron`",
                    )
                )
    if actor.backend == "megatron":
        model_parallel = actor.tensor_parallel_size * actor.pipeline_parallel_size
        num_devices = len(config.cluster.devices_of("actor")) if placement(config.cluster) else 0
        if num_devices and num_devices % model_parallel:
            errors.append(
                ConfigProblem(
                    "actor.tensor_parallel_size",
                    f"tensor_parallel_size {actor.tensor_parallel_size} x pipeline_parallel_size "
                    f"{actor.pipeline_parallel_size} = {model_parallel} does not divide the {num_devices} "
                    f"actor devices; their product must be one of {_divisors(num_devices)}",
                )
            )
        if getattr(actor, "sequence_parallel", False) and actor.tensor_parallel_size == 1:
            errors.append(
                ConfigProblem(
                    "actor.sequence_parallel",
                    "needs `actor.tensor_parallel_size` above 1; write false",
                )
            )


def _check_batches(config: AsyncRLConfig, errors: list[ConfigProblem], warnings: list[ConfigProblem]) -> None:
    group_size = config.algorithm.group_size
    if group_size == 1:
        warnings.append(
            ConfigProblem(
                "algorithm.group_size",
                "1 trajectory per prompt makes every group-relative advantage 0, so nothing is learnt; "
                "use 2 or more",
            )
        )
    if placement(config.cluster) is None or not config.cluster.devices_of("actor"):
        return
    trajectories = config.data.rollout_batch_size * group_size
    data_parallel = config.actor_data_parallel_size
    per_rank, remainder = divmod(trajectories, data_parallel)
    described = (
        f"the {trajectories} trajectories of a step (data.rollout_batch_size "
        f"{config.data.rollout_batch_size} x algorithm.group_size {group_size})"
    )
    if remainder:
        errors.append(
            ConfigProblem(
                "data.rollout_batch_size",
                f"{described} do not split evenly over the actor's {data_parallel} data-parallel ranks; "
                f"make rollout_batch_size x group_size a multiple of {data_parallel}",
            )
        )
        return
    micro_batch_size = config.actor.micro_batch_size
    if per_rank % micro_batch_size:
        errors.append(
            ConfigProblem(
                "actor.micro_batch_size",
                f"{described} give {per_rank} per data-parallel rank ({data_parallel} ranks), which micro "
                f"batches of {micro_batch_size} do not divide; choose one of {_divisors(per_rank)}",
            )
        )


def _check_lengths(config: AsyncRLConfig, errors: list[ConfigProblem]) -> None:
    data, context_length = config.data, config.rollout.context_length
    if context_length is not None and data.max_prompt_len + data.max_response_len > context_length:
        errors.append(
            ConfigProblem(
                "rollout.context_length",
                f"{context_length} tokens cannot hold data.max_prompt_len {data.max_prompt_len} + "
                f"data.max_response_len {data.max_response_len} = "
                f"{data.max_prompt_len + data.max_response_len}; raise it or shorten those lengths",
            )
        )


def _check_buffer(config: AsyncRLConfig, errors: list[ConfigProblem], warnings: list[ConfigProblem]) -> None:
    batch = config.data.rollout_batch_size
    buffer = config.rollout_buffer
    inflight, buffered = buffer.max_inflight_groups, buffer.max_buffered_groups
    if buffered is not None and buffered < batch:
        errors.append(
            ConfigProblem(
                "rollout_buffer.max_buffered_groups",
                f"{buffered} is below data.rollout_batch_size {batch}, so a training batch could never fill; "
                f"write at least {batch} (the default is {2 * batch})",
            )
        )
    elif buffered is not None and inflight is not None and buffered < inflight + batch:
        warnings.append(
            ConfigProblem(
                "rollout_buffer.max_buffered_groups",
                f"{buffered} is below max_inflight_groups {inflight} + data.rollout_batch_size {batch}, so "
                f"the buffer limit, not the engines, caps generation; raise it to {inflight + batch} to keep "
                "the engines busy",
            )
        )
    staleness_cap = config.agentloop.max_actor_accept_staleness
    if staleness_cap is not None and buffered is not None and staleness_cap * batch < buffered:
        warnings.append(
            ConfigProblem(
                "agentloop.max_actor_accept_staleness",
                f"{staleness_cap} is below max_buffered_groups / rollout_batch_size = {buffered}/{batch}, so "
                "groups the buffer admits can wait longer than the cap and be dropped; raise it to "
                f"{-(-buffered // batch)} or lower rollout_buffer.max_buffered_groups",
            )
        )
    workers = config.agentloop
    if (
        inflight is not None
        and workers.max_concurrent_groups is not None
        and workers.max_concurrent_groups * workers.num_workers < inflight
    ):
        warnings.append(
            ConfigProblem(
                "agentloop.max_concurrent_groups",
                f"{workers.num_workers} worker(s) x {workers.max_concurrent_groups} groups run fewer groups "
                f"than rollout_buffer.max_inflight_groups {inflight}; raise it or remove it (it is derived)",
            )
        )


def _check_resolved(config: AsyncRLConfig, errors: list[ConfigProblem]) -> None:
    """Every derived key has a value once the rules pass (`cluster.num_devices` may stay unset: no GPU)."""
    values = {
        "rollout.num_instances": config.rollout.num_instances,
        "rollout_buffer.max_inflight_groups": config.rollout_buffer.max_inflight_groups,
        "agentloop.max_concurrent_groups": config.agentloop.max_concurrent_groups,
    }
    for key, value in values.items():
        if value is None:
            errors.append(ConfigProblem(key, "could not be derived from the other keys; set it explicitly"))


def _check_checkpoint(config: AsyncRLConfig, warnings: list[ConfigProblem]) -> None:
    checkpoint, num_steps = config.checkpoint, config.runner.num_steps
    periodic = checkpoint.save_every_steps is not None and checkpoint.save_every_steps <= num_steps
    if not periodic and not checkpoint.save_at_end:
        warnings.append(
            ConfigProblem(
                "checkpoint.save_every_steps",
                f"no checkpoint is saved in {num_steps} steps; set it to at most {num_steps}, or "
                "`checkpoint.save_at_end: true`",
            )
        )


def _check_plugins(config: AsyncRLConfig, errors: list[ConfigProblem]) -> None:
    from asyncrl_core import plugins

    task_name = config.agentloop.task_name
    if task_name is None:
        names = plugins.names("asyncrl.tasks")
        errors.append(
            ConfigProblem(
                "agentloop.task_name",
                "no task selected; every run needs one (async mode included): write a name from "
                f"`asyncrl-run --list-tasks` ({', '.join(names) or 'none is installed'}) or `module:attr`",
            )
        )
    else:
        problem = plugins.check_selectable("asyncrl.tasks", task_name)
        if problem is not None:
            errors.append(ConfigProblem("agentloop.task_name", problem))
    if config.actor.backend not in ("torch", "megatron"):
        problem = plugins.check_selectable("asyncrl.actors", config.actor.backend)
        if problem is not None:
            errors.append(ConfigProblem("actor.backend", problem))
    if config.rollout.rollout_backend != "sglang":
        problem = plugins.check_selectable("asyncrl.rollout_backends", config.rollout.rollout_backend)
        if problem is not None:
            errors.append(ConfigProblem("rollout.rollout_backend", problem))


def _devices(ids: tuple[int, ...]) -> str:
    """`device 3 is` or `devices 2-5 are`, for messages."""
    return f"device {ids[0]} is" if len(ids) == 1 else f"devices {format_device_ids(ids)} are"


def _divisors(number: int) -> str:
    found = [divisor for divisor in range(1, math.isqrt(number) + 1) if number % divisor == 0]
    found += [number // divisor for divisor in reversed(found) if divisor * divisor != number]
    if len(found) > 12:
        found = [*found[:6], *found[-6:]]
    return ", ".join(str(divisor) for divisor in found)


def problems_from_validation_error(error: ValidationError) -> list[ConfigProblem]:
    """pydantic's field errors as `ConfigProblem`s: dotted keys, `did you mean` for unknown keys, and the
    value that was given."""
    problems: list[ConfigProblem] = []
    for item in error.errors(include_url=False):
        location = list(item["loc"])
        actor_tag = ""
        if len(location) > 1 and location[0] == "actor" and location[1] in _ACTOR_TAGS:
            actor_tag = str(location.pop(1))  # the union member's tag is not a key the user wrote
        key = ""
        for part in location:
            key += f"[{part}]" if isinstance(part, int) else (f".{part}" if key else str(part))
        kind = item["type"]
        if kind == "extra_forbidden":
            names = _names_at([str(part) for part in location[:-1]], actor_tag)
            message = f"unknown key; {suggest(str(location[-1]), names)}known keys here: {', '.join(names)}"
        elif kind == "missing":
            message = "required key is missing"
        else:
            shown = repr(item["input"])
            if len(shown) > 80:
                shown = shown[:77] + "..."
            message = f"{item['msg']} (got {shown})"
        problems.append(ConfigProblem(key, message))
    return problems


def _names_at(parents: list[str], actor_tag: str) -> list[str]:
    """Field names of the section at `parents` (the actor variant chosen by `actor_tag`)."""
    from asyncrl_core.config import models

    actor_models: dict[str, type[models.Section]] = {
        "torch": models.TorchActorConfig,
        "megatron": models.MegatronActorConfig,
        "plugin": models.PluginActorConfig,
    }
    section: type[models.Section] = models.AsyncRLConfig
    for part in parents:
        if section is models.AsyncRLConfig and part == "actor":
            section = actor_models.get(actor_tag, models.TorchActorConfig)
            continue
        info = section.model_fields.get(part)
        if info is None or not (
            isinstance(info.annotation, type) and issubclass(info.annotation, models.Section)
        ):
            return []
        section = info.annotation
    return field_names([section])


def check_launch_devices(config: AsyncRLConfig) -> list[ConfigProblem]:
    """Problems that only a launch on this machine has: placement ids beyond the devices present here.

    A dry run skips this, so a cluster's configuration can be prepared on a laptop. With `RAY_ADDRESS` set
    the run joins a Ray cluster whose devices are not all on this machine, and this check is left to the
    runner, which sees the cluster's resources.
    """
    import os

    cluster = config.cluster
    if os.environ.get("RAY_ADDRESS") or placement(cluster) is None:
        return []
    used = [device_id for ids in (placement(cluster) or {}).values() for device_id in ids]
    if not used:
        return []
    device_type = "gpu" if cluster.device_type == "gpu" else "cpu"
    present = detect_devices(device_type)
    needed = max(used) + 1
    if present >= needed:
        return []
    what = "GPUs are visible" if device_type == "gpu" else "CPU cores are present"
    return [
        ConfigProblem(
            "cluster.component_placement",
            f"the placement uses {device_type} ids up to {needed - 1}, but only {present} {what} on this "
            f"machine; place the components on ids below {present}, or join a Ray cluster (RAY_ADDRESS)"
            if present
            else f"the placement asks for {device_type} devices, but no {what.split(' ')[0]} "
            "is visible on this machine; write `cluster.device_type: cpu` to run on CPU cores",
        )
    ]
