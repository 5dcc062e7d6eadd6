"""A rank's rows of a mini-batch laid out as tensors for a causal LM forward pass: padded or packed.

Two layouts, one alignment. Every per-token tensor is `[N, T]` and aligned with the *logits*: position `t`
concerns the prediction of `input_ids[n, t + 1]` from the logits at `t`, so `target_ids[n, t] ==
input_ids[n, t + 1]` within a trajectory. The response token `j` of a trajectory with prompt length `P` that
starts at column `s` sits at `input_ids[n, s + P + j]` and is described at column `s + P - 1 + j` of
`loss_mask`, `rollout_logprobs` and `advantages`. The last position of every trajectory, and every padding
position, has a zero mask.

- **Padded**: row `n` holds one trajectory, right-padded (`sequence_offsets` is None). Attention is causal
  within each row; right padding needs no mask, since a real token never sees a later pad.
- **Packed**: one row holds the micro-batch's trajectories one after the other, then padding up to a
  multiple of `length_multiple` tokens (`asyncrl_core.shares.LENGTH_MULTIPLE` on a GPU); `position_ids`
  restart at 0 with each
  trajectory, and `sequence_offsets` (`[S + 1]`, int32) says where each attention sequence starts
  (a trajectory, or the padding at the end), so attention never crosses from one trajectory to another.
  Nothing is computed for padding beyond its own short tail.

Loss weights. `loss_weights[n, t]` is the share of the *whole mini-batch's* loss that token `(n, t)`
carries: the loss is `sum(loss_weights * per_token_loss)`. Because the normalisation is fixed once for the
mini-batch, any split of the rows (micro-batches of either layout, data-parallel ranks) gives losses and
gradients that simply add up to the mini-batch's, for both aggregations:

- `token_mean`: `loss_mask / (number of trained tokens in the mini-batch)`;
- `sequence_mean`: `loss_mask / (trained tokens of the row) / (number of rows with a trained token)`.
  A trajectory without a single model token contributes nothing and is not counted.

Micro-batches (`micro_batches`, `rank_plan`): `micro_batch_size` rows each, padded (the same number on every
rank); or, with `max_tokens`, as many rows as fit in that many tokens (`asyncrl_core.shares.cut_by_tokens`),
packed or padded as the actor's attention needs. Padded widths are rounded up to a multiple of
`length_multiple` too, so that a run on a GPU meets a few shapes again and again rather than a new one per
micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Literal

import numpy as np
import torch

from asyncrl_core.shares import (
    LENGTH_MULTIPLE,
    BatchError,
    bucket_length,
    cut_by_tokens,
    deal_rows,
    num_micro_batches,
    split_batch,
    whole_batch,
)
from asyncrl_core.types import NO_VERSION, BatchShare, Group, MiniBatchShare

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

_ROW_FIELDS = (
    "input_ids",
    "attention_mask",
    "position_ids",
    "target_ids",
    "loss_mask",
    "loss_weights",
    "rollout_logprobs",
    "advantages",
    "versions",
)
"""The `[N, T]` fields of a `PackedBatch`."""


@dataclass(frozen=True, slots=True)
class PackedBatch:
    """Trajectories as `[N, T]` tensors, padded or packed (see the module docstring for both layouts)."""

    input_ids: torch.Tensor
    """`[N, T]` int64: prompt + response tokens, padding at the end of a row holding the pad id."""
    attention_mask: torch.Tensor
    """`[N, T]` int64: 1 on real tokens, 0 on padding."""
    position_ids: torch.Tensor
    """`[N, T]` int64: `0, 1, 2, ...` along each trajectory (padding included, where it is never attended
    to by a real token)."""
    target_ids: torch.Tensor
    """`[N, T]` int64: each trajectory's `input_ids` shifted left by one; the pad id at its last token."""
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
    """`[N]` int64: real tokens per row (prompt + response, of every trajectory in a packed row)."""
    sequence_offsets: torch.Tensor | None = None
    """Packed layout only (`N == 1`): `[S + 1]` int32 offsets into the row where each of its `S` attention
    sequences starts (each trajectory, then the padding at the end if any), and the row's width last.
    None: the padded layout, one trajectory per row."""
    max_sequence_len: int = 0
    """Packed layout only: the longest of its attention sequences, in tokens (what variable-length
    attention kernels take beside the offsets)."""

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

    @property
    def packed(self) -> bool:
        """Whether this is the packed layout (several trajectories in one row)."""
        return self.sequence_offsets is not None

    def select(self, rows: Sequence[int] | torch.Tensor) -> PackedBatch:
        """The given rows of a padded batch, in that order, with the columns trimmed to the longest of them.

        Loss weights are kept as they are, so the rows' losses stay shares of the original batch's loss.
        """
        if self.packed:
            raise BatchError("rows of a packed batch cannot be selected: pack the share's rows instead")
        index = torch.as_tensor(rows, dtype=torch.int64)
        width = max(int(self.lengths[index].max().item()), 1) if index.numel() else 1
        values = {name: getattr(self, name)[index, :width] for name in _ROW_FIELDS}
        return _from_fields(values, self.lengths[index])

    def rank_micro_batches(self, rank: int, world_size: int, micro_batch_size: int) -> list[PackedBatch]:
        """Rank `rank`'s rows of a padded batch, in micro-batches of at most `micro_batch_size` rows, as
        `micro_batches` cuts a rank's share of it.

        Rows are dealt as `asyncrl_core.shares.deal_rows` deals them (sorted by length, round-robin), so ranks
        get similar token counts and a micro-batch holds rows of similar length (little padding). Every rank
        gets the same number of micro-batches: a rank with fewer rows gets empty ones, made of one
        zero-weight row, so the ranks' collectives still match.
        """
        mine = deal_rows(self.lengths.tolist(), world_size)[rank]
        count = num_micro_batches(self.num_rows, world_size, micro_batch_size)
        parts = [mine[index * micro_batch_size : (index + 1) * micro_batch_size] for index in range(count)]
        return [
            _widened(self.select(rows))
            if rows
            else _zero_weight(_widened(self.select([mine[0] if mine else 0])))
            for rows in parts
        ]

    def to(self, device: torch.device | str) -> PackedBatch:
        """The same batch on `device` (the tensors are copied without blocking where possible)."""
        moved = {
            spec.name: value.to(device, non_blocking=True)
            for spec in fields(self)
            if isinstance(value := getattr(self, spec.name), torch.Tensor)
        }
        return replace(self, **moved)


