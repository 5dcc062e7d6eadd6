"""The driver's watch over the run's engines and agent-loop workers, and what it does when one fails.

Each engine's `RolloutWorker.watch()` and each agent-loop worker's `serve()` are pending Ray calls while
the part works; the driver waits on them in the same `ray.wait` as the data, so a failure is seen as soon as
Ray reports it:

- an engine process that exits or stops answering `/health` (`rollout.engine_unresponsive_s`) is restarted
  on its address and given the actor's current weights, up to `rollout.max_engine_restarts` times in the
  run; its requests meanwhile go to the other engines or wait for it (`asyncrl_sglang.pool`);
- an agent-loop worker whose process died is started again, and the groups it had admitted are handed back
  to be issued again, up to `agentloop.max_worker_restarts` times;
- anything else (a worker's error, a dead buffer or rollout worker, restarts spent) stops the run with a
  `RunnerError` naming the part.

Every failure and recovery is a line of `faults.jsonl` in the run folder (unix time, part, event, message)
and a warning on the log; the step's metrics count the restarts.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl_core import metrics
from asyncrl_core.runner.workers import EngineEndpoint, EngineFailure, RunnerError

if TYPE_CHECKING:
    from asyncrl_core.runner.groups import WorkerGroups

logger = logging.getLogger(__name__)

FAULTS_FILE = "faults.jsonl"
"""One JSON object per line: `time` (unix seconds), `part` (`engine 0`, `agent-loop worker 1`, `actor rank
0`), `event` (`failed`, `recovered`, `fatal`) and `message`."""
ENGINE = "engine"
AGENT_LOOP = "agent-loop worker"


class Liveness:
    """Watches `workers`' engines from creation, and their agent loops once `serve` starts them."""

    def __init__(self, workers: WorkerGroups, run_dir: Path) -> None:
        self.workers = workers
        self.config = workers.config
        self.faults_path = run_dir / FAULTS_FILE
        self._watched: dict[Any, tuple[str, int]] = {}
        self._serving = False
        self.num_engine_restarts = 0
        self.num_agent_loop_restarts = 0
        self._step_engine_restarts = 0
        self._step_agent_loop_restarts = 0
        for index, rollout in enumerate(workers.rollouts):
            self._watched[rollout.watch.remote()] = (ENGINE, index)
        workers.on_death = lambda part, message: self.record(part, "fatal", message)

    # --- what the drivers call ----------------------------------------------------------------------------

    def serve(self) -> None:
        """Start every agent loop's continuous generation (async mode), watched."""
        self._serving = True
        for index, loop in enumerate(self.workers.agent_loops):
            self._watched[loop.serve.remote(self.workers.buffer_port)] = (AGENT_LOOP, index)

    def stop_serving(self) -> None:
        """End the agent loops' continuous generation and wait for their running groups."""
        self._serving = False
        for loop in self.workers.agent_loops:
            loop.stop.remote()
        serving = [ref for ref, (kind, _) in self._watched.items() if kind == AGENT_LOOP]
        for ref in serving:
            del self._watched[ref]
        self.workers.get(serving, "stopping the agent loops", "rollout.drain_timeout_s")

    def refs(self) -> list[Any]:
        """The pending calls to wait on beside the data: any of them ending means a part failed."""
        return list(self._watched)

    def recover(self, ref: Any) -> None:
        """Handle the watched call `ref` that ended: restart what failed, or raise `RunnerError`."""
        import ray
        from ray.exceptions import RayActorError

        kind, index = self._watched.pop(ref)
        part = f"{kind} {index}"
        try:
            result: EngineFailure | None = ray.get(ref, timeout=0)
        except RayActorError as error:
            if kind == AGENT_LOOP:
                self._restart_agent_loop(index, error)
                return
            raise self.fatal(part, f"its worker died: {error}") from error
        except Exception as error:
            raise self.fatal(part, f"failed: {error}") from error
        if kind == ENGINE:
            if result is not None:
                self._restart_engine(result)
            return
        if self._serving:
            raise self.fatal(part, "stopped serving while the run needed data")

    def sync_weights(self, mode: str) -> dict[str, float]:
        """`WorkerGroups.sync_weights`; when it fails because an engine failed meanwhile, that engine is
        restarted and the sync runs once more."""
        try:
            return self.workers.sync_weights(mode)
        except Exception as error:
            self.check_actors("the weight sync", error)
            if not self._recover_engines(self.config.rollout.engine_unresponsive_s + 5.0):
                raise
        return self.workers.sync_weights(mode)

    def check_actors(self, what: str, error: Exception) -> None:
        """After `error` in `what`: if an actor rank's worker is dead, the `RunnerError` naming it."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        for rank, actor in enumerate(self.workers.actors):
            try:
                ray.get(actor.get_version.remote(), timeout=10)
            except RayActorError as death:
                raise self.fatal(f"actor rank {rank}", f"died during {what}: {death}") from error
            except GetTimeoutError:
                continue  # busy or hung, not dead: the error raised stands

    def end_step(self) -> dict[str, float]:
        """The step's restart counts (metrics), reset for the next step."""
        counts = {
            metrics.ENGINE_RESTARTS: float(self._step_engine_restarts),
            metrics.AGENT_LOOP_RESTARTS: float(self._step_agent_loop_restarts),
        }
        self._step_engine_restarts = self._step_agent_loop_restarts = 0
        return counts

    def fatal(self, part: str, message: str) -> RunnerError:
        """Record that `part` failed beyond repair; the error the run stops with."""
        self.record(part, "fatal", message)
        return RunnerError(f"{part} {message}")

    def record(self, part: str, event: str, message: str, at: float | None = None) -> None:
        """Append an event to `faults.jsonl` (and warn)."""
        logger.warning("%s: %s: %s", part, event, message)
        line = {"time": time.time() if at is None else at, "part": part, "event": event, "message": message}
        with open(self.faults_path, "a", encoding="utf-8") as faults:
            faults.write(json.dumps(line) + "\n")

    # --- recovery -------------------------------------------------------------------------------------------

    def _recover_engines(self, wait_s: float) -> bool:
        """Wait up to `wait_s` for an engine watch to end and handle every one that did; whether any did."""
        import ray

        engines = [ref for ref, (kind, _) in self._watched.items() if kind == ENGINE]
        ready, _ = ray.wait(engines, num_returns=1, timeout=wait_s)
        ready, _ = ray.wait(engines, num_returns=len(engines), timeout=0) if ready else (ready, None)
        for ref in ready:
            self.recover(ref)
        return bool(ready)

    def _restart_engine(self, failure: EngineFailure) -> None:
        part = f"{ENGINE} {failure.index}"
        self.record(
            part, "failed", f"{failure.what}; the end of its log:\n{failure.log_tail}", failure.detected_at
        )
        limit = self.config.rollout.max_engine_restarts
        if self.num_engine_restarts >= limit:
            raise self.fatal(
                part, f"{failure.what}, and its {limit} restarts (rollout.max_engine_restarts) are spent"
            )
        if self.config.rollout.sglang.weight_transport == "distributed":
            raise self.fatal(
                part,
                f"{failure.what}; a restarted engine cannot join the weight-update group of "
                "rollout.sglang.weight_transport: distributed, so it is not restarted",
            )
        self.num_engine_restarts += 1
        self._step_engine_restarts += 1
        rollout = self.workers.rollouts[failure.index]
        endpoint: EngineEndpoint = self.workers.get(
            rollout.restart.remote(), f"restarting {part}", "runner.startup_timeout_s"
        )
        if endpoint != self.workers.endpoints[failure.index]:
            raise self.fatal(
                part,
                f"came back at {endpoint.url}, not at {self.workers.endpoints[failure.index].url} where the "
                "agent loops send (another process holds that port)",
            )
        # It serves the weights it started with: the actor's current ones go in before it is watched again.
        self.workers.get(
            [actor.sync_weights.remote([endpoint], "retract") for actor in self.workers.actors],
            f"pushing the weights into the restarted {part}",
            "actor.train_timeout_s",
        )
        self._watched[rollout.watch.remote()] = (ENGINE, failure.index)
        self.record(
            part, "recovered", f"restarted ({self.num_engine_restarts} of {limit}) with the current weights"
        )

    def _restart_agent_loop(self, index: int, error: Exception) -> None:
        part = f"{AGENT_LOOP} {index}"
        self.record(part, "failed", f"its process died: {error}")
        limit = self.config.agentloop.max_worker_restarts
        if self.num_agent_loop_restarts >= limit:
            raise self.fatal(
                part, f"died, and its {limit} restarts (agentloop.max_worker_restarts) are spent"
            )
        self.num_agent_loop_restarts += 1
        self._step_agent_loop_restarts += 1
        handed_back: int = self.workers.get(
            self.workers.buffer.hand_back.remote(index), f"handing back the groups of {part}"
        )
        loop = self.workers.restart_agent_loop(index)
        if self._serving:
            self._watched[loop.serve.remote(self.workers.buffer_port)] = (AGENT_LOOP, index)
        self.record(
            part,
            "recovered",
            f"restarted ({self.num_agent_loop_restarts} of {limit}); the {handed_back} groups it had "
            "admitted are issued again",
        )
