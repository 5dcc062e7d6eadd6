"""The per-slot KV cache of the running requests (`KVCache`), and the layout of a packed prefill batch on the
host and in a CUDA graph's static inputs (`PackedPrefill`, `PackedShape`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from asyncrl_engine import extend_attention
from asyncrl_engine.model_config import ModelConfig


class KVCache:
    """Per-slot KV buffers of the running requests, one tensor for every layer:
    `kv` [num_layers, 2 (K, V), num_slots, kv_heads, capacity, head_dim]; `keys[l]` and `values[l]` are views.

    Slot `s` holds one request's KV at positions `0..length-1`. The engine keeps the running requests in slots
    `0..B-1` (it moves the last slot into a freed one), so a decode step reads one contiguous view; with every
    layer in one tensor, that move is a single copy.
    """

    def __init__(
        self, config: ModelConfig, num_slots: int, capacity: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.num_slots = num_slots
        self.capacity = capacity
        shape = (config.num_layers, 2, num_slots, config.num_kv_heads, capacity, config.head_dim)
        self.kv = torch.zeros(shape, device=device, dtype=dtype)
        self.keys = list(self.kv[:, 0].unbind(0))
        self.values = list(self.kv[:, 1].unbind(0))

    @staticmethod
    def bytes_for(config: ModelConfig, num_slots: int, capacity: int, dtype: torch.dtype) -> int:
        """The bytes of a cache of `num_slots` x `capacity` positions."""
        per_position = 2 * config.num_layers * config.num_kv_heads * config.head_dim
        return per_position * num_slots * capacity * dtype.itemsize

    def move_slot(self, source: int, target: int, length: int) -> None:
        """Copy the first `length` positions of slot `source` into slot `target` (every layer at once)."""
        self.kv[:, :, target, :, :length].copy_(self.kv[:, :, source, :, :length])

    def copy_from(self, other: KVCache, num_slots: int, length: int) -> None:
        """Copy the first `length` positions of the first `num_slots` slots of `other` (a smaller cache)."""
        self.kv[:, :, :num_slots, :, :length].copy_(other.kv[:, :, :num_slots, :, :length])

    def copy_slot_from(self, other: KVCache, slot: int, length: int) -> None:
        """Copy the first `length` positions of slot `slot` of `other` (a smaller cache), into that slot."""
        self.kv[:, :, slot, :, :length].copy_(other.kv[:, :, slot, :, :length])

    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


def aligned_bounds(sizes: Sequence[int]) -> tuple[list[tuple[int, int]], int]:
    """Where columns of `sizes` int64 values go in one tensor so that each starts on a 16-byte boundary
    whatever the sizes: ([(start, stop)] per column, the total length). Triton specializes a kernel on its
    pointers' 16-byte alignment, so a view that is aligned or not by the parity of a batch's length would
    compile a second variant of the kernel in the middle of serving."""
    bounds: list[tuple[int, int]] = []
    end = 0
    for size in sizes:
        bounds.append((end, end + size))
        end += size + size % 2  # 2 int64 = 16 bytes
    return bounds, end


@dataclass(frozen=True, slots=True)
class PackedPrefill:
    """A packed prefill batch on the host (`EngineModel.pack_prefill`), as `forward_packed` reads it.

    `columns` (int64, in this order): per token its id, position and slot ([N] each); per sequence its slot,
    cached prefix and the offsets of its rows ([B], [B], [B + 1]); per program of the extend kernel its
    sequence and first token ([I] each, `extend_attention.work_items`; empty without the kernel). The lists
    are what the torch path reads."""

    columns: tuple[Tensor, ...]
    slots: list[int]
    starts: list[int]
    lengths: list[int]
    end: int
    """The furthest position written (the rope table must cover it)."""

    @classmethod
    def pack(
        cls,
        sequences: Sequence[Sequence[int]],
        cache: KVCache,
        slots: Sequence[int],
        starts: Sequence[int] | None,
        per_program: int | None,
    ) -> PackedPrefill:
        """The batch of `EngineModel.prefill_packed`'s arguments, checked against `cache`, as columns.
        `per_program`: tokens per program of the extend kernel, which gets work items (None: no kernel)."""
        num = len(sequences)
        starts = [0] * num if starts is None else list(starts)
        lengths = [len(s) for s in sequences]
        if num == 0 or len(slots) != num or len(starts) != num:
            raise ValueError(
                f"{num} sequences but {len(slots)} slots and {len(starts)} starts (one each, >= 1)"
            )
        for row, (slot, start, length) in enumerate(zip(slots, starts, lengths, strict=True)):
            if length == 0 or start < 0 or start + length > cache.capacity or not 0 <= slot < cache.num_slots:
                raise ValueError(
                    f"sequence {row}: {length} tokens from position {start} in slot {slot} do not fit a "
                    f"cache of {cache.num_slots} slots x {cache.capacity} positions (each needs a token)"
                )
        total = sum(lengths)
        length_t = torch.tensor(lengths)
        offsets = torch.zeros(num + 1, dtype=torch.long)
        torch.cumsum(length_t, 0, out=offsets[1:])
        slot_t, start_t = torch.tensor(slots), torch.tensor(starts)
        owner = torch.repeat_interleave(torch.arange(num), length_t)
        positions = torch.arange(total) - offsets[owner] + start_t[owner]
        tokens = torch.tensor(list(itertools.chain.from_iterable(sequences)), dtype=torch.long)
        if per_program is not None:
            work = extend_attention.work_items(length_t, per_program)
        else:
            work = torch.empty((2, 0), dtype=torch.long)
        return cls(
            (tokens, positions, slot_t[owner], slot_t, start_t, offsets, work[0], work[1]),
            list(slots),
            starts,
            lengths,
            max(start + length for start, length in zip(starts, lengths, strict=True)),
        )

    @property
    def total(self) -> int:
        return self.columns[0].shape[0]

    @property
    def num_sequences(self) -> int:
        return len(self.slots)

    @property
    def shape(self) -> PackedShape:
        """Its own sizes, unpadded."""
        return PackedShape(self.total, self.num_sequences, self.columns[-1].numel())

    def padded(self, shape: PackedShape, capacity: int) -> Tensor:
        """The columns padded to `shape` (which must fit them) as one host tensor laid out by
        `shape.bounds`, for a cache of `capacity` positions. Padding tokens (id 0) write their K/V at the
        cache's last position of slot 0, which the capacity rule keeps free of live KV, and no work item takes
        them, so their rows are left as they are (rows do not mix outside attention); padding sequences have
        no tokens; padding work items start past every sequence and do nothing."""
        if not shape.fits(self):
            raise ValueError(f"a packed prefill of {self.total} tokens does not fit {shape}")
        bounds, end = shape.bounds
        packed = torch.zeros(end, dtype=torch.long)
        fills = (0, capacity - 1, 0, 0, 0, self.total, 0, extend_attention.NO_WORK)
        for (start, stop), column, fill in zip(bounds, self.columns, fills, strict=True):
            packed[start : start + column.numel()] = column
            packed[start + column.numel() : stop] = fill
        return packed


@dataclass(frozen=True, slots=True)
class PackedShape:
    """The fixed sizes of a padded packed prefill (a CUDA graph's): tokens, sequences, extend-kernel
    programs."""

    tokens: int
    sequences: int
    work: int

    @property
    def bounds(self) -> tuple[list[tuple[int, int]], int]:
        """Where each column lies in the tensor of `PackedPrefill.padded` (`aligned_bounds`)."""
        return aligned_bounds(
            [self.tokens] * 3 + [self.sequences] * 2 + [self.sequences + 1] + [self.work] * 2
        )

    def columns(self, packed: Tensor) -> list[Tensor]:
        """The columns of a tensor laid out by `bounds`, as views."""
        return [packed[start:stop] for start, stop in self.bounds[0]]

    def fits(self, batch: PackedPrefill) -> bool:
        return (
            batch.total <= self.tokens
            and batch.num_sequences <= self.sequences
            and batch.columns[-1].numel() <= self.work
        )


PrefillReplay = Callable[[PackedPrefill, "KVCache"], Tensor | None]
"""Runs a packed prefill another way (a CUDA graph): its hidden states, or None where it cannot."""
