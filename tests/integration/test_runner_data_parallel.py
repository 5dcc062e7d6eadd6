"""The torch actor at data parallelism 2 (two gloo ranks on the CPU) training through the runner and syncing
its weights into two engines, by each weight transport, and its checkpoints.

The engines are built-in engines this module starts itself (`launch: external`), so that they outlive the
runs: after each run their weights are read back (`/get_weights_by_name`) and compared, tensor by tensor,
with the actor's final weights, which the run's last checkpoint holds. Two runs share the engines: two
steps with the `tensor` transport, then a resume of that run for a third step with `distributed` (gloo).
The tests read what the runs left.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from runner_testing import read_metrics, read_summary, run_config
from safetensors.torch import load_file

from asyncrl_core import metrics
from asyncrl_core.config import AlgorithmConfig, TorchActorConfig
from asyncrl_core.runner import run
from asyncrl_core.runner.checkpoint import verify_checkpoint

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1200)]

STEPS = {"tensor": 2, "distributed": 3}
"""The last step of each run: the `distributed` run resumes the `tensor` run's for one more step."""


@dataclass(frozen=True)
class EnginesAfterRun:
    """What the two engines held when a run ended."""

    weights: list[dict[str, torch.Tensor]]
    """Every parameter of each engine, as it answered `/get_weights_by_name`."""
    versions: list[int]


@dataclass(frozen=True)
class Runs:
    run_dir: Path
    engines: dict[str, EnginesAfterRun]
    """By weight transport."""

    def actor_dir(self, step: int) -> Path:
        return self.run_dir / "checkpoints" / f"step_{step}" / "actor"


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> Iterator[None]:
    ray = pytest.importorskip("ray")

    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


async def _read_engine(url: str, shapes: dict[str, tuple[int, ...]]) -> tuple[dict[str, torch.Tensor], int]:
    from asyncrl_sglang.client import SGLangClient

    async with SGLangClient(url) as client:
        weights = {
            name: torch.tensor(await client.get_weights_by_name(name, truncate_size=shape[0]))
            for name, shape in shapes.items()
        }
        return weights, await client.weight_version()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny_llama_path: Path) -> Runs:
    from engine_process import serve_builtin

    tmp_path = tmp_path_factory.mktemp("dp")
    found: dict[str, EnginesAfterRun] = {}
    with ExitStack() as stack, ThreadPoolExecutor(2) as starting:
        engines = list(
            starting.map(
                lambda _: stack.enter_context(serve_builtin(tiny_llama_path, max_running_requests=8)),
                range(2),
            )
        )
        run_dir = tmp_path / "run"
        for transport, num_steps in STEPS.items():
            config = run_config(
                tmp_path,
                tiny_llama_path,
                runner={"num_steps": num_steps},
                cluster={"component_placement": {"actor": "0-1"}},
                actor={"data_parallel_size": 2, "micro_batch_size": 1},
                algorithm={"entropy_coef": 0.01},  # a gradient even when every reward of a group is equal
                rollout={
                    "sglang": {
                        "launch": "external",
                        "urls": [engine.url for engine in engines],
                        "weight_transport": transport,
                    }
                },
                checkpoint={"resume_from": "latest" if transport == "distributed" else None},
            )
            assert (config.actor_data_parallel_size, config.rollout.num_instances) == (2, 2)
            assert run(config) == run_dir
            saved = load_file(
                str(run_dir / "checkpoints" / f"step_{num_steps}" / "actor" / "model.safetensors")
            )
            shapes = {name: tuple(tensor.shape) for name, tensor in saved.items()}
            read = [asyncio.run(_read_engine(engine.url, shapes)) for engine in engines]
            found[transport] = EnginesAfterRun(
                [weights for weights, _ in read], [version for _, version in read]
            )
    return Runs(run_dir, found)


def test_every_step_trained_on_two_ranks(runs: Runs) -> None:
    records = [record for record in read_metrics(runs.run_dir) if metrics.TIME_STEP in record]
    assert [record["step"] for record in records] == [1, 2, 3]
    assert [record[metrics.WEIGHT_VERSION] for record in records] == [1.0, 2.0, 3.0]
    assert records[0][metrics.TRAIN_KL] == 0.0  # the policy starts as the reference, on both ranks
    assert records[2][metrics.TRAIN_KL] > 0.0
    summary = read_summary(runs.run_dir)
    assert summary["version"] == STEPS["distributed"]
    # The ranks met at the store a worker of its own hosted on rank 0's node, on the port it bound.
    address, port = summary["nodes"]["actor_master"].rsplit(":", 1)
    assert address == summary["nodes"]["actor"][0]
    assert int(port) > 0
    for step in STEPS.values():
        state = json.loads((runs.actor_dir(step) / "actor_state.json").read_text())
        # The ranks formed one process group (a rank alone would say 1) and held the same weights and
        # optimiser state when the checkpoint was taken (the actor compares them before writing).
        assert state["data_parallel_size"] == 2
        assert sorted(path.name for path in runs.actor_dir(step).glob("rng_state_rank*.json")) == [
            "rng_state_rank0.json",
            "rng_state_rank1.json",
        ]
        assert verify_checkpoint(runs.actor_dir(step).parent) == []


@pytest.mark.parametrize("transport", STEPS)
def test_every_engine_holds_the_actors_weights(runs: Runs, transport: str, tiny_llama_path: Path) -> None:
    step = STEPS[transport]
    saved = load_file(str(runs.actor_dir(step) / "model.safetensors"))
    before = (
        load_file(str(runs.actor_dir(step - 1) / "model.safetensors"))
        if step > 2
        else load_file(str(tiny_llama_path / "model.safetensors"))
    )
    assert any(not torch.equal(before[name], tensor) for name, tensor in saved.items())  # the run trained
    engines = runs.engines[transport]
    assert engines.versions == [step, step]
    for index, weights in enumerate(engines.weights):
        assert weights.keys() == saved.keys()
        for name, tensor in saved.items():
            assert torch.equal(weights[name], tensor), f"engine {index} differs from the actor at {name}"


def test_a_checkpoint_of_two_ranks_resumes_on_one(runs: Runs) -> None:
    """A torch actor checkpoint holds whole tensors (rank 0's, equal on every rank), so an actor with
    another number of ranks loads it: here one process, as a run resumed with `data_parallel_size: 1`."""
    from asyncrl_core.actor import TorchActor

    folder = runs.actor_dir(STEPS["distributed"])
    actor = TorchActor(
        TorchActorConfig(model_path=str(folder), dtype="float32", lr=1e-4, temperature=1.0),
        AlgorithmConfig(group_size=2),
    )
    actor.load_checkpoint(str(folder))
    assert actor.version == STEPS["distributed"]
    saved = load_file(str(folder / "model.safetensors"))
    for name, tensor in actor.module.state_dict().items():
        if name in saved:
            assert torch.equal(tensor, saved[name]), name
    assert len(actor.optimizer.state) == len(list(actor.module.parameters()))  # AdamW's moments, restored
