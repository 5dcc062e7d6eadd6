"""A step's groups cut into the shares of the actor's data-parallel ranks, as NumPy arrays.

The buffer worker cuts each batch here (`split_batch`) and puts every rank's `BatchShare` into Ray's object
store, so each actor rank receives its own rows and nothing else (`asyncrl_core.runner.handoff`). An actor
given the groups themselves (a test, a single process) cuts them the same way and keeps its own share: both
paths train on the same rows, in the same order.

The cut. The step's groups are taken, in order, `mini_batch_size` at a time (one optimiser update each).
Within a mini-batch every trajectory is a row; its advantage is computed over its whole group
(`group_advantages`); the rows are sorted by length, longest first (ties keep their order), and dealt
round-robin to the ranks (`deal_rows`), so the ranks get similar token counts and a rank's consecutive rows
have similar lengths (little padding in a micro-batch). The mini-batch's totals (trained tokens, rows with a
trained token) travel with every share: they fix each token's share of the mini-batch loss, so the ranks'
losses add up to the mini-batch loss whatever the cut.

A rank then cuts each of its mini-batches into micro-batches, by row count or by token budget
(`cut_by_tokens`: as few micro-batches of at most so many tokens as first-fit decreasing finds); widths
and packed lengths are rounded up to `LENGTH_MULTIPLE` tokens on a GPU (`bucket_length`). Round-robin
dealing of the length-sorted rows keeps the ranks' token counts within one row of each other.

NumPy only, no torch: the buffer worker imports this module.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from asyncrl_core.errors import AsyncRLError
from asyncrl_core.types import NO_VERSION, BatchShare, Group, MiniBatchShare

ADVANTAGE_EPS = 1e-6
"""Added to the group's reward standard deviation before dividing, as GRPO implementations do."""


class BatchError(AsyncRLError, ValueError):
    """A group or trajectory cannot be trained on: inconsistent lengths, an empty prompt, no trajectories."""


@dataclass(frozen=True, slots=True)
class TokenArrays:
    """One trajectory's token data as arrays aligned with its `token_ids` (`MiniBatchShare`'s layout: on
    prompt positions the mask is 0, the logprob 0.0 and the version `NO_VERSION`)."""

    token_ids: NDArray[np.int32]
    loss_mask: NDArray[np.int8]
    rollout_logprobs: NDArray[np.float32]
    versions: NDArray[np.int32]


def group_advantages(
    rewards: Sequence[float] | NDArray[np.floating], normalize_std: bool
) -> NDArray[np.float32]:
    """Advantages of one group: `reward - mean`, divided by `std + 1e-6` when `normalize_std`; `[G]` float32.

    The standard deviation is the sample (Bessel-corrected) one, as GRPO uses, computed in float64. A group
    whose rewards are all equal, a single trajectory included, carries no learning signal: its advantages
    are exactly zero (never NaN, never a rounding residue amplified by the division).
    """
    values = np.asarray(rewards, dtype=np.float64)
    if values.ndim != 1 or values.size == 0:
        raise ValueError(f"rewards must be a non-empty 1-d sequence, got shape {values.shape}")
    if not bool(np.isfinite(values).all()):
        raise ValueError(f"rewards must be finite, got {values.tolist()}")
    if values.size == 1 or bool((values == values[0]).all()):
        return np.zeros(values.shape, dtype=np.float32)
    centred = values - values.mean()
    if normalize_std:
        centred = centred / (values.std(ddof=1) + ADVANTAGE_EPS)
    return centred.astype(np.float32)


def deal_rows(lengths: Sequence[int], num_ranks: int) -> list[list[int]]:
    """The rows (indices into `lengths`) each of `num_ranks` ranks trains, in its training order: sorted by
    length, longest first (ties in row order), dealt round-robin."""
    order = sorted(range(len(lengths)), key=lambda row: -lengths[row])
    return [order[rank::num_ranks] for rank in range(num_ranks)]


def num_micro_batches(num_rows: int, num_ranks: int, micro_batch_size: int) -> int:
    """Micro-batches every rank runs for a mini-batch of `num_rows` rows: the same on every rank (a rank
    with fewer rows runs empty ones), so the ranks' collectives match."""
    return math.ceil(math.ceil(num_rows / num_ranks) / micro_batch_size)


