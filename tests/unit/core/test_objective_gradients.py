"""Gradients of every objective function against an independent float64 reference, at the temperatures and
logit dtypes the actors use, composed from the logits as the actors compose them; and no function of the
objective changes its inputs.

The reference is written from the formulas, not from `asyncrl_core.algorithms`: logprobs as `z / T` minus a
max-shifted log-sum-exp, the entropy as `-sum(p log p)`, the PPO-clip surrogate, Schulman's KL estimators and
the truncated decoupled weight, all in float64 from the same (rounded) logits.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from asyncrl_core.algorithms import (
    KLEstimator,
    LossSettings,
    group_advantages,
    kl_penalty,
    loss_weights,
    policy_loss,
    token_entropy,
    token_logprobs,
    token_logprobs_and_entropy,
)

TEMPERATURES = [0.7, 1.0, 1.3]
DTYPES = [torch.float32, torch.bfloat16]
ROWS, COLUMNS, VOCAB = 3, 5, 17


def reference_log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    scaled = logits.double() / temperature
    shift = scaled.max(dim=-1, keepdim=True).values.detach()
    return scaled - (shift + torch.log(torch.exp(scaled - shift).sum(dim=-1, keepdim=True)))


def reference_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    return reference_log_softmax(logits, temperature).gather(-1, targets[..., None]).squeeze(-1)


def reference_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    log_p = reference_log_softmax(logits, temperature)
    return -(torch.exp(log_p) * log_p).sum(dim=-1)


def reference_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    x = ref_logprobs - logprobs  # log(pi_ref / pi)
    if estimator == "k1":
        return -x
    if estimator == "k2":
        return x * x / 2
    return torch.exp(x) - 1 - x


def reference_loss(
    logits: torch.Tensor, inputs: dict[str, torch.Tensor], settings: LossSettings, temperature: float
) -> torch.Tensor:
    """`sum(w * (iw * max(-A r, -A clip(r)) + kl_coef * kl - entropy_coef * H))`, in float64."""
    logprobs = reference_logprobs(logits, inputs["targets"], temperature)
    behaviour = inputs["rollout"].double()
    anchor = behaviour
    importance = torch.ones_like(behaviour)
    if settings.off_policy_correction == "decoupled":
        anchor = inputs["proximal"].double()
        importance = torch.minimum(
            torch.exp(anchor - behaviour), torch.tensor(settings.off_policy_max_weight)
        )
    ratio = torch.exp(logprobs - anchor)
    advantages = inputs["advantages"].double()
    bounded = torch.minimum(
        torch.maximum(ratio, torch.tensor(1 - settings.clip_eps_low)),
        torch.tensor(1 + settings.clip_eps_high),
    )
    per_token = importance * torch.maximum(-advantages * ratio, -advantages * bounded)
    if settings.kl_coef > 0:
        per_token = per_token + settings.kl_coef * reference_kl(
            logprobs, inputs["ref"].double(), settings.kl_estimator
        )
    if settings.entropy_coef > 0:
        per_token = per_token - settings.entropy_coef * reference_entropy(logits, temperature)
    return (inputs["weights"].double() * per_token).sum()


def our_loss(
    logits: torch.Tensor, inputs: dict[str, torch.Tensor], settings: LossSettings, temperature: float
) -> torch.Tensor:
    """The objective as the actors compose it: logprobs, then the entropy, from the same logits."""
    targets = inputs["targets"]
    logprobs = token_logprobs(logits, targets, temperature)
    entropy = token_entropy(logits, temperature) if settings.entropy_coef > 0 else None
    loss, _ = policy_loss(
        logprobs,
        inputs["rollout"],
        inputs["advantages"],
        inputs["weights"],
        settings,
        proximal_logprobs=inputs["proximal"] if settings.needs_proximal else None,
        ref_logprobs=inputs["ref"] if settings.needs_reference else None,
        entropy=entropy,
    )
    return loss


def make_inputs(logits: torch.Tensor, temperature: float, seed: int) -> dict[str, torch.Tensor]:
    """Targets, and behaviour/proximal/reference logprobs near the policy's own, so that some ratios fall
    inside the clip range and some outside, and some decoupled weights are truncated."""
    generator = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, VOCAB, (ROWS, COLUMNS), generator=generator)
    own = reference_logprobs(logits.detach(), targets, temperature).float()

    def near(scale: float) -> torch.Tensor:
        return own + scale * torch.randn(ROWS, COLUMNS, generator=generator)

    mask = (torch.rand(ROWS, COLUMNS, generator=generator) > 0.2).float()
    mask[:, 0] = 1.0
    return {
        "targets": targets,
        "rollout": near(0.4) * mask,
        "proximal": near(0.4),
        "ref": near(0.5),
        "advantages": torch.randn(ROWS, 1, generator=generator) * mask,
        "weights": loss_weights(mask, "token_mean"),
    }


def make_logits(dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (3.0 * torch.randn(ROWS, COLUMNS, VOCAB, generator=generator)).to(dtype)


def tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """`(rtol, atol)` of a gradient: bfloat16 ones are rounded to 8 significant bits, float32 ones are exact
    to its precision."""
    return (1e-2, 1e-4) if dtype == torch.bfloat16 else (1e-5, 1e-7)


def check_gradient(
    ours: Callable[[torch.Tensor], torch.Tensor],
    reference: Callable[[torch.Tensor], torch.Tensor],
    logits: torch.Tensor,
) -> None:
    """Value and gradient of `ours(logits)` against `reference` (float64); the logits stay as they were."""
    original = logits.clone()
    leaf = logits.clone().requires_grad_(True)
    value = ours(leaf)
    (grad,) = torch.autograd.grad(value, leaf)

    reference_leaf = original.double().requires_grad_(True)
    expected = reference(reference_leaf)
    (expected_grad,) = torch.autograd.grad(expected, reference_leaf)

    assert grad.dtype == logits.dtype
    # The value is float32 computed from the same (rounded) logits.
    torch.testing.assert_close(value.double(), expected.detach(), rtol=1e-5, atol=1e-6)
    rtol, atol = tolerances(logits.dtype)
    torch.testing.assert_close(grad.double(), expected_grad, rtol=rtol, atol=atol)
    assert torch.equal(leaf.detach(), original), "the logits were changed"


SETTINGS = {
    "ppo": LossSettings(clip_eps_low=0.2, clip_eps_high=0.28),
    "ppo_sequence": LossSettings(loss_aggregation="sequence_mean"),
    "entropy": LossSettings(entropy_coef=0.05),
    "kl_k1": LossSettings(kl_coef=0.3, kl_estimator="k1"),
    "kl_k2": LossSettings(kl_coef=0.3, kl_estimator="k2"),
    "kl_k3": LossSettings(kl_coef=0.3, kl_estimator="k3"),
    "decoupled": LossSettings(off_policy_correction="decoupled", off_policy_max_weight=1.2),
    "everything": LossSettings(
        kl_coef=0.1, entropy_coef=0.02, off_policy_correction="decoupled", off_policy_max_weight=1.5
    ),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_logprobs_gradient(temperature: float, dtype: torch.dtype) -> None:
    logits = make_logits(dtype, seed=0)
    targets = make_inputs(logits.float(), temperature, seed=1)["targets"]
    upstream = torch.randn(ROWS, COLUMNS, generator=torch.Generator().manual_seed(2))
    check_gradient(
        lambda z: (token_logprobs(z, targets, temperature) * upstream).sum(),
        lambda z: (reference_logprobs(z, targets, temperature) * upstream.double()).sum(),
        logits,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_entropy_gradient(temperature: float, dtype: torch.dtype) -> None:
    logits = make_logits(dtype, seed=3)
    upstream = torch.randn(ROWS, COLUMNS, generator=torch.Generator().manual_seed(4))
    check_gradient(
        lambda z: (token_entropy(z, temperature) * upstream).sum(),
        lambda z: (reference_entropy(z, temperature) * upstream.double()).sum(),
        logits,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_fused_logprobs_and_entropy(temperature: float, dtype: torch.dtype) -> None:
    """The logged entropy of the fused pass is the entropy at `temperature`; the logprobs' gradient is the
    one of `token_logprobs`."""
    logits = make_logits(dtype, seed=5)
    targets = make_inputs(logits.float(), temperature, seed=6)["targets"]
    original = logits.clone()
    leaf = logits.clone().requires_grad_(True)
    logprobs, entropy = token_logprobs_and_entropy(leaf, targets, temperature)
    logprobs.sum().backward()
    assert torch.equal(leaf.detach(), original)
    torch.testing.assert_close(
        entropy.double(), reference_entropy(original, temperature), rtol=1e-5, atol=1e-5
    )
    check_gradient(
        lambda z: token_logprobs_and_entropy(z, targets, temperature)[0].sum(),
        lambda z: reference_logprobs(z, targets, temperature).sum(),
        logits,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("name", list(SETTINGS))
def test_objective_gradient_from_the_logits(name: str, temperature: float, dtype: torch.dtype) -> None:
    """PPO-clip, KL (k1, k2, k3), entropy bonus and decoupled weights, each from the logits."""
    settings = SETTINGS[name]
    logits = make_logits(dtype, seed=7)
    inputs = make_inputs(logits.float(), temperature, seed=8)
    if settings.loss_aggregation == "sequence_mean":
        inputs["weights"] = loss_weights((inputs["weights"] > 0).float(), "sequence_mean")
    check_gradient(
        lambda z: our_loss(z, inputs, settings, temperature),
        lambda z: reference_loss(z, inputs, settings, temperature),
        logits,
    )


def test_the_reference_inputs_exercise_both_sides_of_the_clip_and_the_truncation() -> None:
    """Guard on the test data: some ratios are clipped and some not, some weights truncated and some not."""
    logits = make_logits(torch.float32, seed=7)
    inputs = make_inputs(logits, 0.7, seed=8)
    logprobs = token_logprobs(logits, inputs["targets"], 0.7)
    settings = LossSettings(off_policy_correction="decoupled", off_policy_max_weight=1.2)
    _, metrics = policy_loss(
        logprobs, inputs["rollout"], inputs["advantages"], inputs["weights"], settings,
        proximal_logprobs=inputs["proximal"],
    )  # fmt: skip
    assert 0.0 < metrics["train/clip_frac"].item() < 1.0
    assert 0.0 < metrics["train/off_policy/truncated_frac"].item() < 1.0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_no_function_of_the_objective_changes_its_inputs(dtype: torch.dtype) -> None:
    logits = make_logits(dtype, seed=9)
    inputs = make_inputs(logits.float(), 0.7, seed=10)
    originals = {name: tensor.clone() for name, tensor in inputs.items()}
    logits_before = logits.clone()
    leaf = logits.requires_grad_(True)

    logprobs = token_logprobs(leaf, inputs["targets"], 0.7)
    fused, logged_entropy = token_logprobs_and_entropy(leaf, inputs["targets"], 0.7)
    entropy = token_entropy(leaf, 0.7)
    for estimator in ("k1", "k2", "k3"):
        kl_penalty(logprobs, inputs["ref"], estimator)
    settings = SETTINGS["everything"]
    loss, _ = policy_loss(
        logprobs, inputs["rollout"], inputs["advantages"], inputs["weights"], settings,
        proximal_logprobs=inputs["proximal"], ref_logprobs=inputs["ref"], entropy=entropy,
    )  # fmt: skip
    (loss + fused.sum() + logged_entropy.sum()).backward()
    rewards = torch.tensor([1.0, 0.0, 0.5])
    group_advantages(rewards, normalize_std=True)
    mask = (inputs["weights"] > 0).float()
    loss_weights(mask, "sequence_mean")

    assert torch.equal(leaf.detach(), logits_before)
    for name, tensor in inputs.items():
        assert torch.equal(tensor, originals[name]), name
    assert rewards.tolist() == [1.0, 0.0, 0.5]
    assert torch.equal(mask, (originals["weights"] > 0).float())


def test_the_issue_reproduction() -> None:
    """float32 logits at T = 0.7: the logits are unchanged and the gradient is `(onehot - softmax(z/T))/T`."""
    generator = torch.Generator().manual_seed(11)
    z = torch.randn(2, 5, 11, generator=generator) * 3
    targets = torch.randint(0, 11, (2, 5), generator=generator)
    x = z.clone().requires_grad_(True)
    token_logprobs(x, targets, 0.7).sum().backward()
    assert torch.equal(x.detach(), z)
    expected = (torch.nn.functional.one_hot(targets, 11) - torch.softmax(z / 0.7, dim=-1)) / 0.7
    assert x.grad is not None
    torch.testing.assert_close(x.grad, expected, rtol=1e-5, atol=1e-6)
    assert math.isfinite(float(x.grad.sum()))
