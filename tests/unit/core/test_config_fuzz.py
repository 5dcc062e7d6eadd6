"""Random YAML trees and random overrides give a valid configuration or a `ConfigError`, never another
exception; a valid one renders to YAML that loads back to the same configuration."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from asyncrl_core.config import AsyncRLConfig, load_config, render_yaml
from asyncrl_core.errors import ConfigError, ConfigProblem

MINI = Path(__file__).resolve().parents[3] / "examples" / "searchr1-mini.yaml"
MINI_TREE = yaml.safe_load(MINI.read_text())


def _leaf_keys(node: object, prefix: str) -> list[str]:
    if isinstance(node, dict) and node:
        return [key for name, value in node.items() for key in _leaf_keys(value, f"{prefix}{name}.")]
    return [prefix.rstrip(".")]


RESOLVED_KEYS = _leaf_keys(load_config(MINI).model_dump(mode="json"), "")
SECTION_NAMES = list(MINI_TREE)
WORDS = sorted({word for key in RESOLVED_KEYS for word in key.split(".")} | {"actor,rollout", "reward", "x"})

SAMPLE_TEXT = [
    *("0-7", "8-3", "0,1", "1", "", "-1", "1e400", "smollm2-135m", "json:loads", "http://127.0.0.1:1"),
    *("${actor.model_path}", "${runner}", "${a.b}", "$${x}", "${rollout.model_path}", "searchr1-mini"),
    *("retract", "drain", "server", "engine", "external", "megatron", "torch", "gpu", "cpu", "auto"),
]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.integers(min_value=-2, max_value=70000),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(SAMPLE_TEXT),
)
keys = st.one_of(st.sampled_from(WORDS), st.text(max_size=8))
trees = st.recursive(
    scalars,
    lambda children: st.one_of(st.lists(children, max_size=3), st.dictionaries(keys, children, max_size=4)),
    max_leaves=30,
)
values_text = st.one_of(
    scalars.map(lambda value: yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()),
    st.text(max_size=20),
)
plausible_text = st.one_of(
    st.integers(min_value=1, max_value=64).map(str),
    st.sampled_from(
        ["true", "false", "null", "0.5", "drain", "in_place", "sequence_mean", "k1", "decoupled"]
    ),
)
override_keys = st.one_of(
    st.sampled_from(RESOLVED_KEYS), st.lists(st.sampled_from(WORDS), min_size=1, max_size=4).map(".".join)
)
overrides = st.lists(
    st.one_of(st.tuples(override_keys, values_text).map("=".join), st.text(max_size=20)), max_size=5
)


def check(text: str, override_list: list[str]) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "run.yaml"
        path.write_text(text, encoding="utf-8")
        problems: tuple[ConfigProblem, ...] = ()
        config: AsyncRLConfig | None = None
        try:
            config = load_config(path, override_list)
        except ConfigError as error:
            problems = error.problems
        if problems:
            assert all(isinstance(problem.key, str) and problem.message for problem in problems)
            event("invalid")
            return
        event("valid")
        assert isinstance(config, AsyncRLConfig)  # load_config returns one or raises ConfigError
        path.write_text(render_yaml(config), encoding="utf-8")
        assert load_config(path).model_dump() == config.model_dump()


pytestmark = pytest.mark.slow

fuzz_settings = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)


@fuzz_settings
@given(
    tree=st.dictionaries(st.one_of(st.sampled_from(SECTION_NAMES), keys), trees, max_size=6), extra=overrides
)
def test_random_trees(tree: dict[str, object], extra: list[str]) -> None:
    check(yaml.safe_dump(tree, allow_unicode=True), extra)


@fuzz_settings
@given(
    replaced=st.dictionaries(st.sampled_from(RESOLVED_KEYS), trees, max_size=4),
    removed=st.lists(st.sampled_from(RESOLVED_KEYS), max_size=3),
    extra=overrides,
)
def test_mutated_example(replaced: dict[str, object], removed: list[str], extra: list[str]) -> None:
    """The example with some keys replaced by random values and some removed, plus random overrides: this
    reaches the cross-field rules far more often than random trees do."""
    tree = yaml.safe_load(MINI.read_text())
    for key, value in replaced.items():
        *sections, leaf = key.split(".")
        node = tree
        for section in sections:
            node = node.setdefault(section, {})
        node[leaf] = value
    for key in removed:
        *sections, leaf = key.split(".")
        node = tree
        for section in sections:
            node = node.get(section, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node.pop(leaf, None)
    check(yaml.safe_dump(tree, allow_unicode=True), extra)


@fuzz_settings
@given(text=st.text(max_size=200), extra=overrides)
def test_random_text(text: str, extra: list[str]) -> None:
    check(text, extra)


@fuzz_settings
@given(
    extra=st.lists(
        st.tuples(st.sampled_from(RESOLVED_KEYS), st.one_of(plausible_text, values_text)).map("=".join),
        max_size=6,
    )
)
def test_random_overrides_of_the_example(extra: list[str]) -> None:
    check(MINI.read_text(), extra)