LENGTH_MULTIPLE = 64
"""On a GPU, widths of padded micro-batches and lengths of packed rows are rounded up to a multiple of this
many tokens, so a run meets a few shapes again and again instead of a new one per micro-batch (kernels that
plan per shape then plan once per bucket). A CPU plans nothing per shape: the actors round to 1 there."""


def bucket_length(num_tokens: int, multiple: int = LENGTH_MULTIPLE) -> int:
    """`num_tokens` rounded up to a multiple of `multiple` (at least one multiple)."""
    return max(1, math.ceil(num_tokens / multiple)) * multiple


def cut_by_tokens(
    lengths: Sequence[int], max_tokens: int, *, padded: bool, length_multiple: int = LENGTH_MULTIPLE
) -> list[list[int]]:
    """A rank's rows (`lengths`, in training order) grouped into as few micro-batches of at most
    `max_tokens` tokens as first-fit decreasing finds; each micro-batch's rows in training order.

    A micro-batch costs the sum of its rows' lengths when packed, and its rows times the width of its
    longest row rounded up to `length_multiple` when `padded`. A row that alone costs more than
    `max_tokens` gets a micro-batch of its own: a row is never split. Deterministic: the same lengths give
    the same cut on every rank.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda row: -lengths[row])
    bins: list[list[int]] = []
    costs: list[tuple[int, int]] = []  # per micro-batch: (tokens or width, rows)
    for row in order:
        length = lengths[row]
        for index, (size, count) in enumerate(costs):
            # Rows come longest first, so a padded micro-batch's width is its first row's.
            cost = (count + 1) * size if padded else size + length
            if cost <= max_tokens:
                bins[index].append(row)
                costs[index] = (size, count + 1) if padded else (cost, count + 1)
                break
        else:
            bins.append([row])
            costs.append((bucket_length(length, length_multiple) if padded else length, 1))
    return [sorted(rows) for rows in bins]


def token_arrays(group: Group) -> list[TokenArrays]:
    """The arrays of every trajectory of `group`, checked: `BatchError`, naming the group and trajectory,
    for an empty prompt, per-token lists that do not match the response length, a mask entry other than 0
    or 1, or a non-finite logprob on a trained token."""
    if not group.trajectories:
        raise BatchError(f"group {group.group_id} (prompt {group.prompt_index}) has no trajectories")
    arrays: list[TokenArrays] = []
    for index, trajectory in enumerate(group.trajectories):
        where = f"group {group.group_id} (prompt {group.prompt_index}), trajectory {index}"
        prompt_len, length = trajectory.prompt_len, len(trajectory.token_ids)
        if prompt_len < 1:
            raise BatchError(f"{where}: prompt_len must be at least 1 to predict the first response token")
        if prompt_len > length:
            raise BatchError(f"{where}: prompt_len {prompt_len} exceeds the {length} token ids")
        for name in ("loss_mask", "rollout_logprobs", "versions"):
            if (size := len(getattr(trajectory, name))) != length - prompt_len:
                raise BatchError(
                    f"{where}: {name} has {size} entries for {length - prompt_len} response tokens"
                )
        mask = np.asarray(trajectory.loss_mask)
        if mask.size and not bool(((mask == 0) | (mask == 1)).all()):
            raise BatchError(f"{where}: loss_mask entries must be 0 or 1")
        trained = mask > 0
        loss_mask = np.zeros(length, dtype=np.int8)
        loss_mask[prompt_len:] = mask
        logprobs = np.zeros(length, dtype=np.float32)
        # Logprobs and versions of tool tokens are meaningless whatever the producer wrote there.
        logprobs[prompt_len:] = np.where(
            trained, np.asarray(trajectory.rollout_logprobs, dtype=np.float32), 0.0
        )
        if not bool(np.isfinite(logprobs).all()):
            raise BatchError(f"{where}: rollout_logprobs of trained tokens must be finite")
        versions = np.full(length, NO_VERSION, dtype=np.int32)
        versions[prompt_len:] = np.where(trained, np.asarray(trajectory.versions, dtype=np.int32), NO_VERSION)
        token_ids = np.asarray(trajectory.token_ids, dtype=np.int32)
        arrays.append(TokenArrays(token_ids, loss_mask, logprobs, versions))
    return arrays


def split_batch(
    groups: Sequence[Group],
    num_ranks: int,
    mini_batch_size: int | None,
    *,
    normalize_std: bool,
    arrays_of: Callable[[Group], list[TokenArrays]] = token_arrays,
) -> list[BatchShare]:
    """The step's `groups` cut into one `BatchShare` per data-parallel rank (the module docstring says
    how), mini-batches of `mini_batch_size` groups (all of them when None).

    `arrays_of` gives a group's arrays (the buffer worker passes the ones it made when the group finished).
    Every group is checked before anything is cut: `BatchError` for a malformed one, an empty list, or a
    number of groups that `mini_batch_size` does not divide.
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be at least 1, got {num_ranks}")
    size = len(groups) if mini_batch_size is None else mini_batch_size
    if not groups:
        raise BatchError("cannot train on an empty list of groups")
    if size < 1 or len(groups) % size:
        raise BatchError(
            f"{len(groups)} groups cannot be cut into mini-batches of {size} groups "
            "(actor.ppo_mini_batch_size must divide the groups of a step)"
        )
    arrays = [arrays_of(group) for group in groups]
    per_rank: list[list[MiniBatchShare]] = [[] for _ in range(num_ranks)]
    for start in range(0, len(groups), size):
        cut = range(start, start + size)
        rows = _Rows.of([groups[index] for index in cut], [arrays[index] for index in cut], normalize_std)
        for rank, mine in enumerate(deal_rows(rows.lengths, num_ranks)):
            per_rank[rank].append(rows.share(mine))
    return [BatchShare(rank, num_ranks, tuple(shares)) for rank, shares in enumerate(per_rank)]


