"""The group buffer between rollout and actor (ARCHITECTURE.md section 3).

`GroupBuffer` is what the buffer worker uses: admission of new prompts under the two limits, the
oldest-first hand-out of finished groups with the staleness cap and the drop guard, the per-step
statistics, and snapshots for checkpoints. The Rust core (`asyncrl_core._buffer_core`) holds the
counters, ids, prompt indices and versions, and each buffered group's payload (its `Group`), registered
in the same step as the core accepts the group; this facade reads the versions off the `Group` and turns
the core's results into typed values.

Every method may be called from several threads at once. Each error is an `asyncrl_core.errors`
`GroupBufferError` subclass with typed fields, raised before anything changes.

Versions (ARCHITECTURE.md section 3): a group's earliest and latest version are those of its model tokens,
which each `Trajectory` records when it is built. Its `finish_version`, the actor version current when it
finished, is stamped by the buffer when it accepts the group: the `actor_version` of the last `take_batch`
(0 before the first), or the group's latest version when that is newer. A producer that knows the actor's
version may set `Group.finish_version` itself; the buffer then checks it instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from asyncrl_core import _buffer_core
from asyncrl_core._buffer_core import StepStats
from asyncrl_core.errors import (
    ConfigError,
    ConfigProblem,
    CorruptStateError,
    DropLimitExceededError,
    GroupBufferError,
    InvalidArgumentError,
    InvalidGroupError,
    VersionError,
)
from asyncrl_core.types import NO_VERSION, Group

if TYPE_CHECKING:
    from asyncrl_core.config import AsyncRLConfig

__all__ = [
    "Batch",
    "BufferSnapshot",
    "CorruptStateError",
    "DropLimitExceededError",
    "GroupBuffer",
    "GroupBufferError",
    "InvalidArgumentError",
    "InvalidGroupError",
    "StepStats",
    "VersionError",
]


@dataclass(slots=True)
class Batch:
    """What `GroupBuffer.take_batch` did: the batch for the actor if it was ready, and the stale groups it
    dropped (whether or not the batch was ready)."""

    groups: list[Group]
    """The `num_groups` oldest finished groups, oldest first (by earliest version, then admission order);
    empty when fewer than `num_groups` were ready."""
    dropped_prompt_indices: list[int]
    """Prompts of the groups dropped by the staleness cap, oldest first, for the dataloader to re-issue."""
    actor_version: int
    """The actor version the batch was taken at; staleness is measured against it."""
    num_ready: int
    """Groups buffered after the drops and before the hand-out: below `num_groups` exactly when the batch
    was not ready."""
    dropped_group_ids: list[int] = field(default_factory=list[int])
    """The ids of the dropped groups, in the order of `dropped_prompt_indices`."""

    @property
    def ready(self) -> bool:
        """Whether the batch was handed out (`groups` holds `num_groups` groups)."""
        return bool(self.groups)


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
    `finish_version` (stamped by the buffer unless the group sets it) is at least the `actor_version` of
    the last batch, and `take_batch`'s `actor_version` never decreases and is at least every
    `finish_version` seen. Anything else is a `VersionError`.
    """

    __slots__ = ("_core",)

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

    @classmethod
    def from_config(cls, config: AsyncRLConfig) -> GroupBuffer:
        """The buffer a resolved configuration describes: the limits of `rollout_buffer` and
        `agentloop.max_actor_accept_staleness`.

        Raises `ConfigError` naming each limit still unset (a configuration from `load_config` has them
        derived, except `max_inflight_groups` when the rollout instances are unknown).
        """
        limits = config.rollout_buffer
        max_inflight_groups = limits.max_inflight_groups
        max_buffered_groups = limits.max_buffered_groups
        max_dropped_groups_per_step = limits.max_dropped_groups_per_step
        if max_inflight_groups is None or max_buffered_groups is None or max_dropped_groups_per_step is None:
            raise ConfigError(
                [
                    ConfigProblem(f"rollout_buffer.{key}", "is unset and could not be derived; set it")
                    for key, value in (
                        ("max_inflight_groups", max_inflight_groups),
                        ("max_buffered_groups", max_buffered_groups),
                        ("max_dropped_groups_per_step", max_dropped_groups_per_step),
                    )
                    if value is None
                ]
            )
        return cls(
            max_inflight_groups=max_inflight_groups,
            max_buffered_groups=max_buffered_groups,
            max_dropped_groups_per_step=max_dropped_groups_per_step,
            max_actor_accept_staleness=config.agentloop.max_actor_accept_staleness,
        )

    @classmethod
    def restore(cls, snapshot: BufferSnapshot) -> GroupBuffer:
        """A buffer in exactly the state of `snapshot`.

        Raises `CorruptStateError` when the bytes are damaged or the payloads do not match the groups
        the core holds.
        """
        for group_id, group in snapshot.groups.items():
            if group.group_id != group_id:
                raise CorruptStateError(
                    f"the payload stored for group {group_id} has group_id {group.group_id}"
                )
        buffer = cls.__new__(cls)
        buffer._core = _buffer_core.GroupBuffer.restore(snapshot.core_state, snapshot.groups)
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

    def complete(self, group: Group) -> bool:
        """Buffer a finished group: True when it is accepted, False when its id is no longer in flight (a
        retried completion, or a group abandoned meanwhile), in which case nothing changes and the first
        completion stands.

        `group.group_id` and `group.prompt_index` must be those `try_admit` returned and was given
        (`InvalidGroupError` otherwise). Its earliest and latest version are `Group.earliest_version` and
        `Group.latest_version`, set when the group was built (no token is read here). On acceptance the
        buffer stamps `group.finish_version` when it is `NO_VERSION` (see the module docs).
        """
        latest_version = group.latest_version
        finish_version = self._core.complete(
            group.group_id,
            group.prompt_index,
            None if latest_version == NO_VERSION else (group.earliest_version, latest_version),
            None if group.finish_version == NO_VERSION else group.finish_version,
            group,
        )
        if finish_version is None:
            return False
        group.finish_version = finish_version
        return True

    def complete_many(self, groups: Sequence[Group]) -> list[bool]:
        """`complete` for several groups under one lock: one flag per group, True when accepted (a group
        listed twice is a retry the second time). On any error no group is buffered."""
        finish_versions = self._core.complete_many(
            [
                (
                    group.group_id,
                    group.prompt_index,
                    None
                    if group.latest_version == NO_VERSION
                    else (group.earliest_version, group.latest_version),
                    None if group.finish_version == NO_VERSION else group.finish_version,
                    group,
                )
                for group in groups
            ]
        )
        for group, finish_version in zip(groups, finish_versions, strict=True):
            if finish_version is not None:
                group.finish_version = finish_version
        return [finish_version is not None for finish_version in finish_versions]

    def abandon(self, group_id: int) -> int:
        """Give up on an in-flight group (its generation failed): frees its slot and returns its prompt
        index for the dataloader to re-issue."""
        return self._core.abandon(group_id)

    def take_batch(self, num_groups: int, actor_version: int, *, timeout_s: float = 0.0) -> Batch:
        """The hand-off to the actor training at `actor_version`, waiting up to `timeout_s` seconds for
        `num_groups` groups (0: do not wait).

        First, groups with `actor_version - earliest_version > max_actor_accept_staleness` are dropped,
        whether or not `num_groups` fresh ones remain: each drop frees capacity at once and its prompt is
        in `Batch.dropped_prompt_indices`, for the dataloader. Then the `num_groups` oldest groups are
        handed out if that many are ready; otherwise `Batch.ready` is False and `Batch.num_ready` says
        how many are. The wait releases the GIL, wakes on every completion, and Ctrl-C interrupts it; it
        returns early, not ready, as soon as it dropped groups, so their prompts are never held back.

        Raises, changing nothing: `InvalidArgumentError` for `num_groups` outside
        `1..=max_buffered_groups` or a negative timeout, `VersionError` when `actor_version` goes
        backwards, `DropLimitExceededError` past `max_dropped_groups_per_step`.
        """
        groups, dropped, num_ready = self._core.take_batch(num_groups, actor_version, timeout_s)
        # Positional and without a type subscript at run time: this is on the hand-off's hot path.
        return Batch(
            cast("list[Group]", groups),
            [prompt_index for _, prompt_index in dropped] if dropped else [],
            actor_version,
            num_ready,
            [group_id for group_id, _ in dropped] if dropped else [],
        )

    def end_step(self) -> StepStats:
        """Close the running step: return its statistics and start the next one now."""
        return self._core.end_step()

    def inflight_groups(self) -> list[tuple[int, int]]:
        """`(group_id, prompt_index)` of every group in flight, by group id."""
        return self._core.inflight_groups()

    def buffered_groups(self) -> list[Group]:
        """The finished groups waiting for the actor, oldest first (a copy; nothing is removed)."""
        return cast("list[Group]", self._core.buffered_payloads())

    def snapshot(self) -> BufferSnapshot:
        """The whole state, for a checkpoint: the core's bytes and the payloads of the groups buffered in
        them, taken at one instant."""
        core_state, groups = self._core.snapshot()
        return BufferSnapshot(core_state=core_state, groups=cast("dict[int, Group]", groups))
