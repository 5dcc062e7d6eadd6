"""A restarted engine serves no request before it has the actor's current weights (CPU, tiny Llama, no Ray).

A rollout worker's engine is killed while the agent loops' pool sends it a request; the worker starts it
again (`RolloutWorker.restart`, as the runner does). The request reaches the new engine, over HTTP or gRPC,
and waits there: it is generated only once a weight sync has pushed the next version, so every one of its
tokens carries that version, none the version the engine loaded at start. The test leaves nothing behind
in its process (later tests start Ray in it): both engines' process groups are gone, and the signal
handlers the launcher set while engines ran are set back, although the restart ran on another thread than
the first start.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
from runner_testing import run_config

from asyncrl_core.runner.workers.rollout import RolloutWorker
from asyncrl_core.types import SamplingParams
from asyncrl_sglang.backend import SGLangBackend
from asyncrl_sglang.client import SGLangClient
from asyncrl_sglang.launcher import free_port
from asyncrl_sglang.weight_sync import TensorTransport

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

HELD_WITHIN_S = 120.0
"""Longest wait for the request to reach the restarted engine (or, without the pause, to be answered)."""


async def _held_at_gate(client: SGLangClient) -> int:
    """Requests the engine holds at its pause gate (`/v1/loads` queues)."""
    loads = await client.loads()
    assert isinstance(loads, dict)
    (load,) = loads["loads"]
    return int(load["queues"]["paused"])


def _group_alive(pgid: int) -> bool:
    """Whether any process of process group `pgid` is alive (an engine leads its own group)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("transport", ["http", "grpc"])
async def test_a_restarted_engine_holds_its_requests_until_the_weights_are_in(
    tmp_path: Path, tiny_llama_path: Path, transport: str
) -> None:
    sglang = {"launch": "builtin", "base_port": free_port(), "transport": transport}
    if transport == "grpc":
        sglang["grpc_base_port"] = free_port()
    config = run_config(tmp_path, tiny_llama_path, rollout={"sglang": sglang})
    handlers = [signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGHUP)]
    worker = RolloutWorker(
        config, model_path=str(tiny_llama_path), index=0, devices=(), run_dir=tmp_path / "run"
    )
    engine_pids: list[int] = []
    try:
        endpoint = worker.endpoint()
        backend = SGLangBackend(config)  # the runner's backend (`rollout.rollout_backend: sglang`)
        # The agent loops' pool (a request whose engine went down waits for it) and the actor's, for the sync.
        async with (
            backend.connect([endpoint.url], [endpoint.grpc_target]) as pool,
            backend.connect([endpoint.url], [endpoint.grpc_target]) as sync_pool,
        ):
            pid = worker.pid()
            assert pid is not None
            engine_pids.append(pid)
            os.kill(pid, signal.SIGKILL)
            sampling = SamplingParams(max_new_tokens=4, ignore_eos=True)
            request = asyncio.create_task(pool.generate([1, 2, 3], sampling, routing_key="trajectory"))
            # Beside the event loop, as the rollout worker's Ray actor runs it.
            assert await asyncio.to_thread(worker.restart) == endpoint
            restarted = worker.pid()
            assert restarted is not None
            engine_pids.append(restarted)
            async with asyncio.timeout(HELD_WITHIN_S):
                while not request.done() and not await _held_at_gate(pool.clients[0]):
                    await asyncio.wait([request], timeout=0.1)
            assert not request.done(), "the restarted engine answered before its weights were pushed"
            assert await pool.weight_versions() == [0]  # what it loaded at start
            await backend.sync_weights(sync_pool, [], 1, mode="retract", transport=TensorTransport())
            generation = await asyncio.wait_for(request, HELD_WITHIN_S)
        assert generation.token_versions() == [1] * 4
    finally:
        worker.stop()
    assert [pid for pid in engine_pids if _group_alive(pid)] == []
    assert [signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGHUP)] == handlers
