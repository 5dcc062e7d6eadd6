"""An engine that stops under a trajectory's turn never cuts the trajectory: the agent loop's request goes
again, under its rid, to another engine of the pool, and the turn is generated whole. A user's abort keeps its
meaning: the episode ends with finish reason `abort`. Two built-in engines served in process over the tiny
Llama, the real pool and the real agent loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncrl_agents.loop import MultiTurnAgentLoop
from asyncrl_agents.tasks.searchr1 import SearchR1MiniTask
from asyncrl_core.types import Group, SamplingParams
from asyncrl_engine.server import BuiltinServer
from asyncrl_sglang.client import SGLangClient
from asyncrl_sglang.pool import EnginePool

WAIT_S = 120.0
TURN_TOKENS = 400
"""One turn's length: long enough to be running when its engine stops."""


async def _start_group(
    make_client: Callable[..., Any], tiny_llama_path: Path
) -> tuple[asyncio.Task[Group], list[BuiltinServer], EnginePool, MultiTurnAgentLoop]:
    """Two engines behind a pool, and a group of two one-turn trajectories running on them (one each: the
    pool sends each new trajectory to the least loaded engine), both running when this returns."""
    served = [await make_client() for _ in range(2)]
    pool = EnginePool([SGLangClient(str(client.make_url("")).rstrip("/")) for client, _ in served])
    # The model writes no tool call: nothing reaches the retriever.
    task = SearchR1MiniTask(retriever_url="http://127.0.0.1:9/retrieve")
    loop = MultiTurnAgentLoop(
        task,
        pool,
        tiny_llama_path,
        group_size=2,
        sampling=SamplingParams(max_new_tokens=TURN_TOKENS, temperature=1.0, ignore_eos=True),
        max_prompt_len=1024,
        max_response_len=TURN_TOKENS,
        context_len=2048,
        max_turns=1,
    )
    group = asyncio.create_task(loop.run_group(0))
    servers = [server for _, server in served]
    async with asyncio.timeout(WAIT_S):
        while not all(server.engine.snapshot.num_running == 1 for server in servers):  # noqa: ASYNC110
            await asyncio.sleep(0.005)
    return group, servers, pool, loop


async def test_a_turn_cut_off_by_its_engine_stopping_is_generated_whole_on_another(
    make_client: Callable[..., Any], tiny_llama_path: Path
) -> None:
    group_task, (first, second), pool, loop = await _start_group(make_client, tiny_llama_path)
    async with pool:
        await first.stop()
        group = await asyncio.wait_for(group_task, WAIT_S)
        await loop.aclose()
    assert pool.down == frozenset({0})
    for trajectory in group.trajectories:
        # Before, the turn on the stopped engine ended `abort` with a partial output, trained as the model's.
        assert trajectory.finish_reason == "context"
        assert sum(trajectory.loss_mask) == TURN_TOKENS
    assert second.engine.counters.num_requests_total == 2  # its own trajectory's turn, and the one moved


async def test_a_user_abort_still_ends_the_episode_as_abort(
    make_client: Callable[..., Any], tiny_llama_path: Path
) -> None:
    group_task, (first, _), pool, loop = await _start_group(make_client, tiny_llama_path)
    async with pool:
        await pool.clients[0].abort_all()
        group = await asyncio.wait_for(group_task, WAIT_S)
        await loop.aclose()
    assert pool.down == frozenset()
    reasons = sorted(trajectory.finish_reason for trajectory in group.trajectories)
    assert reasons == ["abort", "context"]
    aborted = next(t for t in group.trajectories if t.finish_reason == "abort")
    assert sum(aborted.loss_mask) < TURN_TOKENS
    assert first.engine.counters.num_requests_total == 1
