"""Data parallelism: two gloo ranks on the CPU make the same update as one process on the same batch.

The test starts the ranks as subprocesses running this file as a script (`python test_torch_actor_ddp.py
--rank ...`), each with a timeout, and stops them whatever happens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncrl_core.actor import ActorError, ProcessGroupSettings, TorchActor, host_store
from asyncrl_core.actor.distributed import destroy_process_group, init_process_group
from asyncrl_core.config import AlgorithmConfig, TorchActorConfig
from asyncrl_core.models import tiny_llama
from asyncrl_core.types import NO_VERSION, Group, Trajectory

RANK_TIMEOUT_S = 240.0


def build_actor(model_dir: str) -> TorchActor:
    return TorchActor(
        TorchActorConfig(
            model_path=model_dir,
            dtype="float32",
            optimizer="sgd",
            lr=0.5,
            micro_batch_size=2,
            temperature=1.0,
        ),
        AlgorithmConfig(group_size=3),
    )


def make_groups() -> list[Group]:
    """Five trajectories of uneven lengths (so one rank gets an empty micro-batch), logprobs near the
    tiny model's, a tool token in each."""
    generator = torch.Generator().manual_seed(3)
    groups: list[Group] = []
    for group_index, group_size in enumerate((3, 2)):
        trajectories: list[Trajectory] = []
        for index in range(group_size):
            prompt_len, response_len = 3, 3 + 2 * index + group_index
            token_ids = torch.randint(10, 3000, (prompt_len + response_len,), generator=generator).tolist()
            mask = [1] * response_len
            mask[1] = 0
            logprobs = (-10.8 + 0.2 * torch.randn(response_len, generator=generator)).tolist()
            trajectories.append(
                Trajectory(
                    token_ids=token_ids,
                    prompt_len=prompt_len,
                    loss_mask=mask,
                    rollout_logprobs=[lp if m else 0.0 for lp, m in zip(logprobs, mask, strict=True)],
                    versions=[0 if m else NO_VERSION for m in mask],
                    reward=float(index == group_index),
                )
            )
        groups.append(Group(group_id=group_index, prompt_index=group_index, trajectories=trajectories))
    return groups


def parameters_of(actor: TorchActor) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone().contiguous() for name, p in actor.module.named_parameters()}


def run_rank(rank: int, world_size: int, port: int, model_dir: str, out: Path) -> None:
    """One data-parallel rank: join the group, train one step, write weights and metrics; save a
    checkpoint, then make rank 1's weights differ and try again (every rank must refuse)."""
    init_process_group(ProcessGroupSettings(rank, world_size, port, timeout_s=RANK_TIMEOUT_S), "cpu")
    try:
        actor = build_actor(model_dir)
        metrics = actor.train_step(make_groups())
        save_file(parameters_of(actor), str(out / f"weights-{rank}.safetensors"))
        (out / f"metrics-{rank}.json").write_text(json.dumps(metrics))
        actor.save_checkpoint(str(out / "checkpoint"))
        if rank == 1:
            with torch.no_grad():
                actor.module.get_parameter("model.norm.weight")[0] += 1e-3
        try:
            actor.save_checkpoint(str(out / "diverged"))
        except ActorError as error:
            (out / f"refused-{rank}.txt").write_text(str(error))
    finally:
        destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("tiny-ddp") / "model")


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(600)  # two fresh interpreters import torch and transformers on a shared CPU
def test_two_gloo_ranks_make_the_single_process_update(model_dir: Path, tmp_path: Path) -> None:
    single = build_actor(str(model_dir))
    single_metrics = single.train_step(make_groups())
    single_weights = parameters_of(single)

    store = host_store("127.0.0.1", RANK_TIMEOUT_S)  # served while the ranks run
    port = store.port
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, __file__, "--world-size", "2", "--port", str(port)]
    command += ["--model", str(model_dir), "--out", str(tmp_path)]
    ranks = [
        subprocess.Popen([*command, "--rank", str(rank)], env=environment, stderr=subprocess.PIPE, text=True)
        for rank in range(2)
    ]
    try:
        for rank, process in enumerate(ranks):
            _, stderr = process.communicate(timeout=RANK_TIMEOUT_S)
            assert process.returncode == 0, f"rank {rank} failed:\n{stderr[-4000:]}"
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)

    for rank in range(2):
        metrics = json.loads((tmp_path / f"metrics-{rank}.json").read_text())
        assert metrics.keys() == single_metrics.keys()
        for name, value in single_metrics.items():
            assert metrics[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
        weights = load_file(str(tmp_path / f"weights-{rank}.safetensors"))
        assert weights.keys() == single_weights.keys()
        for name, value in single_weights.items():
            torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert single_metrics["train/clip_frac"] > 0.0  # the batch exercises the clipped branch too
    # The ranks' checkpoint: rank 0's files, each rank's generators, and the number of ranks.
    state = json.loads((tmp_path / "checkpoint" / "actor_state.json").read_text())
    assert state["data_parallel_size"] == 2
    assert (tmp_path / "checkpoint" / "rng_state_rank1.json").is_file()
    # Ranks whose weights differ refuse, all of them, and write nothing.
    for rank in range(2):
        assert "model.norm.weight" in (tmp_path / f"refused-{rank}.txt").read_text()
    assert not (tmp_path / "diverged" / "model.safetensors").exists()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="one rank of the data-parallel actor test")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", type=Path, required=True)
    arguments = parser.parse_args()
    run_rank(arguments.rank, arguments.world_size, arguments.port, arguments.model, arguments.out)
