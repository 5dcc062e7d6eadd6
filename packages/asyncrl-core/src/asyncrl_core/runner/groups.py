"""Ray actors for the workers, placed on the devices `cluster.component_placement` gives each component
(`asyncrl_core.runner.placement`: placement groups, device ids by node address, the addresses workers meet
at)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl_core.runner.liveness import ACTOR, ACTOR_WATCH_GROUP, AGENT_LOOP, BUFFER, ROLLOUT_WORKER
from asyncrl_core.runner.placement import Placement, Slot
from asyncrl_core.runner.timeouts import CONTROL_TIMEOUT_S, TimeoutKey, timed_out, timeout_of
from asyncrl_core.runner.workers import (
    ActorWorker,
    AgentLoopWorker,
    BufferWorker,
    EngineEndpoint,
    RankSettings,
    RolloutWorker,
    RunnerError,
)
from asyncrl_core.types import Group

if TYPE_CHECKING:
    from asyncrl_core.config import AsyncRLConfig

ROLLOUT_CALLS = 4
"""Concurrent calls a rollout worker serves: its `watch` blocks for the whole run beside the others."""

STOP_TIMEOUT_S = 30.0
"""Longest the agent loops and engines get to close at the end of a run before their workers are killed
(an engine's own stop is SIGTERM, then SIGKILL of its process group after 10 s)."""
logger = logging.getLogger(__name__)

MAX_BUFFER_CALLS = 64
"""Concurrent calls the buffer worker serves (blocking admissions of every agent-loop worker, completions
and the driver's hand-off at once)."""


class RayBufferPort:
    """A `BufferPort` over the buffer worker's Ray actor handle (what agent-loop workers call)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def admit(self, max_groups: int, timeout_s: float, worker_index: int = 0) -> list[tuple[int, int]]:
        return await self.handle.admit.remote(max_groups, timeout_s, worker_index)

    async def complete(self, group: Group) -> bool:
        return await self.handle.complete.remote(group)

    async def abandon(self, group_id: int, reason: str | None = None) -> None:
        await self.handle.abandon.remote(group_id, reason)


class WorkerGroups:
    """Every Ray actor of a run: buffer, agent loops, rollout engines and actor ranks; `stop` ends them all.

    They start together (the buffer with the size of the task's train split, `dataset_size`); the agent
    loops connect to the engines once these answer.
    """

    def __init__(
        self,
        config: AsyncRLConfig,
        *,
        actor_model_path: str,
        rollout_model_path: str,
        run_dir: Path,
        task_services: dict[str, str],
        dataset_size: int,
        stopped: list[str] | None = None,
    ) -> None:
        self.config = config
        self._handles: list[Any] = []
        self.on_death: Callable[[str, str], RunnerError] | None = None
        """Told `(part, message)` when `get` finds a worker dead (the run's fault record); the error `get`
        raises then."""
        self._started = False
        self.stopped = stopped if stopped is not None else []
        """Where `stop` says what it stopped (the run's message on an interruption)."""
        self.rollouts: list[Any] = []
        self.actors: list[Any] = []
        self.agent_loops: list[Any] = []
        self.start_times: dict[str, float] = {}
        """Seconds from the start of the workers until each role was ready: `engines`, `actor`,
        `agent loops`, `buffer` (they start together)."""
        self.placement: Placement | None = None
        """The run's placement groups, once reserved; removed by `stop`."""
        try:
            self._start(config, actor_model_path, rollout_model_path, run_dir, task_services, dataset_size)
        except BaseException:
            # A failure or a signal while the workers are built: nothing else holds the actors made so far.
            self.stop()
            raise
        self._started = True

    def _start(
        self,
        config: AsyncRLConfig,
        actor_model_path: str,
        rollout_model_path: str,
        run_dir: Path,
        task_services: dict[str, str],
        dataset_size: int,
    ) -> None:
        import ray

        stage_started = time.perf_counter()
        gpu = config.cluster.device_type == "gpu"
        self.placement = Placement.reserve(config, timeout_of(config, "runner.startup_timeout_s"))
        placement = self.placement

        rollout_devices = config.cluster.devices_of("rollout")
        tp = config.rollout.tensor_parallel_size
        num_instances = config.rollout.num_instances or 1
        rollout_class = ray.remote(RolloutWorker)
        self.rollout_slots: list[Slot] = []
        for index in range(num_instances):
            share = rollout_devices[index * tp : (index + 1) * tp] if gpu else rollout_devices
            # An external engine has no devices: its rollout worker only watches it, from the head node.
            if config.rollout.sglang.launch == "external":
                share = ()
            slot = placement.slot(share, f"engine {index}") if share else placement.head_slot()
            self.rollout_slots.append(slot)

        def rollout(index: int, **replacing: Any) -> Any:
            slot = self.rollout_slots[index]
            # The engine binds where the cluster's other nodes can reach it (placement.engine_bind_host).
            engine_config = config.model_copy(
                update={
                    "rollout": config.rollout.model_copy(
                        update={
                            "sglang": config.rollout.sglang.model_copy(
                                update={"host": placement.engine_host(slot)}
                            )
                        }
                    )
                }
            )
            return self._keep(
                rollout_class.options(**placement.options(slot), max_concurrency=ROLLOUT_CALLS).remote(
                    engine_config,
                    model_path=rollout_model_path,
                    index=index,
                    devices=slot.local_devices,
                    run_dir=run_dir,
                    **replacing,
                )
            )

        self._rollout = rollout
        self.rollouts.extend(rollout(index) for index in range(num_instances))

        actor_devices = config.cluster.devices_of("actor")
        world_size = config.actor_data_parallel_size * config.actor.tensor_parallel_size
        per_rank = max(1, len(actor_devices) // world_size)
        # On a CPU the ranks split the actor's cores when there are enough, else each uses all of them.
        split = gpu or len(actor_devices) >= world_size
        actor_slots = [
            placement.slot(
                actor_devices[rank * per_rank : (rank + 1) * per_rank] if split else actor_devices,
                f"actor rank {rank}",
            )
            for rank in range(world_size)
        ]
        self.nodes: dict[str, Any] = {
            "actor": [slot.node.address for slot in actor_slots],
            "rollout": [slot.node.address for slot in self.rollout_slots],
        }
        """Where the run's parts are: the node address of each actor rank and engine, and where the actor
        ranks meet when there are several (written to `summary.json`, with the engines' URLs once they
        started)."""
        master_address, master_port = actor_slots[0].node.address, 0  # a world of one meets nobody
        if world_size > 1:  # the ranks meet at a store on rank 0's node
            store, master_address, master_port = placement.rendezvous(
                actor_slots[0], timeout_of(config, "runner.startup_timeout_s")
            )
            self._keep(store)
            self.nodes["actor_master"] = f"{master_address}:{master_port}"
        # A concurrency group of its own for `watch`, so its call pends beside the rank's serial calls.
        actor_class = ray.remote(concurrency_groups={ACTOR_WATCH_GROUP: 1})(ActorWorker)  # pyright: ignore[reportCallIssue]
        for rank, slot in enumerate(actor_slots):
            self.actors.append(
                self._keep(
                    actor_class.options(**placement.options(slot)).remote(
                        config,
                        model_path=actor_model_path,
                        devices=slot.local_devices,
                        rank=RankSettings(rank, world_size, master_port, master_address),
                    )
                )
            )
        loop_class = ray.remote(AgentLoopWorker)

        def agent_loop(index: int, endpoints: list[EngineEndpoint] | None = None) -> Any:
            # Beside an engine (each in turn), on the CPU sharing its cores.
            slot = self.rollout_slots[index % len(self.rollout_slots)]
            return self._keep(
                loop_class.options(**placement.options(slot, ())).remote(
                    config,
                    model_path=rollout_model_path,
                    endpoints=endpoints,
                    task_services=task_services,
                    worker_index=index,
                    cores=() if gpu else slot.local_devices,
                )
            )

        self._agent_loop = agent_loop
        # Every role starts at once; the agent loops connect to the engines once these answer.
        self.agent_loops.extend(agent_loop(i) for i in range(config.agentloop.num_workers))
        buffer_class = ray.remote(BufferWorker)
        self.buffer = self._keep(
            buffer_class.options(
                **placement.options(placement.head_slot()), max_concurrency=MAX_BUFFER_CALLS
            ).remote(config, dataset_size, by_reference=True)
        )
        self.buffer_port = RayBufferPort(self.buffer)
        endpoint_refs = [rollout.endpoint.remote() for rollout in self.rollouts]
        starting: dict[Any, str] = {
            **dict.fromkeys(endpoint_refs, "engines"),
            **{actor.get_version.remote(): "actor" for actor in self.actors},
            **{loop.dataset_size.remote(): "agent loops" for loop in self.agent_loops},
            self.buffer.counts.remote(): "buffer",
        }
        results = self._wait_for_start(starting, stage_started, config)
        self.endpoints: list[EngineEndpoint] = [results[ref] for ref in endpoint_refs]
        self.engine_pids: list[int | None] = self.get(
            [rollout.pid.remote() for rollout in self.rollouts], "the engines' process ids"
        )
        """Each engine's process id (None for an `external` one), for the worker that replaces a dead
        rollout worker (`restart_rollout`); kept current across restarts (`engine_restarted`)."""
        self.engine_restarts = [0] * len(self.rollouts)
        """Each engine's restarts so far, by either kind (its process, its rollout worker)."""
        self.nodes["engines"] = [endpoint.url for endpoint in self.endpoints]
        self.get(
            [loop.connect.remote(self.endpoints) for loop in self.agent_loops],
            "connecting the agent loops to the engines",
        )

    def _wait_for_start(
        self, starting: dict[Any, str], started: float, config: AsyncRLConfig
    ) -> dict[Any, Any]:
        """Wait for every start call of `starting` (a reference per worker, with its role), recording in
        `start_times` when each role was ready; the first failure is raised at once, naming its worker.
        Returns each reference's result."""
        import ray

        timeout_s = timeout_of(config, "runner.startup_timeout_s")
        deadline = time.monotonic() + timeout_s
        waiting = dict(starting)
        left = {role: list(waiting.values()).count(role) for role in dict.fromkeys(waiting.values())}
        results: dict[Any, Any] = {}
        while waiting:
            ready, _ = ray.wait(list(waiting), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                roles = ", ".join(dict.fromkeys(waiting.values()))
                raise timed_out(
                    f"the start of the workers ({roles} still starting)",
                    timeout_s,
                    "runner.startup_timeout_s",
                )
            for ref in ready:
                role = waiting.pop(ref)
                results[ref] = self.get(ref, f"the start of the {role}")
                left[role] -= 1
                if left[role] == 0:
                    self.start_times[role] = time.perf_counter() - started
        return results

    def restart_agent_loop(self, index: int) -> Any:
        """A new agent-loop worker in place of worker `index` (whose process died); returns its handle once
        it has started."""
        import ray

        old = self.agent_loops[index]
        ray.kill(old)
        self._handles.remove(old)
        self.agent_loops[index] = self._agent_loop(index, self.endpoints)
        self.get(
            self.agent_loops[index].dataset_size.remote(),
            f"restarting agent-loop worker {index}",
            "runner.startup_timeout_s",
        )
        return self.agent_loops[index]

    def restart_rollout(self, index: int) -> EngineEndpoint:
        """A new rollout worker in place of worker `index` (whose process died): it ends the dead worker's
        engine and starts its own on the same port, paused. Returns the endpoint of that engine once it is
        healthy; it holds every request until the actor's current weights, pushed next, continue it."""
        import urllib.parse

        import ray

        old = self.rollouts[index]
        ray.kill(old)
        self._handles.remove(old)
        port = urllib.parse.urlsplit(self.endpoints[index].url).port
        self.rollouts[index] = self._rollout(
            index,
            port=port,
            replaces_pid=self.engine_pids[index],
            num_restarts=self.engine_restarts[index] + 1,
            start_paused=True,
        )
        endpoint: EngineEndpoint = self.get(
            self.rollouts[index].endpoint.remote(),
            f"restarting rollout worker {index}",
            "runner.startup_timeout_s",
        )
        self.engine_restarted(index)
        return endpoint

    def engine_restarted(self, index: int) -> None:
        """Engine `index` was started again (by its rollout worker, or by a new one): count it, and read its
        new process id."""
        self.engine_restarts[index] += 1
        self.engine_pids[index] = self.get(
            self.rollouts[index].pid.remote(), f"the process id of engine {index}"
        )

    def _keep(self, handle: Any) -> Any:
        self._handles.append(handle)
        return handle

    def get(self, refs: Any, what: str, key: TimeoutKey | None = None) -> Any:
        """`ray.get` bounded by the timeout `key` names (`CONTROL_TIMEOUT_S` without one: a call that
        answers at once), with an error naming `what` and the key."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        timeout = timeout_of(self.config, key) if key is not None else CONTROL_TIMEOUT_S
        try:
            return ray.get(refs, timeout=timeout)
        except GetTimeoutError as error:
            raise timed_out(what, timeout, key) from error
        except RayActorError as error:
            part = self.part_of(getattr(error, "actor_id", None))
            if self.on_death is not None:
                raise self.on_death(part, f"died during {what}: {error}") from error
            raise RunnerError(f"{part} died during {what}: {error}") from error

    def part_of(self, actor_id: str | None) -> str:
        """What the Ray actor `actor_id` (hex) is in the run: `actor rank 0`, `agent-loop worker 1`, ..."""
        roles = [
            *((ACTOR, index, handle) for index, handle in enumerate(self.actors)),
            *((AGENT_LOOP, index, handle) for index, handle in enumerate(self.agent_loops)),
            *((ROLLOUT_WORKER, index, handle) for index, handle in enumerate(self.rollouts)),
        ]
        for role, index, handle in roles:
            if actor_id is not None and handle._actor_id.hex() == actor_id:
                return f"{role} {index}"
        buffer = getattr(self, "buffer", None)  # absent while the workers start
        if actor_id is not None and buffer is not None and buffer._actor_id.hex() == actor_id:
            return BUFFER
        return "a worker"

    def sync_weights(self, mode: str) -> dict[str, float]:
        """Push the actor's weights into every engine in `mode`; in `drain` mode the agent loops hold new
        requests and wait for theirs first, and reopen afterwards whatever happens."""
        if mode == "drain":
            timeout_s = self.config.rollout.drain_timeout_s
            self.get(
                [loop.drain.remote(timeout_s) for loop in self.agent_loops],
                "draining the agent loops",
                "rollout.drain_timeout_s",
            )
        try:
            results = self.get(
                [actor.sync_weights.remote(self.endpoints, mode) for actor in self.actors],
                "weight sync",
                "actor.train_timeout_s",
            )
        finally:
            if mode == "drain":
                self.get([loop.reopen.remote() for loop in self.agent_loops], "reopening the agent loops")
        return results[0]

    def stop(self) -> None:
        """Close the weight transport (the engines leave the `distributed` transport's group, so engines
        that outlive the run can join another) and the agent loops, then stop the engines (each engine's
        whole process group), each stage waiting up to `STOP_TIMEOUT_S`; then end every actor. Workers still
        starting are ended at once: their start, not the stop, would run first; the devices the run reserved
        are given back last. Idempotent; says what it stopped in `stopped`."""
        import ray

        handles, self._handles = self._handles, []
        if not handles:
            self._give_back_devices()
            return
        if self._started:
            self.buffer.close.remote()  # ends the driver's watch of it
            # A rank busy with a step or a sync closes once that call returns (its calls run in turn).
            leaving = [actor.close_weight_transport.remote(self.endpoints) for actor in self.actors]
            for loop in self.agent_loops:
                loop.stop.remote()
            closing = [loop.aclose.remote() for loop in self.agent_loops]
            self._close_weight_transport(leaving)
            stopping = [rollout.stop.remote() for rollout in self.rollouts]
            pending = closing + stopping
            ready, _ = ray.wait(pending, num_returns=len(pending), timeout=STOP_TIMEOUT_S)
            if len(ready) < len(pending):
                logger.warning(
                    "%d agent loops or engines did not stop within %.0f s; ending their workers",
                    len(pending) - len(ready),
                    STOP_TIMEOUT_S,
                )
        for handle in handles:
            ray.kill(handle)
        self._give_back_devices()
        parts = [
            _count(len(self.rollouts), "engine"),
            _count(len(self.actors), "actor rank"),
            _count(len(self.agent_loops), "agent loop"),
        ]
        described = ", ".join(part for part in parts if part)
        self.stopped.append(described if self._started else f"{described} (still starting)")

    def _close_weight_transport(self, leaving: list[Any]) -> None:
        """Wait up to `STOP_TIMEOUT_S` for the actor ranks' `close_weight_transport` calls (before the
        engines stop: they take part); a failure is logged, since the run ends anyway."""
        import ray

        ready, _ = ray.wait(leaving, num_returns=len(leaving), timeout=STOP_TIMEOUT_S)
        if len(ready) < len(leaving):
            logger.warning(
                "the weight transport did not close within %.0f s; the engines may keep its group",
                STOP_TIMEOUT_S,
            )
        for ref in ready:
            try:
                ray.get(ref, timeout=0)
            except Exception as error:  # a rank that died, an engine that did not answer
                logger.warning(
                    "closing the weight transport failed (the engines may keep its group): %s: %s",
                    type(error).__name__,
                    error,
                )

    def _give_back_devices(self) -> None:
        placement, self.placement = self.placement, None
        if placement is not None:
            placement.remove()


def _count(number: int, what: str) -> str:
    return f"{number} {what}{'s' if number != 1 else ''}" if number else ""


def start_ray(config: AsyncRLConfig) -> None:
    """Join `runner.ray_address`, or start a local Ray instance: CPUs set explicitly, no dashboard, no
    usage reporting, logs of the workers forwarded to this terminal."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if ray.is_initialized():
        return
    if config.runner.ray_address is not None:
        ray.init(address=config.runner.ray_address, include_dashboard=False, logging_level=logging.WARNING)
        return
    # A local instance serves this process only: no token is written to the home folder.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    num_cpus = len(os.sched_getaffinity(0))
    ray.init(num_cpus=num_cpus, num_gpus=None, include_dashboard=False, logging_level=logging.WARNING)
