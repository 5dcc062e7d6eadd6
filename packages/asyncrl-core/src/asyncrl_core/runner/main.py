"""`run(config)`: a whole training run, from Ray's start to the last checkpoint, whatever fails midway.

Order: Ray (local, or `runner.ray_address`), started beside the task and its model (the optional warm
start, usually from the cache); the task's services (a retrieval server); the workers (every role starts at
once); the driver of `runner.async_mode`; then everything started is stopped, engines and Ray's own
processes included, also on an error, SIGINT or SIGTERM, from any phase (`asyncrl_core.runner.shutdown`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from asyncrl_core import models

if TYPE_CHECKING:
    from asyncrl_core.config import AsyncRLConfig
    from asyncrl_core.protocols import Task
    from asyncrl_core.runner.shutdown import RunStopper

logger = logging.getLogger(__name__)
_T = TypeVar("_T")
_STDERR = logging.StreamHandler(sys.stderr)


def run(config: AsyncRLConfig) -> Path:
    """Train as `config` says; returns the run folder (`runner.run_dir`, already created by the CLI or
    here). Raises `AsyncRLError` subclasses for failures the run explains itself, and `RunInterrupted` (a
    `KeyboardInterrupt`) on SIGINT or SIGTERM, after stopping everything (`asyncrl_core.runner.shutdown`)."""
    # Ray's `uv run` hook would package the working directory for every worker and start each one with
    # `uv run` there: the workers must import this interpreter's installed packages instead. The hook reads
    # this variable when Ray is first imported.
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    from asyncrl_core.runner.folder_lock import locked

    assert config.runner.run_dir is not None  # derived
    assert config.agentloop.task_name is not None  # required
    run_dir = Path(config.runner.run_dir)
    with locked(run_dir):  # one run at a time in a folder (asyncrl-run holds it already)
        _run_in(config, run_dir)
    return run_dir


def _run_in(config: AsyncRLConfig, run_dir: Path) -> None:
    from asyncrl_core.runner.shutdown import RunStopper

    _log_to_stderr(config.logging.level)
    # Ray is imported after the signals are taken (an import of seconds): a Ray started before (a test's)
    # is already imported.
    ray_module = sys.modules.get("ray")
    ray_running = ray_module is not None and bool(ray_module.is_initialized())
    owns_ray = not ray_running and config.runner.ray_address is None
    stopper = RunStopper(local=owns_ray)
    stopper.start()
    try:
        _run(config, run_dir, stopper, owns_ray=owns_ray)
    except KeyboardInterrupt as interrupt:
        interruption = stopper.interruption()
        if interruption is None or interruption is interrupt:
            raise
        raise interruption from None
    finally:
        stopper.finish()


def _run(config: AsyncRLConfig, run_dir: Path, stopper: RunStopper, *, owns_ray: bool) -> None:
    from asyncrl_core.runner.checkpoint import checkpoint_step, resolve_resume
    from asyncrl_core.runner.timeouts import timed_out, timeout_of

    stopper.phase = "the check of the checkpoint to resume"
    resume = config.checkpoint.resume_from
    # Every file of the checkpoint is checked against its manifest before anything starts: a damaged one is
    # named at once (or passed over for `latest`), not after the workers' start-up.
    checkpoint = resolve_resume(run_dir, resume) if resume is not None else None
    if checkpoint is not None and checkpoint_step(checkpoint) >= config.runner.num_steps:
        logger.info(
            "the run has finished: %s is after step %d, and runner.num_steps is %d; nothing to train "
            "(raise runner.num_steps to train on from it)",
            checkpoint,
            checkpoint_step(checkpoint),
            config.runner.num_steps,
        )
        return
    stopper.phase = "start-up"
    started = time.perf_counter()
    # The task and its model (a warm start, from the cache or trained now) are made in a thread while this
    # one starts Ray: neither needs the other. Ray starts here because the processes it starts die with the
    # thread that started them (PR_SET_PDEATHSIG), and because signals reach only this thread.
    preparing = _beside(_task_and_model, config)
    try:
        ray_s = _start_ray(config)
        stopper.take_signals()  # `ray.init` installed its own SIGTERM handler, which skips every cleanup
        timeout_s = timeout_of(config, "runner.startup_timeout_s")
        try:
            task, actor_path, rollout_path, task_and_model_s = preparing.result(timeout=timeout_s)
        except TimeoutError:
            raise timed_out("the task and its model", timeout_s, "runner.startup_timeout_s") from None
        with task.serve() as task_services:
            _train(
                config,
                run_dir,
                stopper,
                checkpoint,
                model_paths=(actor_path, rollout_path),
                task_services=dict(task_services),
                dataset_size=len(task.dataset("train")),
                started=started,
                stages={"Ray": ray_s, "task and model": task_and_model_s},
                start_step=checkpoint_step(checkpoint) if checkpoint is not None else 0,
            )
    finally:
        stopper.stopping = True
        ray = sys.modules.get("ray")
        if owns_ray and ray is not None and ray.is_initialized():
            ray.shutdown()
            # Ray's shutdown puts back, under Python's feet, the C-level SIGTERM action its failure handler
            # found at `ray.init` (the default: death without cleanup); Python's record still shows ours.
            stopper.take_signals()
            stopper.stopped.append("Ray")


def _beside(function: Callable[[AsyncRLConfig], _T], config: AsyncRLConfig) -> Future[_T]:
    """`function(config)` in a daemon thread: an interrupted run exits without waiting for it."""
    future: Future[_T] = Future()

    def run() -> None:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(function(config))
            except BaseException as error:
                future.set_exception(error)

    threading.Thread(target=run, name="task-and-model", daemon=True).start()
    return future


def _task_and_model(config: AsyncRLConfig) -> tuple[Task, str, str, float]:
    """The run's task and the model folders of actor and engines, with the seconds they took."""
    from asyncrl_core.runner.workers import build_task

    started = time.perf_counter()
    task = build_task(config, {})
    actor_path, rollout_path = _model_paths(config, task)
    return task, actor_path, rollout_path, time.perf_counter() - started


