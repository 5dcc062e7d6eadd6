"""The runner with the Megatron actor at tensor parallelism 2 (two gloo ranks on the CPU) pushing its weights
over the distributed transport into two engines. One run serves every check: after its last sync both engines
hold the actor's weights tensor by tensor, the first step's KL to the reference (the starting policy) is 0,
and the checkpoint it saved at TP = 2 passes its manifest check.

The engines are started here (`launch: external`), so they outlive the run and can be read after it; the
actor's weights are those of the checkpoint the run saved after its last step, whose version the engines
report.

The tensor transport (safetensors in each engine's request body) takes the same path through two actor
ranks built without Ray (`parallel.spawn`): both engines get the actor's weights, and a push that fails
(an engine that does not answer) leaves both ranks in step for the next collective."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_process import serve_builtin
from runner_testing import read_metrics, read_summary, run_config

from asyncrl_core import metrics
from asyncrl_core.config import AsyncRLConfig
from asyncrl_core.runner import run
from asyncrl_core.runner.checkpoint import ACTOR_DIR, checkpoints, verify_checkpoint
from asyncrl_core.server_process import free_port
from asyncrl_core.types import NO_VERSION, Group, Trajectory
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


def _groups() -> list[Group]:
    """Two groups (`data.rollout_batch_size` of the run's configuration)."""
    generator = torch.Generator().manual_seed(3)
    return [
        Group(
            group_id=group_id,
            prompt_index=group_id,
            trajectories=[
                Trajectory(
                    token_ids=torch.randint(10, 49000, (9,), generator=generator).tolist(),
                    prompt_len=4,
                    loss_mask=[1, 1, 0, 1, 1],
                    rollout_logprobs=[-10.5, -11.0, 0.0, -10.9, -10.7],
                    versions=[0, 0, NO_VERSION, 0, 0],
                    reward=reward,
                )
                for reward in (0.0, 1.0)
            ],
        )
        for group_id in range(2)
    ]


def _train_and_push(config: AsyncRLConfig, model_dir: str, urls: list[str], dead_url: str) -> dict[str, Any]:
    """One of two spawned actor ranks (TP = 2): a step, a push into `urls`, a push that fails, an export."""
    from asyncrl_core.runner.workers import ActorWorker, EngineEndpoint, RankSettings
    from asyncrl_megatron import parallel

    try:
        rank = RankSettings(int(os.environ["RANK"]), 2, int(os.environ["MASTER_PORT"]))
        worker = ActorWorker(config, model_path=model_dir, devices=(), rank=rank)
        worker.actor.train_step(_groups())
        synced = worker.sync_weights([EngineEndpoint(url) for url in urls], "retract")
        failure = None
        try:
            worker.sync_weights([EngineEndpoint(dead_url)], "retract")
        except Exception as error:
            failure = repr(error)
        # A collective after the failed push: it completes only if both ranks left the push in step.
        weights = {name: t.clone() for bucket in worker.actor.export_weights(1 << 20) for name, t in bucket}
        return {"synced": synced, "failure": failure, "weights": weights, "version": worker.version}
    finally:
        parallel.destroy()


@pytest.mark.timeout(600)
def test_the_tensor_transport_from_two_ranks_into_two_engines(tmp_path: Path, tiny_llama_path: Path) -> None:
    with (
        serve_builtin(tiny_llama_path, max_running_requests=8) as first,
        serve_builtin(tiny_llama_path, max_running_requests=8) as second,
    ):
        urls = [first.url, second.url]
        config = run_config(
            tmp_path,
            tiny_llama_path,
            actor={"backend": "megatron", "tensor_parallel_size": 2, "lr": 1e-3},
            algorithm={"entropy_coef": 0.01},
            rollout={"sglang": {"launch": "external", "urls": urls, "weight_transport": "tensor"}},
        )
        from asyncrl_megatron.parallel import spawn

        dead_url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        sender, joiner = spawn(
            _train_and_push, 2, (config, str(tiny_llama_path), urls, dead_url), timeout_s=480
        )
        expected = sender["weights"]
        served = [asyncio.run(_served(url, {n: t.shape for n, t in expected.items()})) for url in urls]
    assert sender["synced"][metrics.TIME_SYNC_WEIGHTS] > 0.0
    assert joiner["synced"] == {}  # the joining rank gathered with the sender and sent nothing
    assert sender["failure"] is not None
    assert dead_url in sender["failure"]
    assert joiner["failure"] is None
    for engine, (weights, version) in enumerate(served):
        assert version == sender["version"] == 1
        for name, tensor in expected.items():
            message = f"engine {engine}: {name}"
            torch.testing.assert_close(weights[name], tensor.float(), rtol=0, atol=0, msg=message)
