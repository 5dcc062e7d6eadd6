"""YAML in, a validated `AsyncRLConfig` out; and the resolved configuration back to YAML.

OmegaConf reads the YAML and resolves interpolations; pydantic (`asyncrl_core.config.models`) checks types
and rules. Order of work: read the file (or the embedded default), apply the command-line overrides, fill
every key the file leaves out with its default (so `${...}` can refer to it), resolve the interpolations,
then validate, which fills derived values and checks every rule. Each step reports all of its problems at
once as a `ConfigError` naming the keys; YAML syntax errors name the file and the line.

Override syntax (OmegaConf's dotted `key=value`, as in Hydra):

- `key=value` sets one dotted key; the value is read as YAML (`runner.num_steps=5`, `actor.lr=1e-6`,
  `rollout.sglang.urls=[http://a:30000]`, `'cluster.component_placement={actor: 0, rollout: 1}'`). A section
  given as a mapping replaces the section of the file whole; `key=` and `key=null` set the value to null.
- `~key` removes a key from the file, so its default, or its derived value, applies again.

Interpolation (OmegaConf's): `${a.b}` alone takes the value of key `a.b` with its type (a number stays a
number); inside a longer string it is replaced by the value's text. A key the file leaves out resolves to its
default. `${oc.env:NAME}` reads an environment variable (`${oc.env:NAME,default}` with a fallback); `\\${`
writes a literal `${`.
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, cast

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException
from pydantic import BaseModel

from asyncrl_core.config.keys import lookup, member_for, section_models
from asyncrl_core.config.models import AsyncRLConfig
from asyncrl_core.errors import ConfigError, ConfigProblem

DEFAULT_CONFIG = "searchr1-mini"
"""The configuration `asyncrl-run` uses when given none (embedded in the package)."""

OVERRIDE_SYNTAX = (
    "`key=value` sets a dotted key, the value read as YAML (`runner.num_steps=5`, "
    "`'cluster.component_placement={actor: 0, rollout: 1}'`); `~key` removes a key so its default applies; "
    "`${a.b}` in a value refers to another key, `${oc.env:NAME}` to an environment variable"
)
"""One-line description of the override and interpolation syntax, for `--help` and `--schema`."""

_KEY = re.compile(r"^[A-Za-z_][\w-]*(\.[\w,-]+)*$")
_REFERENCE = re.compile(r"\$\{\s*([A-Za-z_][\w.,-]*)\s*\}")

Tree = dict[str, Any]


class _NamedText(io.StringIO):
    """Text that YAML's error marks name as `name` (PyYAML reads the stream's `name` attribute)."""

    def __init__(self, text: str, name: str) -> None:
        super().__init__(text)
        self.name = name


def _yaml_problem(error: yaml.YAMLError, source: str) -> str:
    """A YAML error in one line: the file, the line and column, and what is wrong there."""
    if isinstance(error, yaml.MarkedYAMLError) and error.problem_mark is not None:
        mark = error.problem_mark
        text = f"{source}, line {mark.line + 1}, column {mark.column + 1}: {error.problem}"
        if error.context and error.context_mark is not None:
            text += f" ({error.context} at line {error.context_mark.line + 1})"
        return text
    return f"{source} is not valid YAML: {' '.join(str(error).split())}"


def read_yaml(text: str, source: str) -> Tree:
    """Parse a configuration file's text with OmegaConf's YAML loader (safe: no Python objects; a key
    written twice in one mapping is an error) into plain data; errors name `source` and the line."""
    try:
        loaded = OmegaConf.load(_NamedText(text, source))
    except yaml.YAMLError as error:
        raise ConfigError(_yaml_problem(error, source)) from None
    except RecursionError:
        raise ConfigError(f"{source} nests too deeply") from None
    except (OmegaConfBaseException, ValueError, OSError) as error:
        raise ConfigError(f"{source} cannot be read as a configuration: {_first_line(error)}") from None
    if isinstance(loaded, ListConfig):
        raise ConfigError(f"{source} must hold a mapping of sections (runner:, cluster:, ...) at the top")
    tree = OmegaConf.to_container(loaded, resolve=False)
    assert isinstance(tree, dict)
    non_text = [key for key in tree if not isinstance(key, str)]
    if non_text:
        raise ConfigError([ConfigProblem(str(key), "section names must be text") for key in non_text])
    return cast(Tree, tree)


def default_config_text() -> str:
    """The embedded default configuration (`searchr1-mini`)."""
    return resources.files("asyncrl_core.config").joinpath("defaults", f"{DEFAULT_CONFIG}.yaml").read_text()


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> AsyncRLConfig:
    """Read, override, interpolate and validate a configuration.

    `path` is a YAML file, or `None` for the embedded default. `overrides` follow the syntax of the module
    docstring (`rollout.pause_mode=drain`, `~rollout_buffer.max_buffered_groups`).
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
    apply_overrides(tree, parse_overrides(overrides))
    fill_defaults(tree, AsyncRLConfig)
    return AsyncRLConfig.model_validate(interpolate(tree))


