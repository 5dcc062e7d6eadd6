"""The workers of a run (ARCHITECTURE.md section 5), as plain classes a test can build in one process.

- `BufferWorker` owns the dataloader (`PromptLoader`), the `GroupBuffer` and the prompt ledger: it issues
  prompts under the two admission limits, buffers finished groups, hands the oldest to the actor and
  records where every prompt went.
- `AgentLoopWorker` runs a task's trajectories against the engines: a fixed number of groups (sync mode), or
  continuously while admission allows (async mode), and evaluations on the task's test split.
- `RolloutWorker` owns one engine server process on its devices.
- `ActorWorker` trains on batches and pushes its weights into the engines after each step.

`asyncrl_core.runner.groups` puts each of them in Ray actors; the drivers (`runner.sync`, `runner.async_`)
call them. asyncrl-core never imports asyncrl-sglang, asyncrl-agents or asyncrl-megatron: the rollout backend,
the actor and the agent loop are found through the plugin registry (`asyncrl_core.plugins`) when a worker
starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from asyncrl_core import metrics, plugins
from asyncrl_core.buffer import Batch, BufferSnapshot, GroupBuffer
from asyncrl_core.errors import AsyncRLError, GenerationError, PluginError, PromptTooLongError
from asyncrl_core.runner.dataloader import LoaderState, PromptLoader, Ticket
from asyncrl_core.runner.handoff import Handoff, ShareCutter
from asyncrl_core.runner.ledger import STALE, PromptLedger
from asyncrl_core.runner.rollout_backend import rollout_backend, weight_group
from asyncrl_core.tasks import load_task
from asyncrl_core.types import BatchShare, Group, SamplingParams, ToolHealth

if TYPE_CHECKING:
    from asyncrl_core.config import AsyncRLConfig
    from asyncrl_core.protocols import Actor, AgentLoop, AgentLoopFactory, EngineClient, NamedTensors, Task

logger = logging.getLogger(__name__)


def build_task(config: AsyncRLConfig, task_services: Mapping[str, str]) -> Task:
    """The run's task, with `agentloop.task_args` and the services its `serve()` yielded (a URL, say)."""
    task_name = config.agentloop.task_name
    if task_name is None:
        raise RunnerError("agentloop.task_name is not set")
    return load_task(task_name, {**config.agentloop.task_args, **task_services})


def agent_loop_factory(config: AsyncRLConfig) -> AgentLoopFactory:
    """The agent loop `agentloop.agent_loop` names (its plugin's module is imported now, in the worker that
    runs it)."""
    factory = plugins.load("asyncrl.agent_loops", config.agentloop.agent_loop)
    if not callable(factory):
        raise PluginError(
            f"`asyncrl.agent_loops`: {config.agentloop.agent_loop!r} is not a factory of agent loops "
            f"(got {factory!r})"
        )
    return cast("AgentLoopFactory", factory)


class RunnerError(AsyncRLError):
    """A worker of the run failed or did not answer in time; the run stops with this message."""


PERMANENT_ERRORS: tuple[type[AsyncRLError], ...] = (PromptTooLongError, GenerationError)
"""Failures of a group that retrying cannot mend (a prompt too long for `data.max_prompt_len`, a request the
engine refused with a 400): the prompt is dropped for good with the error as its reason. Every other
`AsyncRLError` of a group (an engine that died or did not answer) hands the prompt back to be issued again."""


def pin_to_cores(cores: Sequence[int]) -> None:
    """Run this process (and the processes it starts) on `cores` only, with one torch thread per core.

    On a machine without GPUs the placement's ids are CPU cores: pinning makes actor and rollout really run
    side by side instead of competing for every core.
    """
    if not cores:
        return
    available = os.sched_getaffinity(0)
    chosen = {core for core in cores if core in available}
    if not chosen:
        raise RunnerError(
            f"none of the cores {list(cores)} is available to this process ({sorted(available)})"
        )
    # Every thread of the process: `sched_setaffinity(0, ...)` alone moves only the calling thread, and an
    # async Ray actor runs `__init__` beside its event loop's thread, which would stay where it was.
    for thread_id in _thread_ids():
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(thread_id, chosen)
    # torch sizes its thread pool from OMP_NUM_THREADS when it is imported; a process that has imported it
    # already is told directly. Importing torch here only for that would cost the engine and agent-loop
    # workers, which never use it, seconds of their start.
    os.environ["OMP_NUM_THREADS"] = str(len(chosen))
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(len(chosen))


