"""A turn that the engine fails on its own (an internal error the request reproduces alone) is never trained:
the engine answers it as an error (500), the client raises `GenerationError` without sending it again, and the
group of that turn fails, its prompt dropped for good with the engine's message as the reason; the next
prompt's group is the one the actor gets. The real agent-loop worker over the real buffer worker and the
real pool, the built-in engine served in process over the tiny Llama (one of its prompts makes the engine
fail: a cached block of it cannot be read)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from asyncrl_agents.loop import MultiTurnAgentLoop
from asyncrl_core.config import load_config
from asyncrl_core.runner.workers import AgentLoopWorker, BufferWorker, EngineEndpoint, LocalBufferPort

WAIT_S = 120.0


async def test_the_group_of_a_turn_the_engine_fails_is_dropped_not_trained(
    make_client: Callable[..., Any], tiny_llama_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    client, server = await make_client()
    url = str(client.make_url("")).rstrip("/")
    pairs = {
        "runner.run_dir": str(tmp_path / "run"),
        "actor.model_path": str(tiny_llama_path),
        "data.rollout_batch_size": 1,
        "data.shuffle": False,
        "algorithm.group_size": 2,
        "actor.micro_batch_size": 2,
        "agentloop.task_name": "arith",
        "agentloop.task_args": '{"num_train": 4, "num_test": 1}',
        "agentloop.max_concurrent_groups": 1,
        "rollout.sampling.max_new_tokens": 8,
    }
    config = load_config(None, [f"{key}={value}" for key, value in pairs.items()])
    worker = AgentLoopWorker(
        config, model_path=str(tiny_llama_path), endpoints=[EngineEndpoint(url)], task_services={}
    )
    loop = worker.loop
    assert isinstance(loop, MultiTurnAgentLoop)
    failing_prompt = loop.prompt_ids(loop.dataset()[0])
    cache = server.engine.prefix_cache
    assert cache is not None
    load = cache.load

    def load_unless_failing(tokens: Any, *args: Any) -> int:
        if list(tokens[: len(failing_prompt)]) == failing_prompt:
            raise RuntimeError("a cached block of this prefix is unreadable")
        return load(tokens, *args)

    monkeypatch.setattr(cache, "load", load_unless_failing)
    buffer = BufferWorker(config, dataset_size=4)
    try:
        # Prompts are issued in order, one group at a time: prompt 0's group fails, prompt 1's replaces it.
        assert await worker.run_groups(LocalBufferPort(buffer), 1, timeout_s=WAIT_S) == 1
    finally:
        await worker.aclose()
    counts = buffer.counts()
    # Before, the failed turn came back as a 200 abort with its partial output: the episode ended `abort` and
    # prompt 0's group was buffered for training (issued 1, dropped 0).
    assert (counts["issued"], counts["dropped"], counts["handed_back"], counts["buffered"]) == (2, 1, 0, 1)
    (reason,) = buffer.failure_reasons.values()
    assert reason.startswith("GenerationError:")
    assert "(500): Internal engine error:" in reason
    assert "unreadable" in reason
    assert list(buffer.failure_reasons) == [0]
    batch = buffer.take_batch(1, actor_version=0, timeout_s=0.0)
    assert batch is not None
    assert [group.prompt_index for group in batch.groups] == [1]
    for trajectory in batch.groups[0].trajectories:
        assert trajectory.finish_reason != "abort"
