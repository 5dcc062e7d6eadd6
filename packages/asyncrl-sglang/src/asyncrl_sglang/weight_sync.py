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

An engine generates only with the weights its version label names. When an engine fails a call of the
push (a bucket, the relabel, a session), the others go on with the remaining buckets (the tensor transport;
the distributed one broadcasts to every engine at once, so none can), and each engine that took every bucket
and the new label is continued, at the new version. An engine that failed, or that took part of the buckets
when the push stopped (an export that raised, a broadcast that failed), holds weights of no version: it is
left paused (in `drain` mode it is paused), so it generates nothing until it is given the weights again or
restarted; the requests it holds wait for that, or their client's timeout. An engine that took nothing (the
pause or the drain failed, or the push stopped before its first bucket) still holds the old weights under
the old label: it is continued. Then an `EngineControlError` names every engine that failed and every engine
left paused.

Transports: `TensorTransport` sends safetensors bytes in the request body (the built-in engine; real SGLang
expects CUDA IPC pickles there, which asyncrl never produces), `DistributedTransport` broadcasts from the
trainer (rank 0) to the engines over a torch process group (NCCL between GPUs, gloo on CPUs): the path for
real SGLang servers.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Literal, Protocol

from asyncrl_core.errors import EngineControlError
from asyncrl_core.metrics import SYNC_PAUSED_REQUESTS, TIME_SYNC_WEIGHTS
from asyncrl_sglang.client import DEFAULT_GROUP_NAME, dtype_name, serialize_named_tensors
from asyncrl_sglang.pool import EnginePool
from asyncrl_sglang.process_group import join_weight_update_group

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed import TCPStore  # pyright: ignore[reportPrivateImportUsage]

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
    """How a bucket of named tensors reaches the engines of a pool."""

    async def push(
        self,
        pool: EnginePool,
        bucket: NamedTensors,
        *,
        weight_version: int | None,
        flush_cache: bool,
        indices: Sequence[int] | None = None,
    ) -> dict[int, Exception]:
        """Load `bucket` into the engines `indices` of `pool` (None: every engine); `weight_version` (last
        bucket only) relabels them. Returns the engines that failed, with their errors (an engine not named
        took the bucket)."""
        ...


class TensorTransport:
    """Weights in the request body of `/update_weights_from_tensor`, as base64 safetensors bytes.

    `num_ranks` is the tensor-parallel size of each engine (every rank gets the same full tensors).
    """

    def __init__(self, num_ranks: int = 1) -> None:
        self.num_ranks = num_ranks

    async def push(
        self,
        pool: EnginePool,
        bucket: NamedTensors,
        *,
        weight_version: int | None,
        flush_cache: bool,
        indices: Sequence[int] | None = None,
    ) -> dict[int, Exception]:
        payload = await asyncio.to_thread(serialize_named_tensors, bucket)
        outcomes = await pool.settle(
            lambda client: client.update_weights_from_tensor(
                payload, weight_version=weight_version, flush_cache=flush_cache, num_ranks=self.num_ranks
            ),
            indices=indices,
        )
        return _failures(outcomes)