def _start_ray(config: AsyncRLConfig) -> float:
    """Start (or join) Ray as `runner` says; returns the seconds it took."""
    from asyncrl_core.runner.groups import start_ray

    started = time.perf_counter()
    start_ray(config)
    seconds = time.perf_counter() - started
    logger.info("Ray: %s (%.1f s)", config.runner.ray_address or "a local instance", seconds)
    return seconds


def _train(
    config: AsyncRLConfig,
    run_dir: Path,
    stopper: RunStopper,
    checkpoint: Path | None,
    *,
    model_paths: tuple[str, str],
    task_services: dict[str, str],
    dataset_size: int,
    started: float,
    stages: dict[str, float],
    start_step: int,
) -> None:
    """Start the workers, run the driver of `runner.async_mode`, and stop the workers whatever happens."""
    from asyncrl_core.runner.async_ import run_async
    from asyncrl_core.runner.context import RunContext
    from asyncrl_core.runner.groups import WorkerGroups
    from asyncrl_core.runner.sync import run_sync
    from asyncrl_core.runner.tracking import RunTracker

    actor_path, rollout_path = model_paths
    logger.info("starting the engines, the actor and the agent loops (model %s)", rollout_path)
    workers_started = time.perf_counter()
    workers = WorkerGroups(
        config,
        actor_model_path=actor_path,
        rollout_model_path=rollout_path,
        run_dir=run_dir,
        task_services=task_services,
        dataset_size=dataset_size,
        stopped=stopper.stopped,
    )
    logger.info(
        "started in %.1f s: %s, workers %.1f s (%s)",
        time.perf_counter() - started,
        " beside ".join(f"{what} {seconds:.1f} s" for what, seconds in stages.items()),
        time.perf_counter() - workers_started,
        ", ".join(f"{what} {seconds:.1f} s" for what, seconds in workers.start_times.items()),
    )
    try:
        with RunTracker(
            run_dir, config.logging, num_steps=config.runner.num_steps, start_step=start_step
        ) as tracker:
            context = RunContext(config, workers, tracker, run_dir)
            if checkpoint is not None:
                context.resume(checkpoint)
            else:
                context.align_external_engines()
            mode = "async" if config.runner.async_mode else "sync"
            stopper.phase = "training"
            logger.info("training: %d steps, %s mode", config.runner.num_steps, mode)
            (run_async if config.runner.async_mode else run_sync)(context)
            stopper.phase = "the end of the run"
            context.finish()
    finally:
        stopper.stopping = True
        workers.stop()


def _log_to_stderr(level: str) -> None:
    """Show the run's progress messages (`logging.level`) on stderr."""
    root = logging.getLogger("asyncrl_core")
    if _STDERR not in root.handlers:
        _STDERR.setFormatter(logging.Formatter("asyncrl-run: %(message)s"))
        root.addHandler(_STDERR)
    root.setLevel(level)


def _model_paths(config: AsyncRLConfig, task: Task) -> tuple[str, str]:
    """The model folders of actor and engines: the warm-started model both begin from (`warm_start`), or
    the configured ones (aliases resolved)."""
    from asyncrl_core.actor.warm_start import warm_start

    if config.warm_start.num_steps > 0:
        folder = str(warm_start(config, task))
        return folder, folder
    actor = models.resolve_model_path(config.actor.model_path, key="actor.model_path")
    rollout_key = config.rollout.model_path or config.actor.model_path
    rollout = models.resolve_model_path(rollout_key, key="rollout.model_path")
    return str(actor), str(rollout)
