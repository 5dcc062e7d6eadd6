"""Push the actor's weights into every engine of a pool, with a clear version boundary.

The three pause modes (`rollout.pause_mode`):
- `retract`: `pause(retract)` -> [begin session] -> buckets with `flush_cache: false` (a flush is illegal
  while retracted requests wait in the queue), the last one carrying the new version -> [end] -> continue.
  In-flight requests keep their tokens and recompute their KV under the new weights.
- `in_place`: the same with `pause(in_place)`; in-flight requests keep their KV cache (computed by the old
  weights) and decode on with the new ones. `flush_cache` is always false (the held batch forbids it).
- `drain`: the pool stops admitting new requests, waits for the in-flight ones to finish (bounded by
  `drain_timeout_s`), pushes the buckets (the last with `flush_cache: true`, legal now that the engines are
  idle, so no prefix computed by old weights survives), and reopens. Drain holds only requests sent through
  this pool: every generation must go through it.

A request paused mid-generation reports the boundary in its version spans: `[old, 0, k], [new, k, n]`.

Whatever fails midway, every engine that was paused is continued (and the pool reopened) before the error,
an `EngineControlError` naming the engine, reaches the caller. The engines then hold a mix of old and new
weights under the old version label: the caller should retry the sync (or stop the run).

Transports: `TensorTransport` sends safetensors bytes in the request body (the built-in engine; real SGLang
expects CUDA IPC pickles there, which asyncrl never produces), `DistributedTransport` broadcasts from the
trainer (rank 0) to the engines over a torch process group (NCCL between GPUs, gloo on CPUs): the path for
real SGLang servers.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Literal, Protocol

from asyncrl_core.errors import EngineControlError
from asyncrl_core.metrics import SYNC_PAUSED_REQUESTS, TIME_SYNC_WEIGHTS
from asyncrl_sglang.client import DEFAULT_GROUP_NAME, dtype_name, serialize_named_tensors
from asyncrl_sglang.pool import EnginePool
from asyncrl_sglang.process_group import join_weight_update_group

if TYPE_CHECKING:
    import torch.distributed as dist

    from asyncrl_core.protocols import NamedTensors

SyncMode = Literal["retract", "in_place", "drain"]


@dataclass(frozen=True, slots=True)
class SyncResult:
    """What one weight sync did."""

    version: int
    """The version the engines hold now."""
    mode: SyncMode
    time_s: float
    """Wall time from the pause (or the closing of admission) to the continue (or the reopening)."""
    num_paused_requests: int
    """Requests the sync paused: in `retract` and `in_place`, those the engines hold once paused, running or
    queued, read from their `/metrics` (every client's requests; the requests in flight through this pool
    when an engine serves no metrics); in `drain`, those in flight through this pool when it began, which
    the drain waited for."""
    num_buckets: int
    num_bytes: int
    """Bytes of tensor data sent to each engine."""

    def metrics(self) -> dict[str, float]:
        """The step metrics of this sync (`time/sync_weights` is the name the runner logs)."""
        return {
            TIME_SYNC_WEIGHTS: self.time_s,
            SYNC_PAUSED_REQUESTS: float(self.num_paused_requests),
        }


class WeightTransport(Protocol):
    """How a bucket of named tensors reaches every engine of a pool."""

    async def push(
        self, pool: EnginePool, bucket: NamedTensors, *, weight_version: int | None, flush_cache: bool
    ) -> None:
        """Load `bucket` into every engine; `weight_version` (last bucket only) relabels the engines."""
        ...


class TensorTransport:
    """Weights in the request body of `/update_weights_from_tensor`, as base64 safetensors bytes.

    `num_ranks` is the tensor-parallel size of each engine (every rank gets the same full tensors).
    """

    def __init__(self, num_ranks: int = 1) -> None:
        self.num_ranks = num_ranks

    async def push(
        self, pool: EnginePool, bucket: NamedTensors, *, weight_version: int | None, flush_cache: bool
    ) -> None:
        payload = await asyncio.to_thread(serialize_named_tensors, bucket)
        await pool.each(
            lambda client: client.update_weights_from_tensor(
                payload, weight_version=weight_version, flush_cache=flush_cache, num_ranks=self.num_ranks
            ),
            "update_weights_from_tensor",
        )


class DistributedTransport:
    """Weights broadcast over a torch process group: the trainer is rank 0, engine `i` (with `num_ranks`
    tensor-parallel ranks each) holds ranks `1 + i * num_ranks ...`. `connect` once, `push` per bucket,
    `close` at the end. `device` is where the trainer stages tensors for the broadcast (`cuda` for NCCL)."""

    def __init__(
        self,
        *,
        master_address: str,
        master_port: int,
        backend: Literal["nccl", "gloo"] = "nccl",
        num_ranks: int = 1,
        group_name: str = DEFAULT_GROUP_NAME,
        device: str = "cuda",
        timeout_s: float = 600.0,
    ) -> None:
        self.master_address = master_address
        self.master_port = master_port
        self.backend = backend
        self.num_ranks = num_ranks
        self.group_name = group_name
        self.device = device
        self.timeout_s = timeout_s
        self._group: dist.ProcessGroup | None = None

    async def connect(self, pool: EnginePool) -> None:
        """Form the group with every engine of `pool` (engines and trainer join at once)."""
        if self._group is not None:
            return
        world_size = 1 + self.num_ranks * len(pool.clients)
        joined = pool.each(
            lambda client: client.init_weights_update_group(
                master_address=self.master_address,
                master_port=self.master_port,
                rank_offset=1 + self.num_ranks * pool.clients.index(client),
                world_size=world_size,
                group_name=self.group_name,
                backend=self.backend,
            ),
            "init_weights_update_group",
        )
        engines = asyncio.ensure_future(joined)
        try:
            self._group = await asyncio.to_thread(
                functools.partial(
                    join_weight_update_group,
                    master_address=self.master_address,
                    master_port=self.master_port,
                    world_size=world_size,
                    rank=0,
                    group_name=self.group_name,
                    backend=self.backend,
                    timeout_s=self.timeout_s,
                )
            )
        finally:
            await engines

    async def push(
        self, pool: EnginePool, bucket: NamedTensors, *, weight_version: int | None, flush_cache: bool
    ) -> None:
        if self._group is None:
            raise EngineControlError("the weight-update group is not formed: call connect() first")
        group = self._group
        receiving = asyncio.ensure_future(  # noqa: RUF006 (awaited in `finally`)
            pool.each(
                lambda client: client.update_weights_from_distributed(
                    [name for name, _ in bucket],
                    [dtype_name(tensor.dtype) for _, tensor in bucket],
                    [list(tensor.shape) for _, tensor in bucket],
                    weight_version=weight_version,
                    flush_cache=flush_cache,
                    group_name=self.group_name,
                ),
                "update_weights_from_distributed",
            )
        )
        try:
            await asyncio.to_thread(self._broadcast, group, bucket)
        finally:
            await receiving

    def _broadcast(self, group: dist.ProcessGroup, bucket: NamedTensors) -> None:
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = 0
        for _, tensor in bucket:
            staged = tensor.detach().to(self.device).contiguous()
            group.broadcast([staged], options).wait(timedelta(seconds=self.timeout_s))

    async def close(self, pool: EnginePool) -> None:
        """Dissolve the group on the engines and here."""
        if self._group is None:
            return
        import torch.distributed as dist

        group, self._group = self._group, None
        try:
            await pool.each(
                lambda client: client.destroy_weights_update_group(self.group_name),
                "destroy_weights_update_group",
            )
        finally:
            dist.destroy_process_group(group)


def _with_last(buckets: Iterable[NamedTensors]) -> Iterator[tuple[NamedTensors, bool]]:
    """Each bucket with whether it is the last, holding one bucket ahead (buckets arrive lazily)."""
    iterator = iter(buckets)
    current = next(iterator, None)
    while current is not None:
        following = next(iterator, None)
        yield current, following is None
        current = following


async def sync_weights(
    pool: EnginePool,
    buckets: Iterable[NamedTensors],
    version: int,
    *,
    mode: SyncMode,
    transport: WeightTransport,
    drain_timeout_s: float = 600.0,
) -> SyncResult:
    """Push `buckets` (from `Actor.export_weights`) into every engine of `pool` as weight `version`.

    See the module docstring for the sequence of each mode. Raises `EngineControlError` naming the engines
    that failed (after continuing every paused engine), or `EngineUnavailableError` when a drain does not
    finish within `drain_timeout_s` (then nothing was updated and admission is open again).
    """
    started = time.perf_counter()
    num_paused = pool.num_inflight
    try:
        if mode == "drain":
            pool.close_admission()
            await pool.wait_idle(drain_timeout_s)
        else:
            await pool.pause(mode)
            held = await _requests_held(pool)
            if held is not None:
                num_paused = held
        # Only an idle engine may flush; the flush drops prefixes computed by the old weights.
        num_buckets, num_bytes = await _push_all(
            pool, buckets, version, transport, flush_last=mode == "drain"
        )
    except BaseException as error:
        try:
            await _reopen(pool, mode)
        except Exception as reopen_error:
            error.add_note(f"reopening the engines after the failure failed too: {reopen_error}")
        raise
    await _reopen(pool, mode)
    return SyncResult(
        version=version,
        mode=mode,
        time_s=time.perf_counter() - started,
        num_paused_requests=num_paused,
        num_buckets=num_buckets,
        num_bytes=num_bytes,
    )


async def _requests_held(pool: EnginePool) -> int | None:
    """The requests the paused engines hold, running or queued (retracted ones included), by their own
    `/metrics`: they count requests of every client, not only those of `pool` (the runner syncs through a
    pool of its own, beside the agent loops' pools). None when an engine serves no metrics (started
    without `--enable-metrics`)."""
    try:
        readings = await pool.each(lambda client: client.metrics(), "metrics")
    except EngineControlError:
        return None
    return round(sum(reading.num_running_requests + reading.num_queued_requests for reading in readings))


async def _reopen(pool: EnginePool, mode: SyncMode) -> None:
    if mode == "drain":
        pool.open_admission()
    else:
        # Continue every engine, also one whose pause failed: continuing an unpaused engine is a no-op.
        await pool.continue_generation()


async def _push_all(
    pool: EnginePool,
    buckets: Iterable[NamedTensors],
    version: int,
    transport: WeightTransport,
    *,
    flush_last: bool,
) -> tuple[int, int]:
    """Every bucket inside an update session, the last one relabelling the engines; (buckets, bytes)."""
    num_buckets = 0
    num_bytes = 0
    sessions = await pool.each(lambda client: client.begin_weight_update(), "begin_weight_update")
    try:
        for bucket, last in _with_last(buckets):
            await transport.push(
                pool, bucket, weight_version=version if last else None, flush_cache=flush_last and last
            )
            num_buckets += 1
            num_bytes += sum(tensor.numel() * tensor.element_size() for _, tensor in bucket)
        if num_buckets == 0:
            await pool.each(lambda client: client.update_weight_version(version), "update_weight_version")
    finally:
        # Engines without the session API answered 404 to begin (False): they get no end.
        opened = [index for index, session in enumerate(sessions) if session]
        if opened:
            await pool.each(lambda client: client.end_weight_update(), "end_weight_update", indices=opened)
    return num_buckets, num_bytes