def whole_batch(groups: Sequence[Group], *, normalize_std: bool) -> MiniBatchShare:
    """Every row of `groups` in group order, then trajectory order, as one share (one rank, one update)."""
    if not groups:
        raise BatchError("cannot train on an empty list of groups")
    rows = _Rows.of(groups, [token_arrays(group) for group in groups], normalize_std)
    return rows.share(list(range(len(rows.arrays))))


@dataclass(frozen=True, slots=True)
class _Rows:
    """The rows of one mini-batch before they are dealt."""

    arrays: list[TokenArrays]
    advantages: NDArray[np.float32]
    row_ids: NDArray[np.int64]
    lengths: list[int]
    trained: list[int]

    @classmethod
    def of(cls, groups: Sequence[Group], arrays: Sequence[list[TokenArrays]], normalize_std: bool) -> _Rows:
        flat = [row for group_arrays in arrays for row in group_arrays]
        advantages = [
            group_advantages([trajectory.reward for trajectory in group.trajectories], normalize_std)
            for group in groups
        ]
        row_ids = [(group.group_id, index) for group in groups for index in range(len(group.trajectories))]
        return cls(
            flat,
            np.concatenate(advantages),
            np.asarray(row_ids, dtype=np.int64).reshape(-1, 2),
            [len(row.token_ids) for row in flat],
            [int(np.count_nonzero(row.loss_mask)) for row in flat],
        )

    def share(self, mine: Sequence[int]) -> MiniBatchShare:
        """The rows `mine`, in that order, with the whole mini-batch's totals."""
        chosen = [self.arrays[row] for row in mine]
        offsets = np.zeros(len(chosen) + 1, dtype=np.int64)
        np.cumsum([self.lengths[row] for row in mine], out=offsets[1:])

        def joined(name: str, dtype: type[np.generic]) -> NDArray[np.generic]:
            if not chosen:
                return np.zeros(0, dtype=dtype)
            return np.concatenate([getattr(row, name) for row in chosen])

        return MiniBatchShare(
            token_ids=joined("token_ids", np.int32).astype(np.int32, copy=False),
            row_offsets=offsets,
            loss_mask=joined("loss_mask", np.int8).astype(np.int8, copy=False),
            rollout_logprobs=joined("rollout_logprobs", np.float32).astype(np.float32, copy=False),
            versions=joined("versions", np.int32).astype(np.int32, copy=False),
            advantages=self.advantages[list(mine)],
            row_ids=self.row_ids[list(mine)],
            num_rows=len(self.arrays),
            num_tokens=sum(self.lengths),
            num_loss_tokens=sum(self.trained),
            num_trained_rows=sum(1 for count in self.trained if count),
        )
