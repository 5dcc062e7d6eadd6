"""What both drivers share: the actor's version, the step's bookkeeping (metrics, evaluation, checkpoints)
and the waits on Ray, each with a timeout."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from asyncrl_core import metrics
from asyncrl_core.runner.dataloader import LoaderState
from asyncrl_core.runner.liveness import Liveness
from asyncrl_core.runner.workers import RunnerError

if TYPE_CHECKING:
    from asyncrl_core.config import AsyncRLConfig
    from asyncrl_core.runner.groups import WorkerGroups
    from asyncrl_core.runner.tracking import RunTracker

CHECKPOINT_PREFIX = "step_"
SUMMARY_FILE = "summary.json"
"""Written at the end of a run: steps, final weight version, and where every issued prompt went."""
EVAL_MAX_PROMPTS = 64
"""Test prompts of one evaluation (one trajectory each), so that it stays short beside training."""


class RunContext:
    """The state of a running run between the driver's steps."""

    def __init__(
        self, config: AsyncRLConfig, workers: WorkerGroups, tracker: RunTracker, run_dir: Path
    ) -> None:
        self.config = config
        self.workers = workers
        self.tracker = tracker
        self.run_dir = run_dir
        self.version = 0
        self.start_step = 0
        self.timeout_s = config.rollout.request_timeout_s
        self._pending_eval: Any = None
        self._pending_eval_version = 0
        self.liveness = Liveness(workers, run_dir)
        """The watch over engines and agent loops the drivers wait through."""

    # --- driver helpers --------------------------------------------------------------------------------

    def shares(self) -> list[tuple[Any, int]]:
        """`rollout_batch_size` groups split over the agent-loop workers (the first ones take the rest)."""
        loops = self.workers.agent_loops
        base, extra = divmod(self.config.data.rollout_batch_size, len(loops))
        return [(loop, base + (index < extra)) for index, loop in enumerate(loops) if base + (index < extra)]

    def train(self, batch: Any) -> dict[str, float]:
        """One step of every actor rank on `batch` (a Ray reference or a `Batch`); rank 0's metrics. A rank
        that dies stops the run at once with its rank and error (the others may wait for it forever)."""
        results = self.wait_all(
            [actor.train.remote(batch) for actor in self.workers.actors], "training", "actor rank"
        )
        self.version += 1
        return results[0]

    def wait_all(self, refs: Sequence[Any], what: str, part: str) -> list[Any]:
        """The results of calls `refs` (in order), one per worker of a kind (`part`: `actor rank`,
        `agent-loop worker`), while the engines are watched (a failed one is restarted meanwhile);
        `RunnerError` naming the worker that died, or after `rollout.request_timeout_s`."""
        import ray
        from ray.exceptions import RayActorError

        deadline = time.monotonic() + self.timeout_s
        pending = list(refs)
        while pending:
            watched = self.liveness.refs()
            ready, _ = ray.wait(
                [*pending, *watched], num_returns=1, timeout=max(0.0, deadline - time.monotonic())
            )
            if not ready:
                raise RunnerError(
                    f"{what} did not finish within {self.timeout_s:.0f} s (rollout.request_timeout_s)"
                )
            if ready[0] in watched:
                self.liveness.recover(ready[0])
                continue
            pending.remove(ready[0])
            try:
                ray.get(ready[0], timeout=0)
            except RayActorError as error:
                index = list(refs).index(ready[0])
                raise self.liveness.fatal(f"{part} {index}", f"died during {what}: {error}") from error
        return self.workers.get(list(refs), what)

    def wait_batch(self, take: Callable[[], Any]) -> Any:
        """Poll `take()` (a hand-off that waits up to a second) until it yields a batch, while the engines
        and agent loops are watched (a failed one is restarted, or its error raised); `RunnerError` after
        `rollout.request_timeout_s` without data."""
        import ray

        deadline = time.monotonic() + self.timeout_s
        ref = take()
        while True:
            watched = self.liveness.refs()
            ready, _ = ray.wait([ref, *watched], num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if ready and ready[0] is not ref:
                self.liveness.recover(ready[0])
                continue
            batch = self.workers.get(ref, "the hand-off of a batch") if ready else None
            if batch is not None:
                return batch
            if time.monotonic() >= deadline:
                raise RunnerError(
                    f"no batch of {self.config.data.rollout_batch_size} groups was ready within "
                    f"{self.timeout_s:.0f} s (rollout.request_timeout_s)"
                )
            ref = take()

    # --- end of a step ---------------------------------------------------------------------------------

    def end_step(self, step: int, step_metrics: dict[str, float]) -> None:
        """Log the step (tokens per second derived here), start or collect an evaluation, checkpoint."""
        tokens = step_metrics.get(metrics.NUM_MODEL_TOKENS, 0.0)
        step_s = step_metrics[metrics.TIME_STEP]
        step_metrics[metrics.TOKENS_PER_S] = tokens / step_s if step_s > 0 else 0.0
        step_metrics[metrics.WEIGHT_VERSION] = float(self.version)
        self._collect_eval(step_metrics, wait=False)
        every = self.config.runner.eval_every_steps
        if every is not None and (step + 1) % every == 0 and self._pending_eval is None:
            self._start_eval()
            if not self.config.runner.async_mode:  # the engines are idle until the next step anyway
                self._collect_eval(step_metrics, wait=True)
        self.tracker.log_step(step + 1, step_metrics)
        save_every = self.config.checkpoint.save_every_steps
        if save_every is not None and (step + 1) % save_every == 0:
            self.save_checkpoint(step + 1)

    def _start_eval(self) -> None:
        self._pending_eval = self.workers.agent_loops[0].evaluate.remote("test", EVAL_MAX_PROMPTS)
        self._pending_eval_version = self.version

    def _collect_eval(self, step_metrics: dict[str, float], *, wait: bool) -> None:
        import ray

        if self._pending_eval is None:
            return
        ready, _ = ray.wait([self._pending_eval], timeout=self.timeout_s if wait else 0)
        if ready:
            step_metrics.update(self.workers.get(self._pending_eval, "evaluation"))
            self._pending_eval = None

    def finish(self) -> None:
        """After the last step: the evaluation still running, and the final checkpoint."""
        if self._pending_eval is not None:
            final: dict[str, float] = {}
            self._collect_eval(final, wait=True)
            if final:
                self.tracker.log_step(self.config.runner.num_steps, final)
        if self.config.checkpoint.save_at_end:
            self.save_checkpoint(self.config.runner.num_steps)
        counts = self.workers.get(self.workers.buffer.counts.remote(), "the buffer's counts")
        summary = {
            "num_steps": self.config.runner.num_steps,
            "version": self.version,
            "prompts": counts,
            "nodes": self.workers.nodes,
        }
        (self.run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")

    # --- checkpoints -----------------------------------------------------------------------------------

    def save_checkpoint(self, step: int) -> Path:
        """`<run_dir>/checkpoints/step_<n>/`: the actor's checkpoint and the dataloader's position. Groups
        in flight or buffered are not saved: a resumed run generates afresh from the saved position."""
        folder = self.run_dir / "checkpoints" / f"{CHECKPOINT_PREFIX}{step}"
        self.workers.get(
            [actor.save_checkpoint.remote(str(folder / "actor")) for actor in self.workers.actors],
            "checkpoint",
        )
        loader: LoaderState = self.workers.get(self.workers.buffer.loader_state.remote(), "checkpoint")
        state = {"step": step, "version": self.version, "loader": asdict(loader)}
        (folder / "runner_state.json").write_text(json.dumps(state), encoding="utf-8")
        kept = sorted(checkpoints(self.run_dir), key=lambda path: int(path.name[len(CHECKPOINT_PREFIX) :]))
        for old in kept[: -self.config.checkpoint.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        return folder

    def resume(self, folder: Path) -> None:
        """Continue from a checkpoint: actor weights and optimiser, version, step, dataloader position;
        then the engines get the restored weights."""
        state = _runner_state(folder)
        self.workers.get(
            [actor.load_checkpoint.remote(str(folder / "actor")) for actor in self.workers.actors], "resume"
        )
        loader = state["loader"]
        restored = LoaderState(
            loader["epoch"], loader["position"], tuple(loader["returned"]), tuple(loader["next_returned"])
        )
        self.workers.get(self.workers.buffer.restore_loader.remote(restored), "resume")
        self.start_step = int(state["step"])
        self.version = int(state["version"])
        self.workers.sync_weights(self.config.rollout.pause_mode)


def _runner_state(folder: Path) -> dict[str, Any]:
    path = folder / "runner_state.json"
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise RunnerError(f"checkpoint.resume_from: cannot read {path}: {error}") from error
    if not isinstance(state, dict):
        raise RunnerError(f"checkpoint.resume_from: {path} does not hold a runner state")
    return cast("dict[str, Any]", state)


def checkpoint_step(folder: Path) -> int:
    """The step a checkpoint was taken after."""
    return int(_runner_state(folder)["step"])


def checkpoints(run_dir: Path) -> list[Path]:
    """The complete checkpoints under `<run_dir>/checkpoints`."""
    folder = run_dir / "checkpoints"
    if not folder.is_dir():
        return []
    return [
        path
        for path in folder.iterdir()
        if path.name.startswith(CHECKPOINT_PREFIX) and (path / "runner_state.json").is_file()
    ]


def resolve_resume(run_dir: Path, resume_from: str) -> Path:
    """The checkpoint folder `checkpoint.resume_from` names (`latest`: the newest under the run folder)."""
    if resume_from != "latest":
        return Path(resume_from)
    found = checkpoints(run_dir)
    if not found:
        raise RunnerError(
            f"checkpoint.resume_from is `latest` but {run_dir / 'checkpoints'} holds no checkpoint"
        )
    return max(found, key=lambda path: int(path.name[len(CHECKPOINT_PREFIX) :]))
