"""The Megatron actor on CPU (TP=1, in this process): an SGD step at a temperature other than 1 equals a
hand-written update, the clip acts on the later updates of a step, checkpoints resume the same training, bad
settings and bad checkpoints are refused without change."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncrl_core.algorithms import LossSettings
from asyncrl_core.errors import AsyncRLError
from asyncrl_core.metrics import TRAIN_KL
from asyncrl_core.models import tiny_llama
from asyncrl_core.types import NO_VERSION, Group, Trajectory
from asyncrl_megatron import parallel
from asyncrl_megatron.actor import MegatronActor, MegatronActorError, MegatronActorSettings

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tiny_llama(tmp_path_factory.mktemp("tiny") / "model")
    parallel.destroy()


def _groups(seed: int) -> list[Group]:
    generator = torch.Generator().manual_seed(seed)
    trajectories = [
        Trajectory(
            token_ids=torch.randint(10, 49000, (8,), generator=generator).tolist(),
            prompt_len=3,
            loss_mask=[1, 0, 1, 1, 1],
            rollout_logprobs=[-10.6, 0.0, -10.9, -10.8, -10.7],
            versions=[0, NO_VERSION, 0, 0, 0],
            reward=reward,
        )
        for reward in (0.0, 1.0, 0.5)
    ]
    return [Group(group_id=seed, prompt_index=seed, trajectories=trajectories)]


def _actor(model_dir: Path, **changes: object) -> MegatronActor:
    fields: dict[str, object] = {
        "model_path": str(model_dir),
        "temperature": 1.0,
        "dtype": "float32",
        "optimizer": "adamw",
        "lr": 1e-2,
    }
    return MegatronActor(MegatronActorSettings(**fields | changes), LossSettings())  # pyright: ignore[reportArgumentType]


def _weights(actor: MegatronActor) -> dict[str, torch.Tensor]:
    return {name: t.clone() for bucket in actor.export_weights(1 << 20) for name, t in bucket}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_checkpoint_resumes_the_same_training(model_dir: Path, tmp_path: Path, dtype: str) -> None:
    # In bfloat16 the optimizer steps float32 master weights: they are saved too, or the next step differs.
    actor = _actor(model_dir, dtype=dtype)
    actor.train_step(_groups(0))
    actor.save_checkpoint(str(tmp_path / "ckpt"))
    actor.train_step(_groups(1))
    expected = _weights(actor)

    resumed = _actor(model_dir, dtype=dtype)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert resumed.version == 1
    resumed.train_step(_groups(1))
    assert resumed.version == 2
    for name, tensor in expected.items():
        torch.testing.assert_close(_weights(resumed)[name], tensor, rtol=0, atol=0, msg=name)
    # The HuggingFace copy is a complete folder the engines can load.
    hf = tmp_path / "ckpt" / "hf"
    assert (hf / "config.json").is_file()
    assert (hf / "model.safetensors").is_file()


def _train_save_and_continue(model_dir: str, folder: str) -> dict[str, dict[str, torch.Tensor]]:
    """At TP = 2 (one of two spawned ranks): a step, a checkpoint, another step; the weights after each."""
    try:
        actor = _actor(Path(model_dir), tensor_parallel_size=2)
        actor.train_step(_groups(0))
        saved = _weights(actor)
        actor.save_checkpoint(folder)
        actor.train_step(_groups(1))
        return {"saved": saved, "continued": _weights(actor)}
    finally:
        parallel.destroy()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_checkpoint_saved_at_tp2_resumes_at_tp1(model_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    first, _ = parallel.spawn(_train_save_and_continue, 2, (str(model_dir), str(folder)), timeout_s=480)
    resumed = _actor(model_dir)
    resumed.load_checkpoint(str(folder))
    assert resumed.version == 1
    restored = _weights(resumed)
    assert set(restored) == set(first["saved"])
    for name, tensor in first["saved"].items():
        torch.testing.assert_close(restored[name], tensor, rtol=0, atol=0, msg=name)
    # AdamW's moments came back too: the next step at TP = 1 is the one TP = 2 made (the moments decide
    # every update's size; zeros would make the step about lr = 1e-2 per weight). The two sum the gradients in
    # another order, and Adam divides by the root of the second moment, so a weight whose gradients are near
    # 0 turns rounding into an update difference of ~1e-6: the bound is a thousandth of lr, not float32's.
    resumed.train_step(_groups(1))
    continued = _weights(resumed)
    for name, tensor in first["continued"].items():
        torch.testing.assert_close(continued[name], tensor, rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_first_step_has_no_kl_to_the_starting_policy(model_dir: Path, dtype: str) -> None:
    actor = MegatronActor(
        MegatronActorSettings(model_path=str(model_dir), temperature=1.0, dtype=dtype, lr=1e-2),  # pyright: ignore[reportArgumentType]
        # The groups' advantages move the policy; the entropy bonus moves it even where they are 0.
        LossSettings(kl_coef=0.1, entropy_coef=0.01),
    )
    assert {p.dtype for p in actor.module.parameters()} == {getattr(torch, dtype)}
    assert actor.reference is not None
    assert {p.dtype for p in actor.reference.parameters()} == {getattr(torch, dtype)}
    # The reference is the starting policy, computed the same way: the KL is 0, not merely small.
    assert actor.train_step(_groups(0))[TRAIN_KL] == 0.0
    # Once the policy has moved the metric is live (and would show any difference of the two passes).
    assert actor.train_step(_groups(0))[TRAIN_KL] > 1e-6


def test_bad_checkpoints_are_refused_without_change(model_dir: Path, tmp_path: Path) -> None:
    actor = _actor(model_dir)
    actor.train_step(_groups(0))
    folder = tmp_path / "ckpt"
    actor.save_checkpoint(str(folder))
    other = _actor(model_dir, optimizer="sgd")
    before = _weights(other)
    with pytest.raises(MegatronActorError, match="optimizer 'adamw'"):
        other.load_checkpoint(str(folder))
    with pytest.raises(MegatronActorError, match="no readable Megatron actor checkpoint"):
        other.load_checkpoint(str(tmp_path / "missing"))
    state = json.loads((folder / "actor_state.json").read_text())
    (folder / "actor_state.json").write_text(json.dumps(state | {"format": "something-else"}))
    with pytest.raises(MegatronActorError, match="is not a asyncrl-megatron-actor-2 checkpoint"):
        other.load_checkpoint(str(folder))
    assert other.version == 0
    for name, tensor in before.items():
        torch.testing.assert_close(_weights(other)[name], tensor, rtol=0, atol=0, msg=name)


def test_settings_it_cannot_honour_are_refused(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(MegatronActorError, match="pipeline_parallel_size"):
        _actor(model_dir, pipeline_parallel_size=2)
    with pytest.raises(AsyncRLError, match=r"actor.model_path: .* is not a HuggingFace model folder"):
        _actor(tmp_path)
    with pytest.raises(MegatronActorError, match="sequence_parallel"):
        _actor(model_dir, sequence_parallel=True)


def test_a_non_finite_gradient_skips_the_step_without_change(model_dir: Path) -> None:
    actor = _actor(model_dir)
    before = _weights(actor)
    # A NaN in one parameter's gradient reaches one element of DDP's gradient buffers.
    parameter = next(p for p in actor.module.parameters() if p.requires_grad and p.dim() == 2)

    def poison(grad: torch.Tensor) -> torch.Tensor:
        return grad.index_fill(0, torch.tensor([0]), float("nan"))

    handle = parameter.register_hook(poison)
    with pytest.raises(MegatronActorError, match="non-finite gradient at version 0"):
        actor.train_step(_groups(0))
    handle.remove()
    assert actor.version == 0
    for name, tensor in _weights(actor).items():
        torch.testing.assert_close(tensor, before[name], rtol=0, atol=0, msg=name)
    actor.train_step(_groups(0))  # the next batch trains as usual
    assert actor.version == 1


def _fresh_groups(model_dir: Path, temperature: float) -> list[Group]:
    """Two groups whose rollout logprobs are the model's own at `temperature`, with a tool token each."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    generator = torch.Generator().manual_seed(5)
    groups: list[Group] = []
    for group_index in range(2):
        trajectories: list[Trajectory] = []
        for index, reward in enumerate((0.0, 1.0, 0.5)):
            prompt_len, response_len = 3 + group_index, 4 + index
            token_ids = torch.randint(10, 2000, (prompt_len + response_len,), generator=generator)
            with torch.no_grad():
                logits = model(input_ids=token_ids[None]).logits[0, prompt_len - 1 : -1]
            log_p = torch.log_softmax(logits / temperature, -1)
            logprobs = log_p.gather(-1, token_ids[prompt_len:, None]).squeeze(-1).tolist()
            mask = [1] * response_len
            mask[1] = 0
            trajectories.append(
                Trajectory(
                    token_ids=token_ids.tolist(),
                    prompt_len=prompt_len,
                    loss_mask=mask,
                    rollout_logprobs=[lp if m else 0.0 for lp, m in zip(logprobs, mask, strict=True)],
                    versions=[0 if m else NO_VERSION for m in mask],
                    reward=reward,
                )
            )
        groups.append(Group(group_id=group_index, prompt_index=group_index, trajectories=trajectories))
    return groups


