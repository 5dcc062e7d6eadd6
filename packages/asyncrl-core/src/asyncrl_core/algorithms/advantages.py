"""Group-relative advantages (GRPO): a trajectory is scored against the other trajectories of its prompt."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncrl_core.types import Group

ADVANTAGE_EPS = 1e-6
"""Added to the group's reward standard deviation before dividing, as GRPO implementations do."""


def group_advantages(rewards: torch.Tensor, normalize_std: bool) -> torch.Tensor:
    """Advantages of one group: `reward - mean`, divided by `std + 1e-6` when `normalize_std`.

    `rewards` is `[G]` (any float dtype); the result is `[G]` float32. The standard deviation is the sample
    (Bessel-corrected) one, as GRPO uses. A group whose rewards are all equal, a single trajectory included,
    carries no learning signal: its advantages are exactly zero (never NaN, never a rounding residue
    amplified by the division).
    """
    if rewards.dim() != 1 or rewards.numel() == 0:
        raise ValueError(f"rewards must be a non-empty 1-d tensor, got shape {tuple(rewards.shape)}")
    values = rewards.detach().to(torch.float64)
    if not bool(torch.isfinite(values).all()):
        raise ValueError(f"rewards must be finite, got {values.tolist()}")
    if values.numel() == 1 or bool((values == values[0]).all()):
        return torch.zeros(values.shape, dtype=torch.float32)
    centred = values - values.mean()
    if normalize_std:
        centred = centred / (values.std(unbiased=True) + ADVANTAGE_EPS)
    return centred.to(torch.float32)


def groups_advantages(groups: Sequence[Group], normalize_std: bool) -> list[torch.Tensor]:
    """`group_advantages` of every group: one `[len(group.trajectories)]` float32 tensor per group."""
    return [
        group_advantages(
            torch.tensor([trajectory.reward for trajectory in group.trajectories], dtype=torch.float64),
            normalize_std,
        )
        for group in groups
    ]
