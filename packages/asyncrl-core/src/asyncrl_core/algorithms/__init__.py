"""The training objective, shared by every actor backend: group-relative advantages, batch packing, and the
clipped PPO loss with optional KL, entropy and decoupled off-policy correction.

Importing this package imports torch; only actor workers do. The API, in the order a backend uses it:

    settings = LossSettings.from_config(config.algorithm)
    plan = rank_plan(share_or_groups, rank, num_ranks, pad_id, mini_batch_size=..., micro_batch_size=...,
                     normalize_std=settings.normalize_advantage_std, aggregation=settings.loss_aggregation,
                     max_tokens=..., packed=...)  # micro-batches by token budget, packed rows or padded
    for parts in plan.micro_batches:                # one optimiser update per mini-batch
      for part in parts:                            # this rank's micro-batches (a `PackedBatch` each)
        logits = model(part.input_ids, ...)         # [n, t, V]; a packed part: attention within
                                                    # the sequences of `part.sequence_offsets`
        logprobs = token_logprobs(logits, part.target_ids, temperature)  # the engines'
        loss, metrics = policy_loss(logprobs, part.rollout_logprobs, part.advantages,
                                    part.loss_weights, settings, proximal_logprobs=..., ref_logprobs=...)
        loss.backward()                             # the parts' losses add up to the batch loss

With data parallelism over `D` ranks that average gradients, multiply each rank's loss by `D`.
"""

from asyncrl_core.algorithms.advantages import group_advantages, groups_advantages
from asyncrl_core.algorithms.batch import (
    BatchError,
    LossAggregation,
    PackedBatch,
    RankPlan,
    loss_weights,
    micro_batches,
    pack_groups,
    pack_mini_batches,
    pack_rows,
    rank_plan,
)
from asyncrl_core.algorithms.losses import (
    KLEstimator,
    LossSettings,
    OffPolicyCorrection,
    kl_penalty,
    policy_loss,
    token_entropy,
    token_logprobs,
    token_logprobs_and_entropy,
)

__all__ = [
    "BatchError",
    "KLEstimator",
    "LossAggregation",
    "LossSettings",
    "OffPolicyCorrection",
    "PackedBatch",
    "RankPlan",
    "group_advantages",
    "groups_advantages",
    "kl_penalty",
    "loss_weights",
    "micro_batches",
    "pack_groups",
    "pack_mini_batches",
    "pack_rows",
    "policy_loss",
    "rank_plan",
    "token_entropy",
    "token_logprobs",
    "token_logprobs_and_entropy",
]
