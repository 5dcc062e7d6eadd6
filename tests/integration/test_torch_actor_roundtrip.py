"""Weights the torch actor exports, loaded into the built-in engine, give the logits of the actor's own
forward pass on the same tokens."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from asyncrl_core.actor import TorchActor
from asyncrl_core.config import AlgorithmConfig, TorchActorConfig
from asyncrl_core.models import tiny_llama
from asyncrl_core.types import NO_VERSION, Group, Trajectory
from asyncrl_engine.model import EngineModel

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def one_group(prompt: list[int], responses: list[list[int]]) -> Group:
    trajectories = [
        Trajectory(
            token_ids=prompt + response,
            prompt_len=len(prompt),
            loss_mask=[1] * len(response),
            rollout_logprobs=[-3.0] * len(response),
            versions=[0] * len(response),
            reward=float(index),
        )
        for index, response in enumerate(responses)
    ]
    for trajectory in trajectories:  # one tool token per response
        trajectory.loss_mask[0] = 0
        trajectory.rollout_logprobs[0] = 0.0
        trajectory.versions[0] = NO_VERSION
    return Group(group_id=0, prompt_index=0, trajectories=trajectories)


def trained_actor(model_path: str, lr: float) -> TorchActor:
    actor = TorchActor(
        TorchActorConfig(model_path=model_path, dtype="float32", optimizer="adamw", lr=lr, temperature=1.0),
        AlgorithmConfig(group_size=2),
    )
    group = one_group([11, 12, 13, 14], [[20, 21, 22, 23], [30, 31, 32]])
    metrics = actor.train_step([group])
    assert metrics["train/grad_norm"] > 0.0
    return actor


def assert_round_trip(actor: TorchActor, initial_dir: Path, bucket_bytes: int) -> None:
    engine = EngineModel.from_pretrained(initial_dir, device="cpu", dtype=torch.float32)
    tokens = torch.tensor([1, 17, 450, 9, 2024, 77, 3, 1200, 45, 6])
    before = engine.forward_logits(tokens)
    expected = actor.forward_logits(tokens)
    assert not torch.allclose(before, expected, atol=1e-4), "the step should have moved the weights"

    num_buckets = 0
    for bucket in actor.export_weights(bucket_bytes, dtype=torch.float32):
        engine.load_named_tensors(bucket)
        num_buckets += 1
    assert num_buckets > 1
    torch.testing.assert_close(engine.forward_logits(tokens), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.integration
def test_exported_tiny_llama_gives_the_actor_logits_in_the_engine(tmp_path: Path) -> None:
    model_dir = tiny_llama(tmp_path / "tiny")
    actor = trained_actor(str(model_dir), lr=1e-2)
    assert_round_trip(actor, model_dir, bucket_bytes=256 * 1024)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(600)  # 135M parameters, AdamW, on a shared CPU
def test_exported_smollm2_gives_the_actor_logits_in_the_engine() -> None:
    actor = trained_actor("smollm2-135m", lr=1e-4)
    assert_round_trip(actor, actor.model_path, bucket_bytes=64 * 1024 * 1024)
