"""The group buffer between rollout and actor (ARCHITECTURE.md section 3).

`GroupBuffer` is what the buffer worker uses: admission of new prompts under the two limits, the
oldest-first hand-out of finished groups with the staleness cap and the drop guard, the per-step
statistics, and snapshots for checkpoints. The Rust core (`asyncrl_core._buffer_core`) holds the
counters, ids, prompt indices and versions; this facade keeps each finished group's payload (a `Group`)
keyed by its group id and turns the core's results into typed values.

Every method may be called from several threads at once. Each error is an `asyncrl_core.errors`
`GroupBufferError` subclass, raised before anything changes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from asyncrl_core import _buffer_core
from asyncrl_core.errors import (
    BatchTooLargeError,
    CorruptStateError,
    DropLimitExceededError,
    GroupBufferError,
    InvalidArgumentError,
    InvalidGroupError,
    VersionError,
)
from asyncrl_core.types import Group

__all__ = [
    "Batch",
    "BatchTooLargeError",
    "BufferSnapshot",
    "CorruptStateError",
    "DropLimitExceededError",
    "GroupBuffer",
    "GroupBufferError",
    "InvalidArgumentError",
    "InvalidGroupError",
    "StepStats",
    "StepTotals",
    "VersionError",
]


class StepTotals(Protocol):
    """The raw totals of one step, as a buffer core's `end_step` returns them."""

    @property
    def num_groups(self) -> int: ...
    @property
    def staleness_sum(self) -> int: ...
    @property
    def staleness_max(self) -> int: ...
    @property
    def staleness_counts(self) -> Mapping[int, int]: ...
    @property
    def version_span_sum(self) -> int: ...
    @property
    def queue_steps_sum(self) -> int: ...
    @property
    def dropped_groups(self) -> int: ...
    @property
    def admission_wait_inflight_limit_s(self) -> float: ...
    @property
    def admission_wait_buffer_full_s(self) -> float: ...
    @property
    def wall_s(self) -> float: ...


@dataclass(frozen=True, slots=True)
class Batch:
    """What `GroupBuffer.take_batch` hands to the actor."""

    groups: list[Group]
    """The oldest finished groups, oldest first (by earliest version, then admission order)."""
    dropped_prompt_indices: list[int]
    """Prompts of the groups dropped by the staleness cap, oldest first, for the dataloader to re-issue."""
    actor_version: int
    """The actor version the batch was taken at; staleness is measured against it."""


@dataclass(frozen=True, slots=True)
class StepStats:
    """The buffer's statistics of one step (between two `end_step` calls).

    Per group handed to the actor at `actor_version`: `staleness = actor_version - earliest_version`,
    `version_span = latest_version - earliest_version`, `queue_steps = actor_version - latest_version`.
    """

    num_groups: int
    """Groups handed to the actor."""
    staleness_sum: int
    staleness_max: int
    """0 when no group was handed out."""
    staleness_counts: dict[int, int]
    """Groups handed out per staleness value."""
    version_span_sum: int
    queue_steps_sum: int
    dropped_groups: int
    """Groups dropped by the staleness cap."""
    admission_wait_inflight_limit_s: float
    """Seconds during which admission was refused by the in-flight limit (it wins a tie)."""
    admission_wait_buffer_full_s: float
    """Seconds during which admission was refused because the buffer was full."""
    wall_s: float
    """Seconds from the start of the step to its end."""

    @classmethod
    def from_totals(cls, totals: StepTotals) -> StepStats:
        return cls(
            num_groups=totals.num_groups,
            staleness_sum=totals.staleness_sum,
            staleness_max=totals.staleness_max,
            staleness_counts=dict(totals.staleness_counts),
            version_span_sum=totals.version_span_sum,
            queue_steps_sum=totals.queue_steps_sum,
            dropped_groups=totals.dropped_groups,
            admission_wait_inflight_limit_s=totals.admission_wait_inflight_limit_s,
            admission_wait_buffer_full_s=totals.admission_wait_buffer_full_s,
            wall_s=totals.wall_s,
        )

    def metrics(self) -> dict[str, float]:
        """The step's metrics under their logged names.

        The admission waits are shares of the step's wall time (0 for a step of no duration). The
        per-group means, the maximum and the `ratio_<k>` shares are present only when the step handed
        out at least one group: a step without training data has no staleness to report.
        """
        metrics = {
            "rollout/dropped_groups": float(self.dropped_groups),
            "rollout/buffer/admission_wait_inflight_limit": _share(
                self.admission_wait_inflight_limit_s, self.wall_s
            ),
            "rollout/buffer/admission_wait_buffer_full": _share(
                self.admission_wait_buffer_full_s, self.wall_s
            ),
        }
        if self.num_groups > 0:
            metrics["rollout/data_staleness/mean"] = self.staleness_sum / self.num_groups
            metrics["rollout/data_staleness/max"] = float(self.staleness_max)
            for staleness, count in sorted(self.staleness_counts.items()):
                metrics[f"rollout/data_staleness/ratio_{staleness}"] = count / self.num_groups
            metrics["rollout/version_span/mean"] = self.version_span_sum / self.num_groups
            metrics["rollout/queue_steps/mean"] = self.queue_steps_sum / self.num_groups
        return metrics


