"""A request over gRPC waits for an engine it cannot reach, as one over HTTP does (the built-in engine's HTTP
and gRPC fronts served in process on loopback over a tiny Llama).

An engine restarted on its address answers `/health` while its gRPC service may still be out of reach
(not yet listening, or the client's channel waiting out its reconnect backoff). The pool must then keep
the request waiting for it, not fail it as one the engine refused to answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from asyncrl_core.types import SamplingParams
from asyncrl_engine.grpc_service import SchedulerService, start_grpc_server
from asyncrl_sglang.client import ClientTimeouts, RetryPolicy
from asyncrl_sglang.grpc_client import GrpcSGLangClient
from asyncrl_sglang.launcher import free_port
from asyncrl_sglang.pool import EnginePool

WAIT_S = 60.0


async def test_a_grpc_request_waits_until_the_engines_grpc_service_is_reachable(
    make_client: Callable[..., Any],
) -> None:
    http, server = await make_client()
    grpc_port = free_port()  # nothing listens there yet
    client = GrpcSGLangClient(
        str(http.make_url("")),
        f"127.0.0.1:{grpc_port}",
        timeouts=ClientTimeouts(health_s=1.0),
        retry=RetryPolicy(max_attempts=2, initial_backoff_s=0.05, max_backoff_s=0.2),
    )
    async with EnginePool([client], recovery_timeout_s=WAIT_S) as pool:
        request = asyncio.create_task(
            pool.generate([5, 6, 7], SamplingParams(max_new_tokens=3, ignore_eos=True), rid="r0")
        )
        async with asyncio.timeout(WAIT_S):
            while not pool.down and not request.done():
                await asyncio.wait([request], timeout=0.01)
        # `/health` answers: the request must wait for the gRPC service, not fail as refused by the engine.
        assert not request.done(), request.exception()
        assert not await client.health()
        service = SchedulerService(server.engine, server.gate, server.info, server.generation.limits)
        service.ready = True
        grpc_server, _ = await start_grpc_server(service, "127.0.0.1", grpc_port, None)
        try:
            generation = await asyncio.wait_for(request, WAIT_S)
        finally:
            await grpc_server.stop(grace=None)
        assert len(generation.output_ids) == 3
        assert generation.versions_verified
        assert pool.down == frozenset()
