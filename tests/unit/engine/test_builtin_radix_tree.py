"""The prefix cache's parts: the radix tree (no torch), the block allocator, the cache over a real pool."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl_engine.kv_cache import KVCache
from asyncrl_engine.kv_pool import BlockAllocator
from asyncrl_engine.model_config import ModelConfig
from asyncrl_engine.prefix_cache import EVICTION_RESERVE, PrefixCache
from asyncrl_engine.radix_tree import RadixTree


def _store(tree: RadixTree, allocator: BlockAllocator, tokens: list[int]) -> list[int]:
    """Cache `tokens` (whole blocks) the way `PrefixCache.store` does, evicting when the allocator is full."""
    usable = len(tokens) - len(tokens) % tree.block_size
    match = tree.match(tokens[:usable])
    missing = usable // tree.block_size - len(match.blocks)
    tree.lock(match.node)
    if allocator.num_free < missing:
        allocator.free(tree.evict(missing - allocator.num_free))
    tree.unlock(match.node)
    count = min(missing, allocator.num_free)
    ids = allocator.allocate(count)
    start = len(match.blocks) * tree.block_size
    tree.insert(match, tokens[start : start + count * tree.block_size], ids)
    return ids


def test_match_shares_prefixes_and_splits_edges() -> None:
    tree = RadixTree(block_size=2)
    allocator = BlockAllocator(16)
    _store(tree, allocator, [1, 2, 3, 4, 5, 6, 7])  # 3 whole blocks; the 7 is not cached
    assert tree.num_blocks == 3
    assert tree.match([1, 2, 3, 4, 5, 6, 7, 8]).blocks == [0, 1, 2]
    assert tree.match([1, 2, 3, 9]).blocks == [0]  # a partly matching block does not count
    _store(tree, allocator, [1, 2, 3, 4, 9, 9])  # shares two blocks, adds one
    assert tree.num_blocks == 4
    assert tree.match([1, 2, 3, 4, 9, 9]).blocks == [0, 1, 3]
    assert tree.match([1, 2, 3, 4, 5, 6]).blocks == [0, 1, 2]
    assert tree.match([2, 1]).blocks == []


def test_a_match_ending_inside_an_edge_stops_there() -> None:
    """The edge is split where the match ends; the walk must not go on from the split's lower part, whose
    child here starts with the query's next token (it spells a later position)."""
    tree = RadixTree(block_size=1)
    allocator = BlockAllocator(16)
    _store(tree, allocator, [1, 2, 3])
    _store(tree, allocator, [1, 2, 3, 2, 8])  # the edge [1, 2, 3] with the child [2, 8]
    assert tree.matched_length([1, 2, 7]) == 2
    assert tree.match([1, 2, 7]).blocks == [0, 1]
    assert tree.match([1, 2, 3, 2, 8]).blocks == [0, 1, 2, 3, 4]


def test_eviction_frees_least_recently_used_unlocked_leaves() -> None:
    tree = RadixTree(block_size=1)
    allocator = BlockAllocator(6)
    _store(tree, allocator, [1, 2, 3])
    _store(tree, allocator, [4, 5, 6])
    tree.match([1, 2, 3])  # [4, 5, 6] is now the least recently used
    locked = tree.match([1, 2, 3]).node
    tree.lock(locked)
    _store(tree, allocator, [7, 8])  # needs 2 blocks: evicts [4, 5, 6] whole
    assert tree.match([4, 5, 6]).blocks == []
    assert len(tree.match([1, 2, 3]).blocks) == 3
    newest = tree.match([7, 8]).blocks
    assert tree.evict(100) == newest  # the locked path stays
    held = tree.match([1, 2, 3]).blocks
    tree.unlock(locked)
    assert sorted(tree.evict(100)) == sorted(held)
    assert tree.num_blocks == 0


def test_allocator_refuses_overdraw_and_double_free_changing_nothing() -> None:
    allocator = BlockAllocator(3)
    ids = allocator.allocate(2)
    with pytest.raises(ValueError, match="cannot allocate 2"):
        allocator.allocate(2)
    with pytest.raises(ValueError, match="not allocated"):
        allocator.free([ids[0], ids[0]])
    with pytest.raises(ValueError, match="not allocated"):
        allocator.free([99])
    assert (allocator.num_free, allocator.num_allocated) == (1, 2)
    allocator.free(ids)
    allocator.grow(5)
    assert (allocator.num_free, allocator.num_allocated, allocator.capacity) == (5, 0, 5)


_sequences = st.lists(st.integers(0, 2), min_size=0, max_size=12)


