"""Typed arguments of a task: the model a task declares for `agentloop.task_args`.

A task factory (usually the task class) declares its arguments as a `TaskArguments` model in the class
attribute `arguments_model`:

```python
class ArithArguments(TaskArguments):
    seed: int = 0
    \"\"\"Seed of the generated problems.\"\"\"

class ArithTask:
    arguments_model = ArithArguments
    def __init__(self, seed: int = 0) -> None: ...
```

`asyncrl-run --dry-run` validates `agentloop.task_args` against it (unknown, missing and ill-typed arguments
are refused before anything starts), `asyncrl-run --list-tasks` shows it, and the agent loop builds the task
with the validated values as keyword arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import PydanticUndefined

from asyncrl_core.config.keys import suggest
from asyncrl_core.errors import ConfigError, ConfigProblem

ARGUMENTS_ATTRIBUTE = "arguments_model"
"""The attribute of a task factory that holds its `TaskArguments` model."""

_WHERE = "agentloop.task_args"


class TaskArguments(BaseModel):
    """Base of a task's arguments model: unknown arguments are errors, types strict, values frozen, and each
    field's docstring is its description (shown by `asyncrl-run --list-tasks`)."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, strict=True, use_attribute_docstrings=True, allow_inf_nan=False
    )


def arguments_model(factory: object) -> type[TaskArguments] | None:
    """The arguments model `factory` declares, or `None` when it declares none."""
    model = getattr(factory, ARGUMENTS_ATTRIBUTE, None)
    if isinstance(model, type) and issubclass(model, TaskArguments):
        return model
    return None


def validate_task_args(model: type[TaskArguments], task_args: Mapping[str, object]) -> TaskArguments:
    """`task_args` checked against `model`; raises `ConfigError` naming every bad argument at once
    (`agentloop.task_args.<name>`)."""
    try:
        return model.model_validate(dict(task_args))
    except ValidationError as error:
        raise ConfigError(_problems(model, error)) from None


def _problems(model: type[TaskArguments], error: ValidationError) -> list[ConfigProblem]:
    names = list(model.model_fields)
    problems: list[ConfigProblem] = []
    for item in error.errors(include_url=False):
        key = _WHERE + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in item["loc"])
        kind = item["type"]
        if kind == "extra_forbidden":
            known = ", ".join(names) or "none"
            message = f"unknown argument; {suggest(str(item['loc'][-1]), names)}arguments: {known}"
        elif kind == "missing":
            message = "required argument is missing"
        else:
            shown = repr(item.get("input"))
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            message = f"{item['msg']} (got {shown})"
        problems.append(ConfigProblem(key, message))
    return problems


def describe_arguments(model: type[TaskArguments]) -> list[str]:
    """One line per argument: `name: type = default  description` (no default when it is required)."""
    lines: list[str] = []
    for name, info in model.model_fields.items():
        default = "" if info.default is PydanticUndefined else f" = {info.default!r}"
        if info.default_factory is not None:
            default = f" = {info.get_default(call_default_factory=True)!r}"
        description = " ".join((info.description or "").split())
        lines.append(f"{name}: {_type_name(info.annotation)}{default}  {description}".rstrip())
    return lines


def _type_name(annotation: object) -> str:
    origin = get_origin(annotation)
    if origin is None:
        return getattr(annotation, "__name__", repr(annotation))
    arguments = get_args(annotation)
    if str(origin) in ("typing.Union", "<class 'types.UnionType'>"):
        return " | ".join(_type_name(argument) for argument in arguments)
    if str(origin) == "typing.Literal":
        return " | ".join(repr(argument) for argument in arguments)
    if str(origin) == "typing.Annotated":
        return _type_name(arguments[0])
    return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type_name(a) for a in arguments)}]"
