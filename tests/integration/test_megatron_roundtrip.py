"""Weights exported by the Megatron actor (TP=1 and TP=2, on CPU) and loaded into the built-in engine give the
same logits as the actor's own forward pass on the same tokens, after a training step has changed them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncrl_core.algorithms import LossSettings
from asyncrl_core.models import tiny_llama
from asyncrl_core.types import NO_VERSION, Group, Trajectory
from asyncrl_megatron.parallel import spawn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SPAWN_TIMEOUT_S = 480.0
TOKENS = [1, 504, 3067, 28, 905, 17, 2, 9001, 4412, 12, 77, 30000]


def _groups() -> list[Group]:
    generator = torch.Generator().manual_seed(3)
    trajectories = [
        Trajectory(
            token_ids=torch.randint(10, 49000, (9,), generator=generator).tolist(),
            prompt_len=4,
            loss_mask=[1, 1, 0, 1, 1],
            rollout_logprobs=[-10.5, -11.0, 0.0, -10.9, -10.7],
            versions=[0, 0, NO_VERSION, 0, 0],
            reward=reward,
        )
        for reward in (0.0, 1.0, 1.0)
    ]
    return [Group(group_id=0, prompt_index=0, trajectories=trajectories)]


def _export_and_compare(model_dir: str, tensor_parallel_size: int) -> dict[str, Any]:
    """Train a step, export into the built-in engine, compare logits; runs in-process or in spawned ranks."""
    from asyncrl_engine.model import EngineModel
    from asyncrl_megatron import parallel
    from asyncrl_megatron.actor import MegatronActor, MegatronActorSettings

    try:
        actor = MegatronActor(
            MegatronActorSettings(
                model_path=model_dir, temperature=1.0, dtype="float32", optimizer="adamw", lr=1e-2,
                tensor_parallel_size=tensor_parallel_size,
            ),
            LossSettings(),
        )  # fmt: skip
        metrics = actor.train_step(_groups())
        engine = EngineModel.from_pretrained(model_dir, "cpu", torch.float32)
        tokens = torch.tensor(TOKENS)
        before = engine.forward_logits(tokens)
        num_buckets = 0
        for bucket in actor.export_weights(64 * 1024):
            engine.load_named_tensors(bucket)
            num_buckets += 1
        return {
            "actor": actor.forward_logits(tokens),
            "engine": engine.forward_logits(tokens),
            "engine_before": before,
            "num_buckets": num_buckets,
            "loss": metrics["train/loss"],
        }
    finally:
        parallel.destroy()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


def _check(result: dict[str, Any]) -> None:
    assert result["num_buckets"] > 1
    assert result["actor"].shape == (len(TOKENS), 49152)
    # The step moved the weights: the engine's logits changed, and now match the actor's.
    assert (result["engine_before"] - result["engine"]).abs().max().item() > 1e-4
    torch.testing.assert_close(result["engine"], result["actor"], rtol=1e-4, atol=1e-4)


def test_megatron_export_loads_into_the_builtin_engine_tp1(model_dir: Path) -> None:
    _check(_export_and_compare(str(model_dir), 1))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_megatron_export_loads_into_the_builtin_engine_tp2(model_dir: Path) -> None:
    results = spawn(_export_and_compare, 2, (str(model_dir), 2), timeout_s=SPAWN_TIMEOUT_S)
    for result in results:
        _check(result)
    torch.testing.assert_close(results[0]["actor"], results[1]["actor"], rtol=0, atol=0)
