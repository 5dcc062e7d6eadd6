"""The policy objective: the clipped PPO surrogate over group-relative advantages, an optional KL penalty
against a reference model, an optional entropy bonus, and the decoupled-PPO correction for stale data.

Every function takes plain tensors and a `LossSettings`, so any backend (the torch actor, Megatron) computes
exactly the same objective. Per-token tensors are `[N, T]` and aligned with the logits as
`asyncrl_core.algorithms.batch` describes; `loss_weights` carries both the mask and the batch normalisation,
so a loss over part of the rows is that part's share of the full batch's loss.

The off-policy correction (`off_policy_correction: decoupled`, after Hilton et al., "Batch size-invariance
for policy optimization", as used by AReaL) separates the two jobs of the old logprob. The trust region is
taken around the *proximal* policy (the actor's own logprobs before the update, `pi_prox`), and the gap
between the proximal and the *behaviour* policy that sampled the data (`pi_behav`, the engines' logprobs)
is corrected by a truncated importance weight:

    loss_t = min(exp(log pi_prox - log pi_behav), max_weight)
             * max(-A * r_t, -A * clip(r_t, 1 - eps_low, 1 + eps_high)),   r_t = pi_theta / pi_prox

On fresh data (`pi_prox == pi_behav`) the weight is 1 and the loss is exactly the plain PPO loss, in which
the ratio is taken against the behaviour logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from asyncrl_core.algorithms.batch import LossAggregation
from asyncrl_core.metrics import (
    TRAIN_CLIP_FRAC,
    TRAIN_ENTROPY,
    TRAIN_KL,
    TRAIN_LOSS,
    TRAIN_OFF_POLICY_BEHAVIOUR_KL,
    TRAIN_OFF_POLICY_TRUNCATED_FRAC,
    TRAIN_OFF_POLICY_WEIGHT_MEAN,
    TRAIN_PG_LOSS,
    TRAIN_PPO_RATIO_MEAN,
)

if TYPE_CHECKING:
    from asyncrl_core.config import AlgorithmConfig

KLEstimator = Literal["k1", "k2", "k3"]
OffPolicyCorrection = Literal["none", "decoupled"]

LOGITS_CHUNK_BYTES = 256 * 1024 * 1024
"""Float32 working memory per chunk of positions in `token_logprobs` and `token_entropy`."""

_MAX_LOG_RATIO = 20.0
"""Bound on `log(pi_ref / pi)` inside the k3 estimator, whose `exp` would otherwise overflow."""


@dataclass(frozen=True, slots=True)
class LossSettings:
    """The objective's hyperparameters (the `algorithm` section of the configuration, without pydantic)."""

    clip_eps_low: float = 0.2
    """The ratio is clipped below at `1 - clip_eps_low`."""
    clip_eps_high: float = 0.2
    """The ratio is clipped above at `1 + clip_eps_high`."""
    kl_coef: float = 0.0
    """Weight of the per-token KL penalty against the reference model; 0 needs no reference logprobs."""
    kl_estimator: KLEstimator = "k3"
    """Schulman's estimator of KL(pi || pi_ref) per token: `k1`, `k2` or `k3`."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss)."""
    off_policy_correction: OffPolicyCorrection = "none"
    """`decoupled`: clip against proximal logprobs and weight by the truncated proximal/behaviour ratio."""
    off_policy_max_weight: float = 2.0
    """Upper truncation of the decoupled importance weight."""
    loss_aggregation: LossAggregation = "token_mean"
    """How per-token losses are averaged; used when packing a batch (`loss_weights`)."""
    normalize_advantage_std: bool = True
    """Divide group-relative advantages by the group's reward standard deviation; used when packing."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.clip_eps_low < 1.0:
            raise ValueError(f"clip_eps_low must be in [0, 1), got {self.clip_eps_low}")
        if self.clip_eps_high < 0.0:
            raise ValueError(f"clip_eps_high must be >= 0, got {self.clip_eps_high}")
        if self.kl_coef < 0.0 or self.entropy_coef < 0.0:
            raise ValueError(f"kl_coef and entropy_coef must be >= 0: {self.kl_coef}, {self.entropy_coef}")
        if self.kl_estimator not in ("k1", "k2", "k3"):
            raise ValueError(f"kl_estimator must be k1, k2 or k3, got {self.kl_estimator!r}")
        if self.off_policy_correction not in ("none", "decoupled"):
            raise ValueError(
                f"off_policy_correction must be `none` or `decoupled`, got {self.off_policy_correction!r}"
            )
        if self.off_policy_max_weight < 1.0:
            raise ValueError(f"off_policy_max_weight must be >= 1, got {self.off_policy_max_weight}")
        if self.loss_aggregation not in ("token_mean", "sequence_mean"):
            raise ValueError(
                f"loss_aggregation must be token_mean or sequence_mean, got {self.loss_aggregation!r}"
            )

    @classmethod
    def from_config(cls, algorithm: AlgorithmConfig) -> LossSettings:
        """The settings of the configuration's `algorithm` section."""
        return cls(
            clip_eps_low=algorithm.clip_eps_low,
            clip_eps_high=algorithm.clip_eps_high,
            kl_coef=algorithm.kl_coef,
            kl_estimator=algorithm.kl_estimator,
            entropy_coef=algorithm.entropy_coef,
            off_policy_correction=algorithm.off_policy_correction,
            off_policy_max_weight=algorithm.off_policy_max_weight,
            loss_aggregation=algorithm.loss_aggregation,
            normalize_advantage_std=algorithm.normalize_advantage_std,
        )

    @property
    def needs_reference(self) -> bool:
        """Whether `policy_loss` needs reference-model logprobs."""
        return self.kl_coef > 0.0

    @property
    def needs_proximal(self) -> bool:
        """Whether `policy_loss` needs proximal logprobs."""
        return self.off_policy_correction == "decoupled"