class DistributedTransport:
    """Weights broadcast over a torch process group: the trainer is rank 0, engine `i` (with `num_ranks`
    tensor-parallel ranks each) holds ranks `1 + i * num_ranks ...`. `connect` once, `push` per bucket,
    `close` at the end. `device` is where the trainer stages tensors for the broadcast (`cuda` for NCCL).

    The trainer hosts the group's store on `master_address`: on `master_port`, or with 0 (the default) on a
    port the system gives the store when it binds, which no other process can take first; `master_port` then
    says where the last group formed."""

    def __init__(
        self,
        *,
        master_address: str,
        master_port: int = 0,
        backend: Literal["nccl", "gloo"] = "nccl",
        num_ranks: int = 1,
        group_name: str = DEFAULT_GROUP_NAME,
        device: str = "cuda",
        timeout_s: float = 600.0,
    ) -> None:
        self.master_address = master_address
        self.master_port = master_port
        self._port_asked = master_port
        self.backend = backend
        self.num_ranks = num_ranks
        self.group_name = group_name
        self.device = device
        self.timeout_s = timeout_s
        self._group: dist.ProcessGroup | None = None
        self._store: TCPStore | None = None

    async def connect(self, pool: EnginePool) -> None:
        """Form the group with every engine of `pool` (engines and trainer join at once)."""
        if self._group is not None:
            return
        if self._port_asked == 0:
            from asyncrl_core.actor.distributed import host_store

            # Multi-tenant: the trainer's join below, as rank 0 on this port, shares the server.
            self._store = host_store(self.master_address, self.timeout_s)
            self.master_port = self._store.port
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
        self,
        pool: EnginePool,
        bucket: NamedTensors,
        *,
        weight_version: int | None,
        flush_cache: bool,
        indices: Sequence[int] | None = None,
    ) -> dict[int, Exception]:
        everyone = list(range(len(pool.clients)))
        indices = everyone if indices is None else indices
        if sorted(indices) != everyone:
            # Every member of the group takes part in each broadcast: once one engine failed, none can
            # take another bucket.
            missing = sorted(set(everyone) - set(indices))
            refusal = EngineControlError(
                f"the distributed transport broadcasts to every engine at once, and engines {missing} "
                "failed: no engine can take the remaining buckets"
            )
            return dict.fromkeys(indices, refusal)
        if self._group is None:
            raise EngineControlError("the weight-update group is not formed: call connect() first")
        group = self._group
        receiving = asyncio.ensure_future(  # noqa: RUF006 (awaited in `finally`)
            pool.settle(
                lambda client: client.update_weights_from_distributed(
                    [name for name, _ in bucket],
                    [dtype_name(tensor.dtype) for _, tensor in bucket],
                    [list(tensor.shape) for _, tensor in bucket],
                    weight_version=weight_version,
                    flush_cache=flush_cache,
                    group_name=self.group_name,
                ),
                indices=indices,
            )
        )
        try:
            await asyncio.to_thread(self._broadcast, group, bucket)
        finally:
            outcomes = await receiving
        return _failures(outcomes)

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
            self._store = None


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

    See the module docstring for the sequence of each mode and what a failure leaves. Raises
    `EngineControlError` naming the engines that failed and those left paused, or `EngineUnavailableError`
    when a drain does not finish within `drain_timeout_s` (then nothing was updated and admission is open
    again).
    """
    started = time.perf_counter()
    num_paused = pool.num_inflight
    progress = _Progress(len(pool.clients))
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
            pool, buckets, version, transport, progress, flush_last=mode == "drain"
        )
    except BaseException as error:
        try:
            await _reopen(pool, mode, progress)
        except Exception as reopen_error:
            error.add_note(f"reopening the engines after the failure failed too: {reopen_error}")
        if progress.left_paused():
            error.add_note(progress.describe(pool, version))
        raise
    await _reopen(pool, mode, progress)
    if progress.failed:
        raise EngineControlError(progress.describe(pool, version))
    return SyncResult(
        version=version,
        mode=mode,
        time_s=time.perf_counter() - started,
        num_paused_requests=num_paused,
        num_buckets=num_buckets,
        num_bytes=num_bytes,
    )


@dataclass(slots=True)
class _Progress:
    """Where a sync stands with each engine: which were sent something, which took everything, which failed
    (by engine index)."""

    num_engines: int
    sent: set[int] = field(default_factory=set[int])
    """Engines sent a bucket or the relabel: their weights may differ from their label until `done`."""
    done: set[int] = field(default_factory=set[int])
    """Engines that took every bucket and the new label."""
    failed: dict[int, Exception] = field(default_factory=dict[int, Exception])

    def live(self) -> list[int]:
        """Engines that have failed nothing."""
        return [index for index in range(self.num_engines) if index not in self.failed]

    def fail(self, failures: Mapping[int, Exception]) -> None:
        for index, error in failures.items():
            self.failed.setdefault(index, error)

    def consistent(self) -> list[int]:
        """Engines whose weights are the ones their label names (all of the new, or all of the old) and that
        failed nothing: they may generate."""
        return [
            index
            for index in range(self.num_engines)
            if index not in self.failed and (index in self.done or index not in self.sent)
        ]

    def left_paused(self) -> list[int]:
        consistent = set(self.consistent())
        return [index for index in range(self.num_engines) if index not in consistent]

    def describe(self, pool: EnginePool, version: int) -> str:
        failures = "; ".join(pool.describe_failure(index, error) for index, error in self.failed.items())
        paused = ", ".join(f"engine {index} ({pool.clients[index].base_url})" for index in self.left_paused())
        text = f"the weight sync to version {version} failed on {len(self.failed)} engine(s): {failures}"
        if not self.failed:
            text = f"the weight sync to version {version} stopped midway"
        return (
            f"{text}. Left paused, as their weights are not those of the version they report: {paused}; "
            "give them the weights again, or restart them"
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


async def _reopen(pool: EnginePool, mode: SyncMode, progress: _Progress) -> None:
    """Let the engines whose weights match their label generate again; keep the others from generating."""
    consistent = progress.consistent()
    left = progress.left_paused()
    if mode == "drain":
        pool.open_admission()
        if left:
            # A drain pauses nothing on the engines: hold the others' requests at their gates (best effort,
            # an engine that failed may not answer).
            await pool.settle(lambda client: client.pause("retract"), indices=left)
    elif consistent:
        # Also an engine whose pause failed: continuing an unpaused engine is a no-op.
        await pool.each(
            lambda client: client.continue_generation(), "continue_generation", indices=consistent
        )


async def _push_all(
    pool: EnginePool,
    buckets: Iterable[NamedTensors],
    version: int,
    transport: WeightTransport,
    progress: _Progress,
    *,
    flush_last: bool,
) -> tuple[int, int]:
    """Every bucket inside an update session, the last one relabelling the engines; (buckets, bytes). An
    engine that fails a call gets nothing more (`progress` records it); the others go on."""
    num_buckets = 0
    num_bytes = 0
    sessions = await pool.settle(lambda client: client.begin_weight_update())
    progress.fail(_failures(sessions))
    # Engines without the session API answered 404 to begin (False): they get no end.
    opened = [index for index, session in sessions.items() if session is True]
    try:
        for bucket, last in _with_last(buckets):
            live = progress.live()
            if not live:
                break
            progress.sent.update(live)
            failures = await transport.push(
                pool,
                bucket,
                weight_version=version if last else None,
                flush_cache=flush_last and last,
                indices=live,
            )
            progress.fail(failures)
            num_buckets += 1
            num_bytes += sum(tensor.numel() * tensor.element_size() for _, tensor in bucket)
        if num_buckets == 0 and (live := progress.live()):
            progress.sent.update(live)
            relabelled = await pool.settle(lambda client: client.update_weight_version(version), indices=live)
            progress.fail(_failures(relabelled))
    finally:
        if opened:
            ended = await pool.settle(lambda client: client.end_weight_update(), indices=opened)
            progress.fail(_failures(ended))
    progress.done.update(progress.live())
    return num_buckets, num_bytes


def _failures(outcomes: Mapping[int, object]) -> dict[int, Exception]:
    """The engines whose call raised, with their errors (`EnginePool.settle`'s outcomes)."""
    return {index: outcome for index, outcome in outcomes.items() if isinstance(outcome, Exception)}
