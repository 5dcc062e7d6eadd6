"""The PyTorch actor on a tiny random Llama: the update it makes, micro-batching, KL and the off-policy
correction, weight export, and checkpoints."""

from __future__ import annotations

import logging
import math
import os
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncrl_core.actor import ActorError, TorchActor
from asyncrl_core.actor.torch_actor import LossPositionLogits, bfloat16_supported
from asyncrl_core.algorithms import BatchError, pack_mini_batches
from asyncrl_core.config import AlgorithmConfig, TorchActorConfig
from asyncrl_core.errors import AsyncRLError
from asyncrl_core.models import tiny_llama
from asyncrl_core.protocols import Actor
from asyncrl_core.shares import split_batch
from asyncrl_core.types import NO_VERSION, Group, Trajectory

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


def make_actor(model_dir: Path, **overrides: object) -> TorchActor:
    actor_fields: dict[str, object] = {"model_path": str(model_dir), "dtype": "float32", "lr": 1e-2}
    algorithm_fields: dict[str, object] = {"group_size": 2}
    actor_fields["temperature"] = 1.0
    for key, value in overrides.items():
        (algorithm_fields if key in AlgorithmConfig.model_fields else actor_fields)[key] = value
    return TorchActor(
        TorchActorConfig.model_validate(actor_fields),
        AlgorithmConfig.model_validate(algorithm_fields),
    )


def sequence_logprobs(
    actor: TorchActor, token_ids: list[int], prompt_len: int, temperature: float = 1.0
) -> list[float]:
    """The actor's own logprob of each response token (fresh data: the behaviour policy is the actor)."""
    ids = torch.tensor(token_ids)
    logits = actor.forward_logits(ids)
    logprobs = torch.log_softmax(logits[:-1] / temperature, dim=-1).gather(-1, ids[1:, None]).squeeze(-1)
    return logprobs[prompt_len - 1 :].tolist()


def make_groups(
    actor: TorchActor, *, num_groups: int = 2, group_size: int = 3, seed: int = 0, temperature: float = 1.0
) -> list[Group]:
    """Groups of trajectories with a tool token in each response and different lengths and rewards."""
    generator = torch.Generator().manual_seed(seed)
    groups: list[Group] = []
    for group_index in range(num_groups):
        trajectories: list[Trajectory] = []
        for index in range(group_size):
            prompt_len = 3 + group_index
            response_len = 4 + index
            token_ids = torch.randint(10, 2000, (prompt_len + response_len,), generator=generator).tolist()
            mask = [1] * response_len
            mask[1] = 0  # a tool token
            logprobs = sequence_logprobs(actor, token_ids, prompt_len, temperature)
            trajectories.append(
                Trajectory(
                    token_ids=token_ids,
                    prompt_len=prompt_len,
                    loss_mask=mask,
                    rollout_logprobs=[lp if m else 0.0 for lp, m in zip(logprobs, mask, strict=True)],
                    versions=[0 if m else NO_VERSION for m in mask],
                    reward=float((index + group_index) % 2),
                )
            )
        groups.append(Group(group_id=group_index, prompt_index=group_index, trajectories=trajectories))
    return groups


def weights_of(actor: TorchActor) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in actor.module.state_dict().items()}


def assert_weights_close(
    left: dict[str, torch.Tensor], right: dict[str, torch.Tensor], rtol: float = 1e-5, atol: float = 1e-6
) -> None:
    assert left.keys() == right.keys()
    for name in left:
        torch.testing.assert_close(left[name], right[name], rtol=rtol, atol=atol, msg=name)