def _chunk_rows(vocab_size: int) -> int:
    return max(1, LOGITS_CHUNK_BYTES // (4 * max(vocab_size, 1)))


def _scaled_float(chunk: torch.Tensor, temperature: float) -> torch.Tensor | None:
    """`chunk / temperature` in a new float32 tensor, or None when the softmax kernels can read `chunk`
    directly (no temperature and no cast beyond the one they do on the fly).

    The copy is explicit: `.float()` of a float32 tensor is the tensor itself, and dividing it in place
    would change the caller's logits (and, in the backward pass, the saved ones a second time).
    """
    if temperature == 1.0:
        return None
    return chunk.to(torch.float32, copy=True).div_(temperature)


class _TokenLogprobs(torch.autograd.Function):
    """`log_softmax(logits / T)[target]` in float32, chunk by chunk, without keeping a float32 copy of the
    logits or their softmax for the backward pass: the gradient is recomputed from the saved logits as
    `(onehot(target) - softmax) / T`.

    With `with_entropy`, the same log-softmax of each chunk also gives the entropy of every position, a
    second output that carries no gradient (the logged entropy costs no second pass over the logits).
    Without it the second output is an empty tensor.
    """

    @staticmethod
    def forward(  # pyright: ignore[reportIncompatibleMethodOverride]
        ctx: FunctionCtx, logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        vocab_size = logits.shape[-1]
        flat_logits = logits.reshape(-1, vocab_size)
        flat_targets = targets.reshape(-1, 1)
        num_positions = flat_logits.shape[0]
        logprobs = torch.empty(num_positions, dtype=torch.float32, device=logits.device)
        entropy = torch.empty(num_positions if with_entropy else 0, dtype=torch.float32, device=logits.device)
        step = _chunk_rows(vocab_size)
        for start in range(0, num_positions, step):
            end = start + step
            chunk = flat_logits[start:end]
            scaled = _scaled_float(chunk, temperature)
            # One kernel reads the (bfloat16) logits and writes float32 log-probabilities.
            log_probs = torch.log_softmax(chunk if scaled is None else scaled, dim=-1, dtype=torch.float32)
            logprobs[start:end] = log_probs.gather(1, flat_targets[start:end]).squeeze(1)
            if with_entropy:
                entropy[start:end] = torch.linalg.vecdot(log_probs.exp(), log_probs).neg_()
        ctx.save_for_backward(logits, targets)
        ctx.temperature = temperature  # pyright: ignore[reportAttributeAccessIssue]
        if with_entropy:
            entropy = entropy.view(targets.shape)
        ctx.mark_non_differentiable(entropy)
        return logprobs.view(targets.shape), entropy

    @staticmethod
    @once_differentiable
    def backward(  # pyright: ignore[reportIncompatibleMethodOverride]
        ctx: FunctionCtx, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor, None, None, None]:
        del grad_entropy  # the entropy output is non-differentiable
        logits, targets = ctx.saved_tensors  # pyright: ignore[reportAttributeAccessIssue]
        temperature: float = ctx.temperature  # pyright: ignore[reportAttributeAccessIssue]
        vocab_size = logits.shape[-1]
        flat_logits = logits.reshape(-1, vocab_size)
        flat_targets = targets.reshape(-1, 1)
        flat_grad = grad_logprobs.reshape(-1, 1).float()
        if temperature != 1.0:
            flat_grad = flat_grad / temperature
        grad_logits = torch.empty_like(flat_logits)
        step = _chunk_rows(vocab_size)
        for start in range(0, flat_logits.shape[0], step):
            end = start + step
            chunk = flat_logits[start:end]
            scaled = _scaled_float(chunk, temperature)
            grad = torch.softmax(chunk if scaled is None else scaled, dim=-1, dtype=torch.float32)
            grad.mul_(-flat_grad[start:end]).scatter_add_(1, flat_targets[start:end], flat_grad[start:end])
            grad_logits[start:end] = grad
        return grad_logits.view(logits.shape), None, None, None


def _check_logprob_arguments(logits: torch.Tensor, target_ids: torch.Tensor, temperature: float) -> None:
    if logits.shape[:-1] != target_ids.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match targets {tuple(target_ids.shape)}")
    if temperature <= 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def token_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of each target under `softmax(logits / temperature)`, in float32.

    `logits` is `[..., V]` in any float dtype, `target_ids` is `[...]` int64; the result has the shape of
    `target_ids`. Memory beyond the logits and their gradient: one float32 chunk of `LOGITS_CHUNK_BYTES`
    at a time, in the forward and in the backward pass. Use the temperature the engines sampled with, so
    these logprobs and the rollout logprobs describe the same distribution.
    """
    _check_logprob_arguments(logits, target_ids, temperature)
    result: tuple[torch.Tensor, torch.Tensor] = _TokenLogprobs.apply(logits, target_ids, temperature, False)  # pyright: ignore[reportAssignmentType]
    return result[0]


def token_logprobs_and_entropy(
    logits: torch.Tensor, target_ids: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(token_logprobs(...), token_entropy(...))` from one pass over the logits; the entropy is detached.

    For logging the entropy (`entropy_coef == 0`): each chunk's log-softmax gives both, so the `[..., V]`
    logits are read once in the forward pass instead of twice. Both results are float32 with the shape of
    `target_ids`; only the logprobs carry a gradient. An entropy bonus needs `token_entropy`, which does.
    """
    _check_logprob_arguments(logits, target_ids, temperature)
    result: tuple[torch.Tensor, torch.Tensor] = _TokenLogprobs.apply(logits, target_ids, temperature, True)  # pyright: ignore[reportAssignmentType]
    return result


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of `softmax(logits / temperature)` at each position, `[..., V] -> [...]`, float32.

    Computed chunk by chunk. Under `torch.no_grad()` (entropy logged only) it needs one float32 chunk of
    working memory; with gradients (an entropy bonus) autograd keeps each chunk's softmax.
    """
    vocab_size = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab_size)
    step = _chunk_rows(vocab_size)
    pieces: list[torch.Tensor] = []
    for start in range(0, flat_logits.shape[0], step):
        log_probs = torch.log_softmax(flat_logits[start : start + step].float() / temperature, dim=-1)
        pieces.append(-(log_probs.exp() * log_probs).sum(dim=-1))
    if not pieces:
        return torch.zeros(logits.shape[:-1], dtype=torch.float32, device=logits.device)
    return torch.cat(pieces).view(logits.shape[:-1])


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' logprobs (Schulman's k1, k2, k3).

    With `log_ratio = log pi_ref - log pi`: k1 = `-log_ratio` (unbiased, can be negative), k2 =
    `log_ratio**2 / 2`, k3 = `exp(log_ratio) - 1 - log_ratio` (unbiased, never negative; `log_ratio` is
    bounded to +-20 first so the exponential cannot overflow). Shapes are elementwise.
    """
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        bounded = log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        return torch.expm1(bounded) - bounded
    raise ValueError(f"kl_estimator must be k1, k2 or k3, got {estimator!r}")


def policy_loss(
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_weights: torch.Tensor,
    settings: LossSettings,
    *,
    proximal_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The objective over some rows of a packed batch: `(loss, metrics)`.

    All tensors are `[N, T]`: `logprobs` of the policy being trained (with gradient), the engines'
    `rollout_logprobs` (behaviour policy), per-token `advantages`, and `loss_weights` (the tokens' shares
    of the full batch's loss; 0 on untrained tokens). `proximal_logprobs` (no gradient) is required by the
    decoupled correction, `ref_logprobs` when `kl_coef > 0`, `entropy` when `entropy_coef > 0` (it is
    logged whenever given).

    `loss` is the scalar `sum(loss_weights * per_token_loss)`, with
    `per_token_loss = ppo + kl_coef * kl - entropy_coef * entropy`. Each metric is a detached float32
    scalar weighted the same way, so summing the results of all micro-batches and ranks gives the full
    batch's value: `train/loss`, `train/pg_loss`, `train/clip_frac` (share of tokens whose clipped term is
    the active one), `train/ppo_ratio/mean`, `train/kl` (with `ref_logprobs`), `train/entropy` (with
    `entropy`), and with the decoupled correction `train/off_policy/weight_mean` (importance weight after
    truncation), `train/off_policy/truncated_frac` (share of tokens whose weight was truncated) and
    `train/off_policy/behaviour_kl` (k3 estimate of KL(pi_behav || pi_prox), a measure of staleness).
    """
    shape = logprobs.shape
    for name, tensor in (
        ("rollout_logprobs", rollout_logprobs),
        ("advantages", advantages),
        ("loss_weights", loss_weights),
        ("proximal_logprobs", proximal_logprobs),
        ("ref_logprobs", ref_logprobs),
        ("entropy", entropy),
    ):
        if tensor is not None and tensor.shape != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, logprobs {tuple(shape)}")
    if settings.needs_proximal and proximal_logprobs is None:
        raise ValueError("off_policy_correction `decoupled` needs proximal_logprobs")
    if settings.needs_reference and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs from the reference model")
    if settings.entropy_coef > 0.0 and entropy is None:
        raise ValueError("entropy_coef > 0 needs the entropy of each position")

    weights = loss_weights.float()
    trained = weights != 0
    behaviour = rollout_logprobs.float()
    anchor = behaviour
    if settings.needs_proximal and proximal_logprobs is not None:
        anchor = proximal_logprobs.detach().float()
    # Untrained positions hold arbitrary values; keep them out of exp() so they cannot produce inf * 0.
    log_ratio = torch.where(trained, logprobs.float() - anchor, 0.0)
    ratio = torch.exp(log_ratio)
    advantages = advantages.float()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - settings.clip_eps_low, 1.0 + settings.clip_eps_high)
    per_token = torch.maximum(unclipped, clipped)
    metrics: dict[str, torch.Tensor] = {}

    def weighted(values: torch.Tensor) -> torch.Tensor:
        return (values.detach().float() * weights).sum()

    if settings.needs_proximal:
        behaviour_log_ratio = torch.where(trained, anchor - behaviour, 0.0)
        raw_weight = torch.exp(behaviour_log_ratio)
        importance = raw_weight.clamp(max=settings.off_policy_max_weight)
        per_token = per_token * importance
        metrics[TRAIN_OFF_POLICY_WEIGHT_MEAN] = weighted(importance)
        metrics[TRAIN_OFF_POLICY_TRUNCATED_FRAC] = weighted(
            (raw_weight > settings.off_policy_max_weight).float()
        )
        metrics[TRAIN_OFF_POLICY_BEHAVIOUR_KL] = weighted(kl_penalty(behaviour, anchor, "k3"))
    metrics[TRAIN_PG_LOSS] = weighted(per_token)
    metrics[TRAIN_CLIP_FRAC] = weighted((clipped > unclipped).float())
    metrics[TRAIN_PPO_RATIO_MEAN] = weighted(ratio)

    total = per_token
    if ref_logprobs is not None:
        kl = kl_penalty(logprobs.float(), ref_logprobs.detach().float(), settings.kl_estimator)
        metrics[TRAIN_KL] = weighted(kl)
        if settings.kl_coef > 0.0:
            total = total + settings.kl_coef * kl
    if entropy is not None:
        metrics[TRAIN_ENTROPY] = weighted(entropy)
        if settings.entropy_coef > 0.0:
            total = total - settings.entropy_coef * entropy.float()
    loss = (torch.where(trained, total, 0.0) * weights).sum()
    metrics[TRAIN_LOSS] = loss.detach()
    return loss, metrics
