"""The engine: continuous batching over a per-slot KV cache, pause modes and weight versions, on one thread.

One scheduler thread owns the model, the KV cache and every request's state. Everything else (the HTTP and
gRPC handlers) talks to it through `Engine.call`, which runs a function on that thread between two steps,
and through each request's `on_update` callback, which the thread calls after every token and at the finish.
Three parts share the work: the scheduler (`scheduler.py`: the table of requests and the rules of a step,
pure state), the step runner (`step_runner.py`: the model, the KV cache, the CUDA graphs) and this module,
which runs the loop, the control calls, and the recording of tokens and finishes.

A step: run the pending control calls; unless paused, admit waiting requests into free slots (one packed
prefill, FIFO, up to `max_running_requests`, within the prefill budget), then decode one token for every
running request in one batched forward. Running requests occupy slots `0..B-1`; when one finishes, the last
slot's KV moves into its place (one copy for every layer), so the decode reads one contiguous view of the
cache. A request longer than the prefill budget is prefilled in chunks, one per step (see `scheduler.py`);
a chunk step is a sync point of the overlap scheduler, and a retract puts the chunked request back at the head
of the queue (the KV of its chunks, if computed under the current weights, into the prefix cache).

The prefix cache (`prefix_cache.py`): a request's KV goes into the cache's block pool when it finishes or
is retracted, and a request whose tokens start with a cached prefix copies that KV into its slot and prefills
only the rest. Loading weights empties the cache, except under an `in_place` pause (whose running requests
keep their old KV too); `/flush_cache` empties it.

Invariant of a running request: the cache of its slot holds K/V for `prompt + output[:-1]`; the last output
token is fed at the next decode step (at position `len(prompt) + len(output) - 1`).

The overlap scheduler (on unless `overlap_schedule=False`, SGLang's `--disable-overlap-schedule`): a decode
step is launched, and left in flight (`LaunchedStep`); the next iteration launches the following step from
its sampled ids on the device, then reads and records the earlier step's tokens (appends, stop strings,
finishes, clients told) while the device runs the later one. A request that finishes in the step being read
has been decoded once more by the step in flight: that token is dropped, and its slot (still read by that
step) is freed at the next sync point, where the step in flight is read before anything else happens:
before every control call, before an admission that needs the host (a prompt whose logprobs are read,
`max_new_tokens` 0, a KV cache too short), when the KV cache must grow, or when a quarter of the batch is
finished rows. Other admissions run beside the step in flight (`Batch.admit_beside`): the admitted requests
are prefilled into the slots of finished rows and after the running ones, and the next step launches from
its ids with their first tokens put in place on the device. Between sync points a slot changes hands only
there.

No request can take the others down: a step that raises is retried request by request (`Batch.recover`), and
only a request that fails on its own is finished with the error (an abort with status 500); an `on_update`
callback that raises ends its own request (status 500 too). Other threads read the engine through
`snapshot` (an `EngineSnapshot` the scheduler swaps in), never through the containers it mutates.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from asyncrl_engine import DEFAULT_CHUNKED_PREFILL_SIZE
from asyncrl_engine.batch import Batch
from asyncrl_engine.model import EngineModel
from asyncrl_engine.prefix_cache import PrefixCache
from asyncrl_engine.request import (
    SHUTTING_DOWN,
    EngineBusyError,
    EngineStoppedError,
    Request,
    shutdown_reason,
)
from asyncrl_engine.scheduler import Scheduler
from asyncrl_engine.snapshot import EngineCounters, EngineSnapshot, WaitingQueue
from asyncrl_engine.step_runner import StepRunner
from asyncrl_sglang.wire import PauseMode

logger = logging.getLogger(__name__)

T = TypeVar("T")
KV_BLOCK_SIZE = 16
"""Tokens per block of the prefix cache (a cached prefix is a whole number of blocks)."""
CPU_PREFIX_CACHE_BYTES = 1 << 30
"""On CPU the prefix cache's pool holds at most this many bytes by default (host memory is shared with the
rest of the job; on CUDA the default is the size of the slots at full length)."""
CUDA_PREFILL_INTERVAL = 32
"""On CUDA, waiting requests join the running batch at most every this many decode steps (unless the batch
is empty, a quarter of its slots are waiting, or the last admission's prefill budget left some waiting): an
eager prefill costs ~10-20 ms of kernel launches for a 30-layer model whatever its token count, so one
prefill of many turns beats one per decode step. Under the agentic workload of `benchmarks/system/engine.py`
(256 trajectories, a turn ending about every step) 32 against 8 took 3% more decode steps and a third of the
prefills (20 against 63), and ran 1.2x faster; a turn waits at most 32 steps (~0.1 s) to join."""


class Engine:
    """Continuous batching for one model; start with `start()`, stop with `stop()`."""

    def __init__(
        self,
        model: EngineModel,
        *,
        max_running_requests: int = 32,
        context_length: int | None = None,
        weight_version: str = "default",
        seed: int = 0,
        eos_token_ids: Sequence[int] = (),
        decode_text: Callable[[list[int]], str] | None = None,
        use_cuda_graphs: bool = False,
        prefix_cache: bool = True,
        kv_block_size: int = KV_BLOCK_SIZE,
        prefix_cache_tokens: int | None = None,
        prefill_interval: int | None = None,
        overlap_schedule: bool = True,
        kv_whole_context: bool | None = None,
        chunked_prefill_size: int | None = DEFAULT_CHUNKED_PREFILL_SIZE,
    ) -> None:
        self.model = model
        self.scheduler = Scheduler(
            max_running_requests=max_running_requests,
            context_length=context_length or model.config.max_position_embeddings,
            prefill_interval=prefill_interval
            or (CUDA_PREFILL_INTERVAL if model.device.type == "cuda" else 1),
            chunked_prefill_size=chunked_prefill_size,
            eos_token_ids=frozenset(eos_token_ids or model.config.eos_token_ids),
            decode_text=decode_text,
        )
        self.weight_version = weight_version
        self.counters = EngineCounters()
        self.snapshot = EngineSnapshot()
        """The scheduler's last published state; read it from any thread."""
        self.paused: PauseMode | None = None
        if prefix_cache_tokens is None:
            prefix_cache_tokens = max_running_requests * self.scheduler.context_length
            if model.device.type != "cuda":
                c = model.config
                token_bytes = 2 * c.num_layers * c.num_kv_heads * c.head_dim * model.embed.element_size()
                prefix_cache_tokens = min(prefix_cache_tokens, CPU_PREFIX_CACHE_BYTES // token_bytes)
        cache = (
            PrefixCache(model.config, model.device, model.dtype, kv_block_size, prefix_cache_tokens)
            if prefix_cache
            else None
        )
        self.scheduler.cached_length = None if cache is None else cache.cached_length
        self.runner = StepRunner(
            model,
            self.scheduler,
            self.counters,
            seed=seed,
            prefix_cache=cache,
            use_cuda_graphs=use_cuda_graphs,
            kv_whole_context=kv_whole_context,
        )
        self.batch = Batch(
            self.scheduler, self.runner, self.counters, self._publish, overlap_schedule=overlap_schedule
        )
        self._commands: deque[tuple[Callable[[], Any], concurrent.futures.Future[Any], bool]] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="builtin-engine", daemon=True)

    # ---------------------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """End the scheduler thread; every request it holds then, and every call queued for it, is answered
        (`shutdown_reason`, `EngineStoppedError`), and every call made later is refused."""
        if not self._thread.is_alive():
            return
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout_s)

    def call(self, fn: Callable[[], T], timeout_s: float | None = None, *, drain: bool = True) -> T:
        """Run `fn` on the scheduler thread between two steps and return its result (or raise its error).

        The decode step in flight is read first (its tokens recorded, its finished slots freed), so `fn` sees
        the engine as the non-overlapped loop leaves it. `drain=False` is for calls that only queue requests
        (they touch nothing a launched step reads): they run beside the step in flight."""
        return self.call_async(fn, drain=drain).result(timeout_s)

    def call_async(self, fn: Callable[[], T], *, drain: bool = True) -> concurrent.futures.Future[T]:
        """`call` without waiting. On the scheduler thread itself (an `on_update` callback) `fn` runs at once,
        inside the step being read: it may queue or abort requests (an abort there leaves the slot to the step
        in flight, as any finish does), nothing more."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        if threading.current_thread() is self._thread:
            if self._stopping:  # the requests are being answered for the last time: none may join them
                future.set_exception(EngineStoppedError(SHUTTING_DOWN))
            else:
                future.set_result(fn())
            return future
        with self._wake:
            if self._stopping:
                future.set_exception(EngineStoppedError(SHUTTING_DOWN))
                return future
            self._commands.append((fn, future, drain))
            self._wake.notify()
        return future

    # ---------------------------------------------------------------------------------------------- state
    # Read on the scheduler thread (through `call`), or where nothing runs; other threads read `snapshot`.
    @property
    def running(self) -> list[Request]:
        return self.scheduler.table.running

    @property
    def waiting(self) -> WaitingQueue[Request]:
        return self.scheduler.table.waiting

    @property
    def max_running_requests(self) -> int:
        return self.scheduler.max_running_requests

    @property
    def context_length(self) -> int:
        return self.scheduler.context_length

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.scheduler.eos_token_ids

    @property
    def chunked_prefill_size(self) -> int | None:
        return self.scheduler.chunked_prefill_size

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self.runner.prefix_cache

    @property
    def kv_whole_context(self) -> bool | None:
        return self.runner.kv_whole_context

    @property
    def num_running(self) -> int:
        return len(self.scheduler.table.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.table.waiting)

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes held by the KV cache (0 before the first request or after a release)."""
        return self.runner.kv_cache_bytes

    @property
    def cuda_graph_batch_sizes(self) -> list[int]:
        """The decode batch sizes captured as CUDA graphs so far (none on CPU): every bucket when the KV cache
        takes the whole context at once, else each on first use."""
        graphs = self.runner.graphs
        return [] if graphs is None else graphs.batch_sizes

    @property
    def cuda_graph_prefill_tokens(self) -> list[int]:
        """The token counts whose prefill graphs are captured (`PREFILL_GRAPH_TOKENS`, at their first use)."""
        graphs = self.runner.graphs
        if graphs is None:
            return []
        return sorted(tokens for tokens, graph in graphs.prefills.items() if graph is not None)

    @property
    def cuda_graph_bytes(self) -> int:
        """Device memory the captured CUDA graphs (decode and prefill) took when they were captured."""
        graphs = self.runner.graphs
        return 0 if graphs is None else graphs.memory_bytes

    def is_idle(self) -> bool:
        return self.scheduler.table.is_idle()

    def find(self, rid: str) -> Request | None:
        return self.scheduler.table.find(rid)

    def _publish(self) -> None:
        """Swap in a new `snapshot` (scheduler thread only; O(running), the queue keeps its own totals). A
        finished request whose slot the step in flight still decodes is not running."""
        table = self.scheduler.table
        num_running = num_used_tokens = 0
        for r in table.running:  # once per step and per finish: plain loop, no property calls
            if r.finish_reason is None:
                num_running += 1
                num_used_tokens += len(r.prompt_ids) + len(r.output_ids)
        if table.chunked is not None:  # neither running nor waiting (as SGLang counts it); its KV is held
            num_used_tokens += table.chunk_prefilled
        waiting = table.waiting
        self.snapshot = EngineSnapshot(
            num_running=num_running,
            num_waiting=len(waiting),
            num_waiting_tokens=waiting.num_tokens,
            num_retracted_waiting=waiting.num_retracted,
            num_used_tokens=num_used_tokens,
            counters=dataclasses.replace(self.counters),
            kv_cache_bytes=self.kv_cache_bytes,
            cuda_graph_batch_sizes=tuple(self.cuda_graph_batch_sizes),
            cuda_graph_bytes=self.cuda_graph_bytes,
        )

    # ---------------------------------------------------------------------------------------------- commands
    # Everything below named without a leading underscore is meant to run through `call`.
    def add_request(self, request: Request) -> None:
        """Queue a request (FIFO). Its version spans start at the current weight version."""
        request.version_marks = [(self.weight_version, 0)]
        if request.options.sampling_seed is not None:
            request.generator = torch.Generator(device=self.model.device).manual_seed(
                request.options.sampling_seed
            )
        self.counters.num_requests_total += 1
        self.scheduler.table.add(request)

    def abort(self, rid: str, message: str = "Aborted") -> bool:
        """Finish the request `rid` with an abort reason; False if no such request is live."""
        request = self.find(rid)
        if request is None:
            return False
        self.batch.abort(request, message)
        return True

    def abort_all(self) -> int:
        """Abort every running and waiting request; returns how many."""
        table = self.scheduler.table
        victims = table.live()
        table.waiting.clear()  # at once: removing each from a long queue would be quadratic
        for request in victims:
            self.batch.abort(request, "Aborted")
        return len(victims)

    def pause(self, mode: PauseMode) -> None:
        """Stop forming batches. `retract` also frees the KV of every running request and requeues it."""
        if mode == "retract":
            table, runner, counters = self.scheduler.table, self.runner, self.counters
            chunked = table.chunked
            if chunked is not None:
                # Retracted as SGLang retracts its chunked request: back to the queue, after the running ones,
                # its chunks' KV kept in the prefix cache under the same rule as theirs.
                self.batch.drop_chunked(store=chunked.kv_weights_epoch == runner.weights_epoch)
                chunked.num_retractions += 1
                counters.num_retracted_requests_total += 1
                counters.num_retracted_output_tokens_total += len(chunked.output_ids)
                table.waiting.appendleft(chunked)
            for slot, request in enumerate(table.running):
                # Only KV computed wholly under the current weights: a request kept through an in_place update
                # holds older KV, and retraction promises a recomputation under the current weights.
                if request.kv_weights_epoch == runner.weights_epoch:
                    runner.store_prefix(request, slot)
            for request in reversed(table.running):
                request.num_retractions += 1
                counters.num_retracted_requests_total += 1
                counters.num_retracted_output_tokens_total += len(request.output_ids)
                table.waiting.appendleft(request)
            table.running.clear()
            counters.gen_throughput = 0.0
            self.batch.throughput_window.clear()
        if mode == "abort":
            self.abort_all()
        # A retract pause on top of an in_place one still retracts; any pause keeps the strongest hold.
        self.paused = mode

    def resume(self) -> None:
        self.paused = None

    def set_weight_version(self, version: str) -> None:
        """Relabel the weights; every live request records a boundary at its current output length."""
        if version == self.weight_version:
            return
        self.weight_version = version
        self.scheduler.table.relabel(version)

    def load_weights(self, tensors: Sequence[tuple[str, Tensor]], version: str | None) -> None:
        """Load (a subset of) parameters by HuggingFace name, then relabel if `version` is given.

        Raises `ModelLoadError` (nothing changed) when a name or shape does not fit. The prefix cache's KV
        was computed under the old weights: it is dropped, except under an `in_place` pause, which keeps old
        KV by contract (for the requests it holds, and so for the cache).
        """
        self.runner.load_weights(tensors, keep_prefix_cache=self.paused == "in_place")
        if version is not None:
            self.set_weight_version(version)

    def flush_cache(self) -> None:
        """Empty the prefix cache; refused unless fully idle. Its memory, the KV cache and the CUDA graphs
        stay (as SGLang's flush keeps its memory pool): a drain-mode weight sync flushes at every update, and
        reallocating and capturing again would cost the next step. `release_memory` frees them."""
        if not self.is_idle():
            raise EngineBusyError(
                f"Cannot flush the cache: {self.num_running} running and {self.num_waiting} waiting requests "
                "are held (finish, abort or continue them first)."
            )
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def release_memory(self, tags: Sequence[str]) -> None:
        """Free the KV cache (`kv_cache`) and move the weights to host memory (`weights`, CUDA only)."""
        if not self.is_idle():
            raise EngineBusyError(
                f"Cannot release memory: {self.num_running} running and {self.num_waiting} waiting requests."
            )
        if "kv_cache" in tags or "cuda_graph" in tags:
            self.runner.release_cache()
        if "weights" in tags:
            self.runner.release_weights()

    def resume_memory(self, tags: Sequence[str]) -> None:
        if "weights" in tags:
            self.runner.resume_weights()

    # ---------------------------------------------------------------------------------------------- the loop
    def _has_work(self) -> bool:
        return (
            self.paused is None and not self.runner.weights_released and self.scheduler.table.has_requests()
        )

    def _loop(self) -> None:
        batch = self.batch
        while True:
            with self._wake:
                while not self._stopping and not self._commands and not self._has_work():
                    self._wake.wait()
                if self._stopping:
                    commands = list(self._commands)
                    self._commands.clear()
                    for _, future, _ in commands:
                        future.set_exception(EngineStoppedError(SHUTTING_DOWN))
                    break
                commands = list(self._commands)
                self._commands.clear()
            if any(drain for _, _, drain in commands):
                batch.drain()
            outcomes: list[tuple[concurrent.futures.Future[Any], Any, BaseException | None]] = []
            for fn, future, _ in commands:
                if future.set_running_or_notify_cancel():
                    try:
                        outcomes.append((future, fn(), None))
                    except BaseException as error:
                        outcomes.append((future, None, error))
            if outcomes:
                # Published before the callers resume: whoever waited for a command sees its effect.
                self._publish()
                for future, result, error in outcomes:
                    if error is None:
                        future.set_result(result)
                    else:
                        future.set_exception(error)
            if self._has_work():
                try:
                    batch.step()
                except Exception as error:
                    batch.recover(error)  # the step in flight is dropped: no client heard of its tokens
                batch.step_requests = []
            self._publish()
        # Stopping. No call can queue a request any more (`call_async` refuses under the lock that was held
        # when the loop saw `_stopping`), so these are the last requests: every one is answered.
        batch.drain()
        table = self.scheduler.table
        victims = table.live()
        table.waiting.clear()
        for request in victims:
            self.counters.num_aborted_requests_total += 1
            batch.finish(request, shutdown_reason())
        self._publish()
