"""The training objective, shared by every actor backend: group-relative advantages, batch packing, and the
clipped PPO loss with optional KL, entropy and decoupled off-policy correction.

Importing this package imports torch; only actor workers do. The API, in the order a backend uses it:

    settings = LossSettings.from_config(config.algorithm)
    batch = pack_groups(groups, pad_id, normalize_std=settings.normalize_advantage_std,
                        aggregation=settings.loss_aggregation)   # or pack_mini_batches: one per update
    for rows in micro_batches:                      # any split of the rows
        part = batch.select(rows)
        logits = model(part.input_ids, ...)         # [n, t, V]
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
    loss_weights,
    pack_groups,
    pack_mini_batches,
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
    "group_advantages",
    "groups_advantages",
    "kl_penalty",
    "loss_weights",
    "pack_groups",
    "pack_mini_batches",
    "policy_loss",
    "token_entropy",
    "token_logprobs",
    "token_logprobs_and_entropy",
]
