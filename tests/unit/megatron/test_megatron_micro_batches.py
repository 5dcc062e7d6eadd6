"""The Megatron actor's micro-batches by token budget against its micro-batches of a fixed row count (CPU,
TP = 1, float32): the same per-token logprobs, loss, metrics and gradients (relative 1e-5) on random ragged
multi-turn batches whose masks hold observation spans, at every loss aggregation; `train/kl` is 0 at the
first step."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from asyncrl_core.algorithms import LossSettings, PackedBatch
from asyncrl_core.models import tiny_llama
from asyncrl_core.shares import LENGTH_MULTIPLE, cut_by_tokens
from asyncrl_core.types import NO_VERSION, Group, Trajectory
from asyncrl_megatron import parallel
from asyncrl_megatron.actor import MegatronActor, MegatronActorSettings
from asyncrl_megatron.model import megatron_warnings_ignored

os.environ.setdefault("HF_HUB_OFFLINE", "1")

BUDGET = 256
"""Tokens per micro-batch, padding included: two to four rows of the batches below."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tiny_llama(tmp_path_factory.mktemp("tiny") / "model")
    parallel.destroy()


def multi_turn_groups(seed: int, num_groups: int = 3, group_size: int = 4) -> list[Group]:
    """Trajectories of 1-4 turns: model tokens (trained), then an observation span (not trained) after most
    turns; lengths range about tenfold."""
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
                    mask += [0] * rng.randint(2, 16)
            trajectories.append(
                Trajectory(
                    token_ids=[rng.randint(10, 2000) for _ in range(prompt_len + len(mask))],
                    prompt_len=prompt_len,
                    loss_mask=mask,
                    rollout_logprobs=[-rng.uniform(5.0, 9.0) if m else 0.0 for m in mask],
                    versions=[0 if m else NO_VERSION for m in mask],
                    reward=rng.choice([0.0, 0.2, 1.0]),
                )
            )
        groups.append(Group(group_id=group_index, prompt_index=group_index, trajectories=trajectories))
    return groups


def make_actor(model_dir: Path, aggregation: str, **changes: object) -> MegatronActor:
    fields: dict[str, object] = {
        "model_path": str(model_dir),
        "temperature": 1.0,
        "dtype": "float32",
        "optimizer": "sgd",
        "grad_clip": 0.0,
        "lr": 1e-2,
    }
    loss = LossSettings(
        kl_coef=0.1,
        kl_estimator="k1",
        entropy_coef=0.01,
        off_policy_correction="decoupled",
        loss_aggregation=aggregation,  # type: ignore[arg-type]
    )
    return MegatronActor(MegatronActorSettings(**fields | changes), loss)  # pyright: ignore[reportArgumentType]


def logprobs_by_row(actor: MegatronActor, parts: list[PackedBatch]) -> list[torch.Tensor]:
    rows: list[torch.Tensor] = []
    for part in parts:
        with torch.no_grad(), megatron_warnings_ignored():
            logprobs = actor._proximal_logprobs(part)
        mask = part.loss_mask.bool()
        rows += [logprobs[row][mask[row]] for row in range(part.num_rows)]
    return rows


def gradients(
    actor: MegatronActor, parts: list[PackedBatch]
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    with megatron_warnings_ignored():  # as `train_step` runs it
        totals = actor._accumulate_gradients(parts, [None] * len(parts))
    grads = {
        name: parameter.main_grad.detach().clone()  # pyright: ignore[reportAttributeAccessIssue]
        for name, parameter in actor.module.named_parameters()
    }
    return grads, {name: float(value) for name, value in totals.items()}


@pytest.mark.parametrize(("aggregation", "seed"), [("token_mean", 0), ("sequence_mean", 1)])
def test_token_budget_gives_the_fixed_row_loss_logprobs_and_gradients(
    model_dir: Path, aggregation: str, seed: int
) -> None:
    rows = make_actor(model_dir, aggregation, micro_batch_size=3)
    budget = make_actor(model_dir, aggregation, max_tokens_per_micro_batch=BUDGET)
    budget.length_multiple = LENGTH_MULTIPLE  # widths in buckets, as on a GPU
    groups = multi_turn_groups(seed)
    row_parts, budget_parts = rows.plan(groups).micro_batches[0], budget.plan(groups).micro_batches[0]
    assert all(part.input_ids.numel() <= BUDGET or part.num_rows == 1 for part in budget_parts)

    lengths = sorted((len(t.token_ids) for g in groups for t in g.trajectories), reverse=True)
    budget_order = [row for cut in cut_by_tokens(lengths, BUDGET, padded=True) for row in cut]
    expected = logprobs_by_row(rows, row_parts)
    got = dict(zip(budget_order, logprobs_by_row(budget, budget_parts), strict=True))
    for row, logprobs in enumerate(expected):
        torch.testing.assert_close(got[row], logprobs, rtol=1e-5, atol=1e-6)

    row_grads, row_totals = gradients(rows, row_parts)
    budget_grads, budget_totals = gradients(budget, budget_parts)
    for name, value in row_totals.items():
        assert budget_totals[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
    for name, want in row_grads.items():
        scale = float(want.abs().max())
        torch.testing.assert_close(budget_grads[name], want, rtol=1e-5, atol=1e-5 * scale, msg=name)


def test_token_budget_steps_match_and_kl_is_zero_at_the_first(model_dir: Path) -> None:
    rows = make_actor(model_dir, "sequence_mean", micro_batch_size=2)
    budget = make_actor(model_dir, "sequence_mean", max_tokens_per_micro_batch=BUDGET)
    groups = multi_turn_groups(5, num_groups=2)
    row_metrics, budget_metrics = rows.train_step(groups), budget.train_step(groups)
    assert budget_metrics["train/kl"] == 0.0
    assert row_metrics["train/kl"] == 0.0
    for name, value in row_metrics.items():
        assert budget_metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
    for (name, left), right in zip(
        budget.module.state_dict().items(), rows.module.state_dict().values(), strict=True
    ):
        if isinstance(left, torch.Tensor):
            torch.testing.assert_close(left, right, rtol=1e-5, atol=1e-7, msg=name)
