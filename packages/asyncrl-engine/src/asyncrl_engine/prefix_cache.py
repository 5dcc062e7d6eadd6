"""The prefix cache: KV of finished (and retracted) requests kept in pool blocks, indexed by a radix tree.

A request that starts with a cached prefix gets that prefix's KV copied from the pool into its slot and
prefills only the rest (an agentic turn's new observation instead of its whole context). Only whole blocks
are cached. When the pool is at its maximum, least-recently-used leaves that no one holds are evicted.

Every entry was computed under the weights loaded when it was stored; the engine empties the cache whenever
weights are loaded, except under an `in_place` pause, whose contract keeps KV computed under the old weights
(see `Engine.load_weights`). Not thread-safe: the scheduler thread owns it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncrl_engine.kv_cache import KVCache
from asyncrl_engine.kv_pool import KVBlockPool
from asyncrl_engine.model_config import ModelConfig
from asyncrl_engine.radix_tree import RadixTree

EVICTION_RESERVE = 32
"""An eviction frees at least 1/EVICTION_RESERVE of the pool's `max_blocks` (least recently used first): each
walks the whole tree (`RadixTree.evict` heaps every evictable leaf), so a full cache under steady turnover
walks once per that share of the pool instead of at every store (about 1 ms a store at 20k blocks)."""


class PrefixCache:
    """A radix tree over token ids whose blocks live in a `KVBlockPool`."""

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        max_tokens: int,
    ) -> None:
        self.block_size = block_size
        self.tree = RadixTree(block_size)
        self.pool = KVBlockPool(config, device, dtype, block_size, max_tokens // block_size)
        self.hit_tokens_total = 0
        """Prompt tokens whose KV came from the cache instead of a prefill."""
        self.evicted_blocks_total = 0

    @property
    def num_cached_tokens(self) -> int:
        return self.tree.num_blocks * self.block_size

    def nbytes(self) -> int:
        return self.pool.nbytes()

    def load(self, tokens: Sequence[int], limit: int, cache: KVCache, slot: int) -> int:
        """Copy the KV of the longest cached prefix of `tokens[:limit]` into `slot`; return its length."""
        if limit < self.block_size:
            return 0
        match = self.tree.match(tokens[:limit])
        self.pool.load(match.blocks, cache, slot)
        cached = len(match.blocks) * self.block_size
        self.hit_tokens_total += cached
        return cached

    def cached_length(self, tokens: Sequence[int], limit: int) -> int:
        """What `load(tokens, limit, ...)` would copy now, without copying it or marking it used."""
        return 0 if limit < self.block_size else self.tree.matched_length(tokens[:limit])

    def store(self, tokens: Sequence[int], cache: KVCache, slot: int) -> None:
        """Keep the KV of `tokens`, which `slot` holds at positions `0..len(tokens)-1` (whole blocks only;
        what is cached already is shared, not copied; as much as fits when the pool is full)."""
        usable = len(tokens) - len(tokens) % self.block_size
        if usable == 0:
            return
        match = self.tree.match(tokens[:usable])
        missing = usable // self.block_size - len(match.blocks)
        if missing == 0:
            return
        self.tree.lock(match.node)
        try:
            self._make_room(missing)
        finally:
            self.tree.unlock(match.node)
        count = min(missing, self.pool.allocator.num_free)
        if count == 0:
            return
        ids = self.pool.allocator.allocate(count)
        start = len(match.blocks) * self.block_size
        self.pool.store(ids, cache, slot, start)
        self.tree.insert(match, tokens[start : start + count * self.block_size], ids)

    def _make_room(self, count: int) -> None:
        self.pool.try_grow(count)
        shortfall = count - self.pool.allocator.num_free
        if shortfall > 0:
            freed = self.tree.evict(max(shortfall, self.pool.max_blocks // EVICTION_RESERVE))
            self.evicted_blocks_total += len(freed)
            self.pool.allocator.free(freed)

    def clear(self) -> None:
        """Forget every entry (the pool's memory stays allocated for reuse)."""
        self.pool.allocator.free(self.tree.clear())

    def release(self) -> None:
        """Forget every entry and free the pool's memory."""
        self.tree.clear()
        self.pool.release()
