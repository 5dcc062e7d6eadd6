"""Packed rows cut by a token budget against padded micro-batches of a fixed row count, for the torch actor:
the same per-token logprobs, loss, metrics and gradients (float32, relative 1e-5) on random ragged multi-turn
batches whose masks hold observation spans, at every loss aggregation; `train/kl` is 0 at the first step.
And the cut itself: every row once, within its budget, a longer row alone."""

from __future__ import annotations

import itertools
import os
import random
from pathlib import Path

import pytest
import torch

from asyncrl_core.actor import TorchActor
from asyncrl_core.algorithms import PackedBatch
from asyncrl_core.config import AlgorithmConfig, TorchActorConfig, load_config
from asyncrl_core.errors import ConfigError
from asyncrl_core.models import tiny_llama
from asyncrl_core.shares import LENGTH_MULTIPLE, bucket_length, cut_by_tokens
from asyncrl_core.types import NO_VERSION, Group, Trajectory

os.environ.setdefault("HF_HUB_OFFLINE", "1")

AGGREGATIONS = ["token_mean", "sequence_mean"]
BUDGET = 160
"""Tokens per packed micro-batch: two to six trajectories of the batches below."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


def make_actor(model_dir: Path, aggregation: str, **overrides: object) -> TorchActor:
    actor_fields: dict[str, object] = {
        "model_path": str(model_dir),
        "dtype": "float32",
        "optimizer": "sgd",
        "grad_clip": 0.0,
        "lr": 1e-2,
        "temperature": 1.0,
    }
    algorithm_fields: dict[str, object] = {
        "group_size": 4,
        "loss_aggregation": aggregation,
        "kl_coef": 0.1,
        "kl_estimator": "k1",
        "entropy_coef": 0.01,
        "off_policy_correction": "decoupled",
    }
    for key, value in overrides.items():
        (algorithm_fields if key in AlgorithmConfig.model_fields else actor_fields)[key] = value
    return TorchActor(
        TorchActorConfig.model_validate(actor_fields), AlgorithmConfig.model_validate(algorithm_fields)
    )


def multi_turn_groups(seed: int, num_groups: int = 3, group_size: int = 4) -> list[Group]:
    """Trajectories of 1-4 turns: model tokens (trained) then an observation span (not trained) per turn
    but the last; lengths range about tenfold (8 to 90 tokens), some rows train a single token."""
    rng = random.Random(seed)
    groups: list[Group] = []
    for group_index in range(num_groups):
        trajectories: list[Trajectory] = []
        for _ in range(group_size):
            prompt_len = rng.randint(2, 12)
            mask: list[int] = []
            for turn in range(rng.randint(1, 4)):
                mask += [1] * rng.randint(1, 14)
                if turn < 3 and rng.random() < 0.8:
                    mask += [0] * rng.randint(2, 16)  # a tool's observation
            token_ids = [rng.randint(10, 2000) for _ in range(prompt_len + len(mask))]
            trajectories.append(
                Trajectory(
                    token_ids=token_ids,
                    prompt_len=prompt_len,
                    loss_mask=mask,
                    rollout_logprobs=[-rng.uniform(5.0, 9.0) if m else 0.0 for m in mask],
                    versions=[0 if m else NO_VERSION for m in mask],
                    reward=rng.choice([0.0, 0.2, 1.0]),
                )
            )
        groups.append(Group(group_id=group_index, prompt_index=group_index, trajectories=trajectories))
    return groups


def trained_logprobs_by_row(actor: TorchActor, parts: list[PackedBatch]) -> list[torch.Tensor]:
    """The logprobs of every trajectory's trained targets, per trajectory, in the order the parts hold
    them (a padded part's rows; a packed part's sequences, its trailing padding left out)."""
    rows: list[torch.Tensor] = []
    for part in parts:
        first = actor._first_trained_column(part)
        with torch.no_grad():
            logprobs = actor._trained_logprobs(actor._logits_at, part, first)[0]
        full = torch.zeros(part.loss_mask.shape)
        full[:, first:] = logprobs
        mask = part.loss_mask.bool()
        if part.sequence_offsets is None:
            rows += [full[row][mask[row]] for row in range(part.num_rows)]
            continue
        bounds = part.sequence_offsets.tolist()
        real = int(part.lengths[0])
        for start, end in itertools.pairwise(bounds):
            if start < real:
                rows.append(full[0, start:end][mask[0, start:end]])
    return rows


def gradients(
    actor: TorchActor, parts: list[PackedBatch]
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    totals = actor._accumulate_gradients(parts, [None] * len(parts))
    grads = {
        name: parameter.grad.detach().clone()
        for name, parameter in actor.module.named_parameters()
        if parameter.grad is not None
    }
    actor.optimizer.zero_grad(set_to_none=True)
    return grads, {name: float(value) for name, value in totals.items()}


@pytest.mark.parametrize(("aggregation", "seed"), [("token_mean", 0), ("sequence_mean", 1)])
def test_packed_token_budget_gives_the_padded_loss_logprobs_and_gradients(
    model_dir: Path, aggregation: str, seed: int
) -> None:
    padded = make_actor(model_dir, aggregation, micro_batch_size=3)
    packed = make_actor(model_dir, aggregation, max_tokens_per_micro_batch=BUDGET)
    packed.length_multiple = LENGTH_MULTIPLE  # as on a GPU: each packed row ends in a padding sequence
    groups = multi_turn_groups(seed)
    padded_plan, packed_plan = padded.plan(groups), packed.plan(groups)
    padded_parts, packed_parts = padded_plan.micro_batches[0], packed_plan.micro_batches[0]
    assert all(part.packed and part.num_rows == 1 for part in packed_parts)
    assert not any(part.packed for part in padded_parts)

    # Per-token logprobs: the packed parts hold the share's rows in the order `cut_by_tokens` gives them.
    share_rows = [len(t.token_ids) for g in groups for t in g.trajectories]
    order = sorted(range(len(share_rows)), key=lambda row: -share_rows[row])
    lengths = [share_rows[row] for row in order]
    packed_order = [row for cut in cut_by_tokens(lengths, BUDGET, padded=False) for row in cut]
    padded_rows = trained_logprobs_by_row(padded, padded_parts)
    packed_rows = dict(zip(packed_order, trained_logprobs_by_row(packed, packed_parts), strict=True))
    assert len(padded_rows) == len(packed_rows) == len(share_rows)
    for row, expected in enumerate(padded_rows):
        torch.testing.assert_close(packed_rows[row], expected, rtol=1e-5, atol=1e-6)
    # ... and each is the logprob of the trajectory alone, through the model's stock forward pass.
    trajectories = [t for g in groups for t in g.trajectories]
    for row, original in enumerate(order):  # share row `row` is trajectory `original`
        trajectory = trajectories[original]
        ids = torch.tensor(trajectory.token_ids)
        alone = torch.log_softmax(packed.forward_logits(ids)[:-1], dim=-1).gather(-1, ids[1:, None])[:, 0]
        mask = torch.tensor([0] * (trajectory.prompt_len - 1) + list(trajectory.loss_mask)).bool()
        torch.testing.assert_close(packed_rows[row], alone[mask], rtol=1e-5, atol=1e-6)

    padded_grads, padded_totals = gradients(padded, padded_parts)
    packed_grads, packed_totals = gradients(packed, packed_parts)
    assert padded_totals.keys() == packed_totals.keys()
    for name, value in padded_totals.items():
        assert packed_totals[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
    assert padded_grads.keys() == packed_grads.keys()
    for name, expected in padded_grads.items():
        scale = float(expected.abs().max())
        torch.testing.assert_close(packed_grads[name], expected, rtol=1e-5, atol=1e-5 * scale, msg=name)
        difference = float((packed_grads[name] - expected).norm() / expected.norm().clamp(min=1e-30))
        assert difference <= 1e-5, name


@pytest.mark.parametrize(("aggregation", "mini_batch_size"), [("token_mean", None), ("sequence_mean", 1)])
def test_packed_training_steps_match_and_kl_is_zero_at_the_first(
    model_dir: Path, aggregation: str, mini_batch_size: int | None
) -> None:
    """Whole steps (with two updates, the proximal logprobs of the decoupled correction come from a pass of
    their own over the same layout): the same metrics and weights; the first update's `train/kl` is 0."""
    options = {"ppo_mini_batch_size": mini_batch_size}
    padded = make_actor(model_dir, aggregation, micro_batch_size=2, **options)
    packed = make_actor(model_dir, aggregation, max_tokens_per_micro_batch=BUDGET, **options)
    groups = multi_turn_groups(7, num_groups=2)
    padded_metrics, packed_metrics = padded.train_step(groups), packed.train_step(groups)
    assert packed.update_metrics[0]["train/kl"] == 0.0
    assert padded.update_metrics[0]["train/kl"] == 0.0
    if mini_batch_size is None:
        assert packed_metrics["train/kl"] == 0.0
    for name, value in padded_metrics.items():
        assert packed_metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
    for (name, left), right in zip(
        packed.module.state_dict().items(), padded.module.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(left, right, rtol=1e-5, atol=1e-7, msg=name)
    later = packed.train_step(groups)
    assert later["train/kl"] != 0.0  # the policy moved away from the reference


def test_cut_by_tokens_keeps_every_row_once_within_its_budget() -> None:
    rng = random.Random(3)
    for _ in range(200):
        lengths = sorted((rng.randint(1, 300) for _ in range(rng.randint(1, 40))), reverse=True)
        budget = rng.randint(50, 900)
        for padded in (False, True):
            cuts = cut_by_tokens(lengths, budget, padded=padded)
            assert sorted(row for cut in cuts for row in cut) == list(range(len(lengths)))
            for cut in cuts:
                assert cut == sorted(cut)
                cost = (
                    len(cut) * bucket_length(lengths[cut[0]]) if padded else sum(lengths[row] for row in cut)
                )
                assert cost <= budget or len(cut) == 1
            assert cuts == cut_by_tokens(lengths, budget, padded=padded)
    assert cut_by_tokens([500, 10], 100, padded=False) == [[0], [1]]
    assert bucket_length(1) == LENGTH_MULTIPLE
    assert bucket_length(LENGTH_MULTIPLE + 1) == 2 * LENGTH_MULTIPLE


def test_the_token_budget_must_hold_the_longest_trajectory() -> None:
    mini = Path(__file__).parents[3] / "examples" / "searchr1-mini.yaml"
    with pytest.raises(ConfigError) as raised:
        load_config(mini, ["actor.max_tokens_per_micro_batch=700"])
    problems = {problem.key: problem.message for problem in raised.value.problems}
    assert "rollout.context_length 768" in problems["actor.max_tokens_per_micro_batch"]
    # With a budget, the row count no longer has to divide a rank's share.
    config = load_config(mini, ["actor.max_tokens_per_micro_batch=768", "actor.micro_batch_size=3"])
    assert config.actor.max_tokens_per_micro_batch == 768
