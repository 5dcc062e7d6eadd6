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

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Literal

import torch

from asyncrl_core.algorithms.advantages import groups_advantages
from asyncrl_core.errors import AsyncRLError
from asyncrl_core.types import Group, Trajectory

LossAggregation = Literal["token_mean", "sequence_mean"]


class BatchError(AsyncRLError, ValueError):
    """A group or trajectory cannot be trained on: inconsistent lengths, an empty prompt, no trajectories."""


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

        Rows are sorted by length (longest first) and dealt round-robin, so ranks get similar token counts
        and a micro-batch holds rows of similar length (little padding). Every rank gets the same number of
        micro-batches: a rank with fewer rows gets empty ones, made of one zero-weight row, so the ranks'
        collectives still match.
        """
        lengths: list[int] = self.lengths.tolist()
        order = sorted(range(self.num_rows), key=lambda row: -lengths[row])
        mine = order[rank::world_size]
        num_micro_batches = math.ceil(math.ceil(self.num_rows / world_size) / micro_batch_size)
        parts: list[PackedBatch] = []
        for index in range(num_micro_batches):
            rows = mine[index * micro_batch_size : (index + 1) * micro_batch_size]
            if rows:
                parts.append(self.select(rows))
            else:
                empty = self.select([0])
                parts.append(replace(empty, loss_weights=torch.zeros_like(empty.loss_weights)))
        return parts

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


def _check_trajectory(group: Group, index: int, trajectory: Trajectory) -> None:
    where = f"group {group.group_id} (prompt {group.prompt_index}), trajectory {index}"
    response_len = trajectory.response_len
    if trajectory.prompt_len < 1:
        raise BatchError(f"{where}: prompt_len must be at least 1 to predict the first response token")
    if response_len < 0:
        raise BatchError(
            f"{where}: prompt_len {trajectory.prompt_len} exceeds the {len(trajectory.token_ids)} token ids"
        )
    for name in ("loss_mask", "rollout_logprobs", "versions"):
        length = len(getattr(trajectory, name))
        if length != response_len:
            raise BatchError(f"{where}: {name} has {length} entries for {response_len} response tokens")
    if any(value not in (0, 1) for value in trajectory.loss_mask):
        raise BatchError(f"{where}: loss_mask entries must be 0 or 1")


def pack_groups(
    groups: Sequence[Group], pad_id: int, *, normalize_std: bool, aggregation: LossAggregation
) -> PackedBatch:
    """Pack every trajectory of `groups` into one `PackedBatch`, with group-relative advantages.

    Rows follow the groups' order, then the trajectories' order. Raises `BatchError`, naming the group and
    trajectory, for a trajectory whose per-token lists do not match its response length, an empty prompt,
    or a group without trajectories; nothing is changed in that case.
    """
    if not groups:
        raise BatchError("cannot pack an empty list of groups")
    for group in groups:
        if not group.trajectories:
            raise BatchError(f"group {group.group_id} (prompt {group.prompt_index}) has no trajectories")
        for index, trajectory in enumerate(group.trajectories):
            _check_trajectory(group, index, trajectory)

    advantages_per_group = groups_advantages(groups, normalize_std)
    trajectories = [trajectory for group in groups for trajectory in group.trajectories]
    row_advantages = torch.cat(advantages_per_group)
    num_rows = len(trajectories)
    width = max(len(trajectory.token_ids) for trajectory in trajectories)

    input_ids = torch.full((num_rows, width), pad_id, dtype=torch.int64)
    attention_mask = torch.zeros((num_rows, width), dtype=torch.int64)
    loss_mask = torch.zeros((num_rows, width), dtype=torch.float32)
    rollout_logprobs = torch.zeros((num_rows, width), dtype=torch.float32)
    versions = torch.full((num_rows, width), -1, dtype=torch.int64)
    lengths = torch.zeros(num_rows, dtype=torch.int64)
    for row, trajectory in enumerate(trajectories):
        length = len(trajectory.token_ids)
        start = trajectory.prompt_len - 1  # logits position predicting the first response token
        end = start + trajectory.response_len
        input_ids[row, :length] = torch.tensor(trajectory.token_ids, dtype=torch.int64)
        attention_mask[row, :length] = 1
        lengths[row] = length
        if trajectory.response_len:
            mask = torch.tensor(trajectory.loss_mask, dtype=torch.float32)
            loss_mask[row, start:end] = mask
            # Logprobs and versions of tool tokens are meaningless whatever the producer wrote there.
            rollout_logprobs[row, start:end] = torch.where(
                mask > 0, torch.tensor(trajectory.rollout_logprobs, dtype=torch.float32), 0.0
            )
            versions[row, start:end] = torch.where(
                mask > 0, torch.tensor(trajectory.versions, dtype=torch.int64), -1
            )

    target_ids = torch.full_like(input_ids, pad_id)
    target_ids[:, :-1] = input_ids[:, 1:]
    position_ids = torch.arange(width, dtype=torch.int64).expand(num_rows, width).contiguous()
    if not bool(torch.isfinite(rollout_logprobs).all()):
        raise BatchError("rollout_logprobs of trained tokens must be finite")
    return PackedBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        target_ids=target_ids,
        loss_mask=loss_mask,
        loss_weights=loss_weights(loss_mask, aggregation),
        rollout_logprobs=rollout_logprobs,
        advantages=row_advantages[:, None] * loss_mask,
        versions=versions,
        lengths=lengths,
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
