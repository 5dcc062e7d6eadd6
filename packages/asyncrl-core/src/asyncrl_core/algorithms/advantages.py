"""Group-relative advantages (GRPO): a trajectory is scored against the other trajectories of its prompt.

The rule itself is `asyncrl_core.shares.group_advantages` (NumPy: the buffer worker computes advantages when
it cuts a batch for the ranks); these are its torch forms.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncrl_core import shares
from asyncrl_core.shares import ADVANTAGE_EPS
from asyncrl_core.types import Group

__all__ = ["ADVANTAGE_EPS", "group_advantages", "groups_advantages"]


def group_advantages(rewards: torch.Tensor, normalize_std: bool) -> torch.Tensor:
    """Advantages of one group: `reward - mean`, divided by `std + 1e-6` when `normalize_std`.

    `rewards` is `[G]` (any float dtype); the result is `[G]` float32. The standard deviation is the sample
    (Bessel-corrected) one, as GRPO uses. A group whose rewards are all equal, a single trajectory included,
    carries no learning signal: its advantages are exactly zero (never NaN, never a rounding residue
    amplified by the division).
    """
    if rewards.dim() != 1 or rewards.numel() == 0:
        raise ValueError(f"rewards must be a non-empty 1-d tensor, got shape {tuple(rewards.shape)}")
    values = rewards.detach().to(device="cpu", dtype=torch.float64).numpy()
    return torch.from_numpy(shares.group_advantages(values, normalize_std))


def groups_advantages(groups: Sequence[Group], normalize_std: bool) -> list[torch.Tensor]:
    """`group_advantages` of every group: one `[len(group.trajectories)]` float32 tensor per group."""
    return [
        torch.from_numpy(
            shares.group_advantages([trajectory.reward for trajectory in group.trajectories], normalize_std)
        )
        for group in groups
    ]
