"""Groups of trajectories packed into padded tensors, ready for a causal LM forward pass.

Layout. Row `n` holds one trajectory, right-padded to the longest row. Every per-token tensor is `[N, T]` and
aligned with the *logits*: position `t` concerns the prediction of `input_ids[n, t + 1]` from the logits at
`t`, so `target_ids[n, t] == input_ids[n, t + 1]`. The response token `j` of a trajectory with prompt length
`P` sits at `input_ids[n, P + j]` and is therefore described at position `P - 1 + j` of `loss_mask`,
`rollout_logprobs` and `advantages`. The last position of every row, and every padding position, has a
zero mask.

Loss weights. `loss_weights[n, t]` is the share of the *whole batch's* loss that token `(n, t)` carries:
the loss is `sum(loss_weights * per_token_loss)`. Because the normalisation is fixed once for the full batch,
any split of the rows (micro-batches, data-parallel ranks) gives losses and gradients that simply add up to
the full-batch ones, for both aggregations:

- `token_mean`: `loss_mask / (number of trained tokens in the batch)`;
- `sequence_mean`: `loss_mask / (trained tokens of the row) / (number of rows with a trained token)`.
  A trajectory without a single model token contributes nothing and is not counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Literal

import numpy as np
import torch

from asyncrl_core.shares import (
    BatchError,
    deal_rows,
    num_micro_batches,
    split_batch,
    whole_batch,
)
from asyncrl_core.types import BatchShare, Group, MiniBatchShare

LossAggregation = Literal["token_mean", "sequence_mean"]

__all__ = [
    "BatchError",
    "LossAggregation",
    "PackedBatch",
    "RankPlan",
    "loss_weights",
    "micro_batches",
    "pack_groups",
    "pack_mini_batches",
    "pack_rows",
    "rank_plan",
]


@dataclass(frozen=True, slots=True)
class PackedBatch:
    """`N` trajectories as `[N, T]` tensors (see the module docstring for the alignment)."""

    input_ids: torch.Tensor
    """`[N, T]` int64: prompt + response tokens, right-padded with the pad id."""
    attention_mask: torch.Tensor
    """`[N, T]` int64: 1 on real tokens, 0 on padding."""
    position_ids: torch.Tensor
    """`[N, T]` int64: `0, 1, 2, ...` along each row (padding included, where it is never attended to)."""
    target_ids: torch.Tensor
    """`[N, T]` int64: `input_ids` shifted left by one; the pad id in the last column."""
    loss_mask: torch.Tensor
    """`[N, T]` float32: 1 where the target is a token the model sampled, 0 for prompt, tool, observation
    and padding tokens."""
    loss_weights: torch.Tensor
    """`[N, T]` float32: the share of the full batch's loss each token carries; sums to 1 over the full batch
    (0 when no token is trained)."""
    rollout_logprobs: torch.Tensor
    """`[N, T]` float32: the engine's (behaviour) log-probability of each target; 0 where the mask is 0."""
    advantages: torch.Tensor
    """`[N, T]` float32: the trajectory's group-relative advantage on its trained tokens, 0 elsewhere."""
    versions: torch.Tensor
    """`[N, T]` int64: the weight version that sampled each target; `NO_VERSION` (-1) where the mask is 0."""
    lengths: torch.Tensor
    """`[N]` int64: real tokens per row (prompt + response)."""

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens in the batch."""
        return int(self.lengths.sum().item())

    @property
    def num_loss_tokens(self) -> int:
        """Tokens the loss is taken over."""
        return int(self.loss_mask.sum().item())

    def select(self, rows: Sequence[int] | torch.Tensor) -> PackedBatch:
        """The given rows, in that order, with the columns trimmed to the longest of them.

        Loss weights are kept as they are, so the rows' losses stay shares of the original batch's loss.
        """
        index = torch.as_tensor(rows, dtype=torch.int64)
        width = max(int(self.lengths[index].max().item()), 1) if index.numel() else 1
        values = {
            spec.name: getattr(self, spec.name)[index]
            if spec.name == "lengths"
            else getattr(self, spec.name)[index, :width]
            for spec in fields(self)
        }
        return PackedBatch(**values)

    def rank_micro_batches(self, rank: int, world_size: int, micro_batch_size: int) -> list[PackedBatch]:
        """Rank `rank`'s rows of the batch, in micro-batches of at most `micro_batch_size` rows.

        Rows are dealt as `asyncrl_core.shares.deal_rows` deals them (sorted by length, round-robin), so ranks
        get similar token counts and a micro-batch holds rows of similar length (little padding). Every rank
        gets the same number of micro-batches: a rank with fewer rows gets empty ones, made of one
        zero-weight row, so the ranks' collectives still match.
        """
        mine = deal_rows(self.lengths.tolist(), world_size)[rank]
        return _cut_micro_batches(
            self, mine, num_micro_batches(self.num_rows, world_size, micro_batch_size), micro_batch_size
        )

    def to(self, device: torch.device | str) -> PackedBatch:
        """The same batch on `device` (the tensors are copied without blocking where possible)."""
        return replace(
            self,
            **{spec.name: getattr(self, spec.name).to(device, non_blocking=True) for spec in fields(self)},
        )


def loss_weights(loss_mask: torch.Tensor, aggregation: LossAggregation) -> torch.Tensor:
    """Per-token shares of the batch loss for a `[N, T]` mask (see the module docstring); float32."""
    mask = loss_mask.to(torch.float32)
    if aggregation == "token_mean":
        return mask / mask.sum().clamp(min=1.0)
    if aggregation == "sequence_mean":
        per_row = mask.sum(dim=1, keepdim=True)
        num_rows = (per_row > 0).sum().clamp(min=1).to(torch.float32)
        return mask / per_row.clamp(min=1.0) / num_rows
    raise ValueError(f"loss_aggregation must be `token_mean` or `sequence_mean`, got {aggregation!r}")


def pack_groups(
    groups: Sequence[Group], pad_id: int, *, normalize_std: bool, aggregation: LossAggregation
) -> PackedBatch:
    """Pack every trajectory of `groups` into one `PackedBatch`, with group-relative advantages.

    Rows follow the groups' order, then the trajectories' order. Raises `BatchError`, naming the group and
    trajectory, for a trajectory whose per-token lists do not match its response length, an empty prompt,
    or a group without trajectories; nothing is changed in that case.
    """
    return pack_rows(whole_batch(groups, normalize_std=normalize_std), pad_id, aggregation)


def pack_rows(rows: MiniBatchShare, pad_id: int, aggregation: LossAggregation) -> PackedBatch:
    """The rows of a share as a `PackedBatch`, in the share's order; the loss weights are shares of the
    whole mini-batch's loss (from the share's mini-batch totals), so the ranks' losses add up to it."""
    lengths_np = np.diff(rows.row_offsets)
    num_rows = len(lengths_np)
    if num_rows == 0:
        raise BatchError("cannot pack a share without rows")
    width = max(int(lengths_np.max()), 1)
    lengths = torch.from_numpy(lengths_np.astype(np.int64))
    real = torch.arange(width, dtype=torch.int64).expand(num_rows, width) < lengths[:, None]

    def spread(values: np.ndarray, fill: float, dtype: torch.dtype) -> torch.Tensor:
        # `real` is row-major, as the share's per-token arrays are; `astype` copies the (read-only,
        # shared) array the object store handed over into memory torch may own.
        out = torch.full((num_rows, width), fill, dtype=dtype)
        out[real] = torch.from_numpy(values.astype(_NUMPY_OF[dtype]))
        return out

    def shifted(values: torch.Tensor, fill: float) -> torch.Tensor:
        # Token-aligned to logits-aligned: position `t` describes the target `input_ids[:, t + 1]`.
        out = torch.full_like(values, fill)
        out[:, :-1] = values[:, 1:]
        return out

    input_ids = spread(rows.token_ids, pad_id, torch.int64)
    loss_mask = shifted(spread(rows.loss_mask, 0, torch.float32), 0)
    target_ids = shifted(input_ids, pad_id)
    advantages = torch.from_numpy(rows.advantages.astype(np.float32))
    return PackedBatch(
        input_ids=input_ids,
        attention_mask=real.to(torch.int64),
        position_ids=torch.arange(width, dtype=torch.int64).expand(num_rows, width).contiguous(),
        target_ids=target_ids,
        loss_mask=loss_mask,
        loss_weights=_share_weights(loss_mask, rows, aggregation),
        rollout_logprobs=shifted(spread(rows.rollout_logprobs, 0.0, torch.float32), 0.0),
        advantages=advantages[:, None] * loss_mask,
        versions=shifted(spread(rows.versions, -1, torch.int64), -1),
        lengths=lengths,
    )


