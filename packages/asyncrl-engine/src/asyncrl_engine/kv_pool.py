"""The KV block pool of the prefix cache: block accounting (`BlockAllocator`) and the tensors (`KVBlockPool`).

A block holds the K/V of `block_size` consecutive tokens for every layer. The pool's tensor is
`blocks` [num_layers, 2 (K, V), kv_heads, num_blocks, block_size, head_dim]: gathering blocks `ids` gives
[layers, 2, kv_heads, n, block_size, D], which is the slot layout of `KVCache` ([..., kv_heads, positions, D])
once the two block axes are merged, so a copy between a slot and the pool is one gather or one scatter for all
layers at once. The pool grows on demand (doubling) up to its maximum.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncrl_engine.kv_cache import KVCache
from asyncrl_engine.model_config import ModelConfig


class BlockAllocator:
    """Free-list accounting of block ids `0..capacity-1` (no tensors): each id is free or allocated."""

    def __init__(self, capacity: int = 0) -> None:
        self.capacity = 0
        self._free: list[int] = []
        self._allocated: set[int] = set()
        self.grow(capacity)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_allocated(self) -> int:
        return len(self._allocated)

    def grow(self, capacity: int) -> None:
        """Add ids up to `capacity` (never shrinks)."""
        if capacity > self.capacity:
            # Reversed so that `allocate` pops the lowest ids first.
            self._free[:0] = range(capacity - 1, self.capacity - 1, -1)
            self.capacity = capacity

    def allocate(self, count: int) -> list[int]:
        """`count` free ids; ValueError (nothing taken) if fewer are free."""
        if count < 0 or count > len(self._free):
            raise ValueError(f"cannot allocate {count} blocks: {len(self._free)} of {self.capacity} are free")
        taken = [self._free.pop() for _ in range(count)]
        self._allocated.update(taken)
        return taken

    def free(self, ids: Sequence[int]) -> None:
        """Return allocated ids; ValueError (nothing freed) for an id that is not allocated or repeated."""
        unique = set(ids)
        if len(unique) != len(ids) or not unique <= self._allocated:
            bad = sorted(i for i in unique if i not in self._allocated)
            raise ValueError(f"cannot free blocks that are not allocated (or repeated): {bad or list(ids)}")
        self._allocated -= unique
        self._free.extend(ids)

    def free_all(self) -> None:
        self._allocated.clear()
        self._free = list(range(self.capacity - 1, -1, -1))


class KVBlockPool:
    """The block tensors and their allocator; copies K/V between blocks and the slots of a `KVCache`."""

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        max_blocks: int,
    ) -> None:
        if block_size < 1 or max_blocks < 0:
            raise ValueError(f"block_size must be >= 1 and max_blocks >= 0, got {block_size}, {max_blocks}")
        self.config = config
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.allocator = BlockAllocator()
        self.blocks = self._empty(0)

    def _empty(self, num_blocks: int) -> torch.Tensor:
        c = self.config
        shape = (c.num_layers, 2, c.num_kv_heads, num_blocks, self.block_size, c.head_dim)
        return torch.zeros(shape, device=self.device, dtype=self.dtype)

    @property
    def num_blocks(self) -> int:
        return self.allocator.capacity

    def nbytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size()

    def try_grow(self, needed_free: int) -> None:
        """Grow (doubling, at least to `needed_free` free blocks) without passing `max_blocks`."""
        shortfall = needed_free - self.allocator.num_free
        if shortfall <= 0 or self.num_blocks >= self.max_blocks:
            return
        target = min(self.max_blocks, max(self.num_blocks + shortfall, 2 * self.num_blocks, 64))
        grown = self._empty(target)
        grown[:, :, :, : self.num_blocks].copy_(self.blocks)
        self.blocks = grown
        self.allocator.grow(target)

    def release(self) -> None:
        """Drop the tensor (every block must be free again before use; the allocator is reset)."""
        self.blocks = self._empty(0)
        self.allocator = BlockAllocator()

    def _index(self, ids: Sequence[int]) -> torch.Tensor:
        # Copied without waiting for the device: a blocking copy (`torch.tensor(..., device=cuda)`) would
        # wait for the decode step in flight when a finished request's prefix is stored.
        return torch.tensor(list(ids), dtype=torch.long).to(self.device, non_blocking=True)

    def load(self, ids: Sequence[int], cache: KVCache, slot: int) -> None:
        """Copy blocks `ids`, in order, into positions `0..len(ids)*block_size-1` of `slot`."""
        if not ids:
            return
        c = self.config
        length = len(ids) * self.block_size
        gathered = self.blocks.index_select(3, self._index(ids))
        cache.kv[:, :, slot, :, :length].copy_(
            gathered.view(c.num_layers, 2, c.num_kv_heads, length, c.head_dim)
        )

    def store(self, ids: Sequence[int], cache: KVCache, slot: int, start: int) -> None:
        """Copy positions `start..start+len(ids)*block_size-1` of `slot` into blocks `ids`, in order."""
        if not ids:
            return
        c = self.config
        length = len(ids) * self.block_size
        source = cache.kv[:, :, slot, :, start : start + length]
        self.blocks.index_copy_(
            3,
            self._index(ids),
            source.reshape(c.num_layers, 2, c.num_kv_heads, len(ids), self.block_size, c.head_dim),
        )