def _share(part_s: float, whole_s: float) -> float:
    return part_s / whole_s if whole_s > 0 else 0.0


@dataclass(frozen=True, slots=True)
class BufferSnapshot:
    """A buffer's whole state for a checkpoint: the core's bytes and the finished groups' payloads.

    `core_state` is versioned and checksummed; how `groups` is persisted is up to the checkpoint code.
    Groups in flight are recorded by id and prompt index only (their payload is still being generated):
    after a restart, `GroupBuffer.inflight_groups` lists them so they can be abandoned and re-issued.
    """

    core_state: bytes
    groups: dict[int, Group] = field(default_factory=dict[int, Group])
    """The buffered (finished, not yet handed out) groups by group id."""


class GroupBuffer:
    """Admission limits, the oldest-first heap of finished groups, and the staleness ledger.

    A prompt is admitted while `inflight < max_inflight_groups` and
    `inflight + buffered < max_buffered_groups`; the limits hold under any number of threads.
    `max_dropped_groups_per_step` may be 0 (any stale drop stops the run); `max_actor_accept_staleness`
    of None keeps every group. A buffer limit below the in-flight limit is accepted: the in-flight
    limit then never binds.

    Versions: every version is 0 or more; a group's `earliest <= latest <= finish_version`, its
    `finish_version` is at least the `actor_version` of the last batch, and `take_batch`'s
    `actor_version` never decreases and is at least every `finish_version` seen. Anything else is a
    `VersionError`.
    """

    __slots__ = ("_core", "_groups")

    def __init__(
        self,
        *,
        max_inflight_groups: int,
        max_buffered_groups: int,
        max_dropped_groups_per_step: int,
        max_actor_accept_staleness: int | None = None,
    ) -> None:
        self._core = _buffer_core.GroupBuffer(
            max_inflight_groups=max_inflight_groups,
            max_buffered_groups=max_buffered_groups,
            max_dropped_groups_per_step=max_dropped_groups_per_step,
            max_actor_accept_staleness=max_actor_accept_staleness,
        )
        self._groups: dict[int, Group] = {}

    @classmethod
    def restore(cls, snapshot: BufferSnapshot) -> GroupBuffer:
        """A buffer in exactly the state of `snapshot`.

        Raises `CorruptStateError` when the bytes are damaged or the payloads do not match the groups
        the core holds.
        """
        core = _buffer_core.GroupBuffer.from_state_bytes(snapshot.core_state)
        buffered_ids = {row[0] for row in core.buffered_groups()}
        if set(snapshot.groups) != buffered_ids:
            missing = sorted(buffered_ids - set(snapshot.groups))
            extra = sorted(set(snapshot.groups) - buffered_ids)
            raise CorruptStateError(
                f"the snapshot's payloads do not match its buffered groups: missing {missing}, "
                f"not buffered {extra}"
            )
        for group_id, group in snapshot.groups.items():
            if group.group_id != group_id:
                raise CorruptStateError(
                    f"the payload stored for group {group_id} has group_id {group.group_id}"
                )
        buffer = cls.__new__(cls)
        buffer._core = core
        buffer._groups = dict(snapshot.groups)
        return buffer

    @property
    def max_inflight_groups(self) -> int:
        return self._core.max_inflight_groups

    @property
    def max_buffered_groups(self) -> int:
        return self._core.max_buffered_groups

    @property
    def max_dropped_groups_per_step(self) -> int:
        return self._core.max_dropped_groups_per_step

    @property
    def max_actor_accept_staleness(self) -> int | None:
        return self._core.max_actor_accept_staleness

    @property
    def num_inflight(self) -> int:
        """Groups admitted and still generating."""
        return self._core.num_inflight

    @property
    def num_buffered(self) -> int:
        """Finished groups waiting for the actor."""
        return self._core.num_buffered

    def try_admit(self, prompt_index: int) -> int | None:
        """Admit the prompt if both limits allow it: its new group id, or None (never blocks)."""
        return self._core.try_admit(prompt_index)

    def try_admit_many(self, prompt_indices: Sequence[int]) -> list[int]:
        """Admit as many of `prompt_indices` as the limits allow, in order: the group ids of the
        admitted prefix. One call fills freed capacity at once."""
        return self._core.try_admit_many(prompt_indices)

    def wait_admit(self, prompt_index: int, timeout_s: float) -> int | None:
        """Admit the prompt, waiting up to `timeout_s` seconds for capacity: its group id, or None on
        timeout. Releases the GIL while it waits; Ctrl-C interrupts it."""
        return self._core.wait_admit(prompt_index, timeout_s)

    def complete(self, group: Group) -> None:
        """Buffer a finished group: `group.group_id` must be in flight.

        Its earliest and latest versions come from the per-token versions (`Group.version_range`), and
        `group.finish_version` must be the actor version current when it finished.
        """
        earliest_version, latest_version = group.version_range()
        existing = self._groups.setdefault(group.group_id, group)
        if existing is not group:
            raise InvalidGroupError(f"group {group.group_id} already finished and is buffered")
        try:
            self._core.complete(group.group_id, earliest_version, latest_version, group.finish_version)
        except BaseException:
            del self._groups[group.group_id]
            raise

    def complete_many(self, groups: Sequence[Group]) -> None:
        """`complete` for several groups, all or nothing: on any error no group is buffered."""
        added: list[int] = []
        try:
            for group in groups:
                if self._groups.setdefault(group.group_id, group) is not group:
                    raise InvalidGroupError(f"group {group.group_id} already finished and is buffered")
                added.append(group.group_id)
            self._core.complete_many(
                [(group.group_id, *group.version_range(), group.finish_version) for group in groups]
            )
        except BaseException:
            # A group listed twice was added once.
            for group_id in set(added):
                del self._groups[group_id]
            raise

    def abandon(self, group_id: int) -> int:
        """Give up on an in-flight group (its generation failed): frees its slot and returns its prompt
        index for the dataloader to re-issue."""
        return self._core.abandon(group_id)

    def take_batch(self, num_groups: int, actor_version: int) -> Batch:
        """Hand the `num_groups` oldest groups to the actor training at `actor_version`.

        First, groups with `actor_version - earliest_version > max_actor_accept_staleness` are dropped
        and their prompts returned. Raises `BatchTooLargeError` when fewer than `num_groups` remain,
        `DropLimitExceededError` past `max_dropped_groups_per_step`; then nothing is dropped.
        """
        taken_ids, dropped = self._core.take_batch(num_groups, actor_version)
        groups = [self._groups.pop(group_id) for group_id in taken_ids]
        for group_id, _ in dropped:
            del self._groups[group_id]
        return Batch(
            groups=groups,
            dropped_prompt_indices=[prompt_index for _, prompt_index in dropped],
            actor_version=actor_version,
        )

    def end_step(self) -> StepStats:
        """Close the running step: return its statistics and start the next one now."""
        return StepStats.from_totals(self._core.end_step())

    def inflight_groups(self) -> list[tuple[int, int]]:
        """`(group_id, prompt_index)` of every group in flight, by group id."""
        return self._core.inflight_groups()

    def buffered_groups(self) -> list[Group]:
        """The finished groups waiting for the actor, oldest first (a copy; nothing is removed)."""
        return [self._groups[row[0]] for row in self._core.buffered_groups()]

    def snapshot(self) -> BufferSnapshot:
        """The whole state, for a checkpoint. Take it while no other thread hands out batches (between
        steps): the payloads are copied after the core's bytes are taken."""
        core_state = self._core.state_bytes()
        # The ids come from the bytes themselves, so groups completed meanwhile are left out consistently.
        buffered_ids = [
            row[0] for row in _buffer_core.GroupBuffer.from_state_bytes(core_state).buffered_groups()
        ]
        return BufferSnapshot(
            core_state=core_state,
            groups={group_id: self._groups[group_id] for group_id in buffered_ids},
        )