_NUMPY_OF: dict[torch.dtype, type[np.generic]] = {torch.int64: np.int64, torch.float32: np.float32}


def _share_weights(
    loss_mask: torch.Tensor, rows: MiniBatchShare, aggregation: LossAggregation
) -> torch.Tensor:
    """`loss_weights` of a share's rows, normalised by the whole mini-batch's counts (0-dim float32 tensors,
    as `loss_weights` divides by, so both give the same float32 values)."""
    if aggregation == "token_mean":
        return loss_mask / torch.tensor(float(max(rows.num_loss_tokens, 1)), dtype=torch.float32)
    if aggregation == "sequence_mean":
        per_row = loss_mask.sum(dim=1, keepdim=True)
        num_rows = torch.tensor(float(max(rows.num_trained_rows, 1)), dtype=torch.float32)
        return loss_mask / per_row.clamp(min=1.0) / num_rows
    raise ValueError(f"loss_aggregation must be `token_mean` or `sequence_mean`, got {aggregation!r}")


def micro_batches(
    rows: MiniBatchShare, num_ranks: int, pad_id: int, aggregation: LossAggregation, micro_batch_size: int
) -> list[PackedBatch]:
    """A rank's share of one mini-batch in micro-batches of at most `micro_batch_size` rows, in order; as
    many as every rank runs (`num_micro_batches`), the missing ones made of one zero-weight row."""
    count = num_micro_batches(rows.num_rows, num_ranks, micro_batch_size)
    if rows.num_share_rows == 0:
        return [_padding_row(pad_id)] * count
    packed = pack_rows(rows, pad_id, aggregation)
    return _cut_micro_batches(packed, list(range(packed.num_rows)), count, micro_batch_size)