def loss_weights(loss_mask: torch.Tensor, aggregation: LossAggregation) -> torch.Tensor:
    """Per-token shares of the batch loss for a `[N, T]` mask of one trajectory per row (see the module
    docstring); float32."""
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
    """Pack every trajectory of `groups` into one padded `PackedBatch`, with group-relative advantages.

    Rows follow the groups' order, then the trajectories' order. Raises `BatchError`, naming the group and
    trajectory, for a trajectory whose per-token lists do not match its response length, an empty prompt,
    or a group without trajectories; nothing is changed in that case.
    """
    return pack_rows(whole_batch(groups, normalize_std=normalize_std), pad_id, aggregation)


def pack_rows(rows: MiniBatchShare, pad_id: int, aggregation: LossAggregation) -> PackedBatch:
    """The rows of a share as a padded `PackedBatch` as wide as its longest row, in the share's order; the
    loss weights are shares of the whole mini-batch's loss (from the share's mini-batch totals), so the
    ranks' losses add up to it."""
    if rows.num_share_rows == 0:
        raise BatchError("cannot pack a share without rows")
    flat = _TokenRows.of(rows, pad_id, aggregation)
    return flat.padded(list(range(rows.num_share_rows)), max(flat.longest, 1))


@dataclass(frozen=True, slots=True)
class _TokenRows:
    """A share's rows as flat, logits-aligned per-token tensors (`[L]`, the rows one after the other): the
    one place where targets are shifted and loss weights fixed; both layouts are cut from it."""

    values: dict[str, torch.Tensor]
    """The `_ROW_FIELDS` as `[L]` tensors."""
    offsets: list[int]
    """`[R + 1]`: where each row starts, then `L`."""
    pad_id: int

    @property
    def longest(self) -> int:
        return max(end - start for start, end in zip(self.offsets, self.offsets[1:], strict=False))

    def length(self, row: int) -> int:
        return self.offsets[row + 1] - self.offsets[row]

    @classmethod
    def of(cls, rows: MiniBatchShare, pad_id: int, aggregation: LossAggregation) -> _TokenRows:
        offsets = rows.row_offsets.astype(np.int64)
        lengths = np.diff(offsets)
        total = int(offsets[-1])
        last = offsets[1:] - 1  # each row's last token: it predicts nothing

        def shifted(values: np.ndarray, dtype: type[np.generic], fill: float) -> torch.Tensor:
            # Token-aligned to logits-aligned: position `t` describes the target at `t + 1` of its row.
            # `astype` copies the (read-only, shared) array the object store handed over.
            source = values.astype(dtype)
            out = np.empty_like(source)
            out[:-1] = source[1:]
            out[last] = fill
            return torch.from_numpy(out)

        row_of_token = torch.from_numpy(np.repeat(np.arange(len(lengths)), lengths))
        starts = torch.from_numpy(np.repeat(offsets[:-1], lengths))
        loss_mask = shifted(rows.loss_mask, np.float32, 0)
        advantages = torch.from_numpy(rows.advantages.astype(np.float32))[row_of_token] * loss_mask
        values = {
            "input_ids": torch.from_numpy(rows.token_ids.astype(np.int64)),
            "attention_mask": torch.ones(total, dtype=torch.int64),
            "position_ids": torch.arange(total, dtype=torch.int64) - starts,
            "target_ids": shifted(rows.token_ids, np.int64, pad_id),
            "loss_mask": loss_mask,
            "loss_weights": _share_weights(loss_mask, row_of_token, len(lengths), rows, aggregation),
            "rollout_logprobs": shifted(rows.rollout_logprobs, np.float32, 0.0),
            "advantages": advantages,
            "versions": shifted(rows.versions, np.int64, NO_VERSION),
        }
        return cls(values, offsets.tolist(), pad_id)

    def padded(self, rows: Sequence[int], width: int) -> PackedBatch:
        """`rows`, one per row of `[len(rows), width]` tensors, right-padded."""
        out = {name: _filled((len(rows), width), name, self.pad_id) for name in _ROW_FIELDS}
        out["position_ids"] = torch.arange(width, dtype=torch.int64).expand(len(rows), width).contiguous()
        for index, row in enumerate(rows):
            start, end = self.offsets[row], self.offsets[row + 1]
            for name in _ROW_FIELDS:
                out[name][index, : end - start] = self.values[name][start:end]
        lengths = torch.tensor([self.length(row) for row in rows], dtype=torch.int64)
        return _from_fields(out, lengths)

    def packed(self, rows: Sequence[int], multiple: int) -> PackedBatch:
        """`rows` one after the other in one row, padded to a multiple of `multiple` tokens."""
        index = torch.cat([torch.arange(self.offsets[row], self.offsets[row + 1]) for row in rows])
        real = int(index.numel())
        width = bucket_length(real, multiple)
        out = {name: _filled((1, width), name, self.pad_id) for name in _ROW_FIELDS}
        out["position_ids"][0, real:] = torch.arange(width - real)
        for name in _ROW_FIELDS:
            out[name][0, :real] = self.values[name][index]
        sizes = [self.length(row) for row in rows] + ([width - real] if width > real else [])
        offsets = torch.zeros(len(sizes) + 1, dtype=torch.int32)
        offsets[1:] = torch.tensor(sizes, dtype=torch.int32).cumsum(0)
        return _from_fields(out, torch.tensor([real], dtype=torch.int64), offsets, max(sizes))


