"""Configurations of short runs for the runner's integration tests: the arith task (no services, a dataset
of any size), a tiny random Llama on the built-in engine, and the torch actor on the CPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from asyncrl_core.config import AsyncRLConfig, load_config


def run_config(tmp_path: Path, model_path: Path, **sections: dict[str, Any]) -> AsyncRLConfig:
    """A two-step async run on cores 0 (actor) and 1 (rollout); `sections` replace keys per section."""
    base: dict[str, dict[str, Any]] = {
        "runner": {"async_mode": True, "num_steps": 2, "seed": 3, "run_dir": str(tmp_path / "run")},
        "cluster": {
            "device_type": "cpu",
            "num_devices": 2,
            "component_placement": {"actor": 0, "rollout": 1},
        },
        "data": {"rollout_batch_size": 2, "max_prompt_len": 256, "max_response_len": 48},
        "algorithm": {"group_size": 2, "kl_coef": 0.001},
        "actor": {"model_path": str(model_path), "dtype": "float32", "micro_batch_size": 4, "lr": 1e-4},
        "rollout": {
            "max_running_requests": 8,
            "request_timeout_s": 240,
            "sglang": {"launch": "builtin"},
            "sampling": {"max_new_tokens": 16},
        },
        "agentloop": {"task_name": "arith", "task_args": {"num_train": 8, "num_test": 4}, "max_turns": 2},
        "logging": {"progress_bar": False, "tensorboard": True},
        "checkpoint": {"save_at_end": True},
    }
    for section, values in sections.items():
        base[section] = {**base.get(section, {}), **values}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(base), encoding="utf-8")
    return load_config(str(path), [])


def read_metrics(run_dir: Path) -> list[dict[str, float]]:
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as lines:
        return [json.loads(line) for line in lines]


def read_summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
