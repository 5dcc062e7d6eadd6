"""asyncrl-sglang as the runner's rollout backend `sglang` (entry point `asyncrl.rollout_backends`): engines
on the SGLang server protocol, started by `launcher` (the built-in engine or real SGLang servers, by
`rollout.sglang.launch`) or reached at `rollout.sglang.urls`, one `EnginePool` over them, and weight syncs
by `rollout.sglang.weight_transport` (`weight_sync`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl_core.errors import EngineControlError
from asyncrl_sglang.client import ClientTimeouts, RetryPolicy, SGLangClient
from asyncrl_sglang.launcher import LaunchedEngines, connect_engines, launch_engines
from asyncrl_sglang.pool import EnginePool
from asyncrl_sglang.weight_sync import (
    DistributedTransport,
    SyncMode,
    TensorTransport,
    WeightTransport,
    sync_weights,
)

if TYPE_CHECKING:
    from asyncrl_core.config import AsyncRLConfig
    from asyncrl_core.config.models import RolloutConfig
    from asyncrl_core.protocols import EngineClient, NamedTensors, RolloutBackend, WeightGroup

_MODES: dict[str, SyncMode] = {"retract": "retract", "in_place": "in_place", "drain": "drain"}


class SGLangBackend:
    """The `sglang` rollout backend of a run configured by `config` (a `RolloutBackend`)."""

    def __init__(self, config: AsyncRLConfig) -> None:
        self.config = config

    def launch(
        self,
        rollout: RolloutConfig,
        *,
        run_dir: Path,
        devices: Sequence[int],
        gpu: bool,
        health_timeout_s: float,
        advertise_host: str,
        random_seed: int,
        start_paused: bool = False,
    ) -> LaunchedEngines:
        return launch_engines(
            rollout,
            run_dir=run_dir,
            devices=devices,
            gpu=gpu,
            health_timeout_s=health_timeout_s,
            advertise_host=advertise_host,
            random_seed=random_seed,
            start_paused=start_paused,
        )

    def connect(self, urls: Sequence[str], grpc_targets: Sequence[str | None]) -> EnginePool:
        rollout = self.config.rollout
        return connect_engines(
            urls,
            grpc_targets=grpc_targets,
            api_key=rollout.sglang.api_key,
            request_timeout_s=rollout.request_timeout_s,
        )

    def weight_transport(self, group: WeightGroup) -> WeightTransport:
        """Request bodies (`tensor`), or a process group the trainer forms with the engines at the first
        sync and keeps (`distributed`), by `rollout.sglang.weight_transport`."""
        num_ranks = self.config.rollout.tensor_parallel_size
        if self.config.rollout.sglang.weight_transport == "tensor":
            return TensorTransport(num_ranks)
        return DistributedTransport(
            master_address=group.master_address,
            master_port=group.master_port,
            backend=group.backend,
            num_ranks=num_ranks,
            device=group.device,
            timeout_s=group.timeout_s,
        )

    async def sync_weights(
        self,
        client: EngineClient,
        buckets: Iterable[NamedTensors],
        version: int,
        *,
        mode: str,
        transport: object,
    ) -> dict[str, float]:
        if not isinstance(client, EnginePool):
            raise EngineControlError(f"not a client of the sglang backend: {client!r}")
        if mode not in _MODES:
            raise EngineControlError(f"unknown pause mode {mode!r}; modes: {', '.join(_MODES)}")
        if not isinstance(transport, TensorTransport | DistributedTransport):
            raise EngineControlError(f"not a transport of the sglang backend: {transport!r}")
        if isinstance(transport, DistributedTransport):
            await transport.connect(client)  # once: the group is kept for the next syncs
        result = await sync_weights(client, buckets, version, mode=_MODES[mode], transport=transport)
        return result.metrics()

    async def engine_counters(self, url: str, *, timeout_s: float) -> dict[str, float]:
        """`SGLangClient.engine_counters` of the engine at `url`: one attempt, bounded by `timeout_s`."""
        timeouts = ClientTimeouts(connect_s=timeout_s, control_s=timeout_s)
        client = SGLangClient(
            url,
            api_key=self.config.rollout.sglang.api_key,
            timeouts=timeouts,
            retry=RetryPolicy(max_attempts=1),
        )
        async with client, asyncio.timeout(timeout_s):
            return await client.engine_counters()

    async def close_weight_transport(self, client: EngineClient, transport: object) -> None:
        """Dissolve the `distributed` transport's group on the engines (`/destroy_weights_update_group`)
        and here; the `tensor` transport holds nothing."""
        if not isinstance(client, EnginePool):
            raise EngineControlError(f"not a client of the sglang backend: {client!r}")
        if isinstance(transport, DistributedTransport):
            await transport.close(client)


if TYPE_CHECKING:
    _PROTOCOL_CHECK: type[RolloutBackend] = SGLangBackend  # the type checker holds the class to the protocol
