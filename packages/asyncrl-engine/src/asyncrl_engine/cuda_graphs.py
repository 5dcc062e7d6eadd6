"""CUDA graphs of the decode step and of the packed prefill (`CudaGraphs`), replayed by the step runner.

On a GPU this decoder is bound by kernel launches, not arithmetic: a graph replays a whole step in one
launch. Graphs are captured over the KV cache's whole capacity, so a cache that grows drops them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor

from asyncrl_engine import extend_attention
from asyncrl_engine.kv_cache import KVCache, PackedPrefill, PackedShape
from asyncrl_engine.model import EngineModel
from asyncrl_engine.sampling import DeviceSample, SamplingPlan, sample_dense

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(slots=True, eq=False)
class DecodeGraph:
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
class PrefillGraph:
    """One captured packed prefill (`EngineModel.forward_packed`) of a fixed `PackedShape`: its static input
    columns (one tensor, laid out as `PackedPrefill.padded` writes it) and its hidden states."""

    graph: torch.cuda.CUDAGraph
    shape: PackedShape
    inputs: Tensor
    hidden: Tensor


class CudaGraphs:
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

    def __init__(self, model: EngineModel, max_running_requests: int, generator: torch.Generator) -> None:
        self.model = model
        self.max_running_requests = max_running_requests
        self.generator = generator
        """The engine's shared sampling generator: a graph that draws takes its uniforms from it."""
        self.graphs: dict[tuple[int, bool], DecodeGraph] = {}
        """Decode graphs, keyed by (batch-size bucket, whether it draws)."""
        self.prefills: dict[int, PrefillGraph | None] = {}
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
        return min(size, self.max_running_requests)

    def capture_all(self, cache: KVCache) -> None:
        """Capture the decode graphs of every batch-size bucket over `cache` (those not captured yet)."""
        limit = self.max_running_requests
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
            torch.rand(batch, generator=self.generator, out=entry.uniforms[:batch])
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
        if tokens is None or not self.model.packed_from_columns:
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

    def _ensure(self, size: int, draws: bool, cache: KVCache) -> DecodeGraph:
        entry = self.graphs.get((size, draws))
        if entry is None:
            entry = self.graphs[size, draws] = self._capture_decode(size, draws, cache)
        return entry

    def _capture_decode(self, size: int, draws: bool, cache: KVCache) -> DecodeGraph:
        model = self.model
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
        return DecodeGraph(graph, static_ids, inputs, temperatures, uniforms, hidden, sample, [1.0] * size)

    def _try_capture_prefill(self, tokens: int, cache: KVCache) -> PrefillGraph | None:
        """`_capture_prefill`, or None where the capture fails (logged; the bucket then runs eagerly for the
        graphs' lifetime). A capture in the middle of a generation must not fail its step: a library call
        that cannot be captured (a first use that allocates, say) costs that bucket its graph, no more."""
        device = self.model.device
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

    def _capture_prefill(self, tokens: int, cache: KVCache) -> PrefillGraph:
        model = self.model
        c = model.config
        sequences = min(tokens, self.max_running_requests)
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
        return PrefillGraph(graph, shape, inputs, hidden)

    def _capture(self, kind: str, cache: KVCache, step: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
        """Capture `step` (after two warm-up runs on a side stream) into the pool of `kind`: the graph and the
        outputs of the captured run (its static outputs). `step` runs over `cache`."""
        model = self.model
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
