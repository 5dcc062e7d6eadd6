"""YAML in, a validated `AsyncRLConfig` out; and the resolved configuration back to YAML.

Order of work: read the file (or the embedded default), apply the command-line overrides (`key=value`,
the value read as YAML), resolve `${dotted.key}` interpolations, then validate (which fills derived
defaults and checks every rule). Each step reports its problems as a `ConfigError` naming the key.

Interpolation: a string that is exactly `${a.b}` takes the value of key `a.b` with its type (a number stays
a number); `${a.b}` inside a longer string is replaced by the text of that value. A key absent from the file
resolves to its default where the model has one. `$${` writes a literal `${`.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Hashable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any, cast

import yaml

from asyncrl_core.config.keys import lookup
from asyncrl_core.config.models import AsyncRLConfig
from asyncrl_core.errors import ConfigError, ConfigProblem

DEFAULT_CONFIG = "searchr1-mini"
"""The configuration `asyncrl-run` uses when given none (embedded in the package)."""

_REFERENCE = re.compile(r"\$(\$?)\{([^}]*)\}")
_KEY = re.compile(r"^[A-Za-z_][\w-]*(\.[\w,-]+)*$")
_MAX_DEPTH = 64

Tree = dict[str, Any]


# libyaml's parser where PyYAML was built with it (ten times faster); the constructor is Python either way.
_SafeLoader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _UniqueKeyLoader(_SafeLoader):
    """A safe loader that rejects a key written twice in one mapping (PyYAML would keep the last)."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict[Hashable, Any]:
    loader.flatten_mapping(node)
    mapping: dict[Hashable, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)  # pyright: ignore[reportUnknownMemberType]
        if not isinstance(key, Hashable):
            raise yaml.constructor.ConstructorError(
                None, None, "a mapping key must be a plain value", key_node.start_mark
            )
        if key in mapping:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} is written twice in one mapping", key_node.start_mark
            )
        mapping[key] = loader.construct_object(value_node, deep=True)  # pyright: ignore[reportUnknownMemberType]
    return mapping


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def read_yaml(text: str, source: str) -> object:
    """Parse YAML text safely (no Python objects), rejecting repeated keys; errors name `source`."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as error:
        raise ConfigError(f"{source} is not valid YAML: {error}") from None
    except RecursionError:
        raise ConfigError(f"{source} nests too deeply") from None


def default_config_text() -> str:
    """The embedded default configuration (`searchr1-mini`)."""
    return resources.files("asyncrl_core.config").joinpath("defaults", f"{DEFAULT_CONFIG}.yaml").read_text()


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> AsyncRLConfig:
    """Read, override, interpolate and validate a configuration.

    `path` is a YAML file, or `None` for the embedded default. `overrides` are `key=value` strings whose
    values are read as YAML (`rollout.pause_mode=drain`, `cluster.component_placement.actor=0-3`).
    Raises `ConfigError` listing every problem found at the first step that fails.
    """
    if path is None:
        source, text = f"the embedded default `{DEFAULT_CONFIG}`", default_config_text()
    else:
        source = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise ConfigError(f"cannot read the configuration file {source}: {error}") from None
    tree = read_yaml(text, source)
    if tree is None:
        tree = {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{source} must hold a mapping of sections (runner:, cluster:, ...) at the top")
    non_text = [key for key in cast(dict[object, object], tree) if not isinstance(key, str)]
    if non_text:
        raise ConfigError([ConfigProblem(str(key), "section names must be text") for key in non_text])
    tree = cast(Tree, tree)
    apply_overrides(tree, parse_overrides(overrides))
    return AsyncRLConfig.model_validate(interpolate(tree))


def parse_overrides(overrides: Sequence[str]) -> list[tuple[list[str], object]]:
    """`key=value` strings as (key parts, value) pairs; every malformed one is reported at once."""
    parsed: list[tuple[list[str], object]] = []
    problems: list[ConfigProblem] = []
    for override in overrides:
        key, equals, value_text = override.partition("=")
        key = key.strip()
        if not equals or not key:
            problems.append(
                ConfigProblem(
                    key or override, f"override {override!r} is not `key=value` (e.g. `runner.seed=1`)"
                )
            )
            continue
        if not _KEY.match(key):
            problems.append(ConfigProblem(key, "not a dotted key such as `rollout.pause_mode`"))
            continue
        parts = key.split(".")
        found = lookup(AsyncRLConfig, parts)
        if not found.known:
            problems.append(ConfigProblem(key, found.problem))
            continue
        try:
            value = yaml.load(value_text, Loader=_UniqueKeyLoader) if value_text.strip() else None
        except (yaml.YAMLError, RecursionError) as error:
            problems.append(ConfigProblem(key, f"cannot read the value {value_text!r} as YAML: {error}"))
            continue
        parsed.append((parts, value))
    if problems:
        raise ConfigError(problems)
    return parsed


def apply_overrides(tree: Tree, overrides: list[tuple[list[str], object]]) -> None:
    """Set each override's value in `tree`, creating the sections it needs."""
    problems: list[ConfigProblem] = []
    for parts, value in overrides:
        node: Tree = tree
        for index, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                problems.append(
                    ConfigProblem(
                        ".".join(parts[: index + 1]),
                        f"holds {child!r} in the file, so `{'.'.join(parts)}` cannot be set; it must be a "
                        "section",
                    )
                )
                break
            node = cast(Tree, child)
        else:
            node[parts[-1]] = value
    if problems:
        raise ConfigError(problems)


