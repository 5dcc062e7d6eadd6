"""`asyncrl-run`: validate a configuration, then start the run, or only show what would run.

Nothing heavy is imported before the configuration is validated: `--help`, `--schema`, `--list-tasks`
(apart from the tasks themselves) and an invalid configuration never load torch, Ray, Megatron or SGLang.

Exit status: 0 done, 1 the run stopped with an error (or `--audit` found a prompt not accounted for), 2
invalid configuration or arguments (nothing was started), 130 interrupted by SIGINT (Ctrl-C), 143 by
SIGTERM; either way everything the run started is stopped first (`asyncrl_core.runner.shutdown`).

Before anything starts, the selected task is imported and `agentloop.task_args` is checked against the
arguments model it declares (`asyncrl_core.config.TaskArguments`), in a dry run too.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

    from asyncrl_core.config import AsyncRLConfig
    from asyncrl_core.errors import ConfigProblem

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_INVALID = 2
EXIT_INTERRUPTED = 130
"""128 + SIGINT; SIGTERM gives 128 + 15 = 143."""

_PROGRAM = "asyncrl-run"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=_PROGRAM,
        usage=(
            f"{_PROGRAM} [CONFIG] [key=value ...] [~key ...] [--dry-run] [--list-tasks] [--schema] "
            "[--rebuild-cache] [--audit RUN_DIR]"
        ),
        description=(
            "Train a language-model agent with asynchronous reinforcement learning.\n\n"
            "CONFIG is a YAML file (default: the embedded `searchr1-mini`, sized for a laptop CPU).\n"
            "Overrides follow OmegaConf's dotted syntax: key=value sets one dotted key, its value read as\n"
            "YAML (a mapping replaces the whole section); ~key removes a key so its default applies again.\n"
            "Values may refer to other keys with ${section.key} and to environment variables with\n"
            "${oc.env:NAME}."
        ),
        epilog=(
            "examples:\n"
            "  asyncrl-run --dry-run\n"
            "  asyncrl-run examples/searchr1-gpu.yaml rollout.pause_mode=drain runner.num_steps=50\n"
            "  asyncrl-run examples/searchr1-mini.yaml 'cluster.component_placement={actor: 0, rollout: 1}'\n"
            "  asyncrl-run examples/searchr1-mini.yaml '~agentloop.max_actor_accept_staleness'\n"
            "  asyncrl-run examples/searchr1-mini.yaml 'runner.run_dir=${oc.env:HOME}/runs/${runner.name}'\n"
            "\n"
            "exit status: 0 done, 1 the run failed, 2 invalid configuration (nothing started), "
            "130 interrupted (SIGINT), 143 terminated (SIGTERM)"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "arguments",
        nargs="*",
        metavar="CONFIG key=value",
        help="configuration file, then overrides such as rollout.pause_mode=drain",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the resolved configuration (derived values marked) and the warnings; start nothing",
    )
    parser.add_argument(
        "--list-tasks", action="store_true", help="list the tasks of the entry-point group asyncrl.tasks"
    )
    parser.add_argument(
        "--schema", action="store_true", help="print the JSON Schema of the configuration (for editors)"
    )
    parser.add_argument(
        "--audit",
        metavar="RUN_DIR",
        help=(
            "check the run folder's prompt ledger (ledger.json): every prompt of each epoch trained exactly "
            "once, dropped with a reason, or still held by the run; exit status 1 if not"
        ),
    )
    parser.add_argument(
        "--rebuild-cache",
        action="store_true",
        help=(
            "build the run's start-up artefacts again (the warm start, converted models, the task's "
            "generated data) even where the cache holds them for the same inputs; the new ones replace them"
        ),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    return parser


def _version() -> str:
    """The installed asyncrl-core's version, read from its metadata (nothing is imported)."""
    from importlib import metadata

    try:
        return metadata.version("asyncrl-core")
    except metadata.PackageNotFoundError:
        return "unknown (asyncrl-core is not installed as a distribution)"


def main(argv: Sequence[str] | None = None) -> int:
    """Run `asyncrl-run` with `argv` (default: the process arguments); returns the exit status."""
    args = _parser().parse_intermixed_args(argv)
    try:
        if args.schema:
            return _print_schema()
        if args.list_tasks:
            return _list_tasks()
        if args.audit is not None:
            return _audit(args.audit)
    except BrokenPipeError:
        sys.stderr.close()
        return EXIT_OK
    config_path, overrides = _split_arguments(args.arguments)
    try:
        return _run(config_path, overrides, dry_run=args.dry_run, rebuild_cache=args.rebuild_cache)
    except KeyboardInterrupt:
        print(f"{_PROGRAM}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader of our output went away (`asyncrl-run --dry-run | head`)
        sys.stderr.close()
        return EXIT_OK


def _split_arguments(arguments: list[str]) -> tuple[str | None, list[str]]:
    """CONFIG is the first argument unless it is an override (`key=value` that is not a file)."""
    if arguments and ("=" not in arguments[0] or os.path.isfile(arguments[0])):
        return arguments[0], arguments[1:]
    return None, arguments


def _print_schema() -> int:
    import json

    from asyncrl_core.config import AsyncRLConfig
    from asyncrl_core.config.loader import OVERRIDE_SYNTAX

    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        **AsyncRLConfig.model_json_schema(),
    }
    schema["$comment"] = f"Command-line overrides of `{_PROGRAM}`: {OVERRIDE_SYNTAX}."
    print(json.dumps(schema, indent=2))
    return EXIT_OK


