"""The user guide (docs/) against the code: it builds strictly, its generated references cover every
configuration key, metric and command-line option, and every command and configuration it shows works.

One strict build of the site (module fixture) serves the reference checks. Fenced blocks of the guide and
the README are exercised by language: `yaml` blocks pass `asyncrl-run --dry-run` (a fragment names the
example it changes in its first line, `# over examples/<file>.yaml`); each line of a `bash` block is run
through a handler for its program (`asyncrl-run ...` with `--dry-run`, `make` targets that exist, scripts
and modules that exist with valid overrides, ...); a program without a handler fails the test, so a new
kind of command gets one. `text` blocks are output and are not run.
"""

from __future__ import annotations

import html
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from omegaconf import OmegaConf

from asyncrl_core import cli, metrics, plot
from asyncrl_core.config import AsyncRLConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = DOCS / "pages"
SOURCES = [*sorted(PAGES.rglob("*.md")), ROOT / "README.md"]
TESTED_LANGUAGES = {"bash", "yaml", "toml", "python"}
UNTESTED_LANGUAGES = {"text"}

pytestmark = pytest.mark.slow


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gen_reference = _load_generator()


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The guide built once, strictly, into a temporary folder."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(DOCS / "mkdocs.yml"), "-d", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr + result.stdout
    assert "WARNING" not in result.stderr + result.stdout, result.stderr + result.stdout
    return out


def page_text(site: Path, page: str) -> str:
    """A built page as text: tags removed, entities decoded, without whitespace (markup moves spaces)."""
    source = (site / page / "index.html").read_text(encoding="utf-8")
    return "".join(html.unescape(re.sub(r"<[^>]+>", " ", source)).split())


def page_ids(site: Path, page: str) -> set[str]:
    source = (site / page / "index.html").read_text(encoding="utf-8")
    return set(re.findall(r'\bid="([^"]+)"', source))


def plain(markdown: str) -> str:
    """Markdown inline text as `page_text` shows it: no backticks, no whitespace."""
    return "".join(markdown.replace("`", "").split())


# --- the references


def schema_keys(schema: dict[str, Any]) -> dict[str, str]:
    """Every leaf key path of the schema with its description, walked here independently of the
    generator (every member of a union contributes its keys)."""
    found: dict[str, str] = {}

    def resolve(node: dict[str, Any]) -> list[dict[str, Any]]:
        if "$ref" in node:
            target = schema["$defs"][node["$ref"].rsplit("/", 1)[1]]
            return [target] if "properties" in target else []
        return [model for member in node.get("oneOf", []) for model in resolve(member)]

    def walk(model: dict[str, Any], prefix: str) -> None:
        for name, node in model["properties"].items():
            models = resolve(node)
            if models:
                for sub in models:
                    walk(sub, f"{prefix}{name}.")
            else:
                found.setdefault(f"{prefix}{name}", node.get("description", ""))

    walk(schema, "")
    return found


def test_configuration_reference_has_every_key_with_its_description(site: Path) -> None:
    schema = AsyncRLConfig.model_json_schema()
    keys = schema_keys(schema)
    assert len(keys) > 90
    ids = page_ids(site, "reference/configuration")
    text = page_text(site, "reference/configuration")
    for path, description in keys.items():
        assert path in ids, f"{path} has no entry in the configuration reference"
        assert plain(description) in text, f"the description of {path} is not in the reference"
    assert set(gen_reference.config_key_paths(schema)) == set(keys)


