"""`run(config)`: a whole training run, from Ray's start to the last checkpoint, whatever fails midway.

Order: Ray (local, or `runner.ray_address`); the task's services (a retrieval server); the optional warm
start; the workers (engines and actor start together); the driver of `runner.async_mode`; then everything
started is stopped, engines included, also on an error or Ctrl-C.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl_core import models

if TYPE_CHECKING:
    from asyncrl_core.config import AsyncRLConfig
    from asyncrl_core.protocols import Task

logger = logging.getLogger(__name__)
_STDERR = logging.StreamHandler(sys.stderr)


def run(config: AsyncRLConfig) -> Path:
    """Train as `config` says; returns the run folder (`runner.run_dir`, already created by the CLI or
    here). Raises `AsyncRLError` subclasses for failures the run explains itself."""
    # Ray's `uv run` hook would package the working directory for every worker and start each one with
    # `uv run` there: the workers must import this interpreter's installed packages instead. The hook reads
    # this variable when Ray is first imported.
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    import ray

    from asyncrl_core.runner.async_ import run_async
    from asyncrl_core.runner.checkpoint import checkpoint_step, resolve_resume
    from asyncrl_core.runner.context import RunContext
    from asyncrl_core.runner.groups import WorkerGroups, start_ray
    from asyncrl_core.runner.sync import run_sync
    from asyncrl_core.runner.tracking import RunTracker
    from asyncrl_core.runner.workers import build_task

    assert config.runner.run_dir is not None  # derived
    assert config.agentloop.task_name is not None  # required
    run_dir = Path(config.runner.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    _log_to_stderr(config.logging.level)
    owns_ray = not ray.is_initialized() and config.runner.ray_address is None
    start_ray(config)
    logger.info("Ray: %s", config.runner.ray_address or "a local instance")
    try:
        task = build_task(config, {})
        with task.serve() as task_services:
            actor_path, rollout_path = _model_paths(config, task, run_dir)
            logger.info("starting the engines, the actor and the agent loops (model %s)", rollout_path)
            workers = WorkerGroups(
                config,
                actor_model_path=actor_path,
                rollout_model_path=rollout_path,
                run_dir=run_dir,
                task_services=dict(task_services),
            )
            try:
                resume = config.checkpoint.resume_from
                checkpoint = resolve_resume(run_dir, resume) if resume is not None else None
                with RunTracker(
                    run_dir,
                    config.logging,
                    num_steps=config.runner.num_steps,
                    start_step=checkpoint_step(checkpoint) if checkpoint is not None else 0,
                ) as tracker:
                    context = RunContext(config, workers, tracker, run_dir)
                    if checkpoint is not None:
                        context.resume(checkpoint)
                    mode = "async" if config.runner.async_mode else "sync"
                    logger.info("training: %d steps, %s mode", config.runner.num_steps, mode)
                    (run_async if config.runner.async_mode else run_sync)(context)
                    context.finish()
            finally:
                workers.stop()
    finally:
        if owns_ray:
            ray.shutdown()
    return run_dir


def _log_to_stderr(level: str) -> None:
    """Show the run's progress messages (`logging.level`) on stderr."""
    root = logging.getLogger("asyncrl_core")
    if _STDERR not in root.handlers:
        _STDERR.setFormatter(logging.Formatter("asyncrl-run: %(message)s"))
        root.addHandler(_STDERR)
    root.setLevel(level)


def _model_paths(config: AsyncRLConfig, task: Task, run_dir: Path) -> tuple[str, str]:
    """The model folders of actor and engines: the warm-started model both begin from (`warm_start`), or
    the configured ones (aliases resolved)."""
    from asyncrl_core.actor.warm_start import warm_start

    if config.warm_start.num_steps > 0:
        logger.info("warm start: %d steps on the task's demonstrations", config.warm_start.num_steps)
        folder = str(warm_start(config, task, run_dir / "warm_start"))
        return folder, folder
    actor = models.resolve_model_path(config.actor.model_path, key="actor.model_path")
    rollout_key = config.rollout.model_path or config.actor.model_path
    rollout = models.resolve_model_path(rollout_key, key="rollout.model_path")
    return str(actor), str(rollout)
