"""What the validation of a configuration is made of, apart from the models: the collector of derived values,
errors and warnings that each section's rules write to, the helpers those rules share, and the translation
of pydantic's field errors into `ConfigProblem`s.

The rules themselves live on the section models (`asyncrl_core.config.models`), beside the fields they
check; this module imports no model, so the two never import each other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TypeVar, cast

from pydantic import BaseModel, ValidationError

from asyncrl_core.config.keys import field_names_at, suggest
from asyncrl_core.config.placement import format_device_ids
from asyncrl_core.errors import ConfigProblem

COMPONENTS = ("actor", "rollout", "reward")
"""Components that take devices in `cluster.component_placement`."""

INFLIGHT_HEADROOM_NUMERATOR, INFLIGHT_HEADROOM_DENOMINATOR = 12, 10
"""`max_inflight_groups` keeps 1.2x the engines' request slots busy, so a finished request is replaced at
once; exact integer arithmetic (no float rounding at large sizes)."""

ACTOR_TAGS = ("torch", "megatron", "plugin")
"""Tags of the actor union's members, which pydantic puts in an error's location after `actor`."""


_T = TypeVar("_T")


def derived_max_inflight_groups(max_running_requests: int, num_instances: int, group_size: int) -> int:
    """`ceil(max_running_requests * num_instances * 1.2 / group_size)`: 128 requests, 4 instances and
    groups of 8 give 77."""
    numerator = max_running_requests * num_instances * INFLIGHT_HEADROOM_NUMERATOR
    return -(-numerator // (INFLIGHT_HEADROOM_DENOMINATOR * group_size))


@dataclass
class Validation:
    """What validating one configuration finds: derived values by dotted key, then errors and warnings.

    Each section's `derive` fills `derived` (sections derived later read earlier results with `value`);
    each section's `check` adds problems. A rule that warns about a value first asks `is_derived`: a value
    asyncrl computed never warns about itself.
    """

    derived: dict[str, object] = field(default_factory=dict[str, object])
    errors: list[ConfigProblem] = field(default_factory=list[ConfigProblem])
    warnings: list[ConfigProblem] = field(default_factory=list[ConfigProblem])

    def derive(self, key: str, value: object) -> None:
        """Record `value` as the derived value of the unset key `key`."""
        self.derived[key] = value

    def value(self, key: str, current: _T | None) -> _T | None:
        """`current`, or the value derived for `key` so far when `current` is unset."""
        if current is not None:
            return current
        return cast("_T | None", self.derived.get(key))

    def is_derived(self, key: str) -> bool:
        return key in self.derived

    def error(self, key: str, message: str) -> None:
        self.errors.append(ConfigProblem(key, message))

    def warn(self, key: str, message: str) -> None:
        self.warnings.append(ConfigProblem(key, message))


def components(key: str) -> list[str]:
    """The component names of one placement key (`rollout,reward` names two)."""
    return [name.strip() for name in key.split(",")]


def devices_text(ids: tuple[int, ...]) -> str:
    """`device 3 is` or `devices 2-5 are`, for messages."""
    return f"device {ids[0]} is" if len(ids) == 1 else f"devices {format_device_ids(ids)} are"


def divisors(number: int) -> str:
    """The divisors of `number` as text (the six smallest and six largest when there are many)."""
    found = [divisor for divisor in range(1, math.isqrt(number) + 1) if number % divisor == 0]
    found += [number // divisor for divisor in reversed(found) if divisor * divisor != number]
    if len(found) > 12:
        found = [*found[:6], *found[-6:]]
    return ", ".join(str(divisor) for divisor in found)


def problems_from_validation_error(error: ValidationError, root: type[BaseModel]) -> list[ConfigProblem]:
    """pydantic's field errors as `ConfigProblem`s: dotted keys, `did you mean` for unknown keys, and the
    value that was given."""
    problems: list[ConfigProblem] = []
    for item in error.errors(include_url=False):
        location = list(item["loc"])
        actor_tag = ""
        if len(location) > 1 and location[0] == "actor" and location[1] in ACTOR_TAGS:
            actor_tag = str(location.pop(1))  # the union member's tag is not a key the user wrote
        key = ""
        for part in location:
            key += f"[{part}]" if isinstance(part, int) else (f".{part}" if key else str(part))
        kind = item["type"]
        given: object = item.get("input")
        if kind == "extra_forbidden":
            names = field_names_at(root, [str(part) for part in location[:-1]], actor_tag)
            message = f"unknown key; {suggest(str(location[-1]), names)}known keys here: {', '.join(names)}"
        elif kind == "missing":
            message = "required key is missing"
        elif given is None and kind in ("model_type", "model_attributes_type", "dict_type"):
            message = "the section is empty; give its keys or remove it"
        else:
            shown = repr(given)
            if len(shown) > 80:
                shown = shown[:77] + "..."
            message = f"{item['msg']} (got {shown})"
        problems.append(ConfigProblem(key, message))
    return problems
