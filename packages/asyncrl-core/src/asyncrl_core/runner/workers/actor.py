"""`ActorWorker`: one rank of the actor, training on its share of each batch and taking part in the weight
sync; the rollout backend's weight transport it keeps for the run."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from asyncrl_core import metrics, plugins
from asyncrl_core.runner.rollout_backend import rollout_backend, weight_group
from asyncrl_core.runner.workers.common import pin_to_cores
from asyncrl_core.runner.workers.rollout import EngineEndpoint
from asyncrl_core.types import BatchShare

if TYPE_CHECKING:
    from asyncrl_core.config import AsyncRLConfig
    from asyncrl_core.protocols import Actor, NamedTensors


@dataclass(frozen=True, slots=True)
class RankSettings:
    """Where one data-parallel rank of the actor meets the others (torch.distributed over TCP)."""

    rank: int
    world_size: int
    master_port: int
    master_address: str = "127.0.0.1"


class ActorWorker:
    """One rank of the actor: trains on batches; one rank pushes the weights into the engines, the ranks
    holding shards of them take part in the export."""

    def __init__(
        self,
        config: AsyncRLConfig,
        *,
        model_path: str,
        devices: Sequence[int],
        rank: RankSettings | None = None,
    ) -> None:
        gpu = config.cluster.device_type == "gpu"
        rank = rank or RankSettings(0, 1, 0)
        if not gpu:
            pin_to_cores(devices)
        os.environ.update(
            RANK=str(rank.rank),
            LOCAL_RANK="0",
            WORLD_SIZE=str(rank.world_size),
            MASTER_ADDR=rank.master_address,
            MASTER_PORT=str(rank.master_port),
        )
        self.config = config
        self.rank = rank.rank
        factory = cast("Callable[..., Actor]", plugins.load("asyncrl.actors", config.actor.backend))
        self.actor = factory(config, model_path=model_path, device="cuda" if gpu else "cpu")
        self._transport: Any = None
        self._watched = threading.Event()

    def watch(self) -> None:
        """Block while the rank lives: the driver keeps this call pending beside the data (on a
        concurrency group of its own), so the rank's death is seen at once, whatever the driver waits for."""
        self._watched.wait()

    @property
    def version(self) -> int:
        return self.actor.version

    def get_version(self) -> int:
        return self.actor.version

    def train(self, share: BatchShare) -> dict[str, float]:
        """One training step on this rank's `share` of a batch (`asyncrl_core.runner.handoff`): the actor's
        `train/...` metrics. A share cut for another data-parallel rank raises `BatchError`."""
        started = time.perf_counter()
        result = self.actor.train_step(share)
        result[metrics.TIME_TRAINING] = time.perf_counter() - started
        return result

    def sync_weights(self, endpoints: Sequence[EngineEndpoint], mode: str) -> dict[str, float]:
        """Push the current weights into the engines as this version, in `mode`.

        Every rank is called. The rank whose `weight_export_role` is `send` pushes the buckets; ranks that
        `join` take the export in step with it (a collective: each bucket gathers tensor-parallel shards),
        holding one bucket at a time and dropping it; the others return at once. In `drain` mode the caller
        has drained the agent loops first; this side then finds the engines idle and flushes their caches
        with the last bucket."""
        role = self.actor.weight_export_role
        if role == "none":
            return {}
        buckets = self.actor.export_weights(self.config.actor.weight_export_bucket_mb << 20)
        if role == "join":
            for _ in buckets:
                pass
            return {}
        if self._transport is None:
            self._transport = weight_transport(self.config)
        return asyncio.run(
            _push_weights(self.config, buckets, self.actor.version, self._transport, endpoints, mode)
        )

    def close_weight_transport(self, endpoints: Sequence[EngineEndpoint]) -> None:
        """Undo what the weight transport set up with the engines at `endpoints` (the `distributed`
        transport's process group), so that engines that outlive the run can join the next run's. Every rank
        is called when the run ends; a rank that never pushed weights, or has closed already, does
        nothing."""
        transport, self._transport = self._transport, None
        if transport is not None:
            asyncio.run(_close_weight_transport(self.config, transport, endpoints))

    def save_checkpoint(self, path: str) -> None:
        self.actor.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> None:
        self.actor.load_checkpoint(path)


async def _push_weights(
    config: AsyncRLConfig,
    buckets: Iterator[NamedTensors],
    version: int,
    transport: Any,
    endpoints: Sequence[EngineEndpoint],
    mode: str,
) -> dict[str, float]:
    # A module function, not a method: a Ray actor class with a coroutine method becomes an asyncio actor,
    # and the actor worker must stay a plain threaded one (training blocks).
    backend = rollout_backend(config)
    client = backend.connect([endpoint.url for endpoint in endpoints], [e.grpc_target for e in endpoints])
    try:
        return await backend.sync_weights(client, buckets, version, mode=mode, transport=transport)
    finally:
        await client.aclose()
        # Buckets left by a failure midway are still taken: the ranks that join the export wait in its
        # collectives until the sender has gone through every bucket.
        for _ in buckets:
            pass


async def _close_weight_transport(
    config: AsyncRLConfig, transport: object, endpoints: Sequence[EngineEndpoint]
) -> None:
    backend = rollout_backend(config)
    client = backend.connect([endpoint.url for endpoint in endpoints], [e.grpc_target for e in endpoints])
    try:
        await backend.close_weight_transport(client, transport)
    finally:
        await client.aclose()


def weight_transport(config: AsyncRLConfig) -> Any:
    """The rollout backend's transport for this run (by `rollout.sglang.weight_transport` for `sglang`):
    request bodies, or a process group that the trainer (rank 0 of the actor) forms with the engines at the
    first sync and keeps, hosted at the trainer's node address on a port picked there (`weight_group`)."""
    return rollout_backend(config).weight_transport(weight_group(config))
