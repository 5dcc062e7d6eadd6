"""The weight transport the runner builds from the configuration: NCCL between GPUs, gloo on CPUs and
wherever the trainer and the engines share a GPU (NCCL forms no group with two ranks on one device)."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl_core.config import load_config
from asyncrl_core.runner.workers import weight_transport

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


@pytest.mark.parametrize(
    ("example", "overrides", "backend", "device"),
    [
        ("searchr1-gpu.yaml", [], "nccl", "cuda"),
        (
            "searchr1-gpu.yaml",
            [
                "cluster.component_placement={actor: 0, rollout: 0}",
                "cluster.allow_shared_devices=true",
                "cluster.num_devices=1",
                "actor.backend=torch",
                "actor.tensor_parallel_size=1",
            ],
            "gloo",
            "cpu",
        ),
        ("searchr1-mini.yaml", [], "gloo", "cpu"),
    ],
    ids=["separate-gpus", "one-shared-gpu", "cpu"],
)
def test_the_process_group_backend_follows_the_placement(
    example: str, overrides: list[str], backend: str, device: str
) -> None:
    config = load_config(EXAMPLES / example, [*overrides, "rollout.sglang.weight_transport=distributed"])
    transport = weight_transport(config)
    assert (transport.backend, transport.device) == (backend, device)
