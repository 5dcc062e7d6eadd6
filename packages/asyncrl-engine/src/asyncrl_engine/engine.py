"""The engine core: continuous batching over a per-slot KV cache, sampling, pause modes and weight versions.

One scheduler thread owns the model, the KV cache and every request's state. Everything else (the HTTP
handlers) talks to it through `Engine.call`, which runs a function on that thread between two steps, and
through each request's `on_update` callback, which the thread calls after every token and at the finish.

A step: run the pending control calls; unless paused, admit waiting requests into free slots (one prefill
each, FIFO, up to `max_running_requests`), then decode one token for every running request in one batched
forward. Running requests occupy slots `0..B-1`; when one finishes, the last slot's KV moves into its place
(one copy for every layer), so the decode reads one contiguous view of the cache.

The prefix cache (`prefix_cache.py`): a request's KV goes into the cache's block pool when it finishes or
is retracted, and a request whose tokens start with a cached prefix copies that KV into its slot and prefills
only the rest. Loading weights empties the cache, except under an `in_place` pause (whose running requests
keep their old KV too); `/flush_cache` empties it.

Chunked prefill (SGLang's `--chunked-prefill-size`, the token budget of one prefill batch): a request with
more tokens still to prefill than the budget leaves on its own (`_chunked`, one at a time, in neither the
waiting queue nor the running batch, as SGLang's `chunked_req`) into the last slot, which the running
requests then leave free. Each step prefills its next chunk (filling the rest of the step's budget at its
first, behind the requests admitted before it; a whole budget after), its cached prefix loaded at the first,
and the running requests decode one token between two chunks. Its last chunk is an ordinary admission: its
KV moves into the slot after the running ones, the rest is prefilled with the requests admitted beside it,
and it samples its first token and joins the batch. A chunk step is a sync point of the overlap scheduler.
Its prompt logprobs are computed chunk by chunk. A retract puts it back at the head of the queue (the KV of
its chunks, if computed under the current weights, into the prefix cache), an abort or a failure drops it.

Invariant of a running request: the cache of its slot holds K/V for `prompt + output[:-1]`; the last output
token is fed at the next decode step (at position `len(prompt) + len(output) - 1`).

The overlap scheduler (on unless `overlap_schedule=False`, SGLang's `--disable-overlap-schedule`): a decode
step is launched, and left in flight (`_LaunchedStep`); the next iteration launches the following step from
its sampled ids on the device, then reads and records the earlier step's tokens (appends, stop strings,
finishes, clients told) while the device runs the later one. A request that finishes in the step being read
has been decoded once more by the step in flight: that token is dropped, and its slot (still read by that
step) is freed at the next sync point, where the step in flight is read before anything else happens:
before every control call, before an admission that needs the host (a prompt whose logprobs are read,
`max_new_tokens` 0, a KV cache too short), when the KV cache must grow, or when a quarter of the batch is
finished rows. Other admissions run beside the step in flight (`_admit_beside`): the admitted requests are
prefilled into the slots of finished rows and after the running ones, and the next step launches from its
ids with their first tokens put in place on the device. Between sync points a slot changes hands only there.

No request can take the others down: a step that raises is retried request by request (`_recover`), and only
a request that fails on its own is finished with the error (an abort with status 500); an `on_update`
callback that raises ends its own request (status 500 too). Other threads read the engine through
`snapshot` (an `EngineSnapshot` the scheduler swaps in), never through the containers it mutates.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import Tensor

from asyncrl_engine import DEFAULT_CHUNKED_PREFILL_SIZE, extend_attention
from asyncrl_engine.model import EngineModel, KVCache, PackedPrefill, PackedShape
from asyncrl_engine.prefix_cache import PrefixCache
from asyncrl_engine.sampling import (
    DeviceSample,
    SampledToken,
    SamplingOptions,
    SamplingPlan,
    sample_dense,
    sample_on_device,
    sample_tokens,
    unpack_samples,
)
from asyncrl_engine.snapshot import EngineCounters, EngineSnapshot, WaitingQueue
from asyncrl_sglang.wire import PauseMode as PauseMode

logger = logging.getLogger(__name__)

T = TypeVar("T")
KV_CAPACITY_STEP = 256
"""The KV cache grows in multiples of this many positions (up to the context length)."""
CUDA_KV_WHOLE_CONTEXT_SHARE = 0.4
"""On CUDA the KV cache takes the whole context length at its first allocation when that needs at most this
share of the device's free memory (as SGLang sizes its KV pool once at start): it then never grows, and a
growth would copy it and drop every captured decode graph, to be captured again at each batch size."""
STOP_TEXT_MAX_PENDING_TOKENS = 16
"""Output tokens whose text may stay undecided (ending in an incomplete UTF-8 character) before the stop
string matcher takes their text as it decodes now (a character has at most 4 bytes)."""
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


SHUTTING_DOWN = "The server is shutting down."
"""The message of every request the engine answers because it stops (and of calls it refuses then)."""


class EngineStoppedError(RuntimeError):
    """The engine has stopped (its server is shutting down): a call made now never runs."""


def shutdown_reason() -> dict[str, Any]:
    """The finish reason of a request cut off because the engine stops: an abort with status 503, as SGLang
    marks a request it cannot serve now (`FINISH_ABORT(message, HTTPStatus.SERVICE_UNAVAILABLE)`), which its
    server answers as a 503 rather than a partial output, so that a client sends the request again (to
    another engine, or to this one restarted) instead of taking the cut-off output as the model's end. A user
    abort (`abort_request`, a pause in abort mode) has status null and answers its partial output (200)."""
    return {"type": "abort", "message": SHUTTING_DOWN, "status_code": 503, "err_type": None}


INTERNAL_ERROR = 500
"""The status of a request the engine finishes because it failed on its own (`_recover`, a callback that
raises), as SGLang marks an internal error (`FINISH_ABORT(message, HTTPStatus.INTERNAL_SERVER_ERROR)`): its
server answers it as an error, never with the partial output, which the model did not end."""


class EngineBusyError(RuntimeError):
    """A control operation that needs an idle engine was called while requests are held or running."""


@dataclass(slots=True, eq=False)
class Request:
    """One sequence being generated. Mutated only by the scheduler thread; lists only ever grow. Compared by
    identity (finding one among the running requests compares no fields)."""

    rid: str
    prompt_ids: list[int]
    options: SamplingOptions
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    on_update: Callable[[Request, bool], None] | None = None
    """Called on the scheduler thread after each new token (finished=False) and once at the end (True)."""
    stream: bool = False
    output_ids: list[int] = field(default_factory=lambda: list[int]())
    output_logprobs: list[float] = field(default_factory=lambda: list[float]())
    output_top_logprobs: list[list[tuple[float, int]]] = field(
        default_factory=lambda: list[list[tuple[float, int]]]()
    )
    input_logprobs: list[float | None] = field(default_factory=lambda: list[float | None]())
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(
        default_factory=lambda: list[list[tuple[float, int]] | None]()
    )
    version_marks: list[tuple[str, int]] = field(default_factory=lambda: list[tuple[str, int]]())
    """(version, first output position under it); the spans of `weight_versions`."""
    num_retractions: int = 0
    finish_reason: dict[str, Any] | None = None
    was_running: bool = False
    """False while it never left the waiting queue (then an abort response carries no `prompt_tokens`)."""
    created_s: float = field(default_factory=time.monotonic)
    generator: torch.Generator | None = None
    stop_prefix_offset: int = 0
    """Stop strings: the output position the incremental decode starts from (before `stop_read_offset`, so
    that the tokenizer sees the context a word's leading space depends on)."""
    stop_read_offset: int = 0
    """Stop strings: output tokens whose text has been matched against."""
    stop_tail: str = ""
    """Stop strings: the end of the matched text that a stop string completed by a later token can start in
    (the longest stop string's length minus one)."""
    cached_tokens: int = 0
    """Tokens whose KV came from the prefix cache instead of a prefill (summed over re-prefills)."""
    kv_weights_epoch: int = -1
    """The engine's `weights_epoch` when this request's KV was (re)computed at its last prefill."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def weight_versions(self, length: int | None = None) -> list[dict[str, Any]]:
        """Half-open spans over the first `length` output positions (all by default), empty ones dropped."""
        end_all = len(self.output_ids) if length is None else length
        spans: list[dict[str, Any]] = []
        for index, (version, start) in enumerate(self.version_marks):
            end = self.version_marks[index + 1][1] if index + 1 < len(self.version_marks) else end_all
            start, end = min(start, end_all), min(end, end_all)
            if end > start:
                spans.append({"version": version, "start": start, "end": end})
        if not spans:
            # Finished before its first token: one empty span under the last version.
            spans.append({"version": self.version_marks[-1][0], "start": 0, "end": 0})
        return spans


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
        if max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {max_running_requests}")
        self.model = model
        self.max_running_requests = max_running_requests
        self.context_length = context_length or model.config.max_position_embeddings
        self.weight_version = weight_version
        self.eos_token_ids = frozenset(eos_token_ids or model.config.eos_token_ids)
        self.decode_text = decode_text
        """Token ids -> text, used for stop strings (None: stop strings are refused at validation)."""
        self._token_text_lengths: dict[int, int] = {}
        """`len(decode_text([id]))` by id, for the stop-string matcher (decoded once per id)."""
        self.generator = torch.Generator(device=model.device).manual_seed(seed)
        self.counters = EngineCounters()
        self.running: list[Request] = []
        self.waiting: WaitingQueue[Request] = WaitingQueue()
        self._by_rid: dict[str, Request] = {}
        """Live (queued or running) requests by rid."""
        self._step_requests: list[Request] = []
        """The requests of the step in progress (admitted and running), for `_recover`."""
        self.snapshot = EngineSnapshot()
        """The scheduler's last published state; read it from any thread."""
        self.paused: PauseMode | None = None
        self.weights_released = False
        self._cache: KVCache | None = None
        self.kv_whole_context = kv_whole_context
        """Whether the KV cache is allocated at the whole context length at once rather than grown on demand
        (None: decided at its first allocation, see `CUDA_KV_WHOLE_CONTEXT_SHARE`; False on CPU)."""
        self.prefill_interval = prefill_interval or (
            CUDA_PREFILL_INTERVAL if model.device.type == "cuda" else 1
        )
        """Decode steps between two admissions of waiting requests while others run (1: every step)."""
        self._steps_since_prefill = 0
        self._admission_cut_short = False
        """The last admission left requests waiting that a slot was free for but its prefill budget was not:
        the next step admits again, as a chunked prefill goes on every step. (The interval gathers turns
        into a prefill worth its launches; a backlog that filled one budget is worth another at once.)"""
        self.overlap_schedule = overlap_schedule
        """Launch each decode step before reading the previous one's tokens (see the module's docstring)."""
        self._in_flight: _LaunchedStep | None = None
        """The decode step launched and not read yet (overlap scheduler only)."""
        self._last_decode_end = 0.0
        self.chunked_prefill_size = (
            chunked_prefill_size if chunked_prefill_size is not None and chunked_prefill_size > 0 else None
        )
        """The token budget of one prefill batch, and of one chunk of a longer request (None: chunking
        disabled, as SGLang reads -1 or 0; then a batch holds `DEFAULT_CHUNKED_PREFILL_SIZE` and a longer
        prompt goes alone)."""
        self._chunked: Request | None = None
        """The request being prefilled in chunks, its KV in `_chunk_slot` (see the module's docstring)."""
        self._chunk_slot = max_running_requests - 1
        self._chunk_prefilled = 0
        """Positions of `_chunked`'s KV in `_chunk_slot` (its prefix-cache hit included)."""
        self._chunk_next = 0
        """Tokens of `_chunked`'s chunk this step (set by `_take_admitted`, 0: none)."""
        self.weights_epoch = 0
        """Counts weight loads: KV computed before the last load is stale under the current weights."""
        if prefix_cache_tokens is None:
            prefix_cache_tokens = max_running_requests * self.context_length
            if model.device.type != "cuda":
                c = model.config
                token_bytes = 2 * c.num_layers * c.num_kv_heads * c.head_dim * model.embed.element_size()
                prefix_cache_tokens = min(prefix_cache_tokens, CPU_PREFIX_CACHE_BYTES // token_bytes)
        self.prefix_cache = (
            PrefixCache(model.config, model.device, model.dtype, kv_block_size, prefix_cache_tokens)
            if prefix_cache
            else None
        )
        """KV of finished requests by token prefix (None: every prefill starts from scratch)."""
        self._graphs = _CudaGraphs(self) if use_cuda_graphs and model.device.type == "cuda" else None
        self._prefill_replay = None if self._graphs is None else self._graphs.prefill
        self._commands: deque[tuple[Callable[[], Any], concurrent.futures.Future[Any], bool]] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="builtin-engine", daemon=True)
        self._throughput_window: deque[tuple[float, int]] = deque(maxlen=32)

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
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes held by the KV cache (0 before the first request or after a release)."""
        pool = 0 if self.prefix_cache is None else self.prefix_cache.nbytes()
        return pool + (0 if self._cache is None else self._cache.nbytes())

    @property
    def cuda_graph_batch_sizes(self) -> list[int]:
        """The decode batch sizes captured as CUDA graphs so far (none on CPU): every bucket when the KV cache
        takes the whole context at once, else each on first use."""
        return [] if self._graphs is None else self._graphs.batch_sizes

    @property
    def cuda_graph_prefill_tokens(self) -> list[int]:
        """The token counts whose prefill graphs are captured (`PREFILL_GRAPH_TOKENS`, at their first use)."""
        if self._graphs is None:
            return []
        return sorted(tokens for tokens, graph in self._graphs.prefills.items() if graph is not None)

    @property
    def cuda_graph_bytes(self) -> int:
        """Device memory the captured CUDA graphs (decode and prefill) took when they were captured."""
        return 0 if self._graphs is None else self._graphs.memory_bytes

    def is_idle(self) -> bool:
        return not self.running and not self.waiting and self._chunked is None

    def find(self, rid: str) -> Request | None:
        return self._by_rid.get(rid)

    def _publish(self) -> None:
        """Swap in a new `snapshot` (scheduler thread only; O(running), the queue keeps its own totals). A
        finished request whose slot the step in flight still decodes is not running."""
        num_running = num_used_tokens = 0
        for r in self.running:  # once per step and per finish: plain loop, no property calls
            if r.finish_reason is None:
                num_running += 1
                num_used_tokens += len(r.prompt_ids) + len(r.output_ids)
        if self._chunked is not None:  # neither running nor waiting (as SGLang counts it); its KV is held
            num_used_tokens += self._chunk_prefilled
        self.snapshot = EngineSnapshot(
            num_running=num_running,
            num_waiting=len(self.waiting),
            num_waiting_tokens=self.waiting.num_tokens,
            num_retracted_waiting=self.waiting.num_retracted,
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
        self._by_rid[request.rid] = request
        self.waiting.append(request)

    def abort(self, rid: str, message: str = "Aborted") -> bool:
        """Finish the request `rid` with an abort reason; False if no such request is live."""
        request = self.find(rid)
        if request is None:
            return False
        self._abort(request, message)
        return True

    def _abort_all(self, message: str = "Aborted") -> int:
        victims = [*self.running, *self._chunked_list(), *self.waiting]
        self.waiting.clear()  # at once: removing each from a long queue would be quadratic
        for request in victims:
            self._abort(request, message)
        return len(victims)

    def _chunked_list(self) -> list[Request]:
        return [] if self._chunked is None else [self._chunked]

    def abort_all(self) -> int:
        """Abort every running and waiting request; returns how many."""
        return self._abort_all()

    def pause(self, mode: PauseMode) -> None:
        """Stop forming batches. `retract` also frees the KV of every running request and requeues it."""
        if mode == "retract":
            chunked = self._chunked
            if chunked is not None:
                # Retracted as SGLang retracts its chunked request: back to the queue, after the running ones,
                # its chunks' KV kept in the prefix cache under the same rule as theirs.
                self._drop_chunked(store=chunked.kv_weights_epoch == self.weights_epoch)
                chunked.num_retractions += 1
                self.counters.num_retracted_requests_total += 1
                self.counters.num_retracted_output_tokens_total += len(chunked.output_ids)
                self.waiting.appendleft(chunked)
            for slot, request in enumerate(self.running):
                # Only KV computed wholly under the current weights: a request kept through an in_place update
                # holds older KV, and retraction promises a recomputation under the current weights.
                if request.kv_weights_epoch == self.weights_epoch:
                    self._store_prefix(request, slot)
            for request in reversed(self.running):
                request.num_retractions += 1
                self.counters.num_retracted_requests_total += 1
                self.counters.num_retracted_output_tokens_total += len(request.output_ids)
                self.waiting.appendleft(request)
            self.running.clear()
            self.counters.gen_throughput = 0.0
            self._throughput_window.clear()
        if mode == "abort":
            self._abort_all()
        # A retract pause on top of an in_place one still retracts; any pause keeps the strongest hold.
        self.paused = mode

    def resume(self) -> None:
        self.paused = None

    def set_weight_version(self, version: str) -> None:
        """Relabel the weights; every live request records a boundary at its current output length."""
        if version == self.weight_version:
            return
        self.weight_version = version
        for request in (*self.running, *self._chunked_list(), *self.waiting):
            position = len(request.output_ids)
            last_version, last_start = request.version_marks[-1]
            if last_start == position:
                request.version_marks[-1] = (version, position)
            elif last_version != version:
                request.version_marks.append((version, position))
            # Merge back if a relabel returned to the previous span's version with no token in between.
            if (
                len(request.version_marks) >= 2
                and request.version_marks[-2][0] == request.version_marks[-1][0]
            ):
                request.version_marks.pop()

    def load_weights(self, tensors: Sequence[tuple[str, Tensor]], version: str | None) -> None:
        """Load (a subset of) parameters by HuggingFace name, then relabel if `version` is given.

        Raises `ModelLoadError` (nothing changed) when a name or shape does not fit. The prefix cache's KV
        was computed under the old weights: it is dropped, except under an `in_place` pause, which keeps old
        KV by contract (for the requests it holds, and so for the cache).
        """
        self.model.load_named_tensors(tensors)
        self.weights_epoch += 1
        if self.prefix_cache is not None and self.paused != "in_place":
            self.prefix_cache.clear()
        if self._graphs is not None:
            self._graphs.weights_changed()
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
            self._release_cache()
        if "weights" in tags and not self.weights_released:
            self._weights_device = self.model.device
            if self.model.device.type == "cuda":
                self.model.move_weights(torch.device("cpu"))
                if self._graphs is not None:
                    self._graphs.weights_changed()
                torch.cuda.empty_cache()
            self.weights_released = True

    def resume_memory(self, tags: Sequence[str]) -> None:
        if "weights" in tags and self.weights_released:
            self.model.move_weights(self._weights_device)
            if self._graphs is not None:
                self._graphs.weights_changed()
            self.weights_released = False

    def _release_cache(self) -> None:
        self._cache = None
        if self.prefix_cache is not None:
            self.prefix_cache.release()
        if self._graphs is not None:
            self._graphs.clear()
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---------------------------------------------------------------------------------------------- the loop
    def _loop(self) -> None:
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
                self._drain()
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
                    self._step()
                except Exception as error:
                    self._in_flight = None  # its tokens are dropped: no client heard of them
                    self._recover(error)
                self._step_requests = []
            self._publish()
        # Stopping. No call can queue a request any more (`call_async` refuses under the lock that was held
        # when the loop saw `_stopping`), so these are the last requests: every one is answered.
        self._drain()
        victims = [*self.running, *self._chunked_list(), *self.waiting]
        self.waiting.clear()
        for request in victims:
            self.counters.num_aborted_requests_total += 1
            self._finish(request, shutdown_reason())
        self._publish()

    def _drain(self) -> None:
        """Read the decode step in flight, if any, and free the slots of the requests finished since it was
        launched: afterwards the engine is as the non-overlapped loop leaves it between two steps."""
        step = self._in_flight
        if step is None:
            return
        self._in_flight = None
        self._step_requests = list(self.running)
        try:
            self._complete(step)
            self._release_finished()
        except Exception as error:
            self._recover(error)
        self._step_requests = []

    def _recover(self, error: Exception) -> None:
        """After a step raised: find which of its requests cannot proceed and finish only those.

        Every unfinished request of the step leaves the batch (its KV is recomputed later, as after a retract)
        and runs alone: a prefill of its prompt and output so far, then one decode step. One that raises alone
        is finished with the error; the others go back to the front of the queue in their order, with the
        tokens they had (and any the probe produced). A failure that no request reproduces alone costs the
        step's requests a re-prefill, never their output."""
        # A step in flight when the failure came is dropped with its tokens (no client heard of them).
        involved = [r for r in self._step_requests if not r.finished]
        chunked = self._chunked
        if chunked is not None:
            # Its KV is dropped and it is probed as the others (its chunks may be what failed).
            self._chunked = None
            if chunked not in involved:
                involved.append(chunked)
        logger.exception("engine step failed for %d requests; retrying them one by one", len(involved))
        # Every running request belongs to the step (a finished one the failure left in place included).
        self.running.clear()
        for request in involved:
            if not request.was_running:
                # Prompt logprobs are computed once, at the first prefill: drop any half-written ones.
                request.input_logprobs.clear()
                request.input_top_logprobs.clear()
        survivors: list[Request] = []
        for request in involved:
            if request.finished:
                continue
            self.running.clear()
            try:
                self._prefill_alone(request)
                if self.running:
                    self._decode()
            except Exception as probe_error:
                self.running.clear()
                self._chunked = None
                if not request.finished:
                    logger.exception("request %s fails alone: finished with the error", request.rid)
                    self._abort(request, f"Internal engine error: {probe_error}", INTERNAL_ERROR)
                continue
            if not request.finished:
                self._store_prefix(request, 0)  # its re-prefill then copies what the probe computed
                self.running.clear()
                survivors.append(request)
        for request in reversed(survivors):
            self.waiting.appendleft(request)
        if survivors and len(survivors) == len(involved):
            logger.warning("no request of the failed step fails alone (%s): all requeued", error)

    def _notify(self, request: Request, finished: bool) -> None:
        """Call the request's `on_update`; one that raises ends its own request (it can no longer be told)."""
        if request.on_update is None:
            return
        try:
            request.on_update(request, finished)
        except Exception as error:
            logger.exception("the update callback of request %s failed", request.rid)
            if not finished and not request.finished:
                self._abort(
                    request, f"Internal engine error: the update callback failed: {error}", INTERNAL_ERROR
                )

    def _has_work(self) -> bool:
        return (
            self.paused is None
            and not self.weights_released
            and bool(self.running or self.waiting or self._chunked is not None)
        )

    def _admission_due(self) -> bool:
        """Whether this step admits waiting requests (see `prefill_interval`); every step while a request is
        prefilled in chunks (one chunk a step) or the last admission was cut short by its prefill budget."""
        if not self.waiting:
            return self._chunked is not None
        return (
            self._chunked is not None
            or self._admission_cut_short
            or not self.running
            or self._steps_since_prefill + 1 >= self.prefill_interval
            or 4 * len(self.waiting) >= self.max_running_requests
        )

    def _step(self) -> None:
        self._step_requests = list(self.running)
        in_flight = self._in_flight
        if in_flight is not None:
            positions = self._decode_positions(pending=1)
            if self._continues(in_flight, positions):
                # Overlapped: launch the next step from this one's ids on the device, then read this one
                # while the device runs the next.
                self._steps_since_prefill += 1
                self._in_flight = self._launch_decode(in_flight, positions)
                self._complete(in_flight)
                return
            if self._admit_beside(in_flight):
                return
            # A sync point: read the step in flight and free the finished slots before the batch changes.
            self._in_flight = None
            self._complete(in_flight)
            self._release_finished()
        due = self._admission_due()
        self._steps_since_prefill = 0 if due else self._steps_since_prefill + 1
        admitted = self._take_admitted(self.max_running_requests - len(self.running)) if due else []
        self._step_requests = [*admitted, *self.running]
        if admitted or self._chunk_next:
            began = time.perf_counter()
            if admitted:
                self._prefill(admitted)
            if self._chunk_next:
                self._prefill_chunk()
            self.counters.prefill_busy_us += round((time.perf_counter() - began) * 1e6)
        if self.running:
            if self.overlap_schedule:
                self._in_flight = self._launch_decode(None)
            else:
                self._decode()

    def _take_admitted(self, free: int, simple_only: bool = False) -> list[Request]:
        """Pop the requests that join now: FIFO, at most `free`, within `chunked_prefill_size` tokens to
        prefill (`_tokens_to_prefill`: a prefix the cache holds is not prefilled, so it does not count). The
        request prefilled in chunks goes first: its next chunk alone (`_chunk_next`) while the rest exceeds
        the budget, else its last chunk, admitted. A longer waiting request then starts its chunks with the
        rest of the budget (`_chunked`) and ends the admission (chunking disabled: a longer one joins
        alone). `simple_only`: stop before the first one whose prefill needs the host at once
        (prompt logprobs to read, `max_new_tokens` 0: finished at its prefill, or a chunk)."""
        admitted: list[Request] = []
        size_limit = self.chunked_prefill_size
        budget = size_limit or DEFAULT_CHUNKED_PREFILL_SIZE
        chunked = self._chunked
        if chunked is not None:
            remaining = chunked.num_tokens - self._chunk_prefilled
            if remaining > budget:
                self._chunk_next = budget
                return admitted
            admitted.append(chunked)  # its last chunk (its slot is counted in `free`)
            budget -= remaining
        while self.waiting and len(admitted) < free:
            head = self.waiting[0]
            if simple_only and (
                head.options.max_new_tokens == 0
                or (not head.was_running and head.return_logprob and head.logprob_start_len >= 0)
            ):
                break
            size = self._tokens_to_prefill(head)
            if size > budget:
                if size_limit is None:
                    if admitted:
                        break
                elif simple_only or self._chunked is not None or budget <= 0:
                    break
                else:
                    # Its slot is the last one, which the running and admitted requests leave free.
                    self._chunked = self.waiting.popleft()
                    self._chunk_prefilled = 0
                    self._chunk_next = budget
                    break
            admitted.append(self.waiting.popleft())
            budget -= size
        self._admission_cut_short = bool(self.waiting) and len(admitted) < free
        return admitted

    def _tokens_to_prefill(self, request: Request) -> int:
        """The tokens a prefill of `request` computes now: its sequence less the prefix that the prefix cache
        holds (what counts against the prefill budget, as SGLang counts a request's extend tokens)."""
        size = request.num_tokens
        if self.prefix_cache is None:
            return size
        sequence = request.prompt_ids + request.output_ids
        return size - self.prefix_cache.cached_length(sequence, self._cacheable_prefix(request, size))

    def _admit_beside(self, step: _LaunchedStep) -> bool:
        """Admit waiting requests without reading the decode step in flight, if nothing needs the host first;
        False (nothing done) otherwise, and the caller syncs.

        The admitted requests are prefilled into the slots of finished rows (the step in flight decodes them
        for nothing, and the device runs the prefill after it) and then into fresh slots after the running
        ones, their first tokens drawn on the device. The next decode step is launched from the step in
        flight's ids with those first tokens put in place on the device, so no read of the host sits
        between the launches. Then the step in flight is read and recorded, then the first tokens, in the
        order the sync path records them. Needs: the batch unchanged since the launch, an admission due, a
        finished row or a free slot, and the KV cache already long enough for the prefill and the next step
        (growing it would copy what the step in flight is still writing)."""
        running = self.running
        if running != step.requests or self._chunked is not None or not self._admission_due():
            return False
        reusable = [slot for slot, r in enumerate(running) if r.finished]
        free = len(reusable) + self.max_running_requests - len(running)
        cache = self._cache
        if cache is None or free == 0:
            return False
        positions = self._decode_positions(pending=1)
        cut_short = self._admission_cut_short
        admitted = self._take_admitted(free, simple_only=True)
        needed = max([*positions, *(r.num_tokens for r in admitted)], default=0) + 2
        if not admitted or cache.capacity < min(needed, self.context_length):
            # Undone: the queue and whether an admission is due are as before, for the sync path.
            for request in reversed(admitted):
                self.waiting.appendleft(request)
            self._admission_cut_short = cut_short
            return False
        slots = (reusable + list(range(len(running), self.max_running_requests)))[: len(admitted)]
        self._steps_since_prefill = 0
        self._step_requests = [*admitted, *running]
        began = time.perf_counter()
        first = self._prefill(admitted, read=False, slots=slots)
        self.counters.prefill_busy_us += round((time.perf_counter() - began) * 1e6)
        assert first is not None
        # Each row's input: the step in flight's token, or the first token of the request admitted there.
        num_reused = min(len(reusable), len(admitted))
        input_ids = step.tokens
        if num_reused:
            rows = torch.tensor(slots[:num_reused]).to(input_ids.device, non_blocking=True)
            input_ids = input_ids.index_copy(0, rows, first.tokens[:num_reused])
        if num_reused < len(admitted):
            input_ids = torch.cat([input_ids, first.tokens[num_reused:]])
        self._in_flight = self._launch_decode(step, self._decode_positions(pending=1), input_ids)
        self._complete(step)
        self._publish()  # the admitted requests run before their clients hear of them
        self._record(first.requests, first.read())
        return True

    def _continues(self, step: _LaunchedStep, positions: list[int]) -> bool:
        """Whether the next decode step may launch from `step`'s ids before the host reads them: the running
        batch stays the step's (no admission due that a slot could take), the KV cache holds one more
        position for every row (the next step's `positions`, `_decode_positions(pending=1)`), fewer than a
        quarter of the rows are finished requests (decoded for nothing until a sync frees them), and some
        request goes on after `step`'s token (when every one ends there by length, the next step would be
        wasted whole: a batch of equal lengths ends as without overlap).
        """
        running = self.running
        if running != step.requests:  # requests compare by identity
            return False
        live = [r for r in running if not r.finished]
        if 4 * (len(running) - len(live)) >= len(running):
            return False
        if len(live) < self.max_running_requests and self._admission_due():
            return False
        if all(self._ends_by_length(r, len(r.output_ids) + 1) for r in live):
            return False
        needed = min(max(positions) + 2, self.context_length)
        return self._cache is not None and self._cache.capacity >= needed

    def _ensure_cache(self, length: int) -> KVCache:
        cache = self._cache
        if cache is not None and cache.capacity >= length:
            return cache
        model = self.model
        if self.kv_whole_context is None:
            self.kv_whole_context = model.device.type == "cuda" and (
                KVCache.bytes_for(model.config, self.max_running_requests, self.context_length, model.dtype)
                <= CUDA_KV_WHOLE_CONTEXT_SHARE * torch.cuda.mem_get_info(model.device)[0]
            )
        capacity = min(self.context_length, -(-max(length, 1) // KV_CAPACITY_STEP) * KV_CAPACITY_STEP)
        if cache is not None:
            capacity = max(capacity, min(self.context_length, 2 * cache.capacity))
        if self.kv_whole_context:
            capacity = self.context_length
        grown = KVCache(model.config, self.max_running_requests, capacity, model.device, model.dtype)
        if cache is not None:
            used = max((r.num_tokens for r in self.running), default=0)
            grown.copy_from(cache, len(self.running), min(used, cache.capacity))
            if self._chunked is not None and self._chunk_prefilled:
                grown.copy_slot_from(cache, self._chunk_slot, self._chunk_prefilled)
        self._cache = grown
        if self._graphs is not None:
            self._graphs.clear()
            if self.kv_whole_context:
                # This cache never grows, so its graphs stay valid: capture every batch size now, as SGLang
                # does at start, rather than one at each new size in the middle of the generation.
                self._graphs.capture_all(grown)
        return grown

    def _prefill(
        self, requests: list[Request], read: bool = True, slots: list[int] | None = None
    ) -> _LaunchedStep | None:
        """Run prompt + output-so-far of each request into a fresh slot (one packed batch) and sample
        its next token. A prefix found in the prefix cache is copied into the slot instead of prefilled.
        A re-prefill after a retract takes from the cache only what is valid under the current weights.
        `slots`: where each request runs (a finished request's slot it takes over, or the next ones after
        the running requests, in order; default: the next ones). `read=False` (requests that all sample and
        read no prompt logprobs): the draws are returned, launched and not read, instead of recorded."""
        sequences = [r.prompt_ids + r.output_ids for r in requests]
        cache = self._ensure_cache(max(len(s) for s in sequences) + 1)
        if slots is None:
            slots = list(range(len(self.running), len(self.running) + len(requests)))
        starts = [0] * len(requests)
        cached = 0
        prefix_cache = self.prefix_cache
        for row, request in enumerate(requests):
            if request is self._chunked:  # its last chunk: the KV of the others moves into its slot
                starts[row] = self._chunk_prefilled
                if slots[row] != self._chunk_slot:
                    cache.move_slot(self._chunk_slot, slots[row], self._chunk_prefilled)
                self._chunked = None
                continue
            request.kv_weights_epoch = self.weights_epoch
            if prefix_cache is not None:
                starts[row] = prefix_cache.load(
                    sequences[row], self._cacheable_prefix(request, len(sequences[row])), cache, slots[row]
                )
                request.cached_tokens += starts[row]
                cached += starts[row]
        computed = sum(len(s) for s in sequences) - sum(starts)
        self.counters.cached_tokens_total += cached
        self.counters.prefill_tokens_total += computed
        self.counters.cache_hit_rate = cached / (cached + computed)
        suffixes = [s[start:] for s, start in zip(sequences, starts, strict=True)]
        hidden = self.model.prefill_packed(
            suffixes, cache, slots, starts, self._prefill_replay
        )  # [new tokens, hidden]
        ends = list(itertools.accumulate(len(s) for s in suffixes))
        last_rows = torch.tensor([end - 1 for end in ends]).to(hidden.device, non_blocking=True)
        last_hidden = hidden[last_rows]
        for row, request in enumerate(requests):
            if not request.was_running:
                self.counters.prompt_tokens_total += len(request.prompt_ids)
                if request.return_logprob and request.logprob_start_len >= 0:
                    rows = hidden[ends[row] - len(suffixes[row]) : ends[row]]
                    self._input_logprobs(request, rows, starts[row], len(sequences[row]))
            request.was_running = True
        for slot, request in zip(slots, requests, strict=True):
            if slot < len(self.running):
                self.running[slot] = request
            else:
                self.running.append(request)
        # max_new_tokens 0 is prefill only (scoring callers read the input logprobs): nothing is sampled.
        sampling_rows = [row for row, r in enumerate(requests) if r.options.max_new_tokens != 0]
        for request in requests:
            if request.options.max_new_tokens == 0:
                self._finish(request, {"type": "length", "length": 0})
        if len(sampling_rows) < len(requests):
            if not sampling_rows:
                return
            last_hidden = last_hidden[torch.tensor(sampling_rows, device=last_hidden.device)]
            requests = [requests[row] for row in sampling_rows]
        if not read:
            sample = sample_on_device(
                requests, self.model.logits(last_hidden), self.generator, self.eos_token_ids
            )
            return _LaunchedStep.launch(requests, sample)
        self._accept(requests, self.model.logits(last_hidden))
        return None

    def _prefill_chunk(self) -> None:
        """Prefill the next `_chunk_next` tokens of `_chunked` into its slot (its cached prefix loaded at its
        first chunk), and their prompt logprobs. Samples nothing: its last chunk is admitted by `_prefill`."""
        request, size = self._chunked, self._chunk_next
        self._chunk_next = 0
        if request is None:  # aborted since its chunk was planned (by a callback of this step)
            return
        sequence = request.prompt_ids + request.output_ids
        # The whole length at its first chunk: the cache grows once, not once per chunk.
        cache = self._ensure_cache(len(sequence) + 1)
        slot, start = self._chunk_slot, self._chunk_prefilled
        if start == 0:
            request.kv_weights_epoch = self.weights_epoch
            if self.prefix_cache is not None:
                start = self.prefix_cache.load(
                    sequence, self._cacheable_prefix(request, len(sequence)), cache, slot
                )
                request.cached_tokens += start
                self.counters.cached_tokens_total += start
        # At least its last token is left for the last chunk, which samples from it.
        end = min(start + size, len(sequence) - 1)
        if end > start:
            hidden = self.model.prefill_packed(
                [sequence[start:end]], cache, [slot], [start], self._prefill_replay
            )
            self.counters.prefill_tokens_total += end - start
            if not request.was_running and request.return_logprob and request.logprob_start_len >= 0:
                self._input_logprobs(request, hidden, start, end)
        self._chunk_prefilled = end

    def _prefill_alone(self, request: Request) -> None:
        """Prefill one request into slot 0 (nothing running) and sample its next token, in chunks if it is
        longer than `chunked_prefill_size` (the probes of `_recover`)."""
        size = self.chunked_prefill_size
        if size is not None and request.num_tokens > size:
            self._chunked, self._chunk_prefilled = request, 0
            while request.num_tokens - self._chunk_prefilled > size:
                self._chunk_next = size
                self._prefill_chunk()
        self._prefill([request])

    def _drop_chunked(self, store: bool) -> None:
        """End the chunked prefill of `_chunked` (retracted, aborted): with `store`, the KV of its chunks goes
        into the prefix cache; its prompt logprobs so far are dropped (recomputed at its next prefill)."""
        request = self._chunked
        assert request is not None
        if store and self._chunk_prefilled:
            self._store_prefix(request, self._chunk_slot, self._chunk_prefilled)
        request.input_logprobs.clear()
        request.input_top_logprobs.clear()
        self._chunked = None
        self._chunk_prefilled = self._chunk_next = 0

    @staticmethod
    def _cacheable_prefix(request: Request, length: int) -> int:
        """How much of a request's `length` tokens may come from the prefix cache: all but the last (whose
        hidden state samples the next token), and none of the prompt positions whose logprobs it asked for."""
        limit = length - 1
        if not request.was_running and request.return_logprob and request.logprob_start_len >= 0:
            limit = min(limit, max(0, min(request.logprob_start_len, len(request.prompt_ids)) - 1))
        return limit

    def _store_prefix(self, request: Request, slot: int, held: int | None = None) -> None:
        """Put the KV that `slot` holds for `request` (its first `held` tokens; default all but the last) into
        the prefix cache. Caching is an optimisation: a failure is logged, and the finish or retract that
        called goes on."""
        if self.prefix_cache is not None and self._cache is not None:
            held = min(request.num_tokens - 1 if held is None else held, self._cache.capacity)
            try:
                self.prefix_cache.store((request.prompt_ids + request.output_ids)[:held], self._cache, slot)
            except Exception:
                logger.exception("the prefix of request %s could not be cached", request.rid)

    def _input_logprobs(self, request: Request, hidden: Tensor, offset: int, end: int) -> None:
        """Append the logprobs of prompt tokens from `logprob_start_len` on (the first prompt token has none)
        that the hidden states of positions `offset..end-1` (`hidden`, a prefill or one chunk of it) predict:
        those of positions `offset + 1..end`, in order (a chunk predicts the next chunk's first token)."""
        num_prompt = len(request.prompt_ids)
        first = min(request.logprob_start_len, num_prompt)
        if first == 0 and offset == 0:
            request.input_logprobs.append(None)
            request.input_top_logprobs.append(None)
        start, stop = max(first, offset + 1), min(num_prompt, end + 1)
        if start >= stop:
            return
        logits = self.model.logits(hidden[start - 1 - offset : stop - 1 - offset])
        logprobs = torch.log_softmax(logits / request.options.logprob_temperature, dim=-1)
        targets = torch.tensor(request.prompt_ids[start:stop], device=logprobs.device)
        chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
        request.input_logprobs.extend(chosen)
        if request.top_logprobs_num > 0:
            values, ids = logprobs.topk(request.top_logprobs_num, dim=-1)
            for row_values, row_ids in zip(values.tolist(), ids.tolist(), strict=True):
                request.input_top_logprobs.append(list(zip(row_values, row_ids, strict=True)))
        else:
            request.input_top_logprobs.extend([None] * len(chosen))

    def _decode(self) -> None:
        """One decode step, read at once (the non-overlapped loop, and the probes of `_recover`)."""
        self._complete(self._launch_decode(None))

    def _decode_positions(self, pending: int) -> list[int]:
        """Each running request's position in the next decode step: its last token's, plus `pending` (the
        steps launched whose tokens the host has not read). A finished request whose slot is still decoded
        keeps its last position (what it writes there is never read)."""
        return [
            len(r.prompt_ids) + len(r.output_ids) - (1 if r.finish_reason is not None else 1 - pending)
            for r in self.running
        ]

    def _launch_decode(
        self,
        previous: _LaunchedStep | None,
        positions: list[int] | None = None,
        input_ids: Tensor | None = None,
    ) -> _LaunchedStep:
        """Launch one decode step for every running request and its sampling, without waiting for the device.
        Its input ids are `previous`'s sampled ids on the device (the step in flight, whose requests are the
        running ones in the same slots; `input_ids` when rows were admitted after them), or each request's
        last token when `previous` is None. `positions`: `_decode_positions` for that case, when the caller
        has them."""
        running = list(self.running)
        pending = 0 if previous is None else 1
        if positions is None:
            positions = self._decode_positions(pending)
        cache = self._ensure_cache(min(max(positions) + 2, self.context_length))
        device = self.model.device
        if input_ids is None:
            if previous is None:
                input_ids = torch.tensor([r.output_ids[-1] for r in running]).to(device, non_blocking=True)
            else:
                input_ids = previous.tokens
        num_outputs = [len(r.output_ids) + pending for r in running]
        plan = SamplingPlan.of(running, self.eos_token_ids, num_outputs)
        sample: DeviceSample | None = None
        if self._graphs is not None:
            hidden, sample = self._graphs.decode(input_ids, positions, cache, plan)
        else:
            position_ids = torch.tensor(positions).to(device, non_blocking=True)
            hidden = self.model.decode(input_ids, position_ids, cache, max(positions) + 1)
        if sample is None:
            sample = sample_on_device(
                running, self.model.logits(hidden), self.generator, self.eos_token_ids, num_outputs, plan
            )
        return _LaunchedStep.launch(running, sample)

    def _complete(self, step: _LaunchedStep) -> None:
        """Read a launched step's tokens (waiting for that step only) and record them. A request finished
        since the launch gets nothing: the token computed after its finish is dropped."""
        recorded = self._record(step.requests, step.read())
        ended = time.monotonic()
        # Launches overlap: a step's time is from its launch or the previous step's end, whichever is later.
        self._throughput_window.append((ended - max(step.launched_s, self._last_decode_end), recorded))
        self._last_decode_end = ended
        elapsed = sum(s for s, _ in self._throughput_window)
        if elapsed > 0:
            self.counters.gen_throughput = sum(n for _, n in self._throughput_window) / elapsed

    def _release_finished(self) -> None:
        """Free the slots of finished requests that a step in flight still decoded (their prefixes were
        cached when they finished)."""
        for slot in reversed(range(len(self.running))):
            if self.running[slot].finished:
                self._free_slot(slot)

    def _accept(self, requests: list[Request], logits: Tensor) -> None:
        """Sample one token per request from logits [B, vocab] and record it (the prefill's first token)."""
        sampled = sample_tokens(requests, logits, self.generator, self.eos_token_ids)
        # Published before any client hears of these requests: one told of a token sees its request running.
        # (A decode step's requests were running at the last publication, at the end of the loop before.)
        self._publish()
        self._record(requests, sampled)

    def _record(self, requests: list[Request], sampled: list[SampledToken]) -> int:
        """Append each unfinished request's token and finish who is done, then publish once (if any
        finished) and tell the clients, in row order; returns how many tokens were appended. A request
        finished since its token was drawn (a step in flight decoded it once more) gets nothing: that token is
        dropped. A callback that finishes another request of the step (an abort) finishes it with the tokens
        it has: it is told of its finish, not of its token."""
        told: list[tuple[Request, bool]] = []
        recorded = 0
        for request, (token, logprob, top) in zip(requests, sampled, strict=True):
            if request.finish_reason is not None:
                continue
            recorded += 1
            request.output_ids.append(token)
            if request.return_logprob:
                request.output_logprobs.append(logprob)
                if request.top_logprobs_num > 0:
                    request.output_top_logprobs.append(top)
            reason = self._finish_reason(request, token)
            if reason is not None:
                self._end(request, reason)
                told.append((request, True))
            elif request.stream:
                told.append((request, False))
        self.counters.generation_tokens_total += recorded
        if told:
            if any(finished for _, finished in told):
                # Before any client hears: one told that its request finished never reads a snapshot where
                # it runs.
                self._publish()
            for request, finished in told:
                if finished or request.finish_reason is None:
                    self._notify(request, finished)
        return recorded

    def _ends_by_length(self, request: Request, num_output: int) -> bool:
        """Whether `num_output` output tokens end `request` by `max_new_tokens` or the context length."""
        limit = request.options.max_new_tokens
        return (limit is not None and num_output >= limit) or (
            len(request.prompt_ids) + num_output >= self.context_length
        )

    def _finish_reason(self, request: Request, token: int) -> dict[str, Any] | None:
        options = request.options
        num_output = len(request.output_ids)
        # The stop-string matcher reads every token's text, also before min_new_tokens, to keep its tail.
        matched = self._match_stop_string(request) if options.stop and self.decode_text is not None else None
        if num_output >= options.min_new_tokens:
            if token in options.stop_token_ids or (not options.ignore_eos and token in self.eos_token_ids):
                return {"type": "stop", "matched": token}
            if matched is not None:
                return {"type": "stop", "matched": matched}
        if self._ends_by_length(request, num_output):
            return {"type": "length", "length": num_output}
        return None

    def _match_stop_string(self, request: Request) -> str | None:
        """The stop string the latest token completes (the earliest in the text when several do), or None.

        Decodes incrementally: only the tokens since the last match (from `stop_prefix_offset`, one token
        of context before them) and matches over the new text plus the `stop_tail` a stop string may start in,
        so a step costs the same at any output length (`decode_text` must be a pure function: the length of
        one token's text is decoded once per id). Text that ends in an incomplete character is matched
        without it and read again at the next token (for at most `STOP_TEXT_MAX_PENDING_TOKENS`)."""
        decode = self.decode_text
        assert decode is not None
        ids = request.output_ids
        prefix, read = request.stop_prefix_offset, request.stop_read_offset
        text = decode(ids[prefix:])
        if read - prefix == 1:  # the usual case: the matched text is the previous token's
            known = self._token_text_lengths.get(ids[prefix])
            if known is None:
                known = self._token_text_lengths[ids[prefix]] = len(decode(ids[prefix:read]))
        else:
            known = len(decode(ids[prefix:read])) if read > prefix else 0
        if text[-1:] == "\ufffd" and len(ids) - read < STOP_TEXT_MAX_PENDING_TOKENS:
            # An incomplete character at the end: match the text before it, and decide it at a later token.
            window = request.stop_tail + text.rstrip("\ufffd")[known:]
        else:
            window = request.stop_tail + text[known:]
            request.stop_prefix_offset, request.stop_read_offset = read, len(ids)
            request.stop_tail = window[max(0, len(window) - request.options.longest_stop + 1) :]
        found = request.options.stop_pattern.search(window)
        return None if found is None else found.group()

    def _finish(self, request: Request, reason: dict[str, Any]) -> None:
        """End `request` (`_end`), publish, then tell its client."""
        self._end(request, reason)
        self._publish()  # a client told that its request finished never reads a snapshot where it runs
        self._notify(request, True)

    def _end(self, request: Request, reason: dict[str, Any]) -> None:
        """Set `request`'s finish reason and take it out of the batch or the queue (its prefix cached); its
        client is not told yet."""
        request.finish_reason = reason
        if self._by_rid.get(request.rid) is request:
            del self._by_rid[request.rid]
        if request in self.running:
            slot = self.running.index(request)
            self._store_prefix(request, slot)
            if self._in_flight is None:
                self._free_slot(slot)
            # Else the step in flight decodes this slot: it is freed once that step is read.
        elif request is self._chunked:
            self._drop_chunked(store=request.kv_weights_epoch == self.weights_epoch)
        elif request in self.waiting:
            self.waiting.remove(request)

    def _abort(self, request: Request, message: str, status_code: int | None = None) -> None:
        """Finish `request` as aborted: status None for a user's abort (answered with its partial output),
        500 for a failure of the engine itself (answered as an error, see `generate.error_abort`)."""
        self.counters.num_aborted_requests_total += 1
        reason = {"type": "abort", "message": message, "status_code": status_code, "err_type": None}
        self._finish(request, reason)

    def _free_slot(self, slot: int) -> None:
        """Remove the running request in `slot`, moving the last running request's KV into its place."""
        last = len(self.running) - 1
        if slot != last and self._cache is not None:
            moved = self.running[last]
            # Up to num_tokens: covers the KV written by this step's decode even before its token is appended.
            self._cache.move_slot(last, slot, min(moved.num_tokens, self._cache.capacity))
        self.running[slot] = self.running[last]
        self.running.pop()


@dataclass(slots=True, eq=False)
class _LaunchedStep:
    """A decode step launched on the device whose sampled tokens the host has not read yet. Row i decoded
    `requests[i]`, in slot i at the launch."""

    requests: list[Request]
    tokens: Tensor
    """[B] sampled ids on the device: the input ids of the step launched after this one."""
    results: Tensor
    """[B, 2 + 2 * top_num] float64 (`DeviceSample.packed`) on the host, in pinned memory on CUDA; valid
    once `ready` has passed."""
    ready: torch.cuda.Event | None
    """Recorded after the copy of `results` (None on CPU, where every operator has run on return)."""
    top_num: int
    launched_s: float

    @classmethod
    def launch(cls, requests: list[Request], sample: DeviceSample) -> _LaunchedStep:
        packed = sample.packed
        ready = None
        results = packed
        if packed.device.type == "cuda":
            results = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            results.copy_(packed, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        return cls(requests, sample.tokens, results, ready, sample.top_num, time.monotonic())

    def read(self) -> list[SampledToken]:
        """The step's draws on the host, after waiting for this step only (not for one launched later)."""
        if self.ready is not None:
            self.ready.synchronize()
        return unpack_samples(self.requests, self.results, self.top_num)


@dataclass(slots=True, eq=False)
class _DecodeGraph:
    """One captured decode step and its static tensors: inputs (ids, positions and lengths; temperatures and
    uniforms for a graph that draws) and outputs (the hidden states, and the draws of `sample_dense`)."""

    graph: torch.cuda.CUDAGraph
    ids: Tensor
    inputs: Tensor
    """[2, B]: the positions, then the lengths attended (one copy from the host)."""
    temperatures: Tensor | None
    uniforms: Tensor | None
    hidden: Tensor
    sample: DeviceSample
    uploaded_temperatures: list[float]
    """What `temperatures` holds (its first rows), as last copied from the host."""


PREFILL_GRAPH_TOKENS = (128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
"""The token counts the prefill graphs are captured for (a packed prefill replays the smallest that holds it:
at most half again its tokens; a longer one runs eagerly). The largest is the default chunked-prefill size."""


@dataclass(slots=True, eq=False)
class _PrefillGraph:
    """One captured packed prefill (`EngineModel.forward_packed`) of a fixed `PackedShape`: its static input
    columns (one tensor, laid out as `PackedPrefill.padded` writes it) and its hidden states."""

    graph: torch.cuda.CUDAGraph
    shape: PackedShape
    inputs: Tensor
    hidden: Tensor


class _CudaGraphs:
    """CUDA graphs of the decode step and of the packed prefill, over the whole KV capacity.

    Decode: two graphs per batch-size bucket (one that takes the argmax, one that draws), each with its
    sampling (`sample_dense`). Each reads its inputs from static tensors and writes the hidden states and the
    draws to static outputs; rows beyond the live batch decode into free slots (harmless: a slot's KV is
    rewritten by its next prefill) and draw what no one reads. A step whose sampling `sample_dense` cannot do
    (`SamplingPlan.dense` None) replays the argmax graph and samples its hidden states eagerly.

    Prefill: one graph per token bucket (`PREFILL_GRAPH_TOKENS`), captured at its first use (a bucket whose
    capture fails runs eagerly, see `_try_capture_prefill`), for as many
    sequences as run at once; a prefill costs one copy to the device and one launch whatever its length and
    number of sequences (eagerly it is a dozen launches per layer), at the price of computing its padding.

    The two kinds keep separate memory pools: a graph's intermediates may overlap the outputs of a graph
    captured after it in the same pool, which is harmless within a kind (a graph's outputs are consumed,
    their operators enqueued, before the next graph of its kind replays) but not across: a decode step's
    sampled ids stay in use across the prefills launched beside it (they feed the next step). The weights are
    read in place, so a weight update needs no recapture unless they move.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.graphs: dict[tuple[int, bool], _DecodeGraph] = {}
        """Decode graphs, keyed by (batch-size bucket, whether it draws)."""
        self.prefills: dict[int, _PrefillGraph | None] = {}
        """Prefill graphs, keyed by their bucket's token count (None: its capture failed, it runs eagerly)."""
        self.pools: dict[str, Any] = {}
        """The memory pool of each kind ("decode", "prefill")."""
        self.memory_bytes = 0
        """Device memory allocated while the graphs were captured (their pools and static tensors)."""

    @property
    def batch_sizes(self) -> list[int]:
        return sorted({size for size, _ in self.graphs})

    def clear(self) -> None:
        # The pools go with their graphs: capturing into a pool whose graphs are gone is an allocator error.
        self.graphs.clear()
        self.prefills.clear()
        self.pools.clear()
        self.memory_bytes = 0

    def weights_changed(self) -> None:
        # `load_named_tensors` copies into the same storage: graphs stay valid. Moving weights does not.
        pass

    def bucket(self, batch: int) -> int:
        size = 1
        while size < batch:
            size *= 2
        return min(size, self.engine.max_running_requests)

    def capture_all(self, cache: KVCache) -> None:
        """Capture the decode graphs of every batch-size bucket over `cache` (those not captured yet)."""
        limit = self.engine.max_running_requests
        for size in sorted({self.bucket(batch) for batch in range(1, limit + 1)}):
            for draws in (False, True):
                self._ensure(size, draws, cache)

    def decode(
        self, input_ids: Tensor, positions: list[int], cache: KVCache, plan: SamplingPlan
    ) -> tuple[Tensor, DeviceSample | None]:
        """Replay a graph of `input_ids`' batch size (ids [B] on the device, copied device to device, so a
        launch never waits for the step before) at `positions`: the hidden states [B, hidden], and the step's
        draws when `plan.dense` is not None (else None: the caller samples the hidden states)."""
        batch = len(positions)
        size = self.bucket(batch)
        dense = plan.dense
        entry = self._ensure(size, dense is True, cache)
        # Padding rows write into free slots at the last position, which no live request uses, and attend
        # to one position only (the decode kernel's work follows the lengths).
        padding = size - batch
        # (The padding rows' ids, temperatures and uniforms are whatever an earlier step left there: any is
        # harmless.)
        inputs = torch.tensor(
            [positions + [cache.capacity - 1] * padding, [p + 1 for p in positions] + [1] * padding],
            dtype=torch.long,
        )
        entry.ids[:batch].copy_(input_ids, non_blocking=True)
        entry.inputs.copy_(inputs, non_blocking=True)
        if entry.uniforms is not None:
            assert entry.temperatures is not None
            if entry.uploaded_temperatures != plan.temperatures:
                entry.temperatures[:batch].copy_(
                    torch.tensor(plan.temperatures, dtype=torch.float32), non_blocking=True
                )
                entry.uploaded_temperatures = plan.temperatures
            # The shared generator's draws in row order, as `sample_on_device` takes them.
            torch.rand(batch, generator=self.engine.generator, out=entry.uniforms[:batch])
        entry.graph.replay()
        hidden = entry.hidden[:batch]
        if dense is None:
            return hidden, None
        sample = entry.sample
        return hidden, DeviceSample(sample.tokens[:batch], sample.packed[:batch], sample.top_num)

    def prefill(self, batch: PackedPrefill, cache: KVCache) -> Tensor | None:
        """Replay the prefill graph of the smallest bucket that holds `batch` (`PrefillReplay`): its hidden
        states [N, hidden], or None where no graph applies (too many tokens, or the model runs without the
        extend or fused kernels)."""
        tokens = next((size for size in PREFILL_GRAPH_TOKENS if size >= batch.total), None)
        if tokens is None or not self.engine.model.packed_from_columns:
            return None
        if tokens not in self.prefills:
            self.prefills[tokens] = self._try_capture_prefill(tokens, cache)
        entry = self.prefills[tokens]
        if entry is None:
            return None  # its capture failed: this bucket runs eagerly
        # One copy that does not wait for the device (the decode step in flight).
        entry.inputs.copy_(batch.padded(entry.shape, cache.capacity), non_blocking=True)
        entry.graph.replay()
        return entry.hidden[: batch.total]

    def _ensure(self, size: int, draws: bool, cache: KVCache) -> _DecodeGraph:
        entry = self.graphs.get((size, draws))
        if entry is None:
            entry = self.graphs[size, draws] = self._capture_decode(size, draws, cache)
        return entry

    def _capture_decode(self, size: int, draws: bool, cache: KVCache) -> _DecodeGraph:
        model = self.engine.model
        device = model.device
        # Warm-up and capture run on the live cache: write only at the last position, which the capacity rule
        # (capacity >= longest request + 1) keeps free of live KV.
        static_ids = torch.zeros(size, dtype=torch.long, device=device)
        inputs = torch.ones((2, size), dtype=torch.long, device=device)
        static_positions, static_lengths = inputs[0], inputs[1]
        static_positions.fill_(cache.capacity - 1)
        temperatures = torch.ones(size, dtype=torch.float32, device=device) if draws else None
        uniforms = torch.full((size,), 0.5, dtype=torch.float32, device=device) if draws else None

        def step() -> tuple[Tensor, DeviceSample]:
            hidden = model.decode(static_ids, static_positions, cache, cache.capacity, static_lengths)
            return hidden, sample_dense(model.logits(hidden), temperatures, uniforms)

        graph, (hidden, sample) = self._capture("decode", cache, step)
        return _DecodeGraph(graph, static_ids, inputs, temperatures, uniforms, hidden, sample, [1.0] * size)

    def _try_capture_prefill(self, tokens: int, cache: KVCache) -> _PrefillGraph | None:
        """`_capture_prefill`, or None where the capture fails (logged; the bucket then runs eagerly for the
        graphs' lifetime). A capture in the middle of a generation must not fail its step: a library call
        that cannot be captured (a first use that allocates, say) costs that bucket its graph, no more."""
        device = self.engine.model.device
        stream = torch.cuda.current_stream(device)
        try:
            return self._capture_prefill(tokens, cache)
        except RuntimeError:
            # Older torch releases (the package takes torch >= 2.4) leave the graph's side stream current
            # when `capture_end` raises; 2.11 restores it. Restored either way, and the device drained of
            # the failed capture's warm-up before the eager prefill runs.
            torch.cuda.set_stream(stream)
            torch.cuda.synchronize(device)
            logger.exception("capturing the prefill graph of %d tokens failed: it runs eagerly", tokens)
            return None

    def _capture_prefill(self, tokens: int, cache: KVCache) -> _PrefillGraph:
        model = self.engine.model
        c = model.config
        sequences = min(tokens, self.engine.max_running_requests)
        per_program = extend_attention.tokens_per_program(c.num_heads, c.num_kv_heads)
        shape = PackedShape(
            tokens, sequences, extend_attention.max_work_items(tokens, sequences, per_program)
        )
        # Warm-up and capture run on the live cache with padding only, which writes only at the last
        # position of slot 0 (free of live KV by the capacity rule).
        empty = PackedPrefill(
            tuple(torch.zeros(n, dtype=torch.long) for n in (0, 0, 0, 0, 0, 1, 0, 0)), [], [], [], 0
        )
        inputs = empty.padded(shape, cache.capacity).to(model.device)
        columns = shape.columns(inputs)
        graph, hidden = self._capture("prefill", cache, lambda: model.forward_packed(columns, cache, None))
        return _PrefillGraph(graph, shape, inputs, hidden)

    def _capture(self, kind: str, cache: KVCache, step: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
        """Capture `step` (after two warm-up runs on a side stream) into the pool of `kind`: the graph and the
        outputs of the captured run (its static outputs). `step` runs over `cache`."""
        model = self.engine.model
        device = model.device
        model.ensure_rope(cache.capacity)
        before = torch.cuda.memory_allocated(device)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                step()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pools.get(kind)):
            outputs = step()
        self.pools[kind] = graph.pool()
        self.memory_bytes += torch.cuda.memory_allocated(device) - before
        return graph, outputs