def interpolate(tree: Tree) -> Tree:
    """A copy of `tree` with every `${key}` resolved (see the module docstring)."""
    resolver = _Interpolator(tree)
    return cast(Tree, resolver.resolve_node(copy.deepcopy(tree), []))


class _Interpolator:
    def __init__(self, tree: Tree) -> None:
        self.tree = tree
        self.done: dict[str, object] = {}
        self.active: list[str] = []

    def resolve_node(self, node: object, path: list[str]) -> object:
        if len(path) > _MAX_DEPTH:
            raise ConfigError(ConfigProblem(".".join(path), "the configuration nests too deeply"))
        if isinstance(node, dict):
            mapping = cast(dict[object, object], node)
            return {key: self.resolve_node(value, [*path, str(key)]) for key, value in mapping.items()}
        if isinstance(node, list):
            items = cast(list[object], node)
            return [self.resolve_node(item, [*path, f"[{index}]"]) for index, item in enumerate(items)]
        if isinstance(node, str) and "${" in node:
            return self.resolve_text(node, ".".join(path))
        return node

    def resolve_text(self, text: str, where: str) -> object:
        whole = _REFERENCE.fullmatch(text)
        if whole is not None and not whole.group(1):
            return copy.deepcopy(self.value_of(whole.group(2).strip(), where))

        def replace(match: re.Match[str]) -> str:
            if match.group(1):  # `$${...}` is a literal `${...}`
                return match.group(0)[1:]
            value = self.value_of(match.group(2).strip(), where)
            if isinstance(value, dict | list):
                raise ConfigError(
                    ConfigProblem(
                        where,
                        f"`${{{match.group(2)}}}` is a section or list and cannot be part of a longer text",
                    )
                )
            if value is None:
                return "null"
            if isinstance(value, bool):
                return "true" if value else "false"
            return str(value)

        return _REFERENCE.sub(replace, text)

    def value_of(self, key: str, where: str) -> object:
        if key in self.done:
            return self.done[key]
        if not _KEY.match(key):
            raise ConfigError(
                ConfigProblem(where, f"`${{{key}}}` does not name a dotted key such as `actor.model_path`")
            )
        if key in self.active:
            cycle = " -> ".join([*self.active[self.active.index(key) :], key])
            raise ConfigError(
                ConfigProblem(where, f"interpolation cycle: {cycle}; break it with a plain value")
            )
        parts = key.split(".")
        node: object = self.tree
        for part in parts:
            if isinstance(node, dict) and part in node:
                node = cast(dict[str, object], node)[part]
                continue
            found = lookup(AsyncRLConfig, parts)
            if found.known and found.has_default:
                node = found.default
                break
            reason = (
                found.problem if not found.known else "it is not set in the configuration and has no default"
            )
            raise ConfigError(ConfigProblem(where, f"`${{{key}}}` cannot be resolved: {reason}"))
        self.active.append(key)
        try:
            value = self.resolve_node(copy.deepcopy(node), parts)
        finally:
            self.active.pop()
        self.done[key] = value
        return value


def render_yaml(config: AsyncRLConfig, *, mark_derived: bool = True) -> str:
    """The resolved configuration as YAML, every key written out, derived values marked `# derived`.

    Loading the text again gives a configuration with the same values (with no key marked derived).
    """
    lines: list[str] = []
    _emit(config.model_dump(mode="json"), [], lines, config.derived_keys if mark_derived else frozenset())
    return "\n".join(lines) + "\n"


def _scalar(value: object) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, allow_unicode=True, width=1 << 30)
    return text.removesuffix("\n").removesuffix("\n...").strip()


def _emit(node: dict[str, Any], path: list[str], lines: list[str], derived: frozenset[str]) -> None:
    indent = "  " * len(path)
    for key, value in node.items():
        dotted = ".".join([*path, key])
        if isinstance(value, dict) and value:
            lines.append(f"{indent}{_scalar(key)}:")
            _emit(cast(dict[str, Any], value), [*path, key], lines, derived)
            continue
        mark = "  # derived" if dotted in derived else ""
        lines.append(f"{indent}{_scalar(key)}: {_scalar(value)}{mark}")