_FILL: dict[str, tuple[float, torch.dtype]] = {
    "input_ids": (0, torch.int64),  # the pad id, set by `_filled`
    "attention_mask": (0, torch.int64),
    "position_ids": (0, torch.int64),
    "target_ids": (0, torch.int64),  # the pad id
    "loss_mask": (0.0, torch.float32),
    "loss_weights": (0.0, torch.float32),
    "rollout_logprobs": (0.0, torch.float32),
    "advantages": (0.0, torch.float32),
    "versions": (NO_VERSION, torch.int64),
}
"""What padding holds in each `[N, T]` field, and the field's dtype."""


def _from_fields(
    values: dict[str, torch.Tensor],
    lengths: torch.Tensor,
    sequence_offsets: torch.Tensor | None = None,
    max_sequence_len: int = 0,
) -> PackedBatch:
    return PackedBatch(
        input_ids=values["input_ids"],
        attention_mask=values["attention_mask"],
        position_ids=values["position_ids"],
        target_ids=values["target_ids"],
        loss_mask=values["loss_mask"],
        loss_weights=values["loss_weights"],
        rollout_logprobs=values["rollout_logprobs"],
        advantages=values["advantages"],
        versions=values["versions"],
        lengths=lengths,
        sequence_offsets=sequence_offsets,
        max_sequence_len=max_sequence_len,
    )


def _filled(shape: tuple[int, int], name: str, pad_id: int) -> torch.Tensor:
    fill, dtype = _FILL[name]
    return torch.full(shape, pad_id if name in ("input_ids", "target_ids") else fill, dtype=dtype)


def _share_weights(
    loss_mask: torch.Tensor,
    row_of_token: torch.Tensor,
    num_rows: int,
    rows: MiniBatchShare,
    aggregation: LossAggregation,
) -> torch.Tensor:
    """`loss_weights` of a share's flat tokens (`[L]`), normalised by the whole mini-batch's counts (0-dim
    float32 tensors, as `loss_weights` divides by, so both give the same float32 values)."""
    if aggregation == "token_mean":
        return loss_mask / torch.tensor(float(max(rows.num_loss_tokens, 1)), dtype=torch.float32)
    if aggregation == "sequence_mean":
        per_row = torch.zeros(num_rows, dtype=torch.float32).index_add_(0, row_of_token, loss_mask)
        trained_rows = torch.tensor(float(max(rows.num_trained_rows, 1)), dtype=torch.float32)
        return loss_mask / per_row[row_of_token].clamp(min=1.0) / trained_rows
    raise ValueError(f"loss_aggregation must be `token_mean` or `sequence_mean`, got {aggregation!r}")


