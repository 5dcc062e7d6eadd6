"""The objective: advantages per group, batch packing, the clipped loss against hand-computed values, the
off-policy correction, KL and entropy, and micro-batch additivity."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl_core.algorithms import (
    BatchError,
    LossSettings,
    PackedBatch,
    group_advantages,
    kl_penalty,
    pack_groups,
    policy_loss,
    token_entropy,
    token_logprobs,
    token_logprobs_and_entropy,
)
from asyncrl_core.config import AlgorithmConfig
from asyncrl_core.types import NO_VERSION, Group, Trajectory

PAD = 0


def trajectory(
    prompt: list[int], response: list[int], mask: list[int], reward: float, logprob: float = -1.0
) -> Trajectory:
    return Trajectory(
        token_ids=prompt + response,
        prompt_len=len(prompt),
        loss_mask=mask,
        rollout_logprobs=[logprob if m else 0.0 for m in mask],
        versions=[3 if m else NO_VERSION for m in mask],
        reward=reward,
    )


def two_groups() -> list[Group]:
    return [
        Group(
            group_id=7,
            prompt_index=0,
            trajectories=[
                trajectory([5, 6], [10, 11, 12], [1, 0, 1], reward=1.0),
                trajectory([5, 6], [13], [1], reward=0.0),
            ],
        ),
        Group(
            group_id=8,
            prompt_index=1,
            trajectories=[
                trajectory([9], [14, 15], [1, 1], reward=0.5),
                trajectory([9], [16, 17, 18, 19], [1, 1, 0, 1], reward=0.5),
            ],
        ),
    ]


# --- advantages ---------------------------------------------------------------------------------------------


def test_group_advantages_normalised_by_sample_std() -> None:
    advantages = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), normalize_std=True)
    # mean 0.5, sample std sqrt(4 * 0.25 / 3) = 0.57735
    expected = 0.5 / (math.sqrt(1.0 / 3.0) + 1e-6)
    torch.testing.assert_close(advantages, torch.tensor([expected, -expected, -expected, expected]))


def test_group_advantages_without_std_keep_the_mean_baseline() -> None:
    advantages = group_advantages(torch.tensor([3.0, 1.0, 2.0]), normalize_std=False)
    torch.testing.assert_close(advantages, torch.tensor([1.0, -1.0, 0.0]))


@pytest.mark.parametrize("rewards", [[0.1, 0.1, 0.1], [1.0], [0.0, 0.0]])
@pytest.mark.parametrize("normalize_std", [True, False])
def test_zero_variance_groups_have_exactly_zero_advantage(rewards: list[float], normalize_std: bool) -> None:
    advantages = group_advantages(torch.tensor(rewards), normalize_std=normalize_std)
    assert advantages.tolist() == [0.0] * len(rewards)


def test_non_finite_rewards_are_refused() -> None:
    with pytest.raises(ValueError, match="finite"):
        group_advantages(torch.tensor([1.0, float("nan")]), normalize_std=True)


def test_advantages_are_computed_per_group() -> None:
    batch = pack_groups(two_groups(), PAD, normalize_std=False, aggregation="token_mean")
    per_row = [float(row[mask > 0][0]) for row, mask in zip(batch.advantages, batch.loss_mask, strict=True)]
    # group 7: rewards (1, 0) -> +-0.5; group 8: equal rewards -> 0, whatever the other group holds
    assert per_row == [0.5, -0.5, 0.0, 0.0]


# --- packing ------------------------------------------------------------------------------------------------


def test_pack_groups_aligns_response_tokens_with_the_logits_that_predict_them() -> None:
    batch = pack_groups(two_groups(), PAD, normalize_std=False, aggregation="token_mean")
    assert batch.input_ids.shape == (4, 5)
    assert batch.input_ids[0].tolist() == [5, 6, 10, 11, 12]
    assert batch.input_ids[2].tolist() == [9, 14, 15, PAD, PAD]
    assert batch.attention_mask[2].tolist() == [1, 1, 1, 0, 0]
    assert batch.target_ids[0].tolist() == [6, 10, 11, 12, PAD]
    # prompt of 2: response token j is predicted at position 1 + j; the tool token (j = 1) is masked
    assert batch.loss_mask[0].tolist() == [0, 1, 0, 1, 0]
    assert batch.rollout_logprobs[0].tolist() == [0, -1, 0, -1, 0]
    assert batch.versions[0].tolist() == [-1, 3, -1, 3, -1]
    assert batch.loss_mask[3].tolist() == [1, 1, 0, 1, 0]
    assert batch.lengths.tolist() == [5, 3, 3, 5]
    assert batch.num_loss_tokens == 2 + 1 + 2 + 3
    assert batch.num_tokens == 16
    torch.testing.assert_close(batch.loss_weights, batch.loss_mask / 8)


def test_sequence_mean_weights_give_every_trajectory_the_same_share() -> None:
    batch = pack_groups(two_groups(), PAD, normalize_std=True, aggregation="sequence_mean")
    torch.testing.assert_close(batch.loss_weights.sum(dim=1), torch.full((4,), 0.25))
    assert batch.loss_weights[0, 1].item() == pytest.approx(0.25 / 2)
    assert batch.loss_weights[3, 0].item() == pytest.approx(0.25 / 3)


def test_select_trims_padding_and_keeps_batch_shares() -> None:
    batch = pack_groups(two_groups(), PAD, normalize_std=True, aggregation="token_mean")
    part = batch.select([2, 1])
    assert part.input_ids.shape == (2, 3)
    assert part.input_ids[0].tolist() == [9, 14, 15]
    assert part.loss_weights.sum().item() == pytest.approx(3 / 8)


def test_inconsistent_trajectories_are_refused_with_their_group_named() -> None:
    groups = two_groups()
    groups[1].trajectories[1].rollout_logprobs.pop()
    with pytest.raises(BatchError, match=r"group 8 .*trajectory 1: rollout_logprobs has 3 entries for 4"):
        pack_groups(groups, PAD, normalize_std=True, aggregation="token_mean")
    with pytest.raises(BatchError, match="prompt_len must be at least 1"):
        pack_groups(
            [Group(1, 0, [trajectory([], [3], [1], 0.0)])], PAD, normalize_std=True, aggregation="token_mean"
        )
    with pytest.raises(BatchError, match="no trajectories"):
        pack_groups([Group(1, 0, [])], PAD, normalize_std=True, aggregation="token_mean")


# --- logprobs and entropy -----------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_and_gradient_match_log_softmax(temperature: float) -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 11, generator=generator, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (3, 4), generator=generator)
    upstream = torch.randn(3, 4, generator=generator, dtype=torch.float64)

    ours = token_logprobs(logits, targets, temperature)
    (grad_ours,) = torch.autograd.grad((ours * upstream).sum(), logits)
    reference = torch.log_softmax(logits / temperature, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    (grad_reference,) = torch.autograd.grad((reference * upstream).sum(), logits)

    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, reference.float())
    torch.testing.assert_close(grad_ours, grad_reference, rtol=1e-5, atol=1e-6)


def test_token_logprobs_work_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncrl_core.algorithms.losses as losses

    monkeypatch.setattr(losses, "LOGITS_CHUNK_BYTES", 3 * 4 * 7)  # three positions per chunk
    logits = torch.randn(2, 5, 7, requires_grad=True)
    targets = torch.randint(0, 7, (2, 5))
    ours = token_logprobs(logits, targets)
    ours.sum().backward()
    assert logits.grad is not None
    reference_logits = logits.detach().clone().requires_grad_(True)
    reference = torch.log_softmax(reference_logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    reference.sum().backward()
    torch.testing.assert_close(ours, reference)
    torch.testing.assert_close(logits.grad, reference_logits.grad)
    uniform = token_entropy(torch.zeros(2, 5, 7))
    torch.testing.assert_close(uniform, torch.full((2, 5), math.log(7)))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_entropy_matches_token_entropy_and_leaves_the_gradient_alone(
    monkeypatch: pytest.MonkeyPatch, temperature: float
) -> None:
    import asyncrl_core.algorithms.losses as losses

    monkeypatch.setattr(losses, "LOGITS_CHUNK_BYTES", 3 * 4 * 7)  # three positions per chunk
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 7, generator=generator, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (2, 5), generator=generator)
    upstream = torch.randn(2, 5, generator=generator, dtype=torch.float64)

    logprobs, entropy = token_logprobs_and_entropy(logits, targets, temperature)
    (grad_fused,) = torch.autograd.grad((logprobs * upstream).sum(), logits)
    alone = token_logprobs(logits, targets, temperature)
    (grad_alone,) = torch.autograd.grad((alone * upstream).sum(), logits)

    assert not entropy.requires_grad
    assert entropy.shape == targets.shape
    assert entropy.dtype == logprobs.dtype == torch.float32
    torch.testing.assert_close(logprobs, alone)
    torch.testing.assert_close(grad_fused, grad_alone)
    torch.testing.assert_close(entropy, token_entropy(logits.detach(), temperature))
    with pytest.raises(ValueError, match="do not match"):
        token_logprobs_and_entropy(logits, targets[:, :3])


def test_bfloat16_logits_give_float32_logprobs_and_bfloat16_gradients() -> None:
    logits = torch.randn(2, 3, 13).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, 13, (2, 3))
    logprobs = token_logprobs(logits, targets)
    logprobs.sum().backward()
    assert logprobs.dtype == torch.float32
    assert logits.grad is not None
    assert logits.grad.dtype == torch.bfloat16
    reference = torch.log_softmax(logits.detach().float(), dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    torch.testing.assert_close(logprobs, reference)


# --- the loss -----------------------------------------------------------------------------------------------


def test_policy_loss_matches_a_hand_computed_example() -> None:
    # Three trained tokens and one tool token (weight 0) holding values that must not matter.
    logprobs = torch.tensor([[-1.0, -2.0, -0.5, 50.0]], requires_grad=True)
    rollout = torch.tensor([[-1.2, -1.9, -0.5, 0.0]])
    advantages = torch.tensor([[1.0, -0.5, 2.0, 0.0]])
    weights = torch.tensor([[1 / 3, 1 / 3, 1 / 3, 0.0]])
    loss, metrics = policy_loss(logprobs, rollout, advantages, weights, LossSettings())

    # token 1: ratio e^0.2 = 1.2214 > 1.2, A > 0: the clipped term wins, -1.2 (clipped, no gradient)
    # token 2: ratio e^-0.1 = 0.904837, inside the range: 0.5 * 0.904837 = 0.452419
    # token 3: ratio 1: -2
    expected = (-1.2 + 0.5 * math.exp(-0.1) - 2.0) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert metrics["train/loss"].item() == pytest.approx(expected, abs=1e-6)
    assert metrics["train/clip_frac"].item() == pytest.approx(1 / 3)
    assert metrics["train/ppo_ratio/mean"].item() == pytest.approx(
        (math.exp(0.2) + math.exp(-0.1) + 1.0) / 3, abs=1e-6
    )
    loss.backward()
    assert logprobs.grad is not None
    # d/dlogp of -A * r / 3 is -A * r / 3; the clipped token and the tool token get none
    expected_grad = [0.0, 0.5 * math.exp(-0.1) / 3, -2.0 / 3, 0.0]
    torch.testing.assert_close(logprobs.grad, torch.tensor([expected_grad]))


def test_negative_advantage_clips_below() -> None:
    logprobs = torch.tensor([[-2.0]], requires_grad=True)
    rollout = torch.tensor([[-1.0]])  # ratio e^-1 = 0.368 < 0.8
    loss, metrics = policy_loss(logprobs, rollout, torch.tensor([[-1.0]]), torch.ones(1, 1), LossSettings())
    assert loss.item() == pytest.approx(0.8)
    assert metrics["train/clip_frac"].item() == 1.0
    loss.backward()
    assert logprobs.grad is not None
    assert logprobs.grad.item() == 0.0


def test_clip_eps_high_widens_the_upper_bound_only() -> None:
    logprobs = torch.tensor([[0.0, 0.0]])
    rollout = torch.tensor([[-0.25, 0.25]])  # ratios e^0.25 = 1.284, e^-0.25 = 0.779
    advantages = torch.tensor([[1.0, -1.0]])
    settings = LossSettings(clip_eps_low=0.2, clip_eps_high=0.28)
    loss, _ = policy_loss(logprobs, rollout, advantages, torch.full((1, 2), 0.5), settings)
    assert loss.item() == pytest.approx((-1.28 + 0.8) / 2, abs=1e-6)


def decoupled(max_weight: float = 2.0) -> LossSettings:
    return LossSettings(off_policy_correction="decoupled", off_policy_max_weight=max_weight)


def test_off_policy_correction_is_the_identity_on_fresh_data() -> None:
    generator = torch.Generator().manual_seed(1)
    batch = pack_groups(two_groups(), PAD, normalize_std=True, aggregation="token_mean")
    current = batch.rollout_logprobs + 0.3 * torch.randn(batch.loss_mask.shape, generator=generator)

    def run(settings: LossSettings, proximal: torch.Tensor | None) -> tuple[float, torch.Tensor]:
        logprobs = current.clone().requires_grad_(True)
        loss, _ = policy_loss(
            logprobs,
            batch.rollout_logprobs,
            batch.advantages,
            batch.loss_weights,
            settings,
            proximal_logprobs=proximal,
        )
        loss.backward()
        assert logprobs.grad is not None
        return loss.item(), logprobs.grad

    plain_loss, plain_grad = run(LossSettings(), None)
    fresh_loss, fresh_grad = run(decoupled(), batch.rollout_logprobs.clone())
    assert fresh_loss == plain_loss
    assert torch.equal(fresh_grad, plain_grad)
    _, metrics = policy_loss(
        current,
        batch.rollout_logprobs,
        batch.advantages,
        batch.loss_weights,
        decoupled(),
        proximal_logprobs=batch.rollout_logprobs,
    )
    assert metrics["train/off_policy/weight_mean"].item() == pytest.approx(1.0)
    assert metrics["train/off_policy/truncated_frac"].item() == 0.0
    assert metrics["train/off_policy/behaviour_kl"].item() == 0.0


def test_off_policy_correction_clips_against_proximal_and_truncates_the_weight() -> None:
    logprobs = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    proximal = torch.tensor([[-1.0, -1.1]])
    behaviour = torch.tensor([[-2.0, -1.0]])  # weights e^1 = 2.718 -> 2.0 (truncated), e^-0.1 = 0.905
    advantages = torch.tensor([[1.0, 1.0]])
    loss, metrics = policy_loss(
        logprobs, behaviour, advantages, torch.full((1, 2), 0.5), decoupled(), proximal_logprobs=proximal
    )
    # token 1: ratio to proximal 1 -> -1 * 2.0; token 2: ratio e^0.1 = 1.105 (inside) -> -1.105 * 0.905 = -1
    expected = (-2.0 - math.exp(0.1) * math.exp(-0.1)) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert metrics["train/off_policy/weight_mean"].item() == pytest.approx((2.0 + math.exp(-0.1)) / 2)
    assert metrics["train/off_policy/truncated_frac"].item() == pytest.approx(0.5)
    assert metrics["train/off_policy/behaviour_kl"].item() > 0.0
    # Without the correction the first token's ratio e^1 is clipped at 1.2; the second's is 1.
    plain, _ = policy_loss(logprobs, behaviour, advantages, torch.full((1, 2), 0.5), LossSettings())
    assert plain.item() == pytest.approx((-1.2 - 1.0) / 2, abs=1e-6)


def test_missing_inputs_are_named() -> None:
    ones = torch.ones(1, 2)
    with pytest.raises(ValueError, match="proximal_logprobs"):
        policy_loss(ones, ones, ones, ones, decoupled())
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(ones, ones, ones, ones, LossSettings(kl_coef=0.1))
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(ones, ones, ones, ones, LossSettings(entropy_coef=0.1))
    with pytest.raises(ValueError, match="advantages has shape"):
        policy_loss(ones, ones, torch.ones(2, 1), ones, LossSettings())


def test_kl_estimators_match_their_definitions() -> None:
    logprobs = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0])
    log_ratio = ref - logprobs  # (-0.5, 1.0)
    torch.testing.assert_close(kl_penalty(logprobs, ref, "k1"), -log_ratio)
    torch.testing.assert_close(kl_penalty(logprobs, ref, "k2"), 0.5 * log_ratio**2)
    torch.testing.assert_close(kl_penalty(logprobs, ref, "k3"), torch.exp(log_ratio) - 1 - log_ratio)
    assert kl_penalty(logprobs, logprobs, "k3").tolist() == [0.0, 0.0]


def test_kl_and_entropy_enter_the_loss_with_their_coefficients() -> None:
    logprobs = torch.tensor([[-1.0]])
    ref = torch.tensor([[-1.5]])
    entropy = torch.tensor([[2.0]])
    settings = LossSettings(kl_coef=0.1, kl_estimator="k2", entropy_coef=0.01)
    loss, metrics = policy_loss(
        logprobs, logprobs, torch.zeros(1, 1), torch.ones(1, 1), settings, ref_logprobs=ref, entropy=entropy
    )
    assert metrics["train/kl"].item() == pytest.approx(0.125)
    assert metrics["train/entropy"].item() == pytest.approx(2.0)
    assert loss.item() == pytest.approx(0.1 * 0.125 - 0.01 * 2.0)


# --- micro-batches ------------------------------------------------------------------------------------------


class TinyLM(torch.nn.Module):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Embedding(vocab_size, 8)
        self.head = torch.nn.Linear(8, vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embedding(input_ids)))


def loss_of(model: TinyLM, batch: PackedBatch, settings: LossSettings) -> torch.Tensor:
    logprobs = token_logprobs(model(batch.input_ids), batch.target_ids)
    loss, _ = policy_loss(logprobs, batch.rollout_logprobs, batch.advantages, batch.loss_weights, settings)
    return loss


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_micro_batch_losses_add_up_to_the_full_batch_loss(aggregation: str) -> None:
    settings = LossSettings(loss_aggregation=aggregation)  # pyright: ignore[reportArgumentType]
    batch = pack_groups(two_groups(), PAD, normalize_std=True, aggregation=settings.loss_aggregation)
    model = TinyLM(vocab_size=20)

    full = loss_of(model, batch, settings)
    full.backward()
    full_grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    accumulated = 0.0
    for rows in ([3], [0, 2], [1]):
        part = loss_of(model, batch.select(rows), settings)
        part.backward()
        accumulated += part.item()
    assert accumulated == pytest.approx(full.item(), abs=1e-6)
    for full_grad, parameter in zip(full_grads, model.parameters(), strict=True):
        assert parameter.grad is not None
        torch.testing.assert_close(parameter.grad, full_grad, rtol=1e-5, atol=1e-7)


def test_tool_tokens_get_no_gradient() -> None:
    batch = pack_groups(two_groups(), PAD, normalize_std=False, aggregation="token_mean")
    logits = torch.randn(*batch.input_ids.shape, 20, requires_grad=True)
    logprobs = token_logprobs(logits, batch.target_ids)
    loss, _ = policy_loss(
        logprobs, batch.rollout_logprobs, batch.advantages, batch.loss_weights, LossSettings()
    )
    loss.backward()
    assert logits.grad is not None
    grad_norm_per_position = logits.grad.abs().sum(dim=-1)
    assert grad_norm_per_position[0, 2].item() == 0.0  # the tool token of trajectory 0
    assert grad_norm_per_position[0, 1].item() > 0.0
    assert bool((grad_norm_per_position[batch.loss_mask == 0] == 0).all())


def test_settings_from_config() -> None:
    config = AlgorithmConfig(
        group_size=4,
        normalize_advantage_std=False,
        loss_aggregation="sequence_mean",
        clip_eps_high=0.28,
        kl_coef=0.05,
        kl_estimator="k1",
        off_policy_correction="decoupled",
        off_policy_max_weight=5.0,
    )
    settings = LossSettings.from_config(config)
    assert settings == LossSettings(
        clip_eps_low=0.2,
        clip_eps_high=0.28,
        kl_coef=0.05,
        kl_estimator="k1",
        entropy_coef=0.0,
        off_policy_correction="decoupled",
        off_policy_max_weight=5.0,
        loss_aggregation="sequence_mean",
        normalize_advantage_std=False,
    )
    assert settings.needs_reference
    assert settings.needs_proximal
    with pytest.raises(ValueError, match="off_policy_max_weight"):
        LossSettings(off_policy_max_weight=0.5)


# --- properties ---------------------------------------------------------------------------------------------

trajectory_shapes = st.tuples(
    st.integers(1, 4),  # prompt length
    st.lists(st.integers(0, 1), min_size=0, max_size=6),  # loss mask of the response
    st.sampled_from([0.0, 0.5, 1.0]),  # reward
)


@settings(max_examples=40, deadline=None)
@given(
    groups_spec=st.lists(st.lists(trajectory_shapes, min_size=1, max_size=4), min_size=1, max_size=3),
    aggregation=st.sampled_from(["token_mean", "sequence_mean"]),
    correction=st.sampled_from(["none", "decoupled"]),
    seed=st.integers(0, 2**16),
)
def test_any_split_of_the_rows_adds_up_to_the_batch(
    groups_spec: list[list[tuple[int, list[int], float]]], aggregation: str, correction: str, seed: int
) -> None:
    groups = [
        Group(
            group_id=index,
            prompt_index=index,
            trajectories=[
                trajectory(list(range(1, prompt_len + 1)), [3] * len(mask), mask, reward, logprob=-1.5)
                for prompt_len, mask, reward in spec
            ],
        )
        for index, spec in enumerate(groups_spec)
    ]
    loss_settings = LossSettings(
        loss_aggregation=aggregation,  # pyright: ignore[reportArgumentType]
        off_policy_correction=correction,  # pyright: ignore[reportArgumentType]
        off_policy_max_weight=1.3,
    )
    batch = pack_groups(groups, PAD, normalize_std=True, aggregation=loss_settings.loss_aggregation)
    generator = torch.Generator().manual_seed(seed)
    current = -1.5 + 0.4 * torch.randn(batch.loss_mask.shape, generator=generator)
    proximal = -1.5 + 0.4 * torch.randn(batch.loss_mask.shape, generator=generator)

    def evaluate(rows: list[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        part = batch.select(rows)
        width = part.input_ids.shape[1]
        return policy_loss(
            current[rows, :width],
            part.rollout_logprobs,
            part.advantages,
            part.loss_weights,
            loss_settings,
            proximal_logprobs=proximal[rows, :width],
        )

    full_loss, full_metrics = evaluate(list(range(batch.num_rows)))
    order = torch.randperm(batch.num_rows, generator=generator).tolist()
    cut = int(torch.randint(0, batch.num_rows + 1, (1,), generator=generator))
    parts = [evaluate(rows) for rows in (order[:cut], order[cut:]) if rows]
    assert sum(loss.item() for loss, _ in parts) == pytest.approx(full_loss.item(), abs=1e-5)
    for name, value in full_metrics.items():
        assert sum(m[name].item() for _, m in parts) == pytest.approx(value.item(), abs=1e-5), name
    assert batch.loss_weights.sum().item() == pytest.approx(1.0 if batch.num_loss_tokens else 0.0, abs=1e-5)