def _thread_ids() -> list[int]:
    """The ids of this process's threads (Linux), or this thread's (0) where `/proc` does not list them."""
    try:
        return [int(name) for name in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


# ---------------------------------------------------------------------------------------------------------
# Buffer


class BufferWorker:
    """The dataloader, the `GroupBuffer` and the prompt ledger: admission, finished groups, hand-off to the
    actor, and where every issued prompt went (`asyncrl_core.runner.ledger`).

    Thread-safe: agent-loop workers admit and complete from several threads while the driver takes batches.
    Every change that touches the ledger happens under one lock, the loader's, also held while `state`
    takes a checkpoint's copy, so a checkpoint never holds a prompt admitted half-way.
    """

    def __init__(self, config: AsyncRLConfig, dataset_size: int, *, by_reference: bool = False) -> None:
        self.buffer = GroupBuffer.from_config(config)
        self.cutter = ShareCutter.from_config(config, by_reference=by_reference)
        """Cuts batches into the actor ranks' shares (`hand_off`); with `by_reference` (the runner's Ray
        actor) each share goes into Ray's object store."""
        seed = config.data.seed if config.data.seed is not None else config.runner.seed
        self.loader = PromptLoader(dataset_size, shuffle=config.data.shuffle, seed=seed)
        self.ledger = PromptLedger(dataset_size)
        # Held while an admission waits for capacity (at most its timeout), so that two admitters never
        # take the same prompt; and by every change of the ledger.
        self._loader_lock = threading.Lock()
        self.dataset_size = dataset_size
        self.failure_reasons: dict[int, str] = {}
        """Prompt index -> why it was dropped for good; such a prompt is not issued again (its later tickets
        are recorded as dropped for the same reason)."""
        self.max_failed_groups_per_step = config.rollout_buffer.max_failed_groups_per_step
        self._admitted_by: dict[int, int] = {}
        """Group id -> the agent-loop worker that admitted it, while the group is in flight."""
        self._step_retried = 0
        self._step_dropped = 0

    def admit(self, max_groups: int, timeout_s: float, worker_index: int = 0) -> list[tuple[int, int]]:
        """Admit up to `max_groups` new prompts for agent-loop worker `worker_index`, waiting up to
        `timeout_s` for the first one; prompts dropped for good are skipped.

        Returns `(group_id, prompt_index)` per admitted prompt; empty when the limits stayed closed. Raises
        `RunnerError` once this step's failures passed `rollout_buffer.max_failed_groups_per_step`.
        """
        self._check_failures()
        admitted: list[tuple[int, int]] = []
        with self._loader_lock:
            prompt_index = self._next_prompt()
            group_id = self.buffer.wait_admit(prompt_index, timeout_s)
            while group_id is not None:
                self.ledger.issued(group_id, self.loader.advance_ticket())
                admitted.append((group_id, prompt_index))
                self._admitted_by[group_id] = worker_index
                if len(admitted) == max_groups:
                    break
                prompt_index = self._next_prompt()
                group_id = self.buffer.try_admit(prompt_index)
        return admitted

    def _next_prompt(self) -> int:
        """The loader's next prompt, past those dropped for good (the loader's lock is held)."""
        if len(self.failure_reasons) >= self.dataset_size:
            raise RunnerError(
                f"every prompt of the dataset ({self.dataset_size}) failed for good; the first reason: "
                f"{next(iter(self.failure_reasons.values()))}"
            )
        while (prompt_index := self.loader.peek()) in self.failure_reasons:
            self.ledger.skipped(self.loader.advance_ticket(), self.failure_reasons[prompt_index])
        return prompt_index

    def complete(self, group: Group) -> bool:
        """Buffer a finished group; False when it was already buffered (a retried call changes nothing)."""
        accepted = self.buffer.complete(group)
        with self._loader_lock:
            self._admitted_by.pop(group.group_id, None)
        if accepted:
            self.cutter.prepare(group)
        return accepted

    def abandon(self, group_id: int, reason: str | None = None) -> None:
        """A group's generation failed: free its slot. With `reason` None the failure is retryable (an
        engine or a worker died) and the prompt is handed back, to be issued again in a later epoch; with a
        reason (a prompt too long for the context, a request the engine refused) it is permanent and the
        prompt is dropped for good, recorded in the ledger with `reason` and not issued again. Both count
        against `rollout_buffer.max_failed_groups_per_step`.

        A group that is no longer in flight (already abandoned or completed) raises `InvalidGroupError`
        and changes nothing."""
        if reason is not None and not reason.strip():
            raise ValueError("abandon: a permanent failure needs a non-empty reason")
        with self._loader_lock:
            self.buffer.abandon(group_id)
            self._admitted_by.pop(group_id, None)
            if reason is None:
                prompt_index, epoch = self.ledger.handed_back(group_id)
                self.loader.give_back(prompt_index, epoch)
                self._step_retried += 1
            else:
                prompt_index, _ = self.ledger.dropped(group_id, reason)
                self.failure_reasons[prompt_index] = reason
                self._step_dropped += 1

    def hand_back(self, worker_index: int) -> int:
        """Abandon (to issue again) every group agent-loop worker `worker_index` admitted and has not
        finished: the worker died. Returns how many."""
        with self._loader_lock:
            lost = [group_id for group_id, worker in self._admitted_by.items() if worker == worker_index]
        for group_id in lost:
            self.abandon(group_id)
        return len(lost)

    def _check_failures(self) -> None:
        failed = self._step_retried + self._step_dropped
        if self.max_failed_groups_per_step is not None and failed > self.max_failed_groups_per_step:
            raise RunnerError(
                f"{failed} groups failed during one step ({self._step_retried} to retry, "
                f"{self._step_dropped} dropped for good), more than "
                f"rollout_buffer.max_failed_groups_per_step ({self.max_failed_groups_per_step}): the "
                "failures are systematic (the warnings above name each); fix their cause or raise the limit"
            )

    def take_batch(self, num_groups: int, actor_version: int, timeout_s: float) -> Batch | None:
        """The `num_groups` oldest fresh groups for the actor at `actor_version`, waiting up to `timeout_s`
        for them; None when they are not ready by then. Stale groups dropped meanwhile go back to the
        dataloader either way. Raises `RunnerError` once this step's failures passed
        `rollout_buffer.max_failed_groups_per_step`."""
        self._check_failures()
        result = self.buffer.take_batch(num_groups, actor_version, timeout_s=timeout_s)
        with self._loader_lock:
            for group_id in result.dropped_group_ids:
                prompt_index, epoch = self.ledger.dropped(group_id, STALE)
                self.loader.give_back(prompt_index, epoch)
            for group in result.groups:
                self.ledger.trained(group.group_id, actor_version)
        self.cutter.forget(result.dropped_group_ids)
        return result if result.ready else None

    def hand_off(self, num_groups: int, actor_version: int, timeout_s: float) -> Handoff | None:
        """`take_batch`, cut into the actor's data-parallel shares (`asyncrl_core.runner.handoff`): what the
        drivers take. None when the batch is not ready within `timeout_s`."""
        batch = self.take_batch(num_groups, actor_version, timeout_s)
        if batch is None:
            return None
        return self.cutter.cut(batch, group_metrics(batch.groups))

    def end_step(self) -> dict[str, float]:
        """Close the step's buffer statistics: the staleness, drop and admission-wait metrics, and the
        groups that failed."""
        step_metrics = self.buffer.end_step().metrics()
        with self._loader_lock:
            step_metrics[metrics.FAILED_GROUPS_RETRIED] = float(self._step_retried)
            step_metrics[metrics.FAILED_GROUPS_DROPPED] = float(self._step_dropped)
            self._step_retried = self._step_dropped = 0
        return step_metrics

    def counts(self) -> dict[str, int]:
        """Where every issued prompt went over the whole run (restarts included):
        `issued = trained + handed_back + dropped + inflight + buffered` (`dropped_stale` of the dropped were
        too stale and issued again; the others failed for good)."""
        with self._loader_lock:
            totals = self.ledger.totals()
            return {
                "issued": totals["issued"],
                "trained": totals["trained"],
                "handed_back": totals["handed_back"],
                "dropped": totals["dropped"],
                "dropped_stale": totals["dropped_stale"],
                "inflight": self.buffer.num_inflight,
                "buffered": self.buffer.num_buffered,
                "epoch": self.loader.epoch,
            }

    def ledger_json(self) -> dict[str, Any]:
        """The ledger as `ledger.json` holds it, its open tickets checked against the buffer and loader."""
        with self._loader_lock:
            return self._ledger_json()

    def _ledger_json(self) -> dict[str, Any]:
        live = [group_id for group_id, _ in self.buffer.inflight_groups()]
        live += [group.group_id for group in self.buffer.buffered_groups()]
        return self.ledger.to_json(
            live_group_ids=live, queued=self.loader.pending(), epochs_issued=self.loader.order_done
        )

    def state(self) -> BufferState:
        """The whole state for a checkpoint, taken at one instant under the loader's lock: the buffer's
        snapshot with its buffered groups, the loader's position and queues, and the ledger."""
        with self._loader_lock:
            return BufferState(self.buffer.snapshot(), self.loader.state(), self._ledger_json())

    def restore(self, state: BufferState) -> list[int]:
        """Continue from a checkpoint's `state`: the buffered groups are kept (the staleness cap applies at
        the next hand-off, as ever), the groups that were in flight are handed back and issued again
        before any other prompt. Returns their prompt indices."""
        buffer = GroupBuffer.restore(state.snapshot)
        for key in ("max_inflight_groups", "max_buffered_groups", "max_dropped_groups_per_step"):
            saved, configured = getattr(buffer, key), getattr(self.buffer, key)
            if saved != configured:
                logger.warning(
                    "rollout_buffer.%s is %s in the checkpoint and %s in this configuration: the "
                    "checkpoint's value applies (the buffer's limits are part of its state)",
                    key,
                    saved,
                    configured,
                )
        ledger = PromptLedger.from_state(state.ledger)
        inflight = buffer.inflight_groups()
        tickets: list[Ticket] = []
        for group_id, _ in inflight:
            buffer.abandon(group_id)
            tickets.append(ledger.handed_back(group_id))
        with self._loader_lock:
            self.buffer, self.ledger = buffer, ledger
            self.cutter.clear()
            self.loader.restore(state.loader)
            self.loader.reissue_first(tickets)
            self.failure_reasons = {
                prompt: record.dropped for (prompt, _), record in ledger.tickets.items() if record.dropped
            }
        return [prompt_index for prompt_index, _ in tickets]


@dataclass(frozen=True, slots=True)
class BufferState:
    """What a checkpoint holds of the buffer worker (`BufferWorker.state`)."""

    snapshot: BufferSnapshot
    loader: LoaderState
    ledger: dict[str, Any]
    """The ledger as `ledger.json` holds it (`BufferWorker.ledger_json`)."""


class BufferPort(Protocol):
    """How an agent-loop worker reaches the buffer worker: in-process, or through a Ray actor handle."""

    async def admit(
        self, max_groups: int, timeout_s: float, worker_index: int = 0
    ) -> list[tuple[int, int]]: ...
    async def complete(self, group: Group) -> bool: ...
    async def abandon(self, group_id: int, reason: str | None = None) -> None: ...


class LocalBufferPort:
    """A `BufferPort` over a `BufferWorker` of this process (blocking calls run in a thread)."""

    def __init__(self, worker: BufferWorker) -> None:
        self.worker = worker

    async def admit(self, max_groups: int, timeout_s: float, worker_index: int = 0) -> list[tuple[int, int]]:
        return await asyncio.to_thread(self.worker.admit, max_groups, timeout_s, worker_index)

    async def complete(self, group: Group) -> bool:
        return await asyncio.to_thread(self.worker.complete, group)

    async def abandon(self, group_id: int, reason: str | None = None) -> None:
        await asyncio.to_thread(self.worker.abandon, group_id, reason)


# ---------------------------------------------------------------------------------------------------------
# Agent loop


_TRAJECTORY_COUNTS = {
    metrics.TRAJECTORY_NUM_TOOL_CALLS: metrics.TOOL_CALLS,
    metrics.TRAJECTORY_NUM_TOOL_ERRORS: metrics.TOOL_ERRORS,
    metrics.TRAJECTORY_NUM_INVALID_TURNS: metrics.INVALID_TURNS,
    metrics.TRAJECTORY_NUM_OBSERVATIONS_CUT: metrics.OBSERVATIONS_CUT,
}
"""Per-trajectory counts and the step metric that sums them."""
_TRAJECTORY_TIMES = (
    metrics.TRAJECTORY_GENERATION_S,
    metrics.TRAJECTORY_TOOL_S,
    metrics.TRAJECTORY_PARSE_S,
    metrics.TRAJECTORY_BOOKKEEPING_S,
    metrics.TRAJECTORY_LOOP_OVERHEAD_S,
    metrics.TRAJECTORY_TOTAL_S,
)
"""Per-trajectory times (seconds) the step reports as means."""


def group_metrics(groups: Sequence[Group]) -> dict[str, float]:
    """Reward, turns and token counts of finished groups, and their trajectories' own measurements (tool
    calls and errors, invalid turns, cut observations summed; times averaged), under their metric names."""
    trajectories = [trajectory for group in groups for trajectory in group.trajectories]
    if not trajectories:
        return {}
    count = len(trajectories)
    result = {
        metrics.REWARD_MEAN: sum(t.reward for t in trajectories) / count,
        metrics.TURNS_MEAN: sum(t.num_turns for t in trajectories) / count,
        metrics.RESPONSE_LEN_MEAN: sum(t.response_len for t in trajectories) / count,
        metrics.NUM_MODEL_TOKENS: float(sum(sum(t.loss_mask) for t in trajectories)),
    }
    for key, name in _TRAJECTORY_COUNTS.items():
        result[name] = float(sum(t.metrics.get(key, 0.0) for t in trajectories))
    calls = result[metrics.TOOL_CALLS]
    result[metrics.TOOL_ERROR_RATE] = result[metrics.TOOL_ERRORS] / calls if calls else 0.0
    for key in _TRAJECTORY_TIMES:
        measured = [t.metrics[key] for t in trajectories if key in t.metrics]
        if measured:
            result[metrics.trajectory_mean(key)] = sum(measured) / len(measured)
    return result


class AgentLoopWorker:
    """Runs groups of a task's trajectories against the engines at `endpoints`.

    `task_services` are the keyword arguments the task's `serve()` yielded in the driver (e.g. the
    retriever's URL); they are added to `agentloop.task_args`. On a machine without GPUs, `cores` are the
    rollout's: tokenising, parsing and tool calls then take time from the engines, never from the actor.
    """

    def __init__(
        self,
        config: AsyncRLConfig,
        *,
        model_path: str,
        endpoints: Sequence[EngineEndpoint],
        task_services: Mapping[str, str],
        worker_index: int = 0,
        cores: Sequence[int] = (),
    ) -> None:
        pin_to_cores(cores)
        self.config = config
        self.worker_index = worker_index
        self._tool_health: list[ToolHealth] = []
        self._tool_health_told = asyncio.Event()
        self._closed = False
        self.task = build_task(config, task_services)
        self.client = _connect_engines(config, endpoints)
        self.model_path = model_path
        self.loop = self._make_loop(group_size=config.algorithm.group_size)
        self._stop = asyncio.Event()
        self._eval_loop: AgentLoop | None = None
        self.num_running = 0
        self.num_groups = 0
        self.num_failed = 0

    def _make_loop(self, *, group_size: int) -> AgentLoop:
        config = self.config
        sampling = config.rollout.sampling
        assert sampling.max_new_tokens is not None  # derived
        max_concurrent = config.agentloop.max_concurrent_groups
        assert max_concurrent is not None  # derived
        return agent_loop_factory(config)(
            self.task,
            self.client,
            self.model_path,
            group_size=group_size,
            sampling=SamplingParams(
                max_new_tokens=sampling.max_new_tokens,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
            ),
            max_prompt_len=config.data.max_prompt_len,
            max_response_len=config.data.max_response_len,
            context_len=config.rollout.context_length,
            max_turns=config.agentloop.max_turns,
            max_concurrent_groups=max_concurrent,
            on_tool_health=self._tell_tool_health,
        )

    def _tell_tool_health(self, event: ToolHealth) -> None:
        self._tool_health.append(event)
        self._tool_health_told.set()

    async def watch_tools(self) -> list[ToolHealth]:
        """Wait until a tool starts failing or answers again (`ToolHealth`, oldest first); empty once the
        worker closes. The driver keeps one call pending beside the data (`runner.liveness`)."""
        while not self._tool_health and not self._closed:
            self._tool_health_told.clear()
            await self._tool_health_told.wait()
        events, self._tool_health = self._tool_health, []
        return events

    def dataset_size(self, split: str = "train") -> int:
        return len(self.loop.dataset(split))

    def dataset_fingerprint(self, split: str = "train") -> str:
        """A hash of the split's samples (ids, messages, answers), so a checkpoint names its dataset."""
        from asyncrl_core.runner.checkpoint import dataset_fingerprint

        return dataset_fingerprint(self.loop.dataset(split))

    def _start(
        self,
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
        buffer: BufferPort,
        admitted: tuple[int, int],
    ) -> asyncio.Task[None]:
        """Run an admitted group as a task; it counts as running from now on, so the capacity read next
        already sees it (a task starts only at the loop's next turn)."""
        self.num_running += 1
        return spawn(self._run_one(buffer, *admitted))

    async def _run_one(self, buffer: BufferPort, group_id: int, prompt_index: int) -> None:
        """One admitted group (counted in `num_running` by `_start`): completed, or abandoned with the
        failure's kind: a permanent error drops the prompt with its reason, any other `AsyncRLError`
        (an engine lost, a request timed out) hands it back to be issued again."""
        try:
            group = await self.loop.run_group(prompt_index, group_id=group_id)
        except asyncio.CancelledError:
            await buffer.abandon(group_id)
            raise
        except PERMANENT_ERRORS as error:
            reason = f"{type(error).__name__}: {error}"
            logger.warning("group %d (prompt %d) dropped for good: %s", group_id, prompt_index, reason)
            self.num_failed += 1
            await buffer.abandon(group_id, reason)
            return
        except AsyncRLError as error:
            logger.warning("group %d (prompt %d) failed, issued again: %s", group_id, prompt_index, error)
            self.num_failed += 1
            await buffer.abandon(group_id)
            return
        finally:
            self.num_running -= 1
        await buffer.complete(group)
        self.num_groups += 1

    async def run_groups(self, buffer: BufferPort, num_groups: int, timeout_s: float) -> int:
        """Run groups until `num_groups` have finished (sync mode); returns how many finished. A group that
        fails is replaced by a new admission, until the buffer's failure guard stops the run. Admission
        waits for the limits like in async mode, so a batch larger than the in-flight limit runs in
        waves. `RunnerError` when `timeout_s` passes first."""
        deadline = time.monotonic() + timeout_s
        finished_before = self.num_groups
        running: set[asyncio.Task[None]] = set()
        try:
            while (finished := self.num_groups - finished_before) < num_groups:
                remaining_s = deadline - time.monotonic()
                if remaining_s <= 0:
                    raise RunnerError(
                        f"{finished} of {num_groups} groups finished within {timeout_s:.0f} s "
                        f"({self.num_failed} failed on this worker so far)"
                    )
                wanted = num_groups - finished - len(running)
                if wanted > 0:
                    for admitted in await buffer.admit(wanted, min(remaining_s, 1.0), self.worker_index):
                        running.add(self._start(asyncio.create_task, buffer, admitted))
                if running:
                    more_wanted = num_groups - finished - len(running) > 0
                    done, running = await asyncio.wait(
                        running,
                        timeout=0 if more_wanted else min(remaining_s, 1.0),
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                    for task in done:
                        task.result()  # an error of the loop itself (not a group's failure) ends the call
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
        return self.num_groups - finished_before

    async def serve(self, buffer: BufferPort) -> None:
        """Async mode: keep admitting prompts and running their groups until `stop`; then wait for the
        groups already running. A failed group's prompt is handed back or dropped; an error of the loop
        itself stops it."""
        self._stop.clear()
        async with asyncio.TaskGroup() as tasks:
            while not self._stop.is_set():
                max_groups = self.loop_capacity()
                if max_groups == 0:
                    await asyncio.sleep(0.01)
                    continue
                for admitted in await buffer.admit(max_groups, 0.2, self.worker_index):
                    self._start(tasks.create_task, buffer, admitted)

    def loop_capacity(self) -> int:
        """Groups this worker can start now without queueing them behind its own concurrency limit."""
        max_concurrent = self.config.agentloop.max_concurrent_groups or 1
        return max(0, max_concurrent - self.num_running)

    async def stop(self) -> None:
        """End `serve`: no new prompt is admitted; the running groups finish and are buffered."""
        self._stop.set()

    async def evaluate(self, split: str = "test", max_prompts: int | None = None) -> dict[str, float]:
        """Mean reward of one trajectory per prompt of `split` (the engines' current weights; runs beside
        training groups), with the weight versions the evaluation saw."""
        started = time.perf_counter()
        if self._eval_loop is None:
            self._eval_loop = self._make_loop(group_size=1)
        dataset = self._eval_loop.dataset(split)
        count = len(dataset) if max_prompts is None else min(max_prompts, len(dataset))
        groups: list[Group] = await asyncio.gather(
            *(self._eval_loop.run_group(index, split=split) for index in range(count))
        )
        rewards = [t.reward for group in groups for t in group.trajectories]
        versions = [r for group in groups for t in group.trajectories if (r := t.version_range()) is not None]
        result = {
            metrics.EVAL_REWARD_MEAN: sum(rewards) / max(1, len(rewards)),
            metrics.TIME_EVAL: time.perf_counter() - started,
        }
        if versions:
            result[metrics.EVAL_WEIGHT_VERSION_MIN] = float(min(v[0] for v in versions))
            result[metrics.EVAL_WEIGHT_VERSION_MAX] = float(max(v[1] for v in versions))
        return result

    async def drain(self, timeout_s: float) -> None:
        """Hold new requests at the client and wait for those in flight (the `drain` pause mode)."""
        self.client.close_admission()
        await self.client.wait_idle(timeout_s)

    async def reopen(self) -> None:
        """Let the requests held by `drain` through."""
        self.client.open_admission()

    async def aclose(self) -> None:
        self._closed = True
        self._tool_health_told.set()
        await self.loop.aclose()  # closes the task, which the evaluation loop shares
        await self.client.aclose()


def _connect_engines(config: AsyncRLConfig, endpoints: Sequence[EngineEndpoint]) -> EngineClient:
    """One client over every engine, through the rollout backend."""
    return rollout_backend(config).connect(
        [endpoint.url for endpoint in endpoints], [endpoint.grpc_target for endpoint in endpoints]
    )


# ---------------------------------------------------------------------------------------------------------
# Rollout


@dataclass(frozen=True, slots=True)
class EngineFailure:
    """What `RolloutWorker.watch` saw happen to its engine process."""

    index: int
    """The engine's index among the rollout workers."""
    what: str
    """What happened, for a message: `exited with status -9`, `stopped answering /health for 15 s`."""
    log_tail: str
    """The end of the engine's log."""
    detected_at: float
    """Unix time at which the watch saw it."""


class RolloutWorker:
    """One engine server process (built-in or SGLang) on `devices`, started through the rollout backend.

    `watch` returns when the process exits or stops answering `/health` for `rollout.engine_unresponsive_s`
    (the process is then killed, so the requests it held fail at once); `restart` starts it again on the
    same address. Both run beside the other calls (the Ray actor serves several at once).
    """

    def __init__(
        self, config: AsyncRLConfig, *, model_path: str, index: int, devices: Sequence[int], run_dir: Path
    ) -> None:
        gpu = config.cluster.device_type == "gpu"
        if not gpu:
            pin_to_cores(devices)
        backend = rollout_backend(config)
        sglang = config.rollout.sglang
        # An external engine: this worker watches the one at its own index of the URLs.
        own = {"urls": sglang.urls[index : index + 1]} if sglang.urls else {}
        if sglang.grpc_urls:
            own["grpc_urls"] = sglang.grpc_urls[index : index + 1]
        rollout = config.rollout.model_copy(
            update={
                "model_path": model_path,
                "num_instances": 1,
                "sglang": sglang.model_copy(update={"base_port": sglang.base_port + index, **own}),
            }
        )
        self.index = index
        self.unresponsive_s = config.rollout.engine_unresponsive_s
        self.api_key = config.rollout.sglang.api_key

        from asyncrl_core.runner.placement import node_address

        advertise_host = node_address()  # the URL's host when the engine binds every interface

        def start(base_port: int) -> Any:
            sglang = rollout.sglang.model_copy(update={"base_port": base_port})
            return backend.launch(
                rollout.model_copy(update={"sglang": sglang}),
                run_dir=run_dir / f"rollout-{index}",
                devices=tuple(devices),
                gpu=gpu,
                health_timeout_s=config.runner.startup_timeout_s,
                advertise_host=advertise_host,
                # `runner.seed`: engine `index` samples with `seed + index`, its restarts too.
                random_seed=config.runner.seed + index,
            )

        self._launch = start
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._base_port = rollout.sglang.base_port
        self.engines = self._launch(self._base_port)

    def endpoint(self) -> EngineEndpoint:
        """Where the engine answers: HTTP for control, and gRPC for generation when configured."""
        return EngineEndpoint(str(self.engines.urls[0]), self.engines.grpc_targets[0])

    def pid(self) -> int | None:
        """The engine process's id (None for an `external` engine)."""
        processes = self.engines.processes
        return int(processes[0].pid) if processes else None

    def watch(self, poll_s: float = 1.0) -> EngineFailure | None:
        """Block until the engine fails: its process exits, or `/health` stays unanswered for
        `rollout.engine_unresponsive_s` (then the process group is killed). None once `stop` was called."""
        from asyncrl_core.server_process import http_ok

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        last_answer = time.monotonic()
        while not self._stopped.wait(poll_s):
            with self._lock:
                engines = self.engines
            process = engines.processes[0] if engines.processes else None
            if process is not None and (code := process.returncode()) is not None:
                if self._stopped.is_set():
                    return None
                return EngineFailure(
                    self.index, f"exited with status {code}", process.log_tail(), time.time()
                )
            probe_s = min(5.0, self.unresponsive_s)
            if http_ok(f"{engines.urls[0]}/health", headers=headers, timeout_s=probe_s):
                last_answer = time.monotonic()
            elif time.monotonic() - last_answer >= self.unresponsive_s and not self._stopped.is_set():
                silent_s = time.monotonic() - last_answer
                detected_at = time.time()
                if process is not None:
                    process.stop(grace_s=1.0)  # SIGKILL reaches a stopped process; SIGTERM waits for it
                return EngineFailure(
                    self.index,
                    f"stopped answering /health for {silent_s:.0f} s (rollout.engine_unresponsive_s)",
                    process.log_tail() if process is not None else "",
                    detected_at,
                )
        return None

    def restart(self) -> EngineEndpoint:
        """Stop what is left of the engine and start it again (same command, same address); returns its
        endpoint once it is healthy. It serves the model it started with: push the current weights next."""
        with self._lock:
            if not self.engines.processes:
                raise RunnerError(
                    f"engine {self.index} at {self.engines.urls[0]} is external: it cannot be restarted"
                )
            port = urllib.parse.urlsplit(self.engines.urls[0]).port or self._base_port
            self.engines.stop()
            self.engines = self._launch(port)  # its own port first: the agent loops send there
        return self.endpoint()

    def stop(self) -> None:
        self._stopped.set()
        with self._lock:
            self.engines.stop()


# ---------------------------------------------------------------------------------------------------------
# Actor


@dataclass(frozen=True, slots=True)
class EngineEndpoint:
    """One engine's addresses: its HTTP base URL and, with `rollout.sglang.transport: grpc`, its gRPC
    target for generation."""

    url: str
    grpc_target: str | None = None


@dataclass(frozen=True, slots=True)
class RankSettings:
    """Where one data-parallel rank of the actor meets the others (torch.distributed over TCP)."""

    rank: int
    world_size: int
    master_port: int
    master_address: str = "127.0.0.1"


class ActorWorker:
    """One rank of the actor: trains on batches; one rank pushes the weights into the engines, the ranks
    holding shards of them take part in the export."""

    def __init__(
        self,
        config: AsyncRLConfig,
        *,
        model_path: str,
        devices: Sequence[int],
        rank: RankSettings | None = None,
    ) -> None:
        gpu = config.cluster.device_type == "gpu"
        rank = rank or RankSettings(0, 1, 0)
        if not gpu:
            pin_to_cores(devices)
        os.environ.update(
            RANK=str(rank.rank),
            LOCAL_RANK="0",
            WORLD_SIZE=str(rank.world_size),
            MASTER_ADDR=rank.master_address,
            MASTER_PORT=str(rank.master_port),
        )
        self.config = config
        self.rank = rank.rank
        factory = cast("Callable[..., Actor]", plugins.load("asyncrl.actors", config.actor.backend))
        self.actor = factory(config, model_path=model_path, device="cuda" if gpu else "cpu")
        self._transport: Any = None
        self._watched = threading.Event()

    def watch(self) -> None:
        """Block while the rank lives: the driver keeps this call pending beside the data (on a
        concurrency group of its own), so the rank's death is seen at once, whatever the driver waits for."""
        self._watched.wait()

    @property
    def version(self) -> int:
        return self.actor.version

    def get_version(self) -> int:
        return self.actor.version

    def train(self, share: BatchShare) -> dict[str, float]:
        """One training step on this rank's `share` of a batch (`asyncrl_core.runner.handoff`): the actor's
        `train/...` metrics. A share cut for another data-parallel rank raises `BatchError`."""
        started = time.perf_counter()
        result = self.actor.train_step(share)
        result[metrics.TIME_TRAINING] = time.perf_counter() - started
        return result

    def sync_weights(self, endpoints: Sequence[EngineEndpoint], mode: str) -> dict[str, float]:
        """Push the current weights into the engines as this version, in `mode`.

        Every rank is called. The rank whose `weight_export_role` is `send` pushes the buckets; ranks that
        `join` take the export in step with it (a collective: each bucket gathers tensor-parallel shards),
        holding one bucket at a time and dropping it; the others return at once. In `drain` mode the caller
        has drained the agent loops first; this side then finds the engines idle and flushes their caches
        with the last bucket."""
        role = self.actor.weight_export_role
        if role == "none":
            return {}
        buckets = self.actor.export_weights(self.config.actor.weight_export_bucket_mb << 20)
        if role == "join":
            for _ in buckets:
                pass
            return {}
        if self._transport is None:
            self._transport = weight_transport(self.config)
        return asyncio.run(
            _push_weights(self.config, buckets, self.actor.version, self._transport, endpoints, mode)
        )

    def close_weight_transport(self, endpoints: Sequence[EngineEndpoint]) -> None:
        """Undo what the weight transport set up with the engines at `endpoints` (the `distributed`
        transport's process group), so that engines that outlive the run can join the next run's. Every rank
        is called when the run ends; a rank that never pushed weights, or has closed already, does
        nothing."""
        transport, self._transport = self._transport, None
        if transport is not None:
            asyncio.run(_close_weight_transport(self.config, transport, endpoints))

    def save_checkpoint(self, path: str) -> None:
        self.actor.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> None:
        self.actor.load_checkpoint(path)


async def _push_weights(
    config: AsyncRLConfig,
    buckets: Iterator[NamedTensors],
    version: int,
    transport: Any,
    endpoints: Sequence[EngineEndpoint],
    mode: str,
) -> dict[str, float]:
    # A module function, not a method: a Ray actor class with a coroutine method becomes an asyncio actor,
    # and the actor worker must stay a plain threaded one (training blocks).
    backend = rollout_backend(config)
    client = backend.connect([endpoint.url for endpoint in endpoints], [e.grpc_target for e in endpoints])
    try:
        return await backend.sync_weights(client, buckets, version, mode=mode, transport=transport)
    finally:
        await client.aclose()
        # Buckets left by a failure midway are still taken: the ranks that join the export wait in its
        # collectives until the sender has gone through every bucket.
        for _ in buckets:
            pass


async def _close_weight_transport(
    config: AsyncRLConfig, transport: object, endpoints: Sequence[EngineEndpoint]
) -> None:
    backend = rollout_backend(config)
    client = backend.connect([endpoint.url for endpoint in endpoints], [e.grpc_target for e in endpoints])
    try:
        await backend.close_weight_transport(client, transport)
    finally:
        await client.aclose()


def weight_transport(config: AsyncRLConfig) -> Any:
    """The rollout backend's transport for this run (by `rollout.sglang.weight_transport` for `sglang`):
    request bodies, or a process group that the trainer (rank 0 of the actor) forms with the engines at the
    first sync and keeps, hosted at the trainer's node address on a port picked there (`weight_group`)."""
    return rollout_backend(config).weight_transport(weight_group(config))
