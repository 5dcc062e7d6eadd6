"""The `distributed` weight transport's group is dissolved when a run ends, so that engines that outlive the
run (`launch: external`) join the next run's: two actor workers in turn, as two runs would, sync their
weights into one built-in engine over gloo, each closing its transport at its end. The engine must then hold
no group (its `/destroy_weights_update_group` refuses: none by that name) and its weights must be the second
actor's."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from engine_process import serve_builtin

from asyncrl_core.config import AsyncRLConfig, load_config
from asyncrl_core.errors import EngineControlError
from asyncrl_core.runner.workers import ActorWorker, EngineEndpoint
from asyncrl_sglang.client import SGLangClient
from asyncrl_sglang.weight_sync import DistributedTransport

pytestmark = pytest.mark.timeout(300)


def _config(tmp_path: Path, model_path: Path, url: str) -> AsyncRLConfig:
    pairs = {
        "runner.run_dir": str(tmp_path / "run"),
        "cluster.component_placement": "{actor: 0}",
        "actor.model_path": str(model_path),
        "actor.dtype": "float32",
        "agentloop.task_name": "arith",
        "rollout.sglang.launch": "external",
        "rollout.sglang.urls": f"[{url}]",
        "rollout.sglang.weight_transport": "distributed",
    }
    return load_config(None, [f"{key}={value}" for key, value in pairs.items()])


async def _destroy(url: str) -> None:
    async with SGLangClient(url) as client:
        await client.destroy_weights_update_group()


async def _weight(url: str, name: str) -> torch.Tensor:
    async with SGLangClient(url) as client:
        return torch.tensor(await client.get_weights_by_name(name, truncate_size=4))


def test_each_run_leaves_the_group_so_the_next_one_joins(
    tmp_path: Path, tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for variable in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(variable, "")  # the actor worker sets them; put back when the test ends
    with serve_builtin(tiny_llama_path, max_running_requests=2) as engine:
        endpoints = [EngineEndpoint(engine.url)]
        config = _config(tmp_path, tiny_llama_path, engine.url)
        name = "model.embed_tokens.weight"
        for run in (1, 2):
            worker = ActorWorker(config, model_path=str(tiny_llama_path), devices=())
            with torch.no_grad():  # a weight only this run's actor holds
                worker.actor.module.get_parameter(name).fill_(float(run))  # type: ignore[attr-defined]
            worker.sync_weights(endpoints, "retract")
            assert isinstance(worker._transport, DistributedTransport)  # pyright: ignore[reportPrivateUsage]
            assert torch.equal(asyncio.run(_weight(engine.url, name)), torch.full((4, 64), float(run)))
            worker.close_weight_transport(endpoints)
            worker.close_weight_transport(endpoints)  # a second close does nothing
            with pytest.raises(
                EngineControlError, match="no weight update group named 'weight_update_group'"
            ):
                asyncio.run(_destroy(engine.url))
