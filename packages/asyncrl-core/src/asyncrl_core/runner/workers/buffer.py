"""`BufferWorker`: the dataloader, the `GroupBuffer` and the prompt ledger of a run, and the ports an
agent-loop worker reaches it through."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from asyncrl_core import metrics
from asyncrl_core.buffer import Batch, BufferSnapshot, GroupBuffer
from asyncrl_core.runner.dataloader import LoaderState, PromptLoader, Ticket
from asyncrl_core.runner.handoff import Handoff, ShareCutter
from asyncrl_core.runner.ledger import STALE, PromptLedger
from asyncrl_core.runner.workers.common import RunnerError
from asyncrl_core.types import Group

if TYPE_CHECKING:
    from asyncrl_core.config import AsyncRLConfig

logger = logging.getLogger(__name__)


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
        self._closed = threading.Event()

    def watch(self, timeout_s: float | None = None) -> bool:
        """Block until `close` (or for `timeout_s`); whether it was closed. The driver keeps one call pending
        for the whole run, beside the others, to learn at once when this worker's process dies; one with
        `timeout_s=0` asks whether it is alive without waiting for any lock."""
        return self._closed.wait(timeout_s)

    def close(self) -> None:
        """End the pending `watch` calls."""
        self._closed.set()

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
