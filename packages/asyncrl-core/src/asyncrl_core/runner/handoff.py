"""Batches by reference: the buffer worker cuts each batch into the shares of the actor's data-parallel
ranks and puts every share into Ray's object store; the driver passes each rank the reference to its own.

The driver never holds a batch's data: what it gets from the buffer worker is a `Handoff` (one object
reference per data-parallel rank, the group ids, the groups' rollout metrics), a few hundred bytes whatever
the batch's size, so `time/wait_data` measures waiting only. A share's token data are NumPy arrays
(`asyncrl_core.types.MiniBatchShare`): Ray's object store hands them to a rank on the same node without a
copy, and to a rank on another node as one transfer of that rank's share. The tensor-parallel ranks of one
data-parallel rank receive the same reference.

Token data become arrays when a group finishes (`ShareCutter.prepare`, called by the buffer worker as it
buffers the group), while the actor trains on the previous batch; the hand-off itself only joins arrays.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asyncrl_core.shares import BatchError, TokenArrays, split_batch, token_arrays
from asyncrl_core.types import BatchShare, Group

if TYPE_CHECKING:
    from asyncrl_core.buffer import Batch
    from asyncrl_core.config import AsyncRLConfig


@dataclass(frozen=True, slots=True)
class Handoff:
    """A batch as the driver sees it: where each data-parallel rank's share is, never the data itself."""

    shares: tuple[Any, ...]
    """Per data-parallel rank, in rank order: a Ray object reference to its `BatchShare` (the runner), or
    the `BatchShare` itself (a buffer worker used without Ray)."""
    share_bytes: tuple[int, ...]
    """Bytes of each share's arrays, in rank order."""
    group_ids: tuple[int, ...]
    """The groups of the batch, oldest first (the ledger has recorded them as trained)."""
    actor_version: int
    """The actor version the batch was taken at."""
    metrics: dict[str, float]
    """The groups' rollout metrics (reward, turns, tokens, tool calls, ...), for the step's record."""


class ShareCutter:
    """Cuts the buffer worker's batches into per-rank shares (`asyncrl_core.shares.split_batch`), with the
    token arrays of each buffered group made once, when the group finished.

    With `by_reference` (the runner), each share is put into Ray's object store from the buffer worker's
    process, which owns it; Ray frees it once the driver and the ranks have let go of the reference.
    Thread-safe: groups finish on the agent loops' calls while the driver takes a batch.
    """

    def __init__(
        self, num_ranks: int, mini_batch_size: int | None, *, normalize_std: bool, by_reference: bool
    ) -> None:
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be at least 1, got {num_ranks}")
        self.num_ranks = num_ranks
        """Data-parallel ranks of the actor: one share each."""
        self.mini_batch_size = mini_batch_size
        """Groups per optimiser update (`actor.ppo_mini_batch_size`; None: the whole batch)."""
        self.normalize_std = normalize_std
        """`algorithm.normalize_advantage_std`."""
        self.by_reference = by_reference
        self._arrays: dict[int, list[TokenArrays]] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, config: AsyncRLConfig, *, by_reference: bool) -> ShareCutter:
        """The cutter of a run: `config.actor_data_parallel_size` shares, `actor.ppo_mini_batch_size`."""
        return cls(
            config.actor_data_parallel_size,
            config.actor.ppo_mini_batch_size,
            normalize_std=config.algorithm.normalize_advantage_std,
            by_reference=by_reference,
        )

    def prepare(self, group: Group) -> None:
        """Make `group`'s token arrays now (it was just buffered). A malformed group is left as it is: the
        hand-off that takes it raises its `BatchError`."""
        try:
            arrays = token_arrays(group)
        except BatchError:
            return
        with self._lock:
            self._arrays[group.group_id] = arrays

    def forget(self, group_ids: Sequence[int]) -> None:
        """Drop the arrays of groups that left the buffer without being trained (dropped as stale)."""
        with self._lock:
            for group_id in group_ids:
                self._arrays.pop(group_id, None)

    def clear(self) -> None:
        """Drop every group's arrays (the buffer was replaced by a checkpoint's)."""
        with self._lock:
            self._arrays.clear()

    def cut(self, batch: Batch, metrics: dict[str, float]) -> Handoff:
        """The `Handoff` of a ready batch: one share per data-parallel rank, put into the object store when
        `by_reference`. `BatchError` for a malformed group (the groups have left the buffer either way)."""
        with self._lock:
            cached = {group.group_id: self._arrays.pop(group.group_id, None) for group in batch.groups}

        def arrays_of(group: Group) -> list[TokenArrays]:
            found = cached[group.group_id]
            return found if found is not None else token_arrays(group)

        shares = split_batch(
            batch.groups,
            self.num_ranks,
            self.mini_batch_size,
            normalize_std=self.normalize_std,
            arrays_of=arrays_of,
        )
        return Handoff(
            shares=tuple(self._place(share) for share in shares),
            share_bytes=tuple(share.nbytes for share in shares),
            group_ids=tuple(group.group_id for group in batch.groups),
            actor_version=batch.actor_version,
            metrics=metrics,
        )

    def _place(self, share: BatchShare) -> Any:
        if not self.by_reference:
            return share
        import ray

        return ray.put(share)


def data_parallel_rank(rank: int, tensor_parallel_size: int) -> int:
    """The data-parallel rank of actor rank `rank`: the tensor-parallel ranks of one model replica are
    consecutive (Megatron's order, tensor-parallel fastest), so they share a data-parallel rank."""
    return rank // tensor_parallel_size


def train_calls(actors: Sequence[Any], handoff: Handoff, tensor_parallel_size: int) -> list[Any]:
    """`train.remote(share)` on every actor rank, each with its own data-parallel rank's share (a reference:
    Ray resolves it in the rank's process, so no rank receives another rank's share)."""
    num_ranks = len(actors) // tensor_parallel_size
    if len(handoff.shares) != num_ranks:
        raise BatchError(
            f"the batch was cut into {len(handoff.shares)} shares for {num_ranks} data-parallel ranks "
            f"({len(actors)} actor ranks at actor.tensor_parallel_size {tensor_parallel_size})"
        )
    return [
        actor.train.remote(handoff.shares[data_parallel_rank(rank, tensor_parallel_size)])
        for rank, actor in enumerate(actors)
    ]