@dataclass(frozen=True, slots=True)
class Override:
    """One command-line override: set `parts` (a dotted key split at the dots) to `value`, or remove it."""

    parts: tuple[str, ...]
    value: object = None
    remove: bool = False

    @property
    def key(self) -> str:
        return ".".join(self.parts)


def parse_overrides(overrides: Sequence[str]) -> list[Override]:
    """`key=value` and `~key` strings as `Override`s; every malformed one is reported at once."""
    parsed: list[Override] = []
    problems: list[ConfigProblem] = []
    for override in overrides:
        remove = override.startswith("~")
        key, equals, value_text = override.removeprefix("~").partition("=")
        key = key.strip()
        if remove and equals:
            problems.append(ConfigProblem(key, f"`{override}`: `~key` removes a key and takes no value"))
            continue
        if not remove and (not equals or not key):
            problems.append(
                ConfigProblem(
                    key or override,
                    f"override {override!r} is not `key=value` (e.g. `runner.seed=1`) or `~key`",
                )
            )
            continue
        if not _KEY.match(key):
            problems.append(ConfigProblem(key, "not a dotted key such as `rollout.pause_mode`"))
            continue
        parts = tuple(key.split("."))
        found = lookup(AsyncRLConfig, list(parts))
        if not found.known:
            problems.append(ConfigProblem(key, found.problem))
            continue
        if remove:
            parsed.append(Override(parts, remove=True))
            continue
        try:
            value = _read_value(value_text)
        except (yaml.YAMLError, OmegaConfBaseException, ValueError, RecursionError) as error:
            problems.append(
                ConfigProblem(key, f"cannot read the value {value_text!r} as YAML: {_first_line(error)}")
            )
            continue
        parsed.append(Override(parts, value))
    if problems:
        raise ConfigError(problems)
    return parsed


def _read_value(text: str) -> object:
    """An override's value as OmegaConf reads a dotlist value (YAML; `1e-6` is a float)."""
    if not text.strip():
        return None
    holder = OmegaConf.from_dotlist([f"value={text}"])
    return cast(Tree, OmegaConf.to_container(holder, resolve=False))["value"]


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def apply_overrides(tree: Tree, overrides: Sequence[Override]) -> None:
    """Set or remove each override's key in `tree`, creating the sections a value needs."""
    problems: list[ConfigProblem] = []
    for override in overrides:
        node: Tree = tree
        parts = override.parts
        for index, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                if override.remove:
                    break
                child = node[part] = {}
            if not isinstance(child, dict):
                problems.append(
                    ConfigProblem(
                        ".".join(parts[: index + 1]),
                        f"holds {child!r} in the file, so `{override.key}` cannot be set; it must be a "
                        "section",
                    )
                )
                break
            node = cast(Tree, child)
        else:
            if override.remove:
                node.pop(parts[-1], None)
            else:
                node[parts[-1]] = override.value
    if problems:
        raise ConfigError(problems)


