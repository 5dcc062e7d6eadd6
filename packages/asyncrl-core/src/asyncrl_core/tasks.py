"""`load_task`: builds the task registered by name in the entry-point group `asyncrl.tasks` (or given as
`module:attr`), its arguments checked against the task's arguments model (`asyncrl_core.config.task_args`).

The agent-loop workers build the run's task with it, and the driver builds one to start the task's services
(`Task.serve`); a test or a benchmark may build any installed task the same way.
"""

from __future__ import annotations

from collections.abc import Mapping

from asyncrl_core import plugins
from asyncrl_core.config.task_args import arguments_model, validate_task_args
from asyncrl_core.errors import ConfigError, PluginError
from asyncrl_core.protocols import Task

_TASK_MEMBERS = (
    "name",
    "max_turns",
    "stop",
    "dataset",
    "tools",
    "parse_turn",
    "observation",
    "reward",
    "demonstrations",
    "serve",
    "aclose",
)


def load_task(name: str, task_args: Mapping[str, object] | None = None) -> Task:
    """Build the task registered as `name` in `asyncrl.tasks` (or `module:attr`) with `task_args`.

    A task that declares an arguments model (`asyncrl_core.config.TaskArguments`) gets `task_args` checked
    against it and receives the checked values (defaults filled in).
    Raises `PluginError` when the name is unknown, the factory rejects the arguments, or what it builds
    lacks a member of the `Task` protocol (the message lists them).
    """
    factory = plugins.load("asyncrl.tasks", name)
    if not callable(factory):
        raise PluginError(f"`asyncrl.tasks`: {name!r} is {type(factory).__name__}, not a task factory")
    arguments = dict(task_args or {})
    model = arguments_model(factory)
    if model is not None:
        try:
            arguments = dict(validate_task_args(model, arguments))
        except ConfigError as error:
            raise PluginError(f"`asyncrl.tasks`: {name!r} rejected agentloop.task_args: {error}") from None
    try:
        task: object = factory(**arguments)
    except TypeError as error:
        raise PluginError(f"`asyncrl.tasks`: {name!r} rejected agentloop.task_args: {error}") from error
    if not isinstance(task, Task):
        missing = [member for member in _TASK_MEMBERS if not hasattr(task, member)]
        raise PluginError(
            f"`asyncrl.tasks`: {name!r} built a {type(task).__name__}, which is not a Task "
            f"(missing: {', '.join(missing) or 'none; check the signatures'})"
        )
    return task
