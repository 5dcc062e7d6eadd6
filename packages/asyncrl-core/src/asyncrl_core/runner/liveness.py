"""The driver's watch over the run's engines and their rollout workers, the agent-loop workers and their
tools, the actor ranks and the buffer worker, and what it does when one fails.

Each engine's `RolloutWorker.watch()`, each agent-loop worker's `serve()` and `watch_tools()`, each actor
rank's `watch()` and the buffer worker's `watch()` are pending Ray calls while the part works; the driver
waits on them in the same `ray.wait` as the data, so a failure is seen as soon as Ray reports it:

- an engine process that exits or stops answering `/health` (`rollout.engine_unresponsive_s`) is restarted
  on its address and given the actor's current weights, up to `rollout.max_engine_restarts` times in the
  run; its requests meanwhile go to the other engines or wait for it (`asyncrl_sglang.pool`). It starts
  paused: a request that reaches it waits there until the weights are in, so none is generated with the
  weights it loads at start;
- a rollout worker whose process died (its engine is ended with it) is started again in its place: it
  starts the engine on the same address, paused, and the engine is given the actor's current weights, up
  to `rollout.max_worker_restarts` times; the engine's requests meanwhile fare as above;
- an agent-loop worker whose process died is started again, and the groups it had admitted are handed back
  to be issued again, up to `agentloop.max_worker_restarts` times;
- a tool that starts failing (a retriever that died: the agent loops' calls fail) is named, and so is its
  return (its calls succeed again); its calls meanwhile come back to the model as errors, counted in the
  step's `rollout/tool_errors`;
- a dead actor rank stops the run at once, naming the rank, even while the driver waits for data;
- a dead buffer worker stops the run at once: it held what exists nowhere else (the prompt ledger, the
  loader's position and the finished groups since the last checkpoint), so the run resumes from that
  checkpoint, which loses and repeats no prompt. A failure of any other part is first checked against it:
  its callers fail when it dies, and the part to name is the buffer worker;
- anything else (a worker's error, restarts spent) stops the run with a `RunnerError` naming the part.

Every failure and recovery is a line of `faults.jsonl` in the run folder (unix time, part, event, message)
and a warning on the log; the step's metrics count the restarts. The error a run stops with says how to
resume it.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from asyncrl_core import metrics
from asyncrl_core.runner.workers import EngineEndpoint, EngineFailure, RunnerError

if TYPE_CHECKING:
    from asyncrl_core.runner.groups import WorkerGroups
    from asyncrl_core.types import ToolHealth

logger = logging.getLogger(__name__)

FAULTS_FILE = "faults.jsonl"
"""One JSON object per line: `time` (unix seconds), `part` (`engine 0`, `rollout worker 0`, `agent-loop
worker 1`, `actor rank 0`, `buffer worker`, `tool search`), `event` (`failed`, `recovered`, `fatal`) and
`message`."""
ENGINE = "engine"
ROLLOUT_WORKER = "rollout worker"
AGENT_LOOP = "agent-loop worker"
TOOLS = "the tools of agent-loop worker"
ACTOR = "actor rank"
BUFFER = "buffer worker"
"""The one buffer worker of a run (no index)."""
BUFFER_PROBE_S = 10.0
"""Longest the driver waits for the buffer worker to answer whether it is alive."""
ACTOR_WATCH_GROUP = "liveness"
"""The concurrency group of `ActorWorker.watch` (`runner.groups`), beside the rank's serial calls."""


