"""Fixtures of the built-in engine's tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
from engine_testing import Served
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from asyncrl_engine.grpc_service import SchedulerService, start_grpc_server


@pytest.fixture
async def make_served(make_client: Callable[..., Any]) -> AsyncIterator[Callable[..., Any]]:
    """Start an engine with its HTTP and gRPC fronts (`ServerArgs` overrides); all stop at teardown."""
    started: list[tuple[grpc.aio.Server, grpc.aio.Channel]] = []

    async def make(**overrides: Any) -> Served:
        client, server = await make_client(**overrides)
        service = SchedulerService(server.engine, server.gate, server.info, server.generation.limits)
        service.ready = True
        grpc_server, port = await start_grpc_server(service, "127.0.0.1", 0, None)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        started.append((grpc_server, channel))
        return Served(client, server, pb_grpc.SglangSchedulerStub(channel), f"127.0.0.1:{port}")

    yield make
    for grpc_server, channel in started:
        await channel.close()
        await grpc_server.stop(grace=None)
