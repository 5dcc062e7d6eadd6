"""What both drivers share: the actor's version, the step's bookkeeping (metrics, evaluation, checkpoints)
and the waits on Ray, each with a timeout."""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl_core import metrics
from asyncrl_core.runner import checkpoint
from asyncrl_core.runner.engine_counters import EngineCounterWindow
from asyncrl_core.runner.handoff import Handoff, train_calls
from asyncrl_core.runner.ledger import LEDGER_FILE, write_json
from asyncrl_core.runner.liveness import Liveness
from asyncrl_core.runner.timeouts import TimeoutKey, timed_out, timeout_of
from asyncrl_core.runner.workers import BufferState, RunnerError

if TYPE_CHECKING:
    from asyncrl_core.config import AsyncRLConfig
    from asyncrl_core.runner.groups import WorkerGroups
    from asyncrl_core.runner.tracking import RunTracker

logger = logging.getLogger(__name__)

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
        self._identity: dict[str, Any] | None = None
        self._saved_step: int | None = None
        """The step of the last checkpoint this run wrote or resumed from (none is written twice)."""
        self.liveness = Liveness(workers, run_dir)
        """The watch over engines and agent loops the drivers wait through."""
        self.engine_counters = EngineCounterWindow(workers)
        """The engines' counters over the step's rollout window, for the step's `rollout/engine/*`."""

    # --- driver helpers --------------------------------------------------------------------------------

    def shares(self, num_groups: int) -> list[tuple[int, int]]:
        """`num_groups` split over the agent-loop workers (the first ones take the rest), as `(worker index,
        groups)`."""
        base, extra = divmod(num_groups, len(self.workers.agent_loops))
        shares = [(index, base + (index < extra)) for index in range(len(self.workers.agent_loops))]
        return [(index, num) for index, num in shares if num > 0]

    def run_groups(self, start: Callable[[Any, int], Any]) -> None:
        """Sync mode: `rollout_batch_size` groups run by the agent-loop workers, `start(worker, num_groups)`
        being one worker's call, while engines, tools and actor ranks are watched. A worker that dies is
        restarted (`Liveness.agent_loop_died`: its unfinished groups are handed back), and the groups the
        batch still lacks once the others are done run again over the workers. `RunnerError` after
        `rollout.request_timeout_s` of one round."""
        import ray
        from ray.exceptions import RayActorError

        wanted = self.config.data.rollout_batch_size
        while wanted > 0:
            deadline = time.monotonic() + self.timeout_s
            loops = self.workers.agent_loops
            pending = {start(loops[index], num): (index, loops[index]) for index, num in self.shares(wanted)}
            died = False
            while pending:
                watched = self.liveness.refs()
                ready, _ = ray.wait(
                    [*pending, *watched], num_returns=1, timeout=max(0.0, deadline - time.monotonic())
                )
                if not ready:
                    raise timed_out("the rollout of a batch", self.timeout_s, "rollout.request_timeout_s")
                if ready[0] in watched:
                    self.liveness.recover(ready[0], "the rollout of a batch")
                    continue
                index, loop = pending.pop(ready[0])
                try:
                    ray.get(ready[0], timeout=0)
                except RayActorError as error:
                    died = True
                    if self.workers.agent_loops[index] is loop:  # not restarted through its other watch
                        self.liveness.agent_loop_died(index, error)  # unless the buffer worker died
                except Exception as error:
                    self.liveness.check_buffer("the rollout of a batch", error)
                    raise
            if not died:
                return
            counts = self.workers.get(self.workers.buffer.counts.remote(), "the buffer's counts")
            wanted = self.config.data.rollout_batch_size - int(counts["buffered"])

    def train(self, handoff: Handoff) -> dict[str, float]:
        """One step of every actor rank, each on its own data-parallel share of the batch `handoff` points
        to (`asyncrl_core.runner.handoff`); rank 0's metrics with the batch's rollout metrics. A rank that
        dies stops the run at once with its rank and error (the others may wait for it forever)."""
        results = self.wait_all(
            train_calls(self.workers.actors, handoff, self.config.actor.tensor_parallel_size),
            "training",
            "actor rank",
            "actor.train_timeout_s",
        )
        self.version += 1
        return {**results[0], **handoff.metrics}

    def wait_all(self, refs: Sequence[Any], what: str, part: str, key: TimeoutKey) -> list[Any]:
        """The results of calls `refs` (in order), one per worker of a kind (`part`: `actor rank`,
        `agent-loop worker`), while the engines are watched (a failed one is restarted meanwhile);
        `RunnerError` naming the worker that died, or after the timeout `key` names."""
        import ray
        from ray.exceptions import RayActorError

        timeout_s = timeout_of(self.config, key)
        deadline = time.monotonic() + timeout_s
        pending = list(refs)
        while pending:
            watched = self.liveness.refs()
            ready, _ = ray.wait(
                [*pending, *watched], num_returns=1, timeout=max(0.0, deadline - time.monotonic())
            )
            if not ready:
                raise timed_out(what, timeout_s, key)
            if ready[0] in watched:
                self.liveness.recover(ready[0], what)
                continue
            pending.remove(ready[0])
            try:
                ray.get(ready[0], timeout=0)
            except RayActorError as error:
                index = list(refs).index(ready[0])
                raise self.liveness.fatal(f"{part} {index}", f"died during {what}: {error}") from error
            except Exception as error:  # a batch lost with the buffer worker that handed it out, ...
                self.liveness.check_buffer(what, error)
                raise
        return self.workers.get(list(refs), what, key)

    def wait_batch(self, take: Callable[[], Any]) -> Handoff:
        """Poll `take()` (a hand-off that waits up to a second) until it yields a batch's `Handoff`, while
        the engines and agent loops are watched (a failed one is restarted, or its error raised);
        `RunnerError` after `rollout.request_timeout_s` without data."""
        import ray

        deadline = time.monotonic() + self.timeout_s
        ref = take()
        while True:
            watched = self.liveness.refs()
            ready, _ = ray.wait([ref, *watched], num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if ready and ready[0] is not ref:
                self.liveness.recover(ready[0], "the wait for data")
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
        timeout_s = self.config.runner.eval_timeout_s
        ready, _ = ray.wait([self._pending_eval], timeout=timeout_s if wait else 0)
        if wait and not ready:
            raise timed_out("evaluation", timeout_s, "runner.eval_timeout_s")
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
        num_steps = self.config.runner.num_steps
        if self.config.checkpoint.save_at_end and self._saved_step != num_steps:
            self.save_checkpoint(num_steps)
        counts = self.workers.get(self.workers.buffer.counts.remote(), "the buffer's counts")
        ledger = self.workers.get(self.workers.buffer.ledger_json.remote(), "the ledger")
        write_json(self.run_dir / LEDGER_FILE, ledger)
        summary = {
            "num_steps": self.config.runner.num_steps,
            "version": self.version,
            "prompts": counts,
            "nodes": self.workers.nodes,
        }
        (self.run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")

    # --- checkpoints (asyncrl_core.runner.checkpoint) -------------------------------------------------------

    def identity(self) -> dict[str, Any]:
        """What a checkpoint of this run records and a resume must match (dataset, seeds, shuffle, task)."""
        if self._identity is None:
            loop = self.workers.agent_loops[0]
            size, fingerprint = self.workers.get(
                [loop.dataset_size.remote(), loop.dataset_fingerprint.remote()], "reading the dataset"
            )
            self._identity = checkpoint.run_identity(self.config, size, fingerprint)
        return self._identity

    def save_checkpoint(self, step: int) -> Path:
        """`<run_dir>/checkpoints/step_<step>/`, written atomically (`asyncrl_core.runner.checkpoint`): the
        actor, the buffer's state with its buffered groups, the dataloader's position and the prompts in
        flight, the ledger, step and version; `ledger.json` in the run folder is brought up to date.

        Any failure to write it (a full disk, permissions, an I/O error, here or in an actor rank) stops the
        run naming the checkpoint, the cause and how to resume, with a `faults.jsonl` line, and leaves no
        temporary folder; a disk with less free space than the last checkpoint took is warned about first.
        """
        problem = checkpoint.space_problem(self.run_dir)
        if problem is not None:
            self.tracker.warn(f"checkpoint: {problem}")
        final = checkpoint.folder_of(self.run_dir, step)
        temporary: Path | None = None
        try:
            final, temporary = checkpoint.begin(self.run_dir, step)
            runner_state, ledger = self._write_checkpoint(temporary, step)
            folder = checkpoint.commit(temporary, final, runner_state, self.config.checkpoint.keep_last)
            write_json(self.run_dir / LEDGER_FILE, ledger)
        except BaseException as error:
            if temporary is not None:
                shutil.rmtree(temporary, ignore_errors=True)
            if isinstance(error, RunnerError) or not isinstance(error, Exception):
                raise  # a worker that died or timed out, a signal: explained where it is raised
            # A rank's error arrives wrapped by Ray, which keeps the original as `cause`.
            cause = getattr(error, "cause", None) or error
            raise self.liveness.fatal(
                "checkpoint", f"{final} could not be written: {type(cause).__name__}: {cause}"
            ) from error
        self._saved_step = step
        logger.info("checkpoint %s written", folder)
        return folder

    def _write_checkpoint(self, temporary: Path, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Write the actor's and the buffer's parts of the checkpoint after `step` into `temporary`; returns
        the runner's state and the ledger."""
        self.workers.get(
            [
                actor.save_checkpoint.remote(str(temporary / checkpoint.ACTOR_DIR))
                for actor in self.workers.actors
            ],
            "saving the actor's checkpoint",
            "checkpoint.timeout_s",
        )
        state: BufferState = self.workers.get(
            self.workers.buffer.state.remote(), "taking the buffer's state", "checkpoint.timeout_s"
        )
        checkpoint.write_buffer_state(temporary, state)
        runner_state = {
            "format": checkpoint.CHECKPOINT_FORMAT,
            "step": step,
            "version": self.version,
            "loader": asdict(state.loader),
            "identity": self.identity(),
        }
        return runner_state, state.ledger

    def align_external_engines(self) -> None:
        """A new run against engines someone else runs (`rollout.sglang.launch: external`): they hold
        whatever weights and version they last had (another run's), so the actor's starting weights go into
        them as version 0 before anything is generated. (A resumed run syncs its restored weights in
        `resume`; engines the run launches load its model themselves.)"""
        if self.config.rollout.sglang.launch != "external":
            return
        logger.info("external engines: syncing the actor's starting weights into them as version 0")
        self.workers.sync_weights(self.config.rollout.pause_mode)

    def resume(self, folder: Path) -> None:
        """Continue from a checkpoint: refused when it belongs to another dataset, seed or task; then the
        actor (weights, optimiser, random generators), the buffer with its buffered groups, the ledger, the
        dataloader with the prompts that were in flight first in line, version and step; then the engines
        get the restored weights."""
        state = checkpoint.check_resumable(folder, self.identity())
        buffer_state = checkpoint.read_buffer_state(folder, state["loader"])
        self.workers.get(
            [
                actor.load_checkpoint.remote(str(folder / checkpoint.ACTOR_DIR))
                for actor in self.workers.actors
            ],
            "loading the actor's checkpoint",
            "checkpoint.timeout_s",
        )
        reissued: list[int] = self.workers.get(
            self.workers.buffer.restore.remote(buffer_state), "restoring the buffer", "checkpoint.timeout_s"
        )
        self.start_step = self._saved_step = int(state["step"])
        self.version = int(state["version"])
        logger.info(
            "resumed from %s: step %d, %d prompts in flight issued again first",
            folder,
            self.start_step,
            len(reissued),
        )
        self.workers.sync_weights(self.config.rollout.pause_mode)