def _list_tasks() -> int:
    from asyncrl_core import plugins

    infos = plugins.available("asyncrl.tasks")
    if not infos:
        print("no tasks are installed; a task declares an entry point in the group `asyncrl.tasks`")
        return EXIT_OK
    from asyncrl_core.config.task_args import arguments_model, describe_arguments

    width = max(len(info.name) for info in infos)
    for info in infos:
        status = "ok" if info.error is None else "broken"
        print(f"{info.name:<{width}}  {status:<6}  {info.target}  ({info.source})")
        if info.error is None:
            model = arguments_model(plugins.load("asyncrl.tasks", info.name))
            if model is None:
                print("    (declares no arguments model: agentloop.task_args is checked when it starts)")
            for line in describe_arguments(model) if model is not None else ():
                print(f"    {line}")
    for info in infos:
        if info.error is not None:
            print(f"{_PROGRAM}: warning: task {info.name!r} cannot be loaded: {info.error}", file=sys.stderr)
    return EXIT_OK


def _audit(run_dir: str) -> int:
    from pathlib import Path

    from asyncrl_core.runner.ledger import audit_run

    ok, lines = audit_run(Path(run_dir))
    print("\n".join(lines))
    return EXIT_OK if ok else EXIT_FAILED


def _report_invalid(problems: Sequence[ConfigProblem]) -> int:
    count = "1 problem" if len(problems) == 1 else f"{len(problems)} problems"
    lines = "\n".join(f"  {problem}" for problem in problems)
    print(
        f"{_PROGRAM}: the configuration is invalid ({count}); nothing was started:\n{lines}", file=sys.stderr
    )
    return EXIT_INVALID


def _run(config_path: str | None, overrides: list[str], *, dry_run: bool, rebuild_cache: bool) -> int:
    from asyncrl_core import plugins
    from asyncrl_core.config import load_config, render_yaml
    from asyncrl_core.config.task_args import arguments_model, validate_task_args
    from asyncrl_core.errors import ConfigError, ConfigProblem, PluginError

    try:
        config = load_config(config_path, overrides)
    except ConfigError as error:
        return _report_invalid(error.problems)
    task_name = config.agentloop.task_name
    assert task_name is not None  # validation requires a task
    # The task is imported, in a dry run too, to check its arguments before anything starts.
    try:
        factory = plugins.load("asyncrl.tasks", task_name)
    except PluginError as error:
        return _report_invalid([ConfigProblem("agentloop.task_name", str(error))])
    model = arguments_model(factory)
    if model is not None:
        try:
            validate_task_args(model, config.agentloop.task_args)
        except ConfigError as error:
            return _report_invalid(error.problems)
    warnings = list(config.warnings)
    if model is None:
        warnings.append(
            ConfigProblem(
                "agentloop.task_args",
                f"task {task_name!r} declares no arguments model, so its arguments are checked only when it "
                "starts",
            )
        )
    # A model path that names no model here is an error, in a dry run too, unless the configuration is
    # prepared here for another machine (devices this one lacks, or a Ray cluster): then a warning.
    path_problems = _model_path_problems(config)
    elsewhere = dry_run and bool(config.cluster.launch_problems(config) or _joins_a_cluster(config))
    if path_problems and not elsewhere:
        return _report_invalid(path_problems)
    model_problems = _model_install_problems(config)
    if not dry_run and model_problems:
        return _report_invalid(model_problems)
    for warning in [*warnings, *path_problems, *model_problems]:
        print(f"{_PROGRAM}: warning: {warning}", file=sys.stderr)
    if dry_run:
        print("# resolved configuration; `# derived` marks values computed from other keys")
        print(render_yaml(config), end="")
        return EXIT_OK
    problems = config.cluster.launch_problems(config)
    if problems:
        return _report_invalid(problems)
    if rebuild_cache:
        from asyncrl_core import cache

        cache.set_rebuild(True)
    return _launch(config)


def _joins_a_cluster(config: AsyncRLConfig) -> bool:
    return config.runner.ray_address is not None or bool(os.environ.get("RAY_ADDRESS"))


def _model_path_problems(config: AsyncRLConfig) -> list[ConfigProblem]:
    """A model path that names no model here (no such folder, no `config.json`, an unknown alias), found
    in milliseconds instead of after the engines' and actor's start-up. Aliases (`smollm2-135m`,
    `tiny-llama:<preset>`) are checked by name, nothing is built."""
    from asyncrl_core.errors import ConfigProblem
    from asyncrl_core.models import model_path_problem

    problems: list[ConfigProblem] = []
    for key, model_path in (
        ("actor.model_path", config.actor.model_path),
        ("rollout.model_path", config.rollout.model_path),
    ):
        if model_path is None or (key == "rollout.model_path" and model_path == config.actor.model_path):
            continue
        problem = model_path_problem(model_path)
        if problem is not None:
            problems.append(ConfigProblem(key, problem))
    return problems


