"""The runner with the Megatron actor at tensor parallelism 2 (two gloo ranks on the CPU) pushing its weights
over the distributed transport into two engines. One run serves every check: after its last sync both engines
hold the actor's weights tensor by tensor, the first step's KL to the reference (the starting policy) is 0,
and the checkpoint it saved at TP = 2 passes its manifest check.

The engines are started here (`launch: external`), so they outlive the run and can be read after it; the
actor's weights are those of the checkpoint the run saved after its last step, whose version the engines
report."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from runner_testing import read_metrics, read_summary, run_config

from asyncrl_core import metrics
from asyncrl_core.runner import run
from asyncrl_core.runner.checkpoint import ACTOR_DIR, checkpoints, verify_checkpoint
from asyncrl_sglang.builtin.testing import serve_builtin
from asyncrl_sglang.client import SGLangClient

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

NUM_STEPS = 2


@dataclass(frozen=True)
class TensorParallelRun:
    run_dir: Path
    engine_weights: list[dict[str, torch.Tensor]]
    """Every tensor each engine served after the run, by HuggingFace name."""
    engine_versions: list[int]


async def _served(url: str, shapes: dict[str, torch.Size]) -> tuple[dict[str, torch.Tensor], int]:
    async with SGLangClient(url) as client:
        weights = {
            name: torch.tensor(await client.get_weights_by_name(name, shape[0]), dtype=torch.float32)
            for name, shape in shapes.items()
        }
        return weights, await client.weight_version()


def _checkpoint_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(checkpoints(run_dir)[-1] / ACTOR_DIR / "hf" / "model.safetensors"))


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory: pytest.TempPathFactory, tiny_llama_path: Path) -> Iterator[TensorParallelRun]:
    ray = pytest.importorskip("ray")
    tmp_path = tmp_path_factory.mktemp("megatron-tp2")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        with (
            serve_builtin(tiny_llama_path, max_running_requests=8) as first,
            serve_builtin(tiny_llama_path, max_running_requests=8) as second,
        ):
            config = run_config(
                tmp_path,
                tiny_llama_path,
                runner={"num_steps": NUM_STEPS},
                actor={"backend": "megatron", "tensor_parallel_size": 2, "lr": 1e-3},
                # The tiny model earns no reward, so every advantage is 0: an entropy bonus moves the weights.
                algorithm={"entropy_coef": 0.01},
                rollout={
                    "sglang": {
                        "launch": "external",
                        "urls": [first.url, second.url],
                        "weight_transport": "distributed",
                    }
                },
            )
            run_dir = run(config)
            shapes = {name: tensor.shape for name, tensor in _checkpoint_weights(run_dir).items()}
            served = [asyncio.run(_served(server.url, shapes)) for server in (first, second)]
        yield TensorParallelRun(
            run_dir, [weights for weights, _ in served], [version for _, version in served]
        )
    finally:
        ray.shutdown()


def test_it_trains_every_step(tp_run: TensorParallelRun) -> None:
    records = [record for record in read_metrics(tp_run.run_dir) if metrics.TIME_STEP in record]
    assert [record["step"] for record in records] == list(range(1, NUM_STEPS + 1))
    assert [record[metrics.WEIGHT_VERSION] for record in records] == [1.0, 2.0]
    assert all(record[metrics.TIME_SYNC_WEIGHTS] > 0.0 for record in records)
    assert read_summary(tp_run.run_dir)["version"] == NUM_STEPS


def test_every_engine_holds_the_actors_weights(tp_run: TensorParallelRun, tiny_llama_path: Path) -> None:
    from safetensors.torch import load_file

    expected = _checkpoint_weights(tp_run.run_dir)
    initial = load_file(str(tiny_llama_path / "model.safetensors"))
    assert not torch.equal(expected["model.embed_tokens.weight"], initial["model.embed_tokens.weight"])
    assert tp_run.engine_versions == [NUM_STEPS, NUM_STEPS]
    for engine, served in enumerate(tp_run.engine_weights):
        assert set(served) == set(expected)
        for name, tensor in expected.items():
            message = f"engine {engine}: {name}"
            torch.testing.assert_close(served[name], tensor.float(), rtol=0, atol=0, msg=message)


def test_the_first_step_has_no_kl_to_its_starting_policy(tp_run: TensorParallelRun) -> None:
    records = [record for record in read_metrics(tp_run.run_dir) if metrics.TIME_STEP in record]
    assert records[0][metrics.TRAIN_KL] == 0.0
    assert records[1][metrics.TRAIN_KL] > 0.0  # the update moved the policy: the metric is live


def test_the_checkpoint_is_intact(tp_run: TensorParallelRun) -> None:
    folder = checkpoints(tp_run.run_dir)[-1]
    assert verify_checkpoint(folder) == []
