"""The Megatron actor on CPU (TP=1, in this process): checkpoints resume the same training, bad settings and
bad checkpoints are refused without change."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from asyncrl_core.algorithms import LossSettings
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
        "dtype": "float32",
        "optimizer": "adamw",
        "lr": 1e-2,
    }
    return MegatronActor(MegatronActorSettings(**fields | changes), LossSettings())  # pyright: ignore[reportArgumentType]


def _weights(actor: MegatronActor) -> dict[str, torch.Tensor]:
    return {name: t.clone() for bucket in actor.export_weights(1 << 20) for name, t in bucket}


def test_checkpoint_resumes_the_same_training(model_dir: Path, tmp_path: Path) -> None:
    actor = _actor(model_dir)
    actor.train_step(_groups(0))
    actor.save_checkpoint(str(tmp_path / "ckpt"))
    actor.train_step(_groups(1))
    expected = _weights(actor)

    resumed = _actor(model_dir)
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
    with pytest.raises(MegatronActorError, match="is not a asyncrl-megatron-actor-1 checkpoint"):
        other.load_checkpoint(str(folder))
    assert other.version == 0
    for name, tensor in before.items():
        torch.testing.assert_close(_weights(other)[name], tensor, rtol=0, atol=0, msg=name)


def test_settings_it_cannot_honour_are_refused(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(MegatronActorError, match="pipeline_parallel_size"):
        _actor(model_dir, pipeline_parallel_size=2)
    with pytest.raises(MegatronActorError, match="not a HuggingFace model folder"):
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