STEP_CASES = {
    "ppo": {},
    "entropy_and_kl": {"entropy_coef": 0.05, "kl_coef": 0.1, "kl_estimator": "k1"},
}


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
@pytest.mark.parametrize("case", list(STEP_CASES))
def test_sgd_step_equals_a_hand_written_policy_gradient_update(
    model_dir: Path, case: str, temperature: float
) -> None:
    """One SGD step moves every weight by `-lr * grad` of the GRPO loss written out independently, at the
    sampling temperature, with the entropy bonus and the KL penalty when they are on."""
    terms = STEP_CASES[case]
    actor = make_actor(
        model_dir, optimizer="sgd", grad_clip=0.0, micro_batch_size=2, temperature=temperature, **terms
    )
    groups = make_groups(actor, temperature=temperature)
    lr = actor.config.lr
    entropy_coef = float(terms.get("entropy_coef", 0.0))
    kl_coef = float(terms.get("kl_coef", 0.0))

    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    frozen = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    loss = torch.zeros(())
    num_tokens = sum(sum(t.loss_mask) for g in groups for t in g.trajectories)
    for group in groups:
        rewards = torch.tensor([t.reward for t in group.trajectories], dtype=torch.float64)
        advantages = ((rewards - rewards.mean()) / (rewards.std() + 1e-6)).float()
        for trajectory, advantage in zip(group.trajectories, advantages, strict=True):
            ids = torch.tensor(trajectory.token_ids)
            start = trajectory.prompt_len - 1
            log_p = torch.log_softmax(
                reference(input_ids=ids[None]).logits[0, start:-1] / temperature, dim=-1
            )
            response = log_p.gather(-1, ids[start + 1 :, None]).squeeze(-1)
            ratio = torch.exp(response - torch.tensor(trajectory.rollout_logprobs))
            clipped = ratio.clamp(0.8, 1.2)
            per_token = torch.maximum(-advantage * ratio, -advantage * clipped)
            if entropy_coef:
                per_token = per_token + entropy_coef * (log_p.exp() * log_p).sum(dim=-1)
            if kl_coef:
                with torch.no_grad():
                    ref_log_p = torch.log_softmax(
                        frozen(input_ids=ids[None]).logits[0, start:-1] / temperature, -1
                    )
                per_token = per_token + kl_coef * (
                    response - ref_log_p.gather(-1, ids[start + 1 :, None]).squeeze(-1)
                )
            loss = loss + (per_token * torch.tensor(trajectory.loss_mask)).sum() / num_tokens
    loss.backward()
    expected = {
        name: (parameter - lr * parameter.grad).detach()
        for name, parameter in reference.named_parameters()
        if parameter.grad is not None
    }

    metrics = actor.train_step(groups)
    assert actor.version == 1
    assert metrics["train/loss"] == pytest.approx(loss.item(), abs=1e-5)
    assert metrics["train/ppo_ratio/mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["train/clip_frac"] == 0.0
    assert metrics["train/num_trajectories"] == 6
    assert metrics["train/num_loss_tokens"] == num_tokens
    assert math.isfinite(metrics["train/entropy"])
    assert metrics["train/grad_norm"] > 0.0
    updated = dict(actor.module.named_parameters())
    for name, value in expected.items():
        torch.testing.assert_close(updated[name].detach(), value, rtol=1e-5, atol=1e-6, msg=name)


def test_logged_entropy_is_the_entropy_at_the_sampling_temperature(model_dir: Path) -> None:
    actor = make_actor(model_dir, temperature=0.7)
    groups = make_groups(actor, temperature=0.7)
    total, count = 0.0, 0
    for group in groups:
        for trajectory in group.trajectories:
            logits = actor.forward_logits(torch.tensor(trajectory.token_ids))[trajectory.prompt_len - 1 : -1]
            log_p = torch.log_softmax(logits.double() / 0.7, dim=-1)
            entropy = -(log_p.exp() * log_p).sum(dim=-1)
            mask = torch.tensor(trajectory.loss_mask, dtype=torch.float64)
            total += float((entropy * mask).sum())
            count += int(mask.sum())
    metrics = actor.train_step(groups)
    assert metrics["train/entropy"] == pytest.approx(total / count, rel=1e-5)


def test_the_temperature_comes_from_the_configuration(model_dir: Path) -> None:
    with pytest.raises(ActorError, match=r"actor.temperature is unset"):
        TorchActor(TorchActorConfig(model_path=str(model_dir)), AlgorithmConfig(group_size=2))
    assert make_actor(model_dir, temperature=0.7).temperature == 0.7


def test_mini_batches_are_successive_updates_in_one_step(model_dir: Path) -> None:
    """Mini-batches of one group each, with SGD, make the updates of one step per group, in order; the
    version goes up by one."""
    split = make_actor(model_dir, optimizer="sgd", ppo_mini_batch_size=1)
    one_by_one = make_actor(model_dir, optimizer="sgd")
    groups = make_groups(split)
    metrics = split.train_step(groups)
    firsts = [one_by_one.train_step([group]) for group in groups]
    assert split.version == 1
    assert metrics["train/num_updates"] == 2
    assert metrics["train/num_trajectories"] == 6
    assert len(split.update_metrics) == 2
    for update, alone in zip(split.update_metrics, firsts, strict=True):
        for name, value in update.items():
            assert alone[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
    assert metrics["train/loss"] == pytest.approx((firsts[0]["train/loss"] + firsts[1]["train/loss"]) / 2)
    assert_weights_close(weights_of(split), weights_of(one_by_one))
    with pytest.raises(BatchError, match="ppo_mini_batch_size"):
        make_actor(model_dir, ppo_mini_batch_size=2).train_step([*groups, groups[0]])


@pytest.mark.parametrize("correction", ["none", "decoupled"])
def test_the_clip_acts_on_the_later_updates_of_a_step(model_dir: Path, correction: str) -> None:
    """Fresh data and three epochs: the first update's ratio is 1 everywhere (nothing is clipped); the old
    (rollout) and proximal logprobs stay those from before the first update, so the later updates' ratios
    move and the clip acts."""
    actor = make_actor(
        model_dir, optimizer="sgd", lr=1.0, grad_clip=0.0, ppo_epochs=3, off_policy_correction=correction
    )
    groups = make_groups(actor)
    metrics = actor.train_step(groups)
    first, *later = actor.update_metrics
    assert actor.version == 1
    assert metrics["train/num_updates"] == 3
    assert first["train/clip_frac"] == 0.0
    assert first["train/ppo_ratio/mean"] == pytest.approx(1.0, abs=1e-5)
    for update in later:
        assert update["train/clip_frac"] > 0.0
        assert update["train/ppo_ratio/mean"] != pytest.approx(1.0, abs=1e-3)
    if correction == "decoupled":
        # Fresh data: the proximal policy is the behaviour policy, whatever the update.
        assert all(
            u["train/off_policy/weight_mean"] == pytest.approx(1.0, abs=1e-4) for u in actor.update_metrics
        )


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_micro_batches_give_the_full_batch_update(model_dir: Path, aggregation: str) -> None:
    whole = make_actor(model_dir, optimizer="sgd", micro_batch_size=6, loss_aggregation=aggregation)
    split = make_actor(model_dir, optimizer="sgd", micro_batch_size=1, loss_aggregation=aggregation)
    groups = make_groups(whole)
    whole_metrics = whole.train_step(groups)
    split_metrics = split.train_step(groups)
    for name, value in whole_metrics.items():
        assert split_metrics[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
    assert_weights_close(weights_of(whole), weights_of(split))


def test_grad_clip_bounds_the_update(model_dir: Path) -> None:
    clipped = make_actor(model_dir, optimizer="sgd", grad_clip=1e-3, lr=1.0)
    free = make_actor(model_dir, optimizer="sgd", grad_clip=0.0, lr=1.0)
    before = weights_of(clipped)
    groups = make_groups(clipped)
    clipped_metrics = clipped.train_step(groups)
    free_metrics = free.train_step(groups)
    assert clipped_metrics["train/grad_norm"] == pytest.approx(free_metrics["train/grad_norm"], rel=1e-5)
    assert clipped_metrics["train/grad_norm"] > 1e-3

    def update(actor: TorchActor) -> torch.Tensor:
        # Parameters, not the state dict: the tied embedding must count once.
        return torch.cat(
            [(p.detach() - before[name]).flatten().double() for name, p in actor.module.named_parameters()]
        )

    clipped_update, free_update = update(clipped), update(free)
    assert clipped_update.norm().item() == pytest.approx(1e-3, rel=1e-2)  # lr 1 x the clipped norm
    assert free_update.norm().item() == pytest.approx(free_metrics["train/grad_norm"], rel=1e-2)
    cosine = torch.nn.functional.cosine_similarity(clipped_update, free_update, dim=0)
    assert cosine.item() == pytest.approx(1.0, abs=1e-3)


def test_adamw_steps_change_the_weights_and_count_versions(model_dir: Path) -> None:
    actor = make_actor(model_dir, optimizer="adamw", lr=1e-3)
    groups = make_groups(actor)
    before = weights_of(actor)
    for step in range(2):
        metrics = actor.train_step(groups)
        assert actor.version == step + 1
        assert all(math.isfinite(value) for value in metrics.values())
    after = weights_of(actor)
    assert any(not torch.equal(before[name], after[name]) for name in before)


DTYPES = [
    "float32",
    pytest.param(
        "bfloat16",
        marks=pytest.mark.skipif(
            not bfloat16_supported(torch.device("cpu")), reason="this CPU has no native bfloat16"
        ),
    ),
]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_reference_forward_is_the_policy_forward(model_dir: Path, dtype: str) -> None:
    """Before any update the reference is the policy, computed the same way: equal logprobs, bit for bit
    (a bfloat16 copy of the reference, beside the policy's float32 weights under autocast, gave a first-step
    `train/kl` of 1e-4 with k1 on a CPU, 6e-5 on an H200)."""
    actor = make_actor(model_dir, kl_coef=0.1, dtype=dtype)
    assert actor.reference is not None
    reference = actor._reference_logits
    assert reference is not None
    batches = pack_mini_batches(
        make_groups(actor), actor.pad_id, 2, normalize_std=True, aggregation="token_mean"
    )
    for batch in batches:
        for part in batch.rank_micro_batches(0, 1, 3):
            first = actor._first_trained_column(part)
            policy = actor._trained_logprobs(actor._logits_at, part, first)[0]
            with torch.no_grad():
                referenced = actor._trained_logprobs(reference, part, first)[0]
            assert torch.equal(policy.detach(), referenced)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kl_to_the_reference_is_zero_until_the_policy_moves(model_dir: Path, dtype: str) -> None:
    # k1 (the mean log-ratio) shows any difference at first order; k3 would square it away.
    actor = make_actor(model_dir, kl_coef=0.1, kl_estimator="k1", lr=1e-2, dtype=dtype)
    groups = make_groups(actor)
    first = actor.train_step(groups)
    second = actor.train_step(groups)
    assert first["train/kl"] == 0.0
    assert abs(second["train/kl"]) > 1e-6
    assert make_actor(model_dir).reference is None


def test_decoupled_correction_reports_the_behaviour_gap(model_dir: Path) -> None:
    actor = make_actor(model_dir, off_policy_correction="decoupled", off_policy_max_weight=1.5)
    groups = make_groups(actor)
    fresh = actor.train_step(groups)
    assert fresh["train/off_policy/weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert fresh["train/off_policy/truncated_frac"] == 0.0
    # Make the behaviour policy much less likely than the actor on the first trained token of each row.
    for group in groups:
        for trajectory in group.trajectories:
            trajectory.rollout_logprobs[0] -= 2.0
    stale = actor.train_step(groups)
    assert stale["train/off_policy/truncated_frac"] > 0.0
    assert stale["train/off_policy/behaviour_kl"] > 0.0
    assert stale["train/ppo_ratio/mean"] == pytest.approx(1.0, abs=1e-5)  # against the proximal policy
    plain = make_actor(model_dir)
    assert "train/off_policy/weight_mean" not in plain.train_step(groups)


def test_malformed_groups_leave_the_actor_unchanged(model_dir: Path) -> None:
    actor = make_actor(model_dir)
    groups = make_groups(actor)
    groups[1].trajectories[0].versions.append(0)
    before = weights_of(actor)
    with pytest.raises(BatchError, match=r"group 1 .*trajectory 0: versions"):
        actor.train_step(groups)
    assert actor.version == 0
    assert_weights_close(before, weights_of(actor), rtol=0.0, atol=0.0)


def test_a_share_trains_as_the_groups_it_was_cut_from(model_dir: Path) -> None:
    # What the runner hands a rank (its `BatchShare`, by reference) and the groups themselves give the same
    # step, bit for bit; a share cut for another rank is refused before anything changes.
    from_groups, from_share = make_actor(model_dir, optimizer="sgd"), make_actor(model_dir, optimizer="sgd")
    groups = make_groups(from_groups)
    (share,) = split_batch(groups, 1, None, normalize_std=True)
    assert from_share.train_step(share) == from_groups.train_step(groups)
    assert_weights_close(weights_of(from_groups), weights_of(from_share), rtol=0.0, atol=0.0)
    other = split_batch(groups, 2, None, normalize_std=True)[1]
    before = weights_of(from_share)
    with pytest.raises(BatchError, match="rank 0 of 1 was handed the share of rank 1 of 2"):
        from_share.train_step(other)
    assert from_share.version == 1
    assert_weights_close(before, weights_of(from_share), rtol=0.0, atol=0.0)


def test_export_streams_hugging_face_names_in_buckets(model_dir: Path) -> None:
    actor = make_actor(model_dir)
    state = actor.module.state_dict()
    bucket_bytes = 300_000
    buckets = list(actor.export_weights(bucket_bytes))
    assert len(buckets) > 1
    largest = max(t.numel() * t.element_size() for t in state.values())
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= max(bucket_bytes, largest)
    exported = dict(name_tensor for bucket in buckets for name_tensor in bucket)
    # The tied output layer is the embedding: exported once, under the embedding's name.
    assert actor.module.config.tie_word_embeddings
    assert set(exported) == set(state) - {"lm_head.weight"}
    for name, tensor in exported.items():
        assert torch.equal(tensor, state[name])
    halves = dict(pair for bucket in actor.export_weights(1 << 30, dtype=torch.bfloat16) for pair in bucket)
    assert all(tensor.dtype == torch.bfloat16 for tensor in halves.values())
    with pytest.raises(ValueError, match="bucket_bytes"):
        next(iter(actor.export_weights(0)))


def test_checkpoint_round_trip_resumes_the_same_training(model_dir: Path, tmp_path: Path) -> None:
    actor = make_actor(model_dir, optimizer="adamw", lr=1e-3)
    groups = make_groups(actor)
    actor.train_step(groups)
    actor.save_checkpoint(str(tmp_path / "checkpoint"))
    generators = (random.random(), float(np.random.random()), float(torch.rand(1)))
    continued = actor.train_step(groups)

    resumed = make_actor(model_dir, optimizer="adamw", lr=1e-3)
    resumed.load_checkpoint(str(tmp_path / "checkpoint"))
    assert resumed.version == 1
    resumed_metrics = resumed.train_step(groups)
    assert resumed.version == 2
    assert resumed_metrics["train/loss"] == pytest.approx(continued["train/loss"], abs=1e-6)
    assert_weights_close(weights_of(actor), weights_of(resumed), rtol=0.0, atol=1e-7)

    # Every random generator continues where the checkpoint left it.
    generators = (random.random(), float(np.random.random()), float(torch.rand(1)))
    resumed.load_checkpoint(str(tmp_path / "checkpoint"))
    assert (random.random(), float(np.random.random()), float(torch.rand(1))) == generators

    # The checkpoint is a HuggingFace folder too.
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "checkpoint"), dtype=torch.float32)
    assert loaded.config.tie_word_embeddings


def test_bad_checkpoints_are_refused_without_change(model_dir: Path, tmp_path: Path) -> None:
    actor = make_actor(model_dir, optimizer="adamw")
    with pytest.raises(ActorError, match="no readable torch actor checkpoint"):
        actor.load_checkpoint(str(tmp_path / "missing"))
    actor.save_checkpoint(str(tmp_path / "adamw"))
    sgd = make_actor(model_dir, optimizer="sgd")
    with pytest.raises(ActorError, match="optimizer 'adamw'"):
        sgd.load_checkpoint(str(tmp_path / "adamw"))
    other = tiny_llama(tmp_path / "wider", hidden_size=32, num_heads=2, num_kv_heads=1)
    wide = TorchActor(
        TorchActorConfig(model_path=str(other), dtype="float32", temperature=1.0),
        AlgorithmConfig(group_size=2),
    )
    before = weights_of(wide)
    with pytest.raises(ActorError, match="does not fit the model"):
        wide.load_checkpoint(str(tmp_path / "adamw"))
    assert_weights_close(before, weights_of(wide), rtol=0.0, atol=0.0)


def test_model_path_must_be_a_model_folder(tmp_path: Path) -> None:
    with pytest.raises(AsyncRLError, match=r"actor.model_path: .* is not a HuggingFace model folder"):
        TorchActor(TorchActorConfig(model_path=str(tmp_path), temperature=1.0), AlgorithmConfig(group_size=2))
    with pytest.raises(ActorError, match="tensor_parallel_size"):
        TorchActor(
            TorchActorConfig(model_path=str(tmp_path), tensor_parallel_size=2), AlgorithmConfig(group_size=2)
        )


def test_bfloat16_is_used_where_the_device_supports_it(
    model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        actor = make_actor(model_dir, dtype="bfloat16")
    if bfloat16_supported(torch.device("cpu")):
        assert actor.compute_dtype == torch.bfloat16
    else:
        assert actor.compute_dtype == torch.float32
        assert "no native bfloat16" in caplog.text
    assert all(p.dtype == torch.float32 for p in actor.module.parameters())  # master weights
    metrics = actor.train_step(make_groups(actor))
    assert math.isfinite(metrics["train/loss"])


def test_gradient_checkpointing_gives_the_same_update(model_dir: Path) -> None:
    plain = make_actor(model_dir, optimizer="sgd")
    checkpointed = make_actor(model_dir, optimizer="sgd", gradient_checkpointing=True)
    groups = make_groups(plain)
    plain.train_step(groups)
    checkpointed.train_step(groups)
    assert_weights_close(weights_of(plain), weights_of(checkpointed))


def test_a_non_finite_gradient_skips_the_step(model_dir: Path) -> None:
    actor = make_actor(model_dir, optimizer="sgd")
    groups = make_groups(actor)
    # A behaviour logprob of -1e4 under a negative advantage makes the unclipped term overflow.
    losing = next(t for t in groups[0].trajectories if t.reward == 0.0)
    losing.rollout_logprobs[0] = -1e4
    before = weights_of(actor)
    with pytest.raises(ActorError, match="non-finite gradient at version 0: the step was skipped"):
        actor.train_step(groups)
    assert actor.version == 0
    assert_weights_close(before, weights_of(actor), rtol=0.0, atol=0.0)
    assert all(p.grad is None for p in actor.module.parameters())


def test_a_non_finite_gradient_in_a_later_update_keeps_the_updates_before_it(model_dir: Path) -> None:
    actor = make_actor(model_dir, optimizer="sgd", ppo_mini_batch_size=1)  # one update per group
    groups = make_groups(actor)
    losing = next(t for t in groups[1].trajectories if t.reward == 0.0)
    losing.rollout_logprobs[0] = -1e4  # overflows the second update's loss only
    before = weights_of(actor)
    message = (
        "non-finite gradient in update 2 of the step: the 1 updates before it were applied and the version "
        "is now 1"
    )
    with pytest.raises(ActorError, match=re.escape(message)):
        actor.train_step(groups)
    assert actor.version == 1
    after_first = weights_of(actor)
    assert any(not torch.equal(before[name], after_first[name]) for name in before)
    # The first update alone, from the same start, gives the same weights.
    alone = make_actor(model_dir, optimizer="sgd", ppo_mini_batch_size=1)
    alone.train_step(groups[:1])
    assert_weights_close(weights_of(alone), after_first, rtol=0.0, atol=0.0)


def test_the_torch_actor_meets_the_actor_protocol(model_dir: Path) -> None:
    actor: Actor = make_actor(model_dir)
    assert isinstance(actor, Actor)
    assert actor.version == 0


@pytest.mark.parametrize("plain", [True, False], ids=["output-layer-at-trained-positions", "full-forward"])
def test_logits_at_trained_positions_are_the_full_forward_logits(model_dir: Path, plain: bool) -> None:
    actor = make_actor(model_dir)
    module = actor.module
    assert LossPositionLogits(module).plain  # a Llama: the output layer runs at the trained positions only
    logits_at = LossPositionLogits(module)
    logits_at.plain = plain
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, module.config.vocab_size, (3, 12), generator=generator)
    position_ids = torch.arange(12).expand(3, 12)
    first = 4
    mask = torch.rand((3, 12 - first), generator=generator) < 0.4
    mask[0, :] = False  # a row with nothing trained
    with torch.no_grad():
        expected = module(input_ids=input_ids, position_ids=position_ids).logits[:, first:][mask]
        got = logits_at(input_ids, position_ids, mask, first)
    assert got.shape == (int(mask.sum()), module.config.vocab_size)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_actor_seeds_every_generator_from_the_run_seed(model_dir: Path) -> None:
    draws = []
    for seed in (5, 5, 6):
        TorchActor(
            TorchActorConfig(model_path=str(model_dir), dtype="float32", temperature=1.0),
            AlgorithmConfig(group_size=2),
            seed=seed,
        )
        draws.append((random.random(), float(np.random.random()), float(torch.rand(1))))
    assert draws[0] == draws[1]
    assert all(a != b for a, b in zip(draws[0], draws[2], strict=True))
