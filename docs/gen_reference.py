"""The guide's reference pages, generated from the code at every build so they cannot drift from it.

- `reference/configuration.md`: every configuration key with its type, default and description, rendered
  from the JSON Schema that `asyncrl-run --schema` prints (`AsyncRLConfig.model_json_schema()`, whose
  descriptions are the models' field docstrings).
- `reference/metrics.md`: every metric name of `asyncrl_core.metrics` with its meaning, the docstring that
  follows its constant in that module, and when it is logged (the module's groupings).
- `reference/cli.md`: every option of `asyncrl-run` and `asyncrl-plot`, from their argparse parsers.

MkDocs loads this file as a hook (`hooks:` in mkdocs.yml): `on_files` adds the three pages to the build
in memory, so the site is always made from the code it documents and nothing generated is committed.
`python docs/gen_reference.py OUT_DIR` writes the same pages as Markdown files, for reading without a build.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GENERATED_NOTE = (
    "<!-- Generated at build time by docs/gen_reference.py from the code; edit the code, not this page. -->"
)

# --- configuration


@dataclass(frozen=True)
class ConfigKey:
    """One leaf key of the configuration, as the JSON Schema describes it."""

    path: str
    type: str
    default: str
    description: str
    applies_to: str = ""


def _resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref")
    if ref is None:
        return node
    return schema["$defs"][ref.rsplit("/", 1)[1]]


def _bounds(node: dict[str, Any]) -> str:
    parts: list[str] = []
    for keyword, sign in (
        ("exclusiveMinimum", ">"),
        ("gt", ">"),
        ("minimum", "≥"),
        ("ge", "≥"),
        ("exclusiveMaximum", "<"),
        ("lt", "<"),
        ("maximum", "≤"),
        ("le", "≤"),
    ):
        if keyword in node:
            parts.append(f"{sign} {node[keyword]}")
    return " " + ", ".join(parts) if parts else ""


def type_text(schema: dict[str, Any], node: dict[str, Any]) -> str:
    """A short English rendering of a JSON Schema type: `integer > 0 or null`, `` `http` | `grpc` ``."""
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[1]
        return "any JSON value" if name == "JsonValue" else "section"
    for union in ("anyOf", "oneOf"):
        if union in node:
            members = [type_text(schema, member) for member in node[union]]
            unique = list(dict.fromkeys(members))
            return " or ".join(unique)
    if "const" in node:
        return f"`{node['const']}`"
    if "enum" in node:
        return " \\| ".join(f"`{value}`" for value in node["enum"])
    kind = node.get("type")
    if kind == "array":
        return f"list of {_grouped(type_text(schema, node.get('items', {})))}"
    if kind == "object":
        values = node.get("additionalProperties")
        if not isinstance(values, dict):
            return "mapping"
        return f"mapping of text to {_grouped(type_text(schema, values))}"
    if kind == "string":
        return "non-empty text" if node.get("minLength") == 1 else "text"
    if kind == "boolean":
        return "boolean"
    if kind in ("integer", "number"):
        return ("integer" if kind == "integer" else "number") + _bounds(node)
    if kind == "null":
        return "null"
    return "any"


def _grouped(text: str) -> str:
    """`text` in parentheses when it is a union, so that `list of (a or b)` reads unambiguously."""
    return f"({text})" if " or " in text else text


def _default_text(node: dict[str, Any], required: bool, description: str) -> str:
    if required:
        return "required"
    if "default" not in node:
        kind = node.get("type")
        return "`{}`" if kind == "object" else "`[]`" if kind == "array" else "—"
    value = node["default"]
    if value is None:
        return "derived" if "Derived" in description else "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def _is_section(schema: dict[str, Any], node: dict[str, Any]) -> bool:
    target = _resolve(schema, node)
    return target is not node and "properties" in target


def _walk(schema: dict[str, Any], model: dict[str, Any], prefix: str, applies_to: str) -> Iterator[ConfigKey]:
    required = set(model.get("required", ()))
    for name, node in model["properties"].items():
        path = f"{prefix}{name}"
        if _is_section(schema, node):
            yield from _walk(schema, _resolve(schema, node), f"{path}.", applies_to)
            continue
        description = " ".join(node.get("description", "").split())
        yield ConfigKey(
            path=path,
            type=type_text(schema, node),
            default=_default_text(node, name in required, description),
            description=description,
            applies_to=applies_to,
        )


def config_schema() -> dict[str, Any]:
    """The JSON Schema of the configuration, as `asyncrl-run --schema` prints it."""
    from asyncrl_core.config import AsyncRLConfig

    return AsyncRLConfig.model_json_schema()


def config_sections(schema: dict[str, Any]) -> list[tuple[str, str, list[ConfigKey]]]:
    """`(section, its description, its keys)` for each top-level section. The actor section is a union
    chosen by `actor.backend`: the keys of the torch actor first, then those only one backend has."""
    sections: list[tuple[str, str, list[ConfigKey]]] = []
    for name, node in schema["properties"].items():
        description = " ".join(node.get("description", "").split())
        if "oneOf" in node:
            sections.append((name, description, _union_keys(schema, name, node["oneOf"])))
        else:
            model = _resolve(schema, node)
            section_text = " ".join(model.get("description", "").split())
            sections.append((name, section_text or description, list(_walk(schema, model, f"{name}.", ""))))
    return sections


def _union_keys(schema: dict[str, Any], name: str, members: list[dict[str, Any]]) -> list[ConfigKey]:
    """The keys of a section that is a union of models told apart by `backend` (the actor): a key every
    member has is listed once, its types joined where they differ; a key of some members says which."""
    labels: list[str] = []
    per_member: list[dict[str, ConfigKey]] = []
    for member in members:
        model = _resolve(schema, member)
        backend = model["properties"]["backend"]
        labels.append(f"`{backend['const']}`" if "const" in backend else "a plugin backend")
        per_member.append({key.path: key for key in _walk(schema, model, f"{name}.", "")})
    keys: list[ConfigKey] = []
    for path in dict.fromkeys(path for found in per_member for path in found):
        holders = [index for index, found in enumerate(per_member) if path in found]
        first = per_member[holders[0]][path]
        types = list(dict.fromkeys(per_member[index][path].type for index in holders))
        applies = (
            ""
            if len(holders) == len(members)
            else "`actor.backend`: " + ", ".join(labels[index] for index in holders)
        )
        descriptions = dict.fromkeys(per_member[index][path].description for index in holders)
        keys.append(ConfigKey(path, " or ".join(types), first.default, " ".join(descriptions), applies))
    return keys


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def configuration_page() -> str:
    """Markdown of the configuration reference."""
    schema = config_schema()
    lines = [
        GENERATED_NOTE,
        "",
        "# Configuration keys",
        "",
        "Every key of a run's YAML file, generated from the configuration models: the same descriptions, "
        "types and defaults as `asyncrl-run --schema`. *required* keys have no default; *derived* keys, "
        "when left unset, are computed from other keys during validation (the dry run marks them "
        '`# derived`); *unset* keys stay null. Values are strict: `true` is not a number and `"3"` is '
        "not a number; `1e-6` is a float.",
        "",
    ]
    for section, description, keys in config_sections(schema):
        lines += [f"## `{section}` {{ #{section} }}", "", description, ""]
        for key in keys:
            lines += [f"### `{key.path}` {{ #{key.path} }}", ""]
            facts = f"**Type:** {key.type} · **Default:** {key.default}"
            if key.applies_to:
                facts += f" · **Only with** {key.applies_to}"
            lines += [facts, "", key.description, ""]
    return "\n".join(lines)


def config_key_paths(schema: dict[str, Any]) -> list[str]:
    """Every leaf key's dotted path (the reference's anchors)."""
    return [key.path for _, _, keys in config_sections(schema) for key in keys]


# --- metrics


@dataclass(frozen=True)
class Metric:
    """One name of `asyncrl_core.metrics`: its constant, the logged name, its meaning."""

    constant: str
    name: str
    meaning: str


def metric_constants() -> list[Metric]:
    """Every string constant of `asyncrl_core.metrics` in source order, with the docstring that follows it
    (an empty meaning where there is none)."""
    from asyncrl_core import metrics

    tree = ast.parse(inspect.getsource(metrics))
    found: list[Metric] = []
    body = tree.body
    for index, statement in enumerate(body):
        target: ast.expr | None = None
        value: ast.expr | None = None
        if isinstance(statement, ast.AnnAssign):
            target, value = statement.target, statement.value
        elif isinstance(statement, ast.Assign) and len(statement.targets) == 1:
            target, value = statement.targets[0], statement.value
        if not isinstance(target, ast.Name) or not isinstance(value, ast.Constant):
            continue
        if not isinstance(value.value, str):
            continue
        meaning = ""
        following = body[index + 1] if index + 1 < len(body) else None
        if (
            isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            meaning = " ".join(following.value.value.split())
        found.append(Metric(target.id, getattr(metrics, target.id), meaning))
    return found


def _when_logged() -> dict[str, str]:
    from asyncrl_core import metrics

    when: dict[str, str] = {}
    for group, text in (
        ("EVERY_STEP", "every step"),
        ("SYNC_MODE_ONLY", "every step, sync mode"),
        ("ASYNC_MODE_ONLY", "every step, async mode"),
        ("EVAL_STEP", "evaluation steps"),
    ):
        for name in getattr(metrics, group, ()):
            when.setdefault(name, text)
    return when


_AREAS = (
    ("time/", "Time of a step (seconds)"),
    ("rollout/buffer/", "Admission"),
    ("rollout/", "Rollout: the data a step trained on"),
    ("train/", "Training"),
    ("eval/", "Evaluation"),
)


def _area(name: str) -> str:
    for prefix, title in _AREAS:
        if name.startswith(prefix):
            return title
    if "/" in name:
        return f"`{name.split('/', 1)[0]}/*`"
    return "Per trajectory (keys of `Trajectory.metrics`)"


def metrics_page() -> str:
    """Markdown of the metrics reference."""
    from asyncrl_core import metrics

    when = _when_logged()
    by_area: dict[str, list[Metric]] = {}
    for metric in metric_constants():
        by_area.setdefault(_area(metric.name), []).append(metric)
    lines = [
        GENERATED_NOTE,
        "",
        "# Metrics",
        "",
        "Every metric name, generated from `asyncrl_core.metrics`, the one module that names them: each "
        "emitter and reader uses its constants. A step's metrics go to `metrics.jsonl` (one JSON object "
        "per logged step) and TensorBoard in the run folder. *When* says which steps log a name, where the "
        "module groups it (`EVERY_STEP`, `SYNC_MODE_ONLY`, `ASYNC_MODE_ONLY`, `EVAL_STEP`); a name without "
        "it is logged where its meaning says.",
        "",
        " ".join((metrics.__doc__ or "").split()),
        "",
    ]
    for area, found in by_area.items():
        lines += [f"## {area}", "", "| name | constant | when | meaning |", "|---|---|---|---|"]
        for metric in found:
            name = f"{metric.name}…" if metric.constant.endswith("_PREFIX") else metric.name
            logged = when.get(metric.name, "")
            lines.append(f"| `{_cell(name)}` | `{metric.constant}` | {logged} | {_cell(metric.meaning)} |")
        lines.append("")
    builders = name_builders()
    if builders:
        lines += [
            "## Names built from a prefix",
            "",
            "A name ending in `…` above is a prefix; these functions of `asyncrl_core.metrics` build the "
            "full names.",
            "",
            "| function | builds |",
            "|---|---|",
        ]
        for signature, doc in builders:
            lines.append(f"| `{_cell(signature)}` | {_cell(doc)} |")
        lines.append("")
    return "\n".join(lines)


def name_builders() -> list[tuple[str, str]]:
    """`(signature, docstring)` of each public function of `asyncrl_core.metrics`."""
    from asyncrl_core import metrics

    found: list[tuple[str, str]] = []
    for name, function in inspect.getmembers(metrics, inspect.isfunction):
        if name.startswith("_") or function.__module__ != metrics.__name__:
            continue
        parameters = ", ".join(inspect.signature(function).parameters)
        found.append((f"{name}({parameters})", " ".join((inspect.getdoc(function) or "").split())))
    return found


# --- command lines


def command_parsers() -> list[argparse.ArgumentParser]:
    """The argparse parsers of the commands a user runs: `asyncrl-run` and `asyncrl-plot`."""
    from asyncrl_core import cli, plot

    return [cli._parser(), plot._parser()]  # pyright: ignore[reportPrivateUsage]


def _option_names(action: argparse.Action) -> str:
    if action.option_strings:
        names = ", ".join(f"`{name}`" for name in action.option_strings)
        if action.nargs != 0 and action.metavar is not None:
            names += f" `{action.metavar}`"
        return names
    return f"`{action.metavar or action.dest}`"


def cli_page() -> str:
    """Markdown of the command-line reference."""
    lines = [
        GENERATED_NOTE,
        "",
        "# Command lines",
        "",
        "Every option of the commands asyncrl installs, generated from their argparse parsers.",
        "",
    ]
    for parser in command_parsers():
        lines += [
            f"## `{parser.prog}` {{ #{parser.prog} }}",
            "",
            "```text",
            parser.format_usage().strip(),
            "```",
            "",
        ]
        if parser.description:
            lines += ["```text", parser.description.strip(), "```", ""]
        lines += ["| argument | default | meaning |", "|---|---|---|"]
        for action in parser._actions:  # pyright: ignore[reportPrivateUsage]
            help_text = "" if action.help in (None, argparse.SUPPRESS) else str(action.help)
            if isinstance(action, argparse._VersionAction):  # pyright: ignore[reportPrivateUsage]
                help_text = help_text or "print the version and exit"
            default = action.default
            shown = "" if default in (None, False, argparse.SUPPRESS) or action.nargs == 0 else f"`{default}`"
            lines.append(f"| {_option_names(action)} | {_cell(shown)} | {_cell(help_text)} |")
        lines.append("")
        if parser.epilog:
            lines += ["```text", parser.epilog.strip(), "```", ""]
    return "\n".join(lines)


def cli_option_strings() -> list[tuple[str, str]]:
    """`(command, option)` for every option string of every parser (positional arguments by metavar)."""
    found: list[tuple[str, str]] = []
    for parser in command_parsers():
        for action in parser._actions:  # pyright: ignore[reportPrivateUsage]
            for name in action.option_strings or [str(action.metavar or action.dest)]:
                found.append((parser.prog, name))
    return found


# --- the pages, and the MkDocs hook

PAGES: dict[str, Callable[[], str]] = {
    "reference/configuration.md": configuration_page,
    "reference/metrics.md": metrics_page,
    "reference/cli.md": cli_page,
}
"""Generated page (path under the docs folder) -> the function that renders it."""


def on_files(files: Any, config: Any) -> Any:
    """MkDocs hook: add the generated pages to the build (nothing is written into the docs folder)."""
    from mkdocs.structure.files import File

    for path, render in PAGES.items():
        files.append(File.generated(config, path, content=render()))
    return files


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python docs/gen_reference.py OUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    for path, render in PAGES.items():
        target = out / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(render(), encoding="utf-8")
        print(target)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
