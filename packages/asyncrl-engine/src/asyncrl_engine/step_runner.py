"""The step runner: the device side of the engine's steps. It owns the model, the KV cache of the running
slots, the prefix cache's KV, the CUDA graphs and the sampling generator, and runs what the scheduler
decided: a packed prefill of admitted requests (their cached prefixes loaded instead of computed), one chunk
of a long prompt, or a decode step of the running batch with its sampling.

A decode step is launched without waiting for the device (`launch_decode` returns a `LaunchedStep`); its
sampled ids stay on the device, where the next step can take them as its input ids, and its packed results
are copied to the host behind a CUDA event, so reading them (`LaunchedStep.read`) waits for that step only.
That is what lets the engine's overlap scheduler do one step's host work while the device runs the next.

The KV cache holds `max_running_requests` slots of one capacity, grown in `KV_CAPACITY_STEP`s (copying the
slots that hold KV: the running rows, and the chunked request's slot) up to the context length, or taken
whole at its first allocation on CUDA when it fits (`CUDA_KV_WHOLE_CONTEXT_SHARE`).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from asyncrl_engine.cuda_graphs import CudaGraphs
from asyncrl_engine.kv_cache import KVCache
from asyncrl_engine.model import EngineModel
from asyncrl_engine.prefix_cache import PrefixCache
from asyncrl_engine.request import Request
from asyncrl_engine.sampling import (
    DeviceSample,
    SampledToken,
    SamplingPlan,
    sample_on_device,
    sample_tokens,
    unpack_samples,
)
from asyncrl_engine.scheduler import Scheduler, cacheable_prefix
from asyncrl_engine.snapshot import EngineCounters

logger = logging.getLogger(__name__)

KV_CAPACITY_STEP = 256
"""The KV cache grows in multiples of this many positions (up to the context length)."""
CUDA_KV_WHOLE_CONTEXT_SHARE = 0.4
"""On CUDA the KV cache takes the whole context length at its first allocation when that needs at most this
share of the device's free memory (as SGLang sizes its KV pool once at start): it then never grows, and a
growth would copy it and drop every captured decode graph, to be captured again at each batch size."""


class StepRunner:
    """Runs the device work of the steps of `scheduler`'s requests (see the module's docstring).

    It reads the scheduler's table (which slots hold KV) and never changes it; `counters` receives the
    prefill and prompt token counts. `prefix_cache` None: every prefill computes all its tokens."""

    def __init__(
        self,
        model: EngineModel,
        scheduler: Scheduler,
        counters: EngineCounters,
        *,
        seed: int,
        prefix_cache: PrefixCache | None,
        use_cuda_graphs: bool,
        kv_whole_context: bool | None,
    ) -> None:
        self.model = model
        self.scheduler = scheduler
        self.counters = counters
        self.generator = torch.Generator(device=model.device).manual_seed(seed)
        self.prefix_cache = prefix_cache
        """KV of finished requests by token prefix (None: every prefill starts from scratch)."""
        self.cache: KVCache | None = None
        """The running slots' KV (None before the first request or after a release)."""
        self.kv_whole_context = kv_whole_context
        """Whether the KV cache is allocated at the whole context length at once rather than grown on demand
        (None: decided at its first allocation, see `CUDA_KV_WHOLE_CONTEXT_SHARE`; False on CPU)."""
        self.graphs = (
            CudaGraphs(model, scheduler.max_running_requests, self.generator)
            if use_cuda_graphs and model.device.type == "cuda"
            else None
        )
        self.prefill_replay = None if self.graphs is None else self.graphs.prefill
        self.weights_epoch = 0
        """Counts weight loads: KV computed before the last load is stale under the current weights."""
        self.weights_released = False
        self._weights_device = model.device

    # ---------------------------------------------------------------------------------------------- memory
    @property
    def kv_cache_bytes(self) -> int:
        """Bytes held by the KV cache and the prefix cache's pool (0 before the first request or after a
        release)."""
        pool = 0 if self.prefix_cache is None else self.prefix_cache.nbytes()
        return pool + (0 if self.cache is None else self.cache.nbytes())

    def ensure_cache(self, length: int) -> KVCache:
        """The KV cache, grown (its held slots copied) if it holds fewer than `length` positions a slot."""
        cache = self.cache
        if cache is not None and cache.capacity >= length:
            return cache
        model, scheduler = self.model, self.scheduler
        slots, context_length = scheduler.max_running_requests, scheduler.context_length
        if self.kv_whole_context is None:
            self.kv_whole_context = model.device.type == "cuda" and (
                KVCache.bytes_for(model.config, slots, context_length, model.dtype)
                <= CUDA_KV_WHOLE_CONTEXT_SHARE * torch.cuda.mem_get_info(model.device)[0]
            )
        capacity = min(context_length, -(-max(length, 1) // KV_CAPACITY_STEP) * KV_CAPACITY_STEP)
        if cache is not None:
            capacity = max(capacity, min(context_length, 2 * cache.capacity))
        if self.kv_whole_context:
            capacity = context_length
        grown = KVCache(model.config, slots, capacity, model.device, model.dtype)
        if cache is not None:
            running = scheduler.table.running
            used = max((r.num_tokens for r in running), default=0)
            grown.copy_from(cache, len(running), min(used, cache.capacity))
            if scheduler.table.chunked is not None and scheduler.table.chunk_prefilled:
                grown.copy_slot_from(cache, scheduler.table.chunk_slot, scheduler.table.chunk_prefilled)
        self.cache = grown
        if self.graphs is not None:
            self.graphs.clear()
            if self.kv_whole_context:
                # This cache never grows, so its graphs stay valid: capture every batch size now, as SGLang
                # does at start, rather than one at each new size in the middle of the generation.
                self.graphs.capture_all(grown)
        return grown

    def move_slot(self, source: int, target: int, length: int) -> None:
        """Move the first `length` positions of `source`'s KV into `target` (no-op without a cache)."""
        if self.cache is not None:
            self.cache.move_slot(source, target, min(length, self.cache.capacity))

    def release_cache(self) -> None:
        """Free the KV cache, the prefix cache's pool and the CUDA graphs (all made again on demand)."""
        self.cache = None
        if self.prefix_cache is not None:
            self.prefix_cache.release()
        if self.graphs is not None:
            self.graphs.clear()
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()

    def release_weights(self) -> None:
        """Move the weights to host memory (CUDA only; on CPU they stay) until `resume_weights`."""
        if self.weights_released:
            return
        self._weights_device = self.model.device
        if self.model.device.type == "cuda":
            self.model.move_weights(torch.device("cpu"))
            if self.graphs is not None:
                self.graphs.weights_changed()
            torch.cuda.empty_cache()
        self.weights_released = True

    def resume_weights(self) -> None:
        if self.weights_released:
            self.model.move_weights(self._weights_device)
            if self.graphs is not None:
                self.graphs.weights_changed()
            self.weights_released = False

    def load_weights(self, tensors: Sequence[tuple[str, Tensor]], keep_prefix_cache: bool) -> None:
        """Load (a subset of) parameters by HuggingFace name (`ModelLoadError`, nothing changed, when a name
        or shape does not fit). The prefix cache's KV was computed under the old weights: it is dropped
        unless `keep_prefix_cache` (an `in_place` pause keeps old KV by contract)."""
        self.model.load_named_tensors(tensors)
        self.weights_epoch += 1
        if self.prefix_cache is not None and not keep_prefix_cache:
            self.prefix_cache.clear()
        if self.graphs is not None:
            self.graphs.weights_changed()

    # ---------------------------------------------------------------------------------------------- prefix KV
    def load_prefix(self, request: Request, sequence: list[int], cache: KVCache, slot: int) -> int:
        """Copy the longest cached prefix of `sequence` that `request` may take from the prefix cache into
        `slot`; returns its length (0 without a prefix cache)."""
        if self.prefix_cache is None:
            return 0
        return self.prefix_cache.load(sequence, cacheable_prefix(request, len(sequence)), cache, slot)

    def store_prefix(self, request: Request, slot: int, held: int | None = None) -> None:
        """Put the KV that `slot` holds for `request` (its first `held` tokens; default all but the last) into
        the prefix cache. Caching is an optimisation: a failure is logged, and the finish or retract that
        called goes on."""
        if self.prefix_cache is not None and self.cache is not None:
            held = min(request.num_tokens - 1 if held is None else held, self.cache.capacity)
            try:
                self.prefix_cache.store((request.prompt_ids + request.output_ids)[:held], self.cache, slot)
            except Exception:
                logger.exception("the prefix of request %s could not be cached", request.rid)

    # ---------------------------------------------------------------------------------------------- prefill
    def prefill(self, requests: list[Request], slots: list[int]) -> Tensor:
        """Run prompt + output-so-far of each request into its slot (one packed batch): the last position's
        hidden states [len(requests), hidden], which sample each request's next token. A prefix found in the
        prefix cache is copied into the slot instead of prefilled (a re-prefill after a retract takes only
        what is valid under the current weights); the chunked request's last chunk continues the KV of its
        slot, moved to its row's. Prompt logprobs are computed at a request's first prefill."""
        scheduler = self.scheduler
        sequences = [r.prompt_ids + r.output_ids for r in requests]
        cache = self.ensure_cache(max(len(s) for s in sequences) + 1)
        starts = [0] * len(requests)
        cached = 0
        for row, request in enumerate(requests):
            if request is scheduler.table.chunked:  # its last chunk: its KV moves into its row's slot
                starts[row] = scheduler.table.chunk_prefilled
                if slots[row] != scheduler.table.chunk_slot:
                    cache.move_slot(scheduler.table.chunk_slot, slots[row], scheduler.table.chunk_prefilled)
                continue
            request.kv_weights_epoch = self.weights_epoch
            starts[row] = self.load_prefix(request, sequences[row], cache, slots[row])
            request.cached_tokens += starts[row]
            cached += starts[row]
        computed = sum(len(s) for s in sequences) - sum(starts)
        self.counters.cached_tokens_total += cached
        self.counters.prefill_tokens_total += computed
        self.counters.cache_hit_rate = cached / (cached + computed)
        suffixes = [s[start:] for s, start in zip(sequences, starts, strict=True)]
        hidden = self.model.prefill_packed(
            suffixes, cache, slots, starts, self.prefill_replay
        )  # [new tokens, hidden]
        ends = list(itertools.accumulate(len(s) for s in suffixes))
        last_rows = torch.tensor([end - 1 for end in ends]).to(hidden.device, non_blocking=True)
        last_hidden = hidden[last_rows]
        for row, request in enumerate(requests):
            if not request.was_running:
                self.counters.prompt_tokens_total += len(request.prompt_ids)
                if request.return_logprob and request.logprob_start_len >= 0:
                    rows = hidden[ends[row] - len(suffixes[row]) : ends[row]]
                    self.input_logprobs(request, rows, starts[row], len(sequences[row]))
            request.was_running = True
        return last_hidden

    def prefill_chunk(self, request: Request, size: int) -> int:
        """Prefill the next `size` tokens of the chunked `request` into the scheduler's chunk slot (its cached
        prefix loaded at its first chunk), and their prompt logprobs; returns the positions its slot then
        holds. Samples nothing: its last chunk is admitted as a prefill."""
        scheduler = self.scheduler
        sequence = request.prompt_ids + request.output_ids
        # The whole length at its first chunk: the cache grows once, not once per chunk.
        cache = self.ensure_cache(len(sequence) + 1)
        slot, start = scheduler.table.chunk_slot, scheduler.table.chunk_prefilled
        if start == 0:
            request.kv_weights_epoch = self.weights_epoch
            start = self.load_prefix(request, sequence, cache, slot)
            request.cached_tokens += start
            self.counters.cached_tokens_total += start
        # At least its last token is left for the last chunk, which samples from it.
        end = min(start + size, len(sequence) - 1)
        if end > start:
            hidden = self.model.prefill_packed(
                [sequence[start:end]], cache, [slot], [start], self.prefill_replay
            )
            self.counters.prefill_tokens_total += end - start
            if not request.was_running and request.return_logprob and request.logprob_start_len >= 0:
                self.input_logprobs(request, hidden, start, end)
        return end

    def input_logprobs(self, request: Request, hidden: Tensor, offset: int, end: int) -> None:
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

    # ---------------------------------------------------------------------------------------------- sampling
    def sample(self, requests: list[Request], hidden: Tensor) -> list[SampledToken]:
        """Draw each request's next token from its hidden state [B, hidden] and read the draws."""
        return sample_tokens(
            requests, self.model.logits(hidden), self.generator, self.scheduler.eos_token_ids
        )

    def launch_sample(self, requests: list[Request], hidden: Tensor) -> LaunchedStep:
        """Draw each request's next token from its hidden state [B, hidden], left on the device."""
        logits = self.model.logits(hidden)
        sample = sample_on_device(requests, logits, self.generator, self.scheduler.eos_token_ids)
        return LaunchedStep.launch(requests, sample)

    # ---------------------------------------------------------------------------------------------- decode
    def launch_decode(
        self,
        previous: LaunchedStep | None,
        positions: list[int] | None = None,
        input_ids: Tensor | None = None,
    ) -> LaunchedStep:
        """Launch one decode step for every running request and its sampling, without waiting for the device.
        Its input ids are `previous`'s sampled ids on the device (the step in flight, whose requests are the
        running ones in the same slots; `input_ids` when rows were admitted after them), or each request's
        last token when `previous` is None. `positions`: the scheduler's `decode_positions` for that case,
        when the caller has them."""
        scheduler = self.scheduler
        running = list(scheduler.table.running)
        pending = 0 if previous is None else 1
        if positions is None:
            positions = scheduler.decode_positions(pending)
        cache = self.ensure_cache(min(max(positions) + 2, scheduler.context_length))
        device = self.model.device
        if input_ids is None:
            if previous is None:
                input_ids = torch.tensor([r.output_ids[-1] for r in running]).to(device, non_blocking=True)
            else:
                input_ids = previous.tokens
        num_outputs = [len(r.output_ids) + pending for r in running]
        eos_token_ids = scheduler.eos_token_ids
        plan = SamplingPlan.of(running, eos_token_ids, num_outputs)
        sample: DeviceSample | None = None
        if self.graphs is not None:
            hidden, sample = self.graphs.decode(input_ids, positions, cache, plan)
        else:
            position_ids = torch.tensor(positions).to(device, non_blocking=True)
            hidden = self.model.decode(input_ids, position_ids, cache, max(positions) + 1)
        if sample is None:
            sample = sample_on_device(
                running, self.model.logits(hidden), self.generator, eos_token_ids, num_outputs, plan
            )
        return LaunchedStep.launch(running, sample)


@dataclass(slots=True, eq=False)
class LaunchedStep:
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
    def launch(cls, requests: list[Request], sample: DeviceSample) -> LaunchedStep:
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