@settings(max_examples=150, deadline=None)
@given(
    block_size=st.integers(1, 3),
    capacity=st.integers(0, 10),
    operations=st.lists(st.tuples(st.sampled_from(["store", "evict", "match"]), _sequences), max_size=25),
)
def test_tree_and_allocator_stay_consistent(
    block_size: int, capacity: int, operations: list[tuple[str, list[int]]]
) -> None:
    """Every block is either free or held once by the tree, and a match's i-th block always holds the KV of
    exactly the matched sequence's first i+1 blocks (what a block's K/V depends on)."""
    tree = RadixTree(block_size)
    allocator = BlockAllocator(capacity)
    content: dict[int, tuple[int, ...]] = {}
    for operation, tokens in operations:
        if operation == "store":
            usable = len(tokens) - len(tokens) % block_size
            start = len(tree.match(tokens[:usable]).blocks)
            for offset, block in enumerate(_store(tree, allocator, tokens)):
                content[block] = tuple(tokens[: (start + offset + 1) * block_size])
            if capacity * block_size >= usable:
                assert len(tree.match(tokens).blocks) * block_size == usable
        elif operation == "evict":
            allocator.free(tree.evict(len(tokens)))
        else:
            # The read-only length first: it neither splits nor marks, so the match after it agrees.
            length = tree.matched_length(tokens)
            blocks = tree.match(tokens).blocks
            assert length == len(blocks) * block_size
            for index, block in enumerate(blocks):
                assert content[block] == tuple(tokens[: (index + 1) * block_size])
        assert tree.num_blocks == allocator.num_allocated
        assert allocator.num_free + allocator.num_allocated == capacity
    held = tree.clear()
    assert len(held) == len(set(held)) == allocator.num_allocated


def _tiny_config() -> ModelConfig:
    return ModelConfig(
        model_type="llama",
        vocab_size=8,
        hidden_size=4,
        intermediate_size=4,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=2,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        attention_bias=False,
        eos_token_ids=(),
    )


def _fill(cache: KVCache, slot: int, tokens: list[int]) -> None:
    """Write into `slot` K/V values that identify each position's whole prefix (as real K/V would)."""
    for position in range(len(tokens)):
        value = float(hash(tuple(tokens[: position + 1])) % 100_003)
        cache.kv[:, 0, slot, :, position] = value
        cache.kv[:, 1, slot, :, position] = -value


@settings(max_examples=40, deadline=None)
@given(
    max_tokens=st.integers(0, 24),
    sequences=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=14), min_size=1, max_size=10),
)
def test_prefix_cache_loads_exactly_what_was_stored(max_tokens: int, sequences: list[list[int]]) -> None:
    """Through pool growth and eviction, a loaded prefix's K/V are those stored for that very prefix."""
    config = _tiny_config()
    prefix_cache = PrefixCache(
        config, torch.device("cpu"), torch.float32, block_size=2, max_tokens=max_tokens
    )
    cache = KVCache(config, 2, 32, torch.device("cpu"), torch.float32)
    for tokens in sequences:
        cache.kv.zero_()
        cached = prefix_cache.load(tokens, len(tokens), cache, 1)
        assert cached % 2 == 0
        assert cached <= len(tokens)
        expected = KVCache(config, 2, 32, torch.device("cpu"), torch.float32)
        _fill(expected, 1, tokens)
        assert torch.equal(cache.kv[:, :, 1, :, :cached], expected.kv[:, :, 1, :, :cached])
        _fill(cache, 0, tokens)
        prefix_cache.store(tokens, cache, 0)
        assert prefix_cache.pool.num_blocks <= max_tokens // 2
        assert prefix_cache.tree.num_blocks == prefix_cache.pool.allocator.num_allocated
    prefix_cache.clear()
    assert prefix_cache.pool.allocator.num_allocated == 0


def test_a_full_prefix_cache_evicts_a_reserve_at_once() -> None:
    """An eviction frees 1/EVICTION_RESERVE of the pool at least, the least recently used entries first: the
    stores that follow find free blocks without evicting (each eviction walks the whole tree)."""
    config = _tiny_config()
    reserve = 4
    max_blocks = reserve * EVICTION_RESERVE
    prefix_cache = PrefixCache(
        config, torch.device("cpu"), torch.float32, block_size=2, max_tokens=2 * max_blocks
    )
    cache = KVCache(config, 1, 4, torch.device("cpu"), torch.float32)
    sequences = [[index // 7, index % 7, 0] for index in range(max_blocks + reserve + 1)]  # one block each
    for tokens in sequences[:max_blocks]:
        prefix_cache.store(tokens, cache, 0)
    assert prefix_cache.pool.allocator.num_free == 0
    assert prefix_cache.evicted_blocks_total == 0
    prefix_cache.store(sequences[max_blocks], cache, 0)
    assert prefix_cache.evicted_blocks_total == reserve
    for tokens in sequences[max_blocks + 1 : max_blocks + reserve]:
        prefix_cache.store(tokens, cache, 0)
    assert prefix_cache.evicted_blocks_total == reserve, "the reserve took the next stores"
    prefix_cache.store(sequences[max_blocks + reserve], cache, 0)
    assert prefix_cache.evicted_blocks_total == 2 * reserve
    assert [prefix_cache.cached_length(tokens, 2) for tokens in sequences[: 2 * reserve + 1]] == [0] * (
        2 * reserve
    ) + [2]
