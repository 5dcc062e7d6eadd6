"""A weight push that fails on one engine, against real built-in engines served in process: no engine
generates with weights other than those its version label names. The engine that failed stays paused; the
others take every bucket and the new version, and go on."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncrl_core.errors import EngineControlError
from asyncrl_core.models import tiny_llama
from asyncrl_core.types import SamplingParams
from asyncrl_engine.model import EngineModel
from asyncrl_sglang.client import SGLangClient
from asyncrl_sglang.pool import EnginePool
from asyncrl_sglang.weight_sync import TensorTransport, sync_weights

WAIT_S = 60.0
NORM = "model.norm.weight"
UP = "model.layers.0.mlp.up_proj.weight"


async def test_an_engine_that_fails_a_push_is_left_paused_and_the_others_take_the_version(
    make_client: Callable[..., Any], tiny_llama_path: Path, tmp_path: Path
) -> None:
    # Engine 1's MLP is narrower: the second bucket (an MLP weight) fails there, with the first loaded.
    # Before, the sync stopped at that bucket and continued both engines: engine 0 generated with two
    # buckets of three under the old label, engine 1 with one.
    narrow = EngineModel.from_pretrained(tiny_llama(tmp_path / "narrow", intermediate_size=96))
    served = [
        await make_client(model=EngineModel.from_pretrained(tiny_llama_path)),
        await make_client(model=narrow),
    ]
    (_, first), (_, second) = served
    hidden = first.engine.model.config.hidden_size
    buckets = [
        [(NORM, torch.full((hidden,), 0.5))],
        [(UP, torch.full((128, hidden), 0.25))],
        [(NORM, torch.full((hidden,), 2.0))],
    ]
    clients = [SGLangClient(str(client.make_url("")).rstrip("/")) for client, _ in served]
    async with EnginePool(clients) as pool:
        with pytest.raises(EngineControlError) as failed:
            await sync_weights(pool, buckets, 3, mode="retract", transport=TensorTransport())
        assert f"engine 1 ({clients[1].base_url})" in str(failed.value)
        assert [await client.weight_version() for client in clients] == [3, 0]
        # Engine 0 holds version 3 whole, and generates with it.
        norm = await clients[0].get_weights_by_name(NORM, truncate_size=hidden)
        assert norm == [2.0] * hidden
        assert first.paused is None
        generation = await asyncio.wait_for(
            clients[0].generate([1, 2, 3], SamplingParams(max_new_tokens=4)), WAIT_S
        )
        assert [span.version for span in generation.version_spans] == [3]
        # Engine 1 holds the first bucket under version 0's label: paused, it generates nothing.
        assert (second.paused, second.engine.paused) == ("retract", "retract")