def test_schema_printed_by_the_cli_is_the_one_documented(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    assert cli.main(["--schema"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert schema_keys(printed) == schema_keys(AsyncRLConfig.model_json_schema())


def test_every_metric_has_a_meaning_and_is_in_the_reference(site: Path) -> None:
    constants = {
        name: value
        for name, value in vars(metrics).items()
        if name.isupper() and isinstance(value, str) and not name.startswith("_")
    }
    documented = {metric.constant: metric for metric in gen_reference.metric_constants()}
    assert set(documented) == set(constants)
    text = page_text(site, "reference/metrics")
    for name, value in constants.items():
        assert documented[name].meaning, f"metrics.{name} has no docstring: write what it means below it"
        assert value in text, f"{value} is not in the metrics reference"
        assert name in text, f"metrics.{name} is not in the metrics reference"
        assert plain(documented[name].meaning) in text
    for signature, doc in gen_reference.name_builders():
        assert doc, f"metrics.{signature} has no docstring"
        assert plain(signature) in text


def test_every_command_line_option_is_in_the_reference(site: Path) -> None:
    text = page_text(site, "reference/cli")
    parsers = {"asyncrl-run": cli._parser(), "asyncrl-plot": plot._parser()}  # pyright: ignore[reportPrivateUsage]
    for program, parser in parsers.items():
        assert program in text
        for action in parser._actions:  # pyright: ignore[reportPrivateUsage]
            for option in action.option_strings:
                assert option in text, f"{program} {option} is not in the command-line reference"
            if action.help:
                assert plain(str(action.help)) in text


README_MAX_LINES = 60
"""The README stays short: the two commands, what to expect, and links into the guide."""


def test_the_readme_is_short_and_its_links_resolve_into_the_guide() -> None:
    readme = ROOT / "README.md"
    text = readme.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES, (
        f"README.md has {len(text.splitlines())} lines: keep it to the two commands, what to expect and "
        "links into the guide; put the rest in docs/pages"
    )
    targets = [target for target in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in target]
    assert targets
    for target in targets:
        path = (readme.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"README.md links to {target}, which does not exist"
    nav = yaml.safe_load((DOCS / "mkdocs.yml").read_text(encoding="utf-8"))["nav"]
    pages = [page for entry in nav for page in entry.values() if isinstance(page, str)]
    linked = {str((readme.parent / target.split("#")[0]).resolve()) for target in targets}
    for page in pages:
        assert str((PAGES / page).resolve()) in linked, f"README.md does not link the guide's page {page}"


def test_the_reference_pages_are_in_the_navigation(site: Path) -> None:
    index = (site / "index.html").read_text(encoding="utf-8")
    for page in gen_reference.PAGES:
        assert page.removesuffix(".md") + "/" in index


# --- fenced blocks


def fenced_blocks(path: Path) -> Iterator[tuple[str, str, int]]:
    """`(language, body, line)` of every fenced block of a Markdown file (fences may be indented)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    index = 0
    while index < len(lines):
        opening = re.match(r"^(\s*)(`{3,})\s*([\w-]*)", lines[index])
        if not opening:
            index += 1
            continue
        indent, fence, language = opening.groups()
        body: list[str] = []
        start = index + 1
        index += 1
        while index < len(lines) and lines[index].strip() != fence:
            body.append(lines[index][len(indent) :] if lines[index].startswith(indent) else lines[index])
            index += 1
        index += 1
        yield language, "\n".join(body), start


BLOCKS = [
    pytest.param(language, body, id=f"{path.relative_to(ROOT)}:{line}")
    for path in SOURCES
    for language, body, line in fenced_blocks(path)
]


def test_every_block_has_a_known_language() -> None:
    for param in BLOCKS:
        language = param.values[0]
        assert language in TESTED_LANGUAGES | UNTESTED_LANGUAGES, (
            f"{param.id}: fence language {language!r}; use one of "
            f"{sorted(TESTED_LANGUAGES | UNTESTED_LANGUAGES)} (`text` for output)"
        )


def shell_commands(body: str) -> Iterator[list[str]]:
    """The commands of a shell block: continuation lines joined, comments dropped, split as a shell does."""
    joined = re.sub(r"\\\n\s*", " ", body)
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if words:
            yield words


def run_asyncrl_run(words: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    arguments = words[1:]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if "--version" in arguments:
        with pytest.raises(SystemExit) as exit_info:
            cli.main(arguments)
        assert exit_info.value.code == 0
        return
    if "--audit" in arguments:  # reads a run folder the guide's reader has, not this checkout: parsed only
        cli._parser().parse_intermixed_args(arguments)  # pyright: ignore[reportPrivateUsage]
        return
    if not {"--schema", "--list-tasks", "--dry-run"} & set(arguments):
        arguments = [*arguments, "--dry-run"]
    assert cli.main(arguments) == 0, f"{shlex.join(words)} does not pass the dry run"


def run_asyncrl_plot(words: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    del env, monkeypatch
    plot._parser().parse_args(words[1:])  # pyright: ignore[reportPrivateUsage]


def run_make(words: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    del env, monkeypatch
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    targets = [word for word in words[1:] if "=" not in word and not word.startswith("-")]
    assert targets
    for target in targets:
        assert re.search(rf"^{re.escape(target)}:", makefile, re.MULTILINE), f"no `make {target}`"


def overrides_are_valid(words: list[str]) -> None:
    overrides = [word for word in words if "=" in word and not word.startswith("-")]
    if overrides:
        load_config(None, overrides)  # raises ConfigError naming every bad key or value


def run_python(words: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    del env, monkeypatch
    if words[1] == "-m":
        module = words[2]
        assert importlib.util.find_spec(module) is not None, f"no module {module}"
        if module == "asyncrl_engine":
            from asyncrl_engine.flags import parse_args

            parse_args(words[3:])
        return
    script = ROOT / words[1]
    assert script.is_file(), f"no script {words[1]}"
    overrides_are_valid(words[2:])


def run_uv(words: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    if words[1] == "run":
        rest = words[2:]
        while rest and rest[0].startswith("-"):
            rest = rest[1:]
        run_words(rest, env, monkeypatch)
    else:
        assert words[1] in {"sync", "lock", "pip", "build"}, f"uv {words[1]}"


def run_ray(words: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    del env, monkeypatch
    assert words[1] in {"start", "stop", "status"}, f"ray {words[1]}"
    if words[1] == "start":
        assert "--head" in words or any(word.startswith("--address") for word in words)


PYTEST_OPTIONS_WITH_VALUES = {"-m", "-k", "-p", "-n", "--basetemp"}
"""pytest options whose value is the next word, not a path."""


def run_pytest(words: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    del env, monkeypatch
    paths: list[str] = []
    arguments = iter(words[1:])
    for word in arguments:
        if word in PYTEST_OPTIONS_WITH_VALUES:
            next(arguments, None)
        elif not word.startswith("-"):
            paths.append(word.split("::")[0])
    assert paths, f"{shlex.join(words)}: name the tests it runs"
    for path in paths:
        assert list(ROOT.glob(path)), f"pytest {path}: no such test file or folder"


def run_plain(words: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Commands of other tools that the guide only shows (pip, tensorboard, mkdocs): parsed, not run."""
    del words, env, monkeypatch


HANDLERS: dict[str, Callable[[list[str], dict[str, str], pytest.MonkeyPatch], None]] = {
    "asyncrl-run": run_asyncrl_run,
    "asyncrl-plot": run_asyncrl_plot,
    "make": run_make,
    "python": run_python,
    "uv": run_uv,
    "ray": run_ray,
    "pytest": run_pytest,
    "pip": run_plain,
    "tensorboard": run_plain,
    "mkdocs": run_plain,
}


def run_words(words: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        name, _, value = words[0].partition("=")
        env = {**env, name: value}
        words = words[1:]
    assert words[0] in HANDLERS, f"no test handler for the command {words[0]!r}: add one to HANDLERS"
    HANDLERS[words[0]](words, env, monkeypatch)


def run_yaml(body: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first = body.splitlines()[0] if body else ""
    base = re.match(r"^#\s*over\s+(\S+\.yaml)\s*$", first)
    block = yaml.safe_load(body)
    assert isinstance(block, dict), "a yaml block is a configuration or a fragment of one"
    if base:
        merged = OmegaConf.merge(OmegaConf.load(ROOT / base.group(1)), OmegaConf.create(body))
        text = OmegaConf.to_yaml(merged)
    else:
        assert "runner" in block, "a yaml fragment names its base in its first line: `# over examples/x.yaml`"
        text = body
    path = tmp_path / "config.yaml"
    path.write_text(text, encoding="utf-8")
    assert cli.main([str(path), "--dry-run"]) == 0, capsys.readouterr().err


def help_examples() -> Iterator[list[str]]:
    """The example commands of each program's help (the command-line reference shows them)."""
    parsers = {"asyncrl-run": cli._parser(), "asyncrl-plot": plot._parser()}  # pyright: ignore[reportPrivateUsage]
    for program, parser in parsers.items():
        for line in (parser.epilog or "").splitlines():
            words = shlex.split(line)
            if words and words[0] == program:
                yield words


def test_the_examples_of_each_help_work(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(ROOT)
    examples = list(help_examples())
    assert {words[0] for words in examples} == {"asyncrl-run", "asyncrl-plot"}
    for words in examples:
        run_words(words, {}, monkeypatch)
    capsys.readouterr()


@pytest.mark.parametrize(("language", "body"), BLOCKS)
def test_block_works(
    language: str,
    body: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(ROOT)
    if language == "yaml":
        run_yaml(body, tmp_path, capsys)
    elif language == "bash":
        for words in shell_commands(body):
            run_words(words, {}, monkeypatch)
    elif language == "toml":
        tomllib.loads(body)
    elif language == "python":
        compile(body, "<guide>", "exec")