def micro_batches(
    rows: MiniBatchShare,
    num_ranks: int,
    pad_id: int,
    aggregation: LossAggregation,
    micro_batch_size: int,
    *,
    max_tokens: int | None = None,
    packed: bool = False,
    length_multiple: int = LENGTH_MULTIPLE,
) -> list[PackedBatch]:
    """A rank's share of one mini-batch in micro-batches, in the share's order (longest rows first).

    Without `max_tokens`: padded micro-batches of at most `micro_batch_size` rows, as many as every rank
    runs (`num_micro_batches`), the missing ones made of one zero-weight row. With `max_tokens`: micro-batches
    of at most that many tokens (`asyncrl_core.shares.cut_by_tokens`; a longer row alone), each packed
    into one row when `packed`, else padded (the padded width times the rows within the budget); a rank
    without rows runs one zero-weight micro-batch. Padded widths and packed lengths are rounded up to a
    multiple of `length_multiple` tokens.
    """
    if rows.num_share_rows == 0:
        count = 1 if max_tokens is not None else num_micro_batches(rows.num_rows, num_ranks, micro_batch_size)
        return [_padding_row(pad_id, packed=packed and max_tokens is not None)] * count
    flat = _TokenRows.of(rows, pad_id, aggregation)
    lengths = [flat.length(row) for row in range(rows.num_share_rows)]
    if max_tokens is None:
        count = num_micro_batches(rows.num_rows, num_ranks, micro_batch_size)
        cuts = [list(range(rows.num_share_rows))[i * micro_batch_size : (i + 1) * micro_batch_size]
                for i in range(count)]  # fmt: skip
        return [
            flat.padded(cut, bucket_length(max(lengths[row] for row in cut), length_multiple))
            if cut
            else _zero_weight(flat.padded([0], bucket_length(lengths[0], length_multiple)))
            for cut in cuts
        ]
    cuts = cut_by_tokens(lengths, max_tokens, padded=not packed, length_multiple=length_multiple)
    if packed:
        return [flat.packed(cut, length_multiple) for cut in cuts]
    return [
        flat.padded(cut, bucket_length(max(lengths[row] for row in cut), length_multiple)) for cut in cuts
    ]


def _widened(batch: PackedBatch) -> PackedBatch:
    """A padded batch right-padded to `bucket_length` of its width."""
    width = int(batch.input_ids.shape[1])
    wide = bucket_length(width)
    if wide == width:
        return batch
    # A trajectory's last target is the pad id (it predicts nothing).
    pad_id = int(batch.target_ids[0, int(batch.lengths[0]) - 1].item())
    values: dict[str, torch.Tensor] = {}
    for name in _ROW_FIELDS:
        old = getattr(batch, name)
        new = _filled((old.shape[0], wide), name, pad_id)
        new[:, :width] = old
        values[name] = new
    values["position_ids"] = torch.arange(wide, dtype=torch.int64).expand(batch.num_rows, wide).contiguous()
    return _from_fields(values, batch.lengths)


def _zero_weight(batch: PackedBatch) -> PackedBatch:
    return replace(batch, loss_weights=torch.zeros_like(batch.loss_weights))


def _padding_row(pad_id: int, *, packed: bool) -> PackedBatch:
    """One row of one padding token that carries no loss (a rank without rows in a mini-batch still runs
    a micro-batch, so the ranks' collectives match)."""
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
        versions=torch.full((1, 1), NO_VERSION, dtype=torch.int64),
        lengths=torch.ones(1, dtype=torch.int64),
        sequence_offsets=torch.tensor([0, 1], dtype=torch.int32) if packed else None,
        max_sequence_len=1 if packed else 0,
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
    max_tokens: int | None = None,
    packed: bool = False,
    length_multiple: int = LENGTH_MULTIPLE,
) -> RankPlan:
    """Data-parallel rank `rank`'s part of a step: from its `BatchShare` (what the runner hands each rank),
    or from the step's groups, which every rank is then given and cuts the same way
    (`asyncrl_core.shares.split_batch`). Each mini-batch is cut by `micro_batches` (`micro_batch_size`
    rows, or `max_tokens` tokens, packed or not, lengths rounded up to `length_multiple`). A share cut
    for another rank, or for another number of ranks, raises `BatchError`: a rank never trains on rows
    that are not its own."""
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
            micro_batches(
                rows,
                num_ranks,
                pad_id,
                aggregation,
                micro_batch_size,
                max_tokens=max_tokens,
                packed=packed,
                length_multiple=length_multiple,
            )
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