def _model_install_problems(config: AsyncRLConfig) -> list[ConfigProblem]:
    """A model the configuration names whose packages are missing here: a warning in a dry run (the run
    may be meant for another machine), an error at launch."""
    from asyncrl_core.errors import ConfigProblem
    from asyncrl_core.models import model_install_problem

    problems: list[ConfigProblem] = []
    seen: set[str] = set()
    for key, model_path in (
        ("actor.model_path", config.actor.model_path),
        ("rollout.model_path", config.rollout.model_path),
    ):
        if model_path is None or model_path in seen:
            continue
        seen.add(model_path)
        problem = model_install_problem(model_path)
        if problem is not None:
            problems.append(ConfigProblem(key, problem))
    return problems


def _launch(config: AsyncRLConfig) -> int:
    from pathlib import Path

    from asyncrl_core.runner.folder_lock import RunFolderBusy, locked

    assert config.runner.run_dir is not None  # derived when unset
    # Held before the folder is prepared: a second run into it changes nothing there, not even config.yaml.
    try:
        with locked(Path(config.runner.run_dir)):
            return _launch_locked(config)
    except RunFolderBusy as error:
        print(f"{_PROGRAM}: {error}; nothing was started", file=sys.stderr)
        return EXIT_INVALID


def _launch_locked(config: AsyncRLConfig) -> int:
    try:
        run_dir = prepare_run_dir(config)
    except FileExistsError as error:
        return _report_invalid([_run_dir_problem(str(error))])
    print(f"{_PROGRAM}: run folder {run_dir}", file=sys.stderr)
    from asyncrl_core.errors import AsyncRLError
    from asyncrl_core.runner import run
    from asyncrl_core.runner.shutdown import RunInterrupted

    try:
        run(config)
    except AsyncRLError as error:  # a failure the run explains itself (e.g. the drop guard); no traceback
        print(f"{_PROGRAM}: the run stopped: {error}", file=sys.stderr)
        return EXIT_FAILED
    except RunInterrupted as interrupted:
        print(f"{_PROGRAM}: {interrupted.describe()}", file=sys.stderr)
        return interrupted.exit_status
    print(
        f"{_PROGRAM}: done; metrics in {run_dir / 'metrics.jsonl'}, curves in {run_dir / 'curves.png'}",
        file=sys.stderr,
    )
    return EXIT_OK


def _run_dir_problem(message: str) -> ConfigProblem:
    from asyncrl_core.errors import ConfigProblem

    return ConfigProblem("runner.run_dir", message)


def prepare_run_dir(config: AsyncRLConfig) -> Path:
    """Create the run folder and write `config.yaml` (resolved, derived values marked) and `warnings.log`.

    A folder that already holds a run is used again only to resume (`checkpoint.resume_from` set), or when
    the earlier start trained nothing (no step logged, no checkpoint: a start that failed or was stopped);
    its earlier `config.yaml` is then kept as `config.<n>.yaml`. Otherwise raises `FileExistsError`, so an
    earlier run is never overwritten.
    """
    from pathlib import Path

    from asyncrl_core.config import render_yaml

    assert config.runner.run_dir is not None  # derived when unset
    run_dir = Path(config.runner.run_dir)
    config_file = run_dir / "config.yaml"
    if config_file.exists():
        if config.checkpoint.resume_from is None and _holds_training(run_dir):
            raise FileExistsError(
                f"{run_dir} already holds a run; choose another `runner.run_dir` or `runner.name`, or set "
                "`checkpoint.resume_from: latest` to continue it"
            )
        number = 1
        while (run_dir / f"config.{number}.yaml").exists():
            number += 1
        config_file.rename(run_dir / f"config.{number}.yaml")
    run_dir.mkdir(parents=True, exist_ok=True)
    config_file.write_text(
        "# resolved configuration; `# derived` marks values computed from other keys\n" + render_yaml(config),
        encoding="utf-8",
    )
    with open(run_dir / "warnings.log", "a", encoding="utf-8") as log:
        for warning in config.warnings:
            log.write(f"config: {warning}\n")
    return run_dir


def _holds_training(run_dir: Path) -> bool:
    """Whether an earlier start in `run_dir` trained something worth keeping: a logged step, a checkpoint
    or a summary."""
    metrics_file = run_dir / "metrics.jsonl"
    if metrics_file.is_file() and metrics_file.stat().st_size > 0:
        return True
    checkpoints = run_dir / "checkpoints"
    return (run_dir / "summary.json").exists() or (checkpoints.is_dir() and any(checkpoints.iterdir()))


if __name__ == "__main__":
    sys.exit(main())