def fill_defaults(tree: Tree, model: type[BaseModel]) -> None:
    """Write into `tree` the default of every key of `model` it leaves out, in sections it holds as mappings
    (an empty section, `null`, counts as an empty mapping), so that interpolations can refer to defaults.

    Leaves required keys out (validation reports them) and anything that is not a mapping alone.
    """
    for name, info in model.model_fields.items():
        members = section_models(info.annotation)
        if members:
            if name not in tree:
                if info.is_required():
                    continue
                tree[name] = {}
            elif tree[name] is None:
                tree[name] = {}
            section = tree[name]
            if isinstance(section, dict):
                section = cast(Tree, section)
                backend = section.get("backend", "torch")
                if len(members) > 1 and isinstance(backend, str) and "${" in backend:
                    continue  # the member is known only once the reference is resolved
                fill_defaults(section, member_for(members, backend))
            continue
        if name not in tree and not info.is_required():
            default = info.get_default(call_default_factory=True)
            tree[name] = default.model_dump(mode="json") if isinstance(default, BaseModel) else default


def interpolate(tree: Tree) -> Tree:
    """`tree` with every `${...}` resolved by OmegaConf; every key whose value cannot be resolved is
    reported at once, with a `did you mean` where the reference names an unknown key."""
    config = OmegaConf.create(tree)
    problems: list[ConfigProblem] = []
    _check_node(config, tree, [], problems)
    if problems:
        raise ConfigError(problems)
    resolved = OmegaConf.to_container(config, resolve=True)
    return cast(Tree, resolved)


def _check_node(
    node: DictConfig | ListConfig, raw: object, path: list[str], problems: list[ConfigProblem]
) -> None:
    keys: Sequence[Any] = list(node.keys()) if isinstance(node, DictConfig) else range(len(node))
    for key in keys:
        where = [*path, f"[{key}]" if isinstance(key, int) else str(key)]
        raw_value = cast(Any, raw)[key]
        try:
            value = node[key]
        except MissingMandatoryValue:
            problems.append(ConfigProblem(_dotted(where), "`???` marks a value still to be given; give it"))
            continue
        except OmegaConfBaseException as error:
            problems.append(ConfigProblem(_dotted(where), _interpolation_problem(str(raw_value), error)))
            continue
        except RecursionError:
            problems.append(ConfigProblem(_dotted(where), "the configuration nests too deeply"))
            continue
        # A container that an interpolation produced was checked where it is written.
        if isinstance(value, DictConfig | ListConfig) and isinstance(raw_value, dict | list):
            _check_node(value, raw_value, where, problems)


def _dotted(parts: list[str]) -> str:
    return "".join(
        part if part.startswith("[") or index == 0 else f".{part}" for index, part in enumerate(parts)
    )


def _interpolation_problem(text: str, error: OmegaConfBaseException) -> str:
    reason = _first_line(error)
    if "Recursive interpolation" in reason:
        return (
            f"`{text}` cannot be resolved: interpolation cycle (it refers back to itself through other "
            "keys); break it with a plain value"
        )
    for reference in _REFERENCE.findall(text):
        found = lookup(AsyncRLConfig, reference.split("."))
        if not found.known:
            return f"`${{{reference}}}` cannot be resolved: {found.problem}"
        if "not found" in reason:
            return (
                f"`${{{reference}}}` cannot be resolved: it is not set in the configuration and has no "
                "default"
            )
    return f"`{text}` cannot be resolved: {reason}"


def render_yaml(config: AsyncRLConfig, *, mark_derived: bool = True) -> str:
    """The resolved configuration as YAML, every key written out, derived values marked `# derived`.

    Loading the text again gives a configuration with the same values (with no key marked derived).
    """
    lines: list[str] = []
    _emit(config.model_dump(mode="json"), [], lines, config.derived_keys if mark_derived else frozenset())
    return "\n".join(lines) + "\n"


def _scalar(value: object) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, allow_unicode=True, width=1 << 30)
    text = text.removesuffix("\n").removesuffix("\n...").strip()
    # OmegaConf would read `${...}` in a value as an interpolation again: escape it.
    return text.replace("${", "\\${") if isinstance(value, str) else text


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
