"""One registry for asyncrl's extension points: tasks, agent loops, actors and rollout backends.

A plugin is found by name in an entry-point group, so it can live in its own distribution:

```toml
[project.entry-points."asyncrl.tasks"]
my-task = "my_package.task:MyTask"
```

asyncrl-core's own plugins are listed in `BUILTINS` (an explicit table, no decorators); asyncrl's other
packages declare theirs as entry points, so core names none of them. A configuration may also name any
object directly as `module:attr`. Listing reads only package metadata;
loading imports the plugin's module, so a broken plugin is reported by `available()` and raised as a
`PluginError` by `load()` only when it is selected.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import re
import sys
from dataclasses import dataclass
from typing import Literal

from asyncrl_core.errors import PluginError

PluginGroup = Literal["asyncrl.tasks", "asyncrl.agent_loops", "asyncrl.actors", "asyncrl.rollout_backends"]
"""The entry-point groups asyncrl reads."""

GROUPS: tuple[PluginGroup, ...] = (
    "asyncrl.tasks",
    "asyncrl.agent_loops",
    "asyncrl.actors",
    "asyncrl.rollout_backends",
)

BUILTINS: dict[PluginGroup, dict[str, str]] = {
    "asyncrl.tasks": {},
    "asyncrl.agent_loops": {},
    "asyncrl.actors": {"torch": "asyncrl_core.actor:TorchActor.from_run_config"},
    "asyncrl.rollout_backends": {},
}
"""Plugins of asyncrl-core itself, as `module:attr` targets. asyncrl's other packages declare theirs as entry
points like any third-party plugin: asyncrl-megatron the actor `megatron`, asyncrl-sglang the rollout backend
`sglang`, asyncrl-agents the agent loop `multi-turn` and the tasks `searchr1` and `searchr1-mini`."""

BUILTIN_SOURCE = "asyncrl (built in)"

_TARGET = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


@dataclass(frozen=True, slots=True)
class PluginInfo:
    """One plugin of a group, as `available()` reports it."""

    group: str
    name: str
    target: str
    """`module:attr` the name points to."""
    source: str
    """The distribution that declares it (`name version`), or `BUILTIN_SOURCE`."""
    error: str | None = None
    """Why it cannot be loaded (`None` when it loads, or when loading was not tried)."""


def is_target(text: str) -> bool:
    """Whether `text` has the `module:attr` form (`package.module:Class`, `module:factory`)."""
    return _TARGET.match(text) is not None


def _check_group(group: str) -> PluginGroup:
    for known in GROUPS:
        if group == known:
            return known
    raise PluginError(f"unknown plugin group {group!r}; groups: {', '.join(GROUPS)}")


def _declared(group: PluginGroup) -> dict[str, list[PluginInfo]]:
    """Every declaration of every name in `group`: built-ins first, then entry points by distribution.

    Reading every installed distribution's metadata takes tens of milliseconds, and validation asks for
    each group once per configuration; the answer is kept per `sys.path`, so a folder added to it is seen.
    """
    return {name: list(infos) for name, infos in _declared_on_path(group, tuple(sys.path)).items()}


@functools.lru_cache(maxsize=32)
def _declared_on_path(group: PluginGroup, path: tuple[str, ...]) -> dict[str, tuple[PluginInfo, ...]]:
    del path  # the cache key: entry points are read from the folders on sys.path
    declared: dict[str, list[PluginInfo]] = {}
    for name, target in BUILTINS[group].items():
        declared.setdefault(name, []).append(PluginInfo(group, name, target, BUILTIN_SOURCE))
    for entry_point in importlib.metadata.entry_points(group=group):
        distribution = entry_point.dist
        source = f"{distribution.name} {distribution.version}" if distribution is not None else "unknown"
        info = PluginInfo(group, entry_point.name, entry_point.value, source)
        infos = declared.setdefault(entry_point.name, [])
        # The same distribution can be found twice on sys.path (an editable install and a build folder).
        if all((known.target, known.source) != (info.target, info.source) for known in infos):
            infos.append(info)
    return {name: tuple(infos) for name, infos in declared.items()}


def _conflict(infos: list[PluginInfo]) -> str | None:
    if len(infos) < 2:
        return None
    sources = "; ".join(f"{info.source} -> {info.target}" for info in infos)
    return f"declared more than once ({sources}); uninstall one, or select one by `module:attr`"


def names(group: str) -> list[str]:
    """The names of `group`, sorted, from metadata only (nothing is imported)."""
    return sorted(_declared(_check_group(group)))


def available(group: str, *, try_load: bool = True) -> list[PluginInfo]:
    """Every plugin of `group`, sorted by name, with why it is broken where it is.

    With `try_load`, each plugin's module is imported to find out; a failure is reported in
    `PluginInfo.error`, never raised.
    """
    checked = _check_group(group)
    infos: list[PluginInfo] = []
    for name, declarations in sorted(_declared(checked).items()):
        first = declarations[0]
        error = _conflict(declarations)
        if error is None and try_load:
            try:
                _import_target(checked, name, first.target)
            except PluginError as load_error:
                error = str(load_error)
        infos.append(PluginInfo(checked, name, first.target, first.source, error))
    return infos


def check_selectable(group: str, name: str) -> str | None:
    """Why `name` cannot be selected in `group`, without importing anything; `None` when it looks fine.

    A registered name is checked against the metadata; for `module:attr`, the syntax and that the top-level
    module exists (its attribute is checked when the plugin is loaded at launch, since importing a plugin
    can be slow).
    """
    checked = _check_group(group)
    if ":" in name:
        if not is_target(name):
            return f"{name!r} is not of the form `module:attr` (e.g. `my_package.tasks:MyTask`)"
        top_level = name.split(":", 1)[0].split(".", 1)[0]
        try:
            spec = importlib.util.find_spec(top_level)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            return f"module `{top_level}` of {name!r} is not installed"
        return None
    declared = _declared(checked)
    declarations = declared.get(name)
    if declarations is None:
        return f"no plugin named {name!r} in `{checked}`; {_listing(sorted(declared))}"
    return _conflict(declarations)


def check_module_found(group: str, name: str) -> str | None:
    """Why the module of plugin `name` cannot be found, or `None` when it can; the module itself is not
    imported (its parent packages are, which is what makes a dotted module findable).

    Cheaper than `load` by as much as the plugin's own imports cost (seconds for a task that imports an HTTP
    stack), so a dry run can afford it; an error raised inside the module shows only when it is loaded.
    """
    checked = _check_group(group)
    if ":" in name:
        target = name
    else:
        declarations = _declared(checked).get(name)
        if declarations is None or len(declarations) != 1:
            return check_selectable(checked, name)
        target = declarations[0].target
    module_name = target.split(":", 1)[0]
    try:
        found = importlib.util.find_spec(module_name) is not None
    except ModuleNotFoundError as error:
        if not error.name or not f"{module_name}.".startswith(f"{error.name}."):
            return f"`{checked}`: plugin {name!r} ({target}): {type(error).__name__}: {error}"
        return f"`{checked}`: plugin {name!r} ({target}): module `{error.name}` is not installed"
    except Exception as error:  # a parent package failed to import
        return f"`{checked}`: plugin {name!r} ({target}): {type(error).__name__}: {error}"
    if not found:
        return f"`{checked}`: plugin {name!r} ({target}): module `{module_name}` is not installed"
    return None


def _listing(found: list[str]) -> str:
    if not found:
        return "none is installed (or write `module:attr`)"
    return f"available: {', '.join(found)} (or write `module:attr`)"


def load(group: str, name: str) -> object:
    """The object registered as `name` in `group`, or the object `name` points to when it is `module:attr`.

    Raises `PluginError` naming the group, the name and what is available when the name is unknown,
    declared twice, or fails to import.
    """
    checked = _check_group(group)
    if ":" in name:
        if not is_target(name):
            raise PluginError(
                f"`{checked}`: {name!r} is not of the form `module:attr` (e.g. `my_package.tasks:MyTask`)"
            )
        return _import_target(checked, name, name)
    declared = _declared(checked)
    declarations = declared.get(name)
    if declarations is None:
        raise PluginError(f"`{checked}`: no plugin named {name!r}; {_listing(sorted(declared))}")
    conflict = _conflict(declarations)
    if conflict is not None:
        raise PluginError(f"`{checked}`: {name!r} is {conflict}")
    return _import_target(checked, name, declarations[0].target)


def _import_target(group: PluginGroup, name: str, target: str) -> object:
    module_name, _, attribute_path = target.partition(":")
    try:
        value: object = importlib.import_module(module_name)
    except Exception as error:  # a plugin's import may fail in any way; report it, do not crash the listing
        raise PluginError(
            f"`{group}`: plugin {name!r} ({target}) failed to import: {type(error).__name__}: {error}"
        ) from error
    for attribute in attribute_path.split("."):
        if not hasattr(value, attribute):
            raise PluginError(
                f"`{group}`: plugin {name!r} ({target}): `{module_name}` has no `{attribute_path}`"
            )
        value = getattr(value, attribute)
    return value