def test_sgd_step_at_a_temperature_equals_a_hand_written_update(model_dir: Path) -> None:
    """One SGD step at T = 0.7, with the entropy bonus, moves every weight by `-lr * grad` of the GRPO loss
    written out independently on the HuggingFace model."""
    temperature, lr, entropy_coef = 0.7, 0.1, 0.05
    groups = _fresh_groups(model_dir, temperature)
    actor = MegatronActor(
        MegatronActorSettings(
            model_path=str(model_dir), temperature=temperature, dtype="float32", optimizer="sgd", lr=lr,
            grad_clip=0.0, micro_batch_size=2,
        ),
        LossSettings(entropy_coef=entropy_coef),
    )  # fmt: skip
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    loss = torch.zeros(())
    num_tokens = sum(sum(t.loss_mask) for g in groups for t in g.trajectories)
    for group in groups:
        rewards = torch.tensor([t.reward for t in group.trajectories], dtype=torch.float64)
        advantages = ((rewards - rewards.mean()) / (rewards.std() + 1e-6)).float()
        for trajectory, advantage in zip(group.trajectories, advantages, strict=True):
            ids = torch.tensor(trajectory.token_ids)
            start = trajectory.prompt_len - 1
            log_p = torch.log_softmax(reference(input_ids=ids[None]).logits[0, start:-1] / temperature, -1)
            response = log_p.gather(-1, ids[start + 1 :, None]).squeeze(-1)
            ratio = torch.exp(response - torch.tensor(trajectory.rollout_logprobs))
            per_token = torch.maximum(-advantage * ratio, -advantage * ratio.clamp(0.8, 1.2))
            per_token = per_token + entropy_coef * (log_p.exp() * log_p).sum(dim=-1)
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
    updated = _weights(actor)
    assert set(expected) - {"lm_head.weight"} <= set(updated)
    for name in set(expected) & set(updated):
        torch.testing.assert_close(updated[name], expected[name], rtol=1e-4, atol=1e-5, msg=name)


