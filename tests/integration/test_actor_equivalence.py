"""The torch actor and the Megatron actor (TP=1 and TP=2, on CPU with gloo) compute the same objective and
make the same update: same weights and batch, float32, plain SGD -> same loss and metrics, and after one step
the same exported HuggingFace weights."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncrl_core.actor import TorchActor
from asyncrl_core.config import AlgorithmConfig, MegatronActorConfig, TorchActorConfig
from asyncrl_core.models import tiny_llama
from asyncrl_core.types import NO_VERSION, Group, Trajectory
from asyncrl_megatron.parallel import spawn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SPAWN_TIMEOUT_S = 480.0
COMPARED_METRICS = ("train/loss", "train/pg_loss", "train/clip_frac", "train/entropy", "train/grad_norm")

CASES: dict[str, dict[str, Any]] = {
    # The plain clipped surrogate, gradient clipping inactive.
    "plain": {"lr": 0.5, "grad_clip": 0.0},
    # Every term of the objective, and a clip that is active (the global norm across TP shards matters).
    "full": {
        "lr": 5.0,
        "grad_clip": 1e-3,
        "kl_coef": 0.1,
        "entropy_coef": 0.01,
        "off_policy_correction": "decoupled",
        "loss_aggregation": "sequence_mean",
    },
}


def _configs(model_dir: str, case: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    actor: dict[str, Any] = {
        "model_path": model_dir,
        "dtype": "float32",
        "optimizer": "sgd",
        "micro_batch_size": 2,
        "temperature": 1.0,
    }
    algorithm: dict[str, Any] = {"group_size": 3}
    for key, value in case.items():
        (algorithm if key in AlgorithmConfig.model_fields else actor)[key] = value
    return actor, algorithm


def _exported(actor: Any) -> dict[str, torch.Tensor]:
    return {
        name: tensor.detach().clone()
        for bucket in actor.export_weights(1 << 20, dtype=torch.float32)
        for name, tensor in bucket
    }


def _megatron_runs(model_dir: str, groups: list[Group], tensor_parallel_size: int) -> dict[str, Any]:
    """Train one step per case with the Megatron actor; runs in this process or in each spawned rank."""
    from asyncrl_megatron import parallel
    from asyncrl_megatron.actor import MegatronActor

    results: dict[str, Any] = {}
    try:
        for name, case in CASES.items():
            actor_fields, algorithm_fields = _configs(model_dir, case)
            actor_fields["tensor_parallel_size"] = tensor_parallel_size
            actor = MegatronActor.from_config(
                MegatronActorConfig.model_validate(actor_fields),
                AlgorithmConfig.model_validate(algorithm_fields),
            )
            before = _exported(actor)
            metrics = actor.train_step(groups)
            results[name] = {
                "before": before,
                "metrics": metrics,
                "after": _exported(actor),
                "version": actor.version,
            }
    finally:
        parallel.destroy()
    return results


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


def _torch_actor(model_dir: Path, case: dict[str, Any]) -> TorchActor:
    actor_fields, algorithm_fields = _configs(str(model_dir), case)
    return TorchActor(
        TorchActorConfig.model_validate(actor_fields), AlgorithmConfig.model_validate(algorithm_fields)
    )


@pytest.fixture(scope="module")
def groups(model_dir: Path) -> list[Group]:
    """Two groups of three trajectories with tool tokens, different lengths and rewards, and behaviour
    logprobs a little off the current policy (stale data, so the off-policy weight is not 1)."""
    actor = _torch_actor(model_dir, CASES["plain"])
    generator = torch.Generator().manual_seed(7)
    result: list[Group] = []
    for group_index in range(2):
        trajectories: list[Trajectory] = []
        for index in range(3):
            prompt_len, response_len = 3 + group_index, 4 + 2 * index
            token_ids = torch.randint(10, 49000, (prompt_len + response_len,), generator=generator).tolist()
            ids = torch.tensor(token_ids)
            logprobs = torch.log_softmax(actor.forward_logits(ids)[:-1], dim=-1).gather(-1, ids[1:, None])
            behaviour = logprobs.squeeze(-1)[prompt_len - 1 :] + 0.05 * torch.randn(
                response_len, generator=generator
            )
            mask = [0 if position == 1 else 1 for position in range(response_len)]
            trajectories.append(
                Trajectory(
                    token_ids=token_ids,
                    prompt_len=prompt_len,
                    loss_mask=mask,
                    rollout_logprobs=[float(lp) if m else 0.0 for lp, m in zip(behaviour, mask, strict=True)],
                    versions=[0 if m else NO_VERSION for m in mask],
                    reward=float((index * 3 + group_index) % 4),
                )
            )
        result.append(Group(group_id=group_index, prompt_index=group_index, trajectories=trajectories))
    return result


@pytest.fixture(scope="module")
def torch_results(model_dir: Path, groups: list[Group]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, case in CASES.items():
        actor = _torch_actor(model_dir, case)
        before = _exported(actor)
        metrics = actor.train_step(groups)
        results[name] = {
            "before": before,
            "metrics": metrics,
            "after": _exported(actor),
            "version": actor.version,
        }
    return results


def _assert_same_step(reference: dict[str, Any], megatron: dict[str, Any]) -> None:
    for name in CASES:
        ours, theirs = megatron[name], reference[name]
        assert ours["version"] == theirs["version"] == 1
        assert ours["before"].keys() == theirs["before"].keys()
        for key in ours["before"]:
            torch.testing.assert_close(ours["before"][key], theirs["before"][key], rtol=0, atol=0, msg=key)
        for metric in COMPARED_METRICS:
            assert ours["metrics"][metric] == pytest.approx(theirs["metrics"][metric], rel=1e-4, abs=1e-6), (
                metric
            )
        for metric in theirs["metrics"]:
            assert metric in ours["metrics"], metric
        # Compare the updates themselves, relative to the largest one, so tolerance cannot hide the step.
        theirs_delta = {key: theirs["after"][key] - theirs["before"][key] for key in theirs["after"]}
        ours_delta = {key: ours["after"][key] - ours["before"][key] for key in theirs["after"]}
        largest = max(delta.abs().max().item() for delta in theirs_delta.values())
        assert largest > 1e-5, "the step must move the weights"
        for key, delta in theirs_delta.items():
            torch.testing.assert_close(ours_delta[key], delta, rtol=1e-3, atol=1e-3 * largest, msg=key)


def test_megatron_actor_matches_the_torch_actor_tp1(
    model_dir: Path, groups: list[Group], torch_results: dict[str, Any]
) -> None:
    assert torch_results["full"]["metrics"]["train/grad_norm"] > CASES["full"]["grad_clip"], (
        "the clip is active"
    )
    _assert_same_step(torch_results, _megatron_runs(str(model_dir), groups, 1))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_megatron_actor_matches_the_torch_actor_tp2(
    model_dir: Path, groups: list[Group], torch_results: dict[str, Any]
) -> None:
    ranks = spawn(_megatron_runs, 2, (str(model_dir), groups, 2), timeout_s=SPAWN_TIMEOUT_S)
    for rank_results in ranks:
        _assert_same_step(torch_results, rank_results)
