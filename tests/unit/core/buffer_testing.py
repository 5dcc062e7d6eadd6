"""Groups for the buffer's tests."""

from __future__ import annotations

from asyncrl_core.types import NO_VERSION, Group, Trajectory


def make_group(
    group_id: int, prompt_index: int, versions: list[int], finish_version: int = NO_VERSION
) -> Group:
    """A group of one trajectory whose model tokens were sampled at `versions` (plus one tool token)."""
    trajectory = Trajectory(
        token_ids=[1, 2, *range(10, 10 + len(versions)), 99],
        prompt_len=2,
        loss_mask=[1] * len(versions) + [0],
        rollout_logprobs=[-0.5] * len(versions) + [0.0],
        versions=[*versions, NO_VERSION],
    )
    return Group(group_id, prompt_index, [trajectory], finish_version=finish_version)
