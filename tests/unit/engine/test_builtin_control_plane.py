"""The built-in engine's control plane cannot be wedged (HTTP, and gRPC where the service has the call; served
in process on loopback over a tiny Llama): pause and continue are serialised, so the admission gate and the
scheduler always change together, and `/health` and `/ready` say whether the scheduler can serve."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from aiohttp.test_utils import TestClient

from asyncrl_engine.server import BuiltinServer

WAIT_S = 60.0
SERVED_S = 10.0
"""How long a one-token `/generate` may take on an engine that can serve (the tiny model needs well under
a second); a wedged engine never answers."""

Factory = Callable[..., Any]


async def _generate(client: TestClient[Any, Any], **body: Any) -> tuple[int, Any]:
    response = await client.post("/generate", json=body)
    return response.status, json.loads(await response.text())


async def _served(client: TestClient[Any, Any]) -> None:
    async with asyncio.timeout(SERVED_S):
        status, body = await _generate(client, input_ids=[1, 2], sampling_params={"max_new_tokens": 1})
    assert status == 200, body
    assert len(body["output_ids"]) == 1


# ------------------------------------------------------------------------------------------------ pause
async def test_pause_and_continue_at_the_same_moment_never_wedge_the_engine(make_client: Factory) -> None:
    client, server = await make_client()
    assert isinstance(server, BuiltinServer)
    modes = ("in_place", "retract", "abort")
    for round_index in range(60):
        mode = modes[round_index % len(modes)]
        pause = client.post("/pause_generation", json={"mode": mode})
        resume = client.post("/continue_generation", json={})
        # Both orders of arrival, alternately.
        first, second = (pause, resume) if round_index % 2 == 0 else (resume, pause)
        async with asyncio.timeout(WAIT_S):
            answers = await asyncio.gather(first, second)
        assert [a.status for a in answers] == [200, 200]
        # The gate and the scheduler agree: both paused or both running.
        gate_paused = server.gate.paused is not None
        scheduler_paused = await asyncio.to_thread(
            server.engine.call, lambda: server.engine.paused is not None
        )
        assert gate_paused == scheduler_paused, f"round {round_index}: gate paused {gate_paused}"
        assert (await client.get("/health")).status == 200
        ready = (await client.get("/ready")).status
        assert ready == (503 if gate_paused else 200)
        if ready == 200:
            await _served(client)
    assert (await client.post("/continue_generation", json={})).status == 200
    await _served(client)


async def test_health_and_ready_refuse_a_scheduler_paused_under_an_open_gate(make_client: Factory) -> None:
    client, server = await make_client()
    assert (await client.get("/health")).status == 200
    assert (await client.get("/ready")).status == 200
    # The state a pause and a continue used to leave when they crossed: the gate open, the scheduler paused.
    await asyncio.to_thread(server.engine.call, lambda: server.engine.pause("in_place"))
    assert server.gate.paused is None
    assert (await client.get("/health")).status == 503
    assert (await client.get("/ready")).status == 503
    assert (await client.post("/continue_generation", json={})).status == 200
    assert (await client.get("/health")).status == 200
    assert (await client.get("/ready")).status == 200
    await _served(client)
