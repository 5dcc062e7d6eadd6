"""The Rust buffer core (`crates/buffer_core`), compiled with pyo3.

Use the facade `asyncrl_core.buffer` instead: it keeps the group payloads and returns typed results.
Every error is an `asyncrl_core.errors.GroupBufferError` subclass raised before anything changes.
"""

from collections.abc import Mapping, Sequence
from typing import final

__all__ = [
    "GroupBuffer",
    "StepStats",
]

@final
class StepStats:
    """The totals of one step, between two `GroupBuffer.end_step` calls (the Rust `StepStats`)."""

    @property
    def num_groups(self) -> int:
        """Groups handed to the actor."""
    @property
    def staleness_sum(self) -> int:
        """Sum of `actor_version - earliest_version` over the groups handed out."""
    @property
    def staleness_max(self) -> int:
        """Largest staleness of the step; 0 when no group was handed out."""
    @property
    def staleness_counts(self) -> dict[int, int]:
        """Groups handed out per staleness value."""
    @property
    def version_span_sum(self) -> int:
        """Sum of `latest_version - earliest_version`."""
    @property
    def queue_steps_sum(self) -> int:
        """Sum of `actor_version - latest_version`."""
    @property
    def dropped_groups(self) -> int:
        """Groups dropped by the staleness cap."""
    @property
    def admission_wait_inflight_limit_ns(self) -> int:
        """Nanoseconds during which admission was refused by the in-flight limit (it wins a tie)."""
    @property
    def admission_wait_buffer_full_ns(self) -> int:
        """Nanoseconds during which admission was refused because the buffer was full."""
    @property
    def wall_ns(self) -> int:
        """Nanoseconds from the start of the step to its end."""
    def metrics(self) -> dict[str, float]:
        """The step's metrics under their names in `asyncrl_core.metrics`.

        The admission waits are shares of the step's wall time (0 for a step of no duration). The
        per-group means, the maximum and the `ratio_<k>` shares are present only when the step handed
        out at least one group: a step without training data has no staleness to report.
        """

@final
class GroupBuffer:
    """Admission counters (lock-free), the oldest-first heap of finished groups and the staleness
    ledger. Safe to call from any number of threads at once."""

    def __new__(
        cls,
        *,
        max_inflight_groups: int,
        max_buffered_groups: int,
        max_dropped_groups_per_step: int,
        max_actor_accept_staleness: int | None = None,
    ) -> GroupBuffer:
        """An empty buffer. Count limits are in `1..=2**32-1`, the other two 0 or more (the cap may be
        None for no cap); `InvalidArgumentError` names the offending key otherwise."""
    @staticmethod
    def restore(data: bytes, payloads: Mapping[int, object]) -> GroupBuffer:
        """Restore a buffer from `snapshot` output: the state's bytes and the payload of each buffered
        group by group id. `CorruptStateError` for any other bytes, or payloads that are not exactly
        those of the buffered groups."""
    def snapshot(self) -> tuple[bytes, dict[int, object]]:
        """The whole state (limits, counters, records, heap, version watermarks, the running step's
        totals and wall time) as versioned, checksummed bytes, and the payload of each group buffered in
        it, at one instant."""
    @property
    def max_inflight_groups(self) -> int: ...
    @property
    def max_buffered_groups(self) -> int: ...
    @property
    def max_dropped_groups_per_step(self) -> int: ...
    @property
    def max_actor_accept_staleness(self) -> int | None: ...
    @property
    def num_inflight(self) -> int:
        """Groups admitted and still generating."""
    @property
    def num_buffered(self) -> int:
        """Finished groups waiting for the actor."""
    def try_admit(self, prompt_index: int) -> int | None:
        """The new group id if both limits allow admission, else None. Never blocks."""
    def try_admit_many(self, prompt_indices: Sequence[int]) -> list[int]:
        """Admit as many prompts as the limits allow, in order, under one lock: the group ids of the
        admitted prefix."""
    def wait_admit(self, prompt_index: int, timeout_s: float) -> int | None:
        """The new group id once both limits allow admission, or None after `timeout_s` seconds.
        Releases the GIL while waiting and checks for signals every 0.1 s."""
    def complete(
        self,
        group_id: int,
        prompt_index: int,
        token_versions: tuple[int, int] | None,
        finish_version: int | None,
        payload: object,
    ) -> int | None:
        """Move an in-flight group to the finished heap, with `payload` (its `Group`).

        `token_versions` is `(earliest_version, latest_version)` of its model tokens, or None when the
        model sampled none; `finish_version` None lets the buffer stamp it. Returns the group's finish
        version, or None when the group was admitted but is no longer in flight (a retry; nothing
        changes). `prompt_index` must be the one the group was admitted for.
        """
    def complete_many(
        self, groups: Sequence[tuple[int, int, tuple[int, int] | None, int | None, object]]
    ) -> list[int | None]:
        """`complete` for each `(group_id, prompt_index, token_versions, finish_version, payload)` under
        one lock; one result per entry. All or nothing on errors."""
    def abandon(self, group_id: int) -> int:
        """Release an in-flight group that failed; returns its prompt index."""
    def take_batch(
        self, num_groups: int, actor_version: int, timeout_s: float = 0.0
    ) -> tuple[list[object], list[tuple[int, int]], int]:
        """Drop the groups past the staleness cap, then hand out the `num_groups` oldest if that many
        are ready, waiting up to `timeout_s` seconds (without the GIL) for them.

        Returns the handed-out groups' payloads (oldest first; empty when not ready), `(group_id,
        prompt_index)` of each dropped group (oldest first), and the number of groups ready after the
        drops. Returns early, not ready, as soon as it dropped groups.
        """
    def end_step(self) -> StepStats:
        """Return the running step's totals and start the next step now."""
    def inflight_groups(self) -> list[tuple[int, int]]:
        """`(group_id, prompt_index)` of every group in flight, by group id."""
    def buffered_payloads(self) -> list[object]:
        """The payloads of the finished groups waiting for the actor, oldest first."""
    def buffered_groups(self) -> list[tuple[int, int, int, int, int]]:
        """`(group_id, prompt_index, earliest_version, latest_version, finish_version)` of every
        finished group waiting for the actor, oldest first."""