def test_the_clip_acts_on_the_later_updates_of_a_step(model_dir: Path) -> None:
    """Two epochs of one-group mini-batches under the decoupled correction: the proximal logprobs are taken
    before the first update, so the first update's ratio is 1 and the later ones' are not."""
    groups = _fresh_groups(model_dir, 1.0)
    actor = MegatronActor(
        MegatronActorSettings(
            model_path=str(model_dir), temperature=1.0, dtype="float32", optimizer="sgd", lr=1.0,
            grad_clip=0.0, ppo_mini_batch_size=1, ppo_epochs=2,
        ),
        LossSettings(off_policy_correction="decoupled"),
    )  # fmt: skip
    metrics = actor.train_step(groups)
    assert actor.version == 1
    assert metrics["train/num_updates"] == 4
    first, *later = actor.update_metrics
    assert first["train/clip_frac"] == 0.0
    assert first["train/ppo_ratio/mean"] == pytest.approx(1.0, abs=1e-5)
    assert all(update["train/clip_frac"] > 0.0 for update in later[1:])  # the epoch over moved weights
    assert later[0]["train/ppo_ratio/mean"] != pytest.approx(1.0, abs=1e-4)  # group 2 after group 1's update


def test_the_actor_seeds_every_generator_from_its_seed(model_dir: Path) -> None:
    # `runner.seed` reaches the Megatron actor as its settings' seed (`from_run_config`).
    draws: list[tuple[float, float, float]] = []
    for seed in (5, 5, 6):
        _actor(model_dir, seed=seed)
        draws.append((random.random(), float(np.random.rand()), float(torch.rand(1))))
    assert draws[0] == draws[1]
    assert all(a != b for a, b in zip(draws[0], draws[2], strict=True))
