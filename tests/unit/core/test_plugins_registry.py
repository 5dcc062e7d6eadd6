"""The plugin registry, against distributions written into a temporary folder on `sys.path`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from asyncrl_core import plugins
from asyncrl_core.config import load_config
from asyncrl_core.errors import ConfigError, PluginError

MINI = Path(__file__).resolve().parents[3] / "examples" / "searchr1-mini.yaml"


def install_distribution(
    root: Path, monkeypatch: pytest.MonkeyPatch, name: str, entry_points: str, modules: dict[str, str]
) -> None:
    """Write a distribution `name` (metadata, entry points, modules) under `root` and put it on sys.path."""
    info = root / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(entry_points)
    for module, source in modules.items():
        (root / f"{module}.py").write_text(source)
        monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.syspath_prepend(str(root))


def assert_lists_available(message: str, expected: list[str]) -> None:
    """The message's `available: a, b, ...` list holds `expected` (other installed tasks may stand beside)."""
    assert "available: " in message
    listed = message.split("available: ", 1)[1].split(" (", 1)[0].split(", ")
    assert set(expected) <= set(listed)
    assert listed == sorted(listed)


@pytest.fixture
def task_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A distribution with a good task, one whose module fails to import, and one with a wrong attribute;
    returns the (per-test unique) module suffix."""
    suffix = tmp_path.name.replace("-", "_")
    install_distribution(
        tmp_path / "site",
        monkeypatch,
        "fake-tasks",
        "[asyncrl.tasks]\n"
        f"good = good_tasks_{suffix}:GoodTask\n"
        f"broken = broken_tasks_{suffix}:Task\n"
        f"missing-attr = good_tasks_{suffix}:Nope\n",
        {
            f"good_tasks_{suffix}": "class GoodTask:\n    name = 'good'\n",
            f"broken_tasks_{suffix}": "raise RuntimeError('the retriever index is missing')\n",
        },
    )
    return suffix


def test_names_come_from_metadata_without_importing(task_modules: str) -> None:
    names = plugins.names("asyncrl.tasks")
    assert {"good", "broken", "missing-attr", "searchr1", "searchr1-mini"} <= set(names)
    assert f"good_tasks_{task_modules}" not in sys.modules


def test_available_reports_broken_plugins(task_modules: str) -> None:
    infos = {info.name: info for info in plugins.available("asyncrl.tasks")}
    assert infos["good"].error is None
    assert infos["good"].source == "fake-tasks 0.1"
    assert infos["broken"].error is not None
    assert "RuntimeError: the retriever index is missing" in infos["broken"].error
    assert infos["missing-attr"].error is not None
    assert "has no `Nope`" in infos["missing-attr"].error


def test_load_returns_the_object(task_modules: str) -> None:
    loaded = plugins.load("asyncrl.tasks", "good")
    assert getattr(loaded, "name", None) == "good"
    assert plugins.load("asyncrl.tasks", f"good_tasks_{task_modules}:GoodTask") is loaded


def test_load_errors_name_group_name_and_choices(task_modules: str) -> None:
    with pytest.raises(PluginError, match=r"`asyncrl.tasks`: plugin 'broken' .* failed to import"):
        plugins.load("asyncrl.tasks", "broken")
    with pytest.raises(PluginError) as caught:
        plugins.load("asyncrl.tasks", "god")
    message = str(caught.value)
    assert "`asyncrl.tasks`" in message
    assert "'god'" in message
    assert_lists_available(message, ["broken", "good", "missing-attr"])
    with pytest.raises(PluginError, match="not of the form `module:attr`"):
        plugins.load("asyncrl.tasks", "a b:c")
    with pytest.raises(PluginError, match="failed to import: ModuleNotFoundError"):
        plugins.load("asyncrl.tasks", "no_such_module_anywhere:Task")


def test_unknown_group() -> None:
    with pytest.raises(PluginError, match=r"asyncrl\.rollout_backends"):
        plugins.names("asyncrl.task")


def test_a_name_declared_twice_is_a_conflict(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for index in (1, 2):
        install_distribution(
            tmp_path / f"site{index}",
            monkeypatch,
            f"twin-{index}",
            "[asyncrl.tasks]\ntwin = json:loads\n[asyncrl.actors]\ntorch = json:dumps\n",
            {},
        )
    infos = {info.name: info for info in plugins.available("asyncrl.tasks")}
    assert infos["twin"].error is not None
    assert "declared more than once" in infos["twin"].error
    with pytest.raises(PluginError) as caught:
        plugins.load("asyncrl.tasks", "twin")
    assert "twin-1 0.1 -> json:loads" in str(caught.value)
    assert "twin-2 0.1 -> json:loads" in str(caught.value)
    assert "declared more than once" in (plugins.check_selectable("asyncrl.actors", "torch") or "")


def test_builtin_backends_are_listed() -> None:
    assert {"torch", "megatron"} <= set(plugins.names("asyncrl.actors"))
    assert "sglang" in plugins.names("asyncrl.rollout_backends")
    assert "multi-turn" in plugins.names("asyncrl.agent_loops")


def test_configuration_checks_the_agent_loop(task_modules: str) -> None:
    assert load_config(MINI).agentloop.agent_loop == "multi-turn"
    config = load_config(MINI, [f"agentloop.agent_loop=good_tasks_{task_modules}:GoodTask"])
    assert config.agentloop.agent_loop == f"good_tasks_{task_modules}:GoodTask"
    with pytest.raises(ConfigError) as caught:
        load_config(MINI, ["agentloop.agent_loop=multi_turn"])
    message = str(caught.value)
    assert "agentloop.agent_loop" in message
    assert "no plugin named 'multi_turn' in `asyncrl.agent_loops`" in message
    assert_lists_available(message, ["multi-turn"])
    with pytest.raises(ConfigError, match=r"agent_loop: module `absent_package` of .* not installed"):
        load_config(MINI, ["agentloop.agent_loop=absent_package.loop:Loop"])


def test_configuration_accepts_an_installed_task(task_modules: str) -> None:
    config = load_config(MINI, ["agentloop.task_name=good"])
    assert config.agentloop.task_name == "good"
    # A broken task is still a known name: it fails when it is loaded at launch, not at validation.
    load_config(MINI, ["agentloop.task_name=broken"])
    with pytest.raises(ConfigError) as caught:
        load_config(MINI, ["agentloop.task_name=goood"])
    assert "agentloop.task_name" in str(caught.value)
    assert_lists_available(str(caught.value), ["broken", "good", "missing-attr"])


def test_plugin_actor_backend(task_modules: str) -> None:
    config = load_config(MINI, ["actor.backend=json:loads", "actor.backend_args={seed: 3}"])
    assert config.actor.backend == "json:loads"
    assert getattr(config.actor, "backend_args", None) == {"seed": 3}
    with pytest.raises(ConfigError, match=r"actor.backend_args: unknown key"):
        load_config(MINI, ["actor.backend_args={seed: 3}"])  # only plugin actors take arguments


def test_check_module_found_does_not_import(task_modules: str) -> None:
    assert plugins.check_module_found("asyncrl.tasks", "good") is None
    assert plugins.check_module_found("asyncrl.tasks", "broken") is None  # found; it fails only when run
    assert f"broken_tasks_{task_modules}" not in sys.modules
    assert f"good_tasks_{task_modules}" not in sys.modules
    assert "no plugin named 'gud'" in (plugins.check_module_found("asyncrl.tasks", "gud") or "")
    message = plugins.check_module_found("asyncrl.tasks", "absent_package.tasks:Task") or ""
    assert "module `absent_package` is not installed" in message


def test_builtin_targets_point_at_modules_that_exist() -> None:
    # Found, not imported: the actors import torch and Megatron.
    for group, table in plugins.BUILTINS.items():
        for name in table:
            assert plugins.check_module_found(group, name) is None, (group, name)