class Liveness:
    """Watches `workers`' engines, actor ranks, buffer worker and the agent loops' tools from creation, and
    the agent loops' generation once `serve` starts it."""

    def __init__(self, workers: WorkerGroups, run_dir: Path) -> None:
        self.workers = workers
        self.config = workers.config
        self.faults_path = run_dir / FAULTS_FILE
        self._watched: dict[Any, tuple[str, int]] = {}
        self._serving = False
        self.num_engine_restarts = 0
        self.num_agent_loop_restarts = 0
        self.num_rollout_worker_restarts = 0
        self._step_engine_restarts = 0
        self._step_agent_loop_restarts = 0
        self._step_rollout_worker_restarts = 0
        self._failing_tools: dict[str, set[int]] = {}
        """Tool name -> the agent-loop workers whose last call of it failed."""
        for index, rollout in enumerate(workers.rollouts):
            self._watched[rollout.watch.remote()] = (ENGINE, index)
        for index, loop in enumerate(workers.agent_loops):
            self._watched[loop.watch_tools.remote()] = (TOOLS, index)
        for rank, actor in enumerate(workers.actors):
            self._watched[actor.watch.options(concurrency_group=ACTOR_WATCH_GROUP).remote()] = (ACTOR, rank)
        self._watched[workers.buffer.watch.remote()] = (BUFFER, 0)
        workers.on_death = self.fatal

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

    def recover(self, ref: Any, during: str = "the run") -> None:
        """Handle the watched call `ref` that ended while the driver waited for `during` (`training`, the
        wait for data): restart what failed, record a tool's change, or raise `RunnerError`."""
        import ray
        from ray.exceptions import RayActorError

        kind, index = self._watched.pop(ref)
        part = BUFFER if kind == BUFFER else f"{AGENT_LOOP if kind == TOOLS else kind} {index}"
        try:
            result: Any = ray.get(ref, timeout=0)
        except RayActorError as error:
            if kind in (AGENT_LOOP, TOOLS):
                self.agent_loop_died(index, error)  # unless the buffer worker died
                return
            if kind == ENGINE:
                self._restart_rollout_worker(index, error)
                return
            raise self.fatal(part, f"died during {during}: {error}") from error
        except Exception as error:
            self.check_buffer(during, error)
            raise self.fatal(part, f"failed: {error}") from error
        if kind == BUFFER:
            raise self.fatal(part, f"stopped being watched during {during}")
        if kind == ENGINE:
            if result is not None:
                self._restart_engine(result)
        elif kind == TOOLS:
            for event in cast("list[ToolHealth]", result):
                self._tool_health(index, event)
            if result:  # an empty answer: the worker closed
                self._watched[self.workers.agent_loops[index].watch_tools.remote()] = (TOOLS, index)
        elif kind == ACTOR:
            raise self.fatal(part, f"stopped being watched during {during}")
        elif self._serving:
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

    def check_buffer(self, what: str, error: Exception) -> None:
        """After `error` in `what`: if the buffer worker is dead, the `RunnerError` naming it (its callers'
        calls fail when it dies, and a batch it handed out by reference is lost with it)."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            ray.get(self.workers.buffer.watch.remote(0.0), timeout=BUFFER_PROBE_S)
        except RayActorError as death:
            raise self.fatal(BUFFER, f"died during {what}: {death}") from error
        except GetTimeoutError:
            return  # busy, not dead: the error raised stands

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
            metrics.ROLLOUT_WORKER_RESTARTS: float(self._step_rollout_worker_restarts),
        }
        self._step_engine_restarts = self._step_agent_loop_restarts = self._step_rollout_worker_restarts = 0
        return counts

    def fatal(self, part: str, message: str) -> RunnerError:
        """Record that `part` failed beyond repair; the error the run stops with, which says how to resume
        the run."""
        self.record(part, "fatal", message)
        if part == BUFFER:
            message += (
                "; it held the prompt ledger, the loader's position and the finished groups since the last "
                "checkpoint, which exist nowhere else, so it is not restarted in the run"
            )
        return RunnerError(f"{part} {message}\n{self._resume_hint()}")

    def _resume_hint(self) -> str:
        from asyncrl_core.runner.checkpoint import checkpoints

        saved = checkpoints(self.faults_path.parent)
        if not saved:
            return (
                "No checkpoint was written (checkpoint.save_every_steps), so the run cannot be resumed: "
                "start it again."
            )
        return (
            f"Resume the run from its last checkpoint ({saved[-1]}) with checkpoint.resume_from=latest: no "
            "prompt is lost or trained twice."
        )

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
        self.workers.engine_restarted(failure.index)
        self._rejoin(part, failure.index, endpoint)
        self.record(
            part, "recovered", f"restarted ({self.num_engine_restarts} of {limit}) with the current weights"
        )

    def _restart_rollout_worker(self, index: int, error: Exception) -> None:
        part = f"{ROLLOUT_WORKER} {index}"
        self.record(part, "failed", f"its process died, and its engine is ended with it: {error}")
        limit = self.config.rollout.max_worker_restarts
        if self.num_rollout_worker_restarts >= limit:
            raise self.fatal(part, f"died, and its {limit} restarts (rollout.max_worker_restarts) are spent")
        if self.config.rollout.sglang.weight_transport == "distributed":
            raise self.fatal(
                part,
                "died with its engine; a restarted engine cannot join the weight-update group of "
                "rollout.sglang.weight_transport: distributed, so it is not restarted",
            )
        self.num_rollout_worker_restarts += 1
        self._step_rollout_worker_restarts += 1
        endpoint = self.workers.restart_rollout(index)
        self._rejoin(part, index, endpoint)
        self.record(
            part,
            "recovered",
            f"restarted ({self.num_rollout_worker_restarts} of {limit}) with its engine, which has the "
            "current weights",
        )

    def _rejoin(self, part: str, index: int, endpoint: EngineEndpoint) -> None:
        """Engine `index`, started again at `endpoint` (paused), takes the actor's current weights and is
        watched."""
        if endpoint != self.workers.endpoints[index]:
            raise self.fatal(
                part,
                f"came back at {endpoint.url}, not at {self.workers.endpoints[index].url} where the "
                "agent loops send (another process holds that port)",
            )
        # It holds the requests that reach it: the sync pauses it (retract), pushes the actor's current
        # weights and continues it, so they are generated with those. A sync that fails stops the run.
        self.workers.get(
            [actor.sync_weights.remote([endpoint], "retract") for actor in self.workers.actors],
            f"pushing the weights into the restarted {part}",
            "actor.train_timeout_s",
        )
        self._watched[self.workers.rollouts[index].watch.remote()] = (ENGINE, index)

    def _tool_health(self, index: int, event: ToolHealth) -> None:
        """Record a tool's outage when the first worker sees it fail, and its return when the last one that
        saw it fail has a call of it succeed."""
        failing = self._failing_tools.setdefault(event.tool, set())
        part = f"tool {event.tool}"
        if event.failing:
            if not failing:
                self.record(part, "failed", f"{event.message} (agent-loop worker {index})", event.at)
            failing.add(index)
        elif index in failing:
            failing.discard(index)
            if not failing:
                self.record(part, "recovered", f"{event.message} (agent-loop worker {index})", event.at)

    def agent_loop_died(self, index: int, error: Exception) -> None:
        """Agent-loop worker `index` died: restart it and hand back its groups (`RunnerError` when its
        restarts are spent). Its other watched calls are dropped; the new worker's replace them. A dead
        buffer worker fails the calls of every agent-loop worker: then the `RunnerError` names it."""
        self.check_buffer(f"the run of agent-loop worker {index}", error)
        for ref, (kind, watched) in list(self._watched.items()):
            if watched == index and kind in (AGENT_LOOP, TOOLS):
                del self._watched[ref]
        for failing in self._failing_tools.values():
            failing.discard(index)
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
        self._watched[loop.watch_tools.remote()] = (TOOLS, index)
        if self._serving:
            self._watched[loop.serve.remote(self.workers.buffer_port)] = (AGENT_LOOP, index)
        self.record(
            part,
            "recovered",
            f"restarted ({self.num_agent_loop_restarts} of {limit}); the {handed_back} groups it had "
            "admitted are issued again",
        )