def _cut_micro_batches(batch: PackedBatch, mine: list[int], count: int, size: int) -> list[PackedBatch]:
    parts: list[PackedBatch] = []
    for index in range(count):
        rows = mine[index * size : (index + 1) * size]
        if rows:
            parts.append(batch.select(rows))
        else:
            empty = batch.select([mine[0] if mine else 0])
            parts.append(replace(empty, loss_weights=torch.zeros_like(empty.loss_weights)))
    return parts


def _padding_row(pad_id: int) -> PackedBatch:
    """One row of one padding token that carries no loss (a rank without rows in a mini-batch still runs
    its micro-batches, so the ranks' collectives match)."""
    zeros_int = torch.zeros((1, 1), dtype=torch.int64)
    zeros = torch.zeros((1, 1), dtype=torch.float32)
    return PackedBatch(
        input_ids=torch.full((1, 1), pad_id, dtype=torch.int64),
        attention_mask=torch.ones((1, 1), dtype=torch.int64),
        position_ids=zeros_int,
        target_ids=torch.full((1, 1), pad_id, dtype=torch.int64),
        loss_mask=zeros,
        loss_weights=zeros,
        rollout_logprobs=zeros,
        advantages=zeros,
        versions=torch.full((1, 1), -1, dtype=torch.int64),
        lengths=torch.ones(1, dtype=torch.int64),
    )


@dataclass(frozen=True, slots=True)
class RankPlan:
    """What one data-parallel rank runs in a step: its micro-batches of each mini-batch, and the step's
    totals over all ranks (for the `train/num_...` metrics)."""

    micro_batches: list[list[PackedBatch]]
    """Per mini-batch (one optimiser update), this rank's micro-batches."""
    num_rows: int
    num_tokens: int
    num_loss_tokens: int


def rank_plan(
    batch: Sequence[Group] | BatchShare,
    rank: int,
    num_ranks: int,
    pad_id: int,
    *,
    mini_batch_size: int | None,
    micro_batch_size: int,
    normalize_std: bool,
    aggregation: LossAggregation,
) -> RankPlan:
    """Data-parallel rank `rank`'s part of a step: from its `BatchShare` (what the runner hands each rank),
    or from the step's groups, which every rank is then given and cuts the same way
    (`asyncrl_core.shares.split_batch`). A share cut for another rank, or for another number of ranks,
    raises `BatchError`: a rank never trains on rows that are not its own."""
    if isinstance(batch, BatchShare):
        share = batch
    else:
        share = split_batch(batch, num_ranks, mini_batch_size, normalize_std=normalize_std)[rank]
    if (share.rank, share.num_ranks) != (rank, num_ranks):
        raise BatchError(
            f"data-parallel rank {rank} of {num_ranks} was handed the share of rank {share.rank} of "
            f"{share.num_ranks}: a rank trains on its own rows only"
        )
    if not share.mini_batches:
        raise BatchError("the share holds no mini-batch")
    return RankPlan(
        micro_batches=[
            micro_batches(rows, num_ranks, pad_id, aggregation, micro_batch_size)
            for rows in share.mini_batches
        ],
        num_rows=sum(rows.num_rows for rows in share.mini_batches),
        num_tokens=sum(rows.num_tokens for rows in share.mini_batches),
        num_loss_tokens=sum(rows.num_loss_tokens for rows in share.mini_batches),
    )


def pack_mini_batches(
    groups: Sequence[Group],
    pad_id: int,
    mini_batch_size: int | None,
    *,
    normalize_std: bool,
    aggregation: LossAggregation,
) -> list[PackedBatch]:
    """A step's groups cut, in order, into mini-batches of `mini_batch_size` groups (all of them when
    `None`), each packed by `pack_groups`: one optimiser update each.

    Each mini-batch is normalised on its own (its loss weights sum to 1), as every update is a mean over its
    own tokens; advantages are per group, so the cut does not change them. Every mini-batch is checked
    before any is returned: a malformed group, or a step whose number of groups `mini_batch_size` does not
    divide, raises `BatchError` before anything is trained.
    """
    size = len(groups) if mini_batch_size is None else mini_batch_size
    if size < 1 or len(groups) % size:
        raise BatchError(
            f"{len(groups)} groups cannot be cut into mini-batches of {size} groups "
            "(actor.ppo_mini_batch_size must divide the groups of a step)"
        )
    cuts = [groups[start : start + size] for start in range(0, len(groups), size)]
    return [pack_groups(cut, pad_id, normalize_std=normalize_std, aggregation=aggregation) for cut in cuts]
