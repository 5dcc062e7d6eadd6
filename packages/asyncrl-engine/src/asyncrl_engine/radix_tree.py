"""The prefix cache's index: a radix tree over token ids whose edges own KV blocks (pure Python, no torch).

Every edge holds a run of whole blocks: a key of `k * block_size` token ids and the `k` block ids that hold
their K/V. A path from the root spells a cached prefix; two sequences that share a prefix share its blocks.
Only whole blocks are cached, so a match is a multiple of `block_size` tokens.

Nodes carry a reference count (`lock` / `unlock`, along the whole path to the root) and a last-use tick.
`evict` frees least-recently-used leaves that nobody holds; a parent becomes a leaf, and so evictable, once
its last child has gone. The tree never allocates or frees blocks itself: `evict` and `clear` hand the ids
back to the caller, which owns the pool.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


class _Node:
    __slots__ = ("blocks", "children", "key", "last_used", "parent", "refs")

    def __init__(self, parent: _Node | None, key: list[int], blocks: list[int]) -> None:
        self.parent = parent
        self.key = key
        """The token ids of this edge (a multiple of the block size; empty for the root)."""
        self.blocks = blocks
        """One block id per `block_size` tokens of `key`."""
        self.children: dict[tuple[int, ...], _Node] = {}
        """Keyed by the first block of the child's key."""
        self.refs = 0
        self.last_used = 0


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The longest cached prefix of a sequence: its blocks, in order, and the node where it ends."""

    blocks: list[int]
    node: _Node


class RadixTree:
    """Token-id prefixes to KV block ids, with LRU eviction of unreferenced leaves."""

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.root = _Node(None, [], [])
        self.root.refs = 1  # never evicted
        self._clock = itertools.count(1)
        self.num_blocks = 0
        """Blocks held by the tree."""

    def _first_block(self, tokens: Sequence[int], start: int) -> tuple[int, ...]:
        return tuple(tokens[start : start + self.block_size])

    def match(self, tokens: Sequence[int]) -> PrefixMatch:
        """The longest prefix of `tokens` held in whole blocks; marks its path as just used.

        A match that ends inside an edge splits the edge there, so the returned node spells exactly the match.
        """
        tick = next(self._clock)
        node = self.root
        node.last_used = tick
        blocks: list[int] = []
        for child, matched in self._walk(tokens):
            if matched < len(child.blocks):
                child = self._split(child, matched)
            blocks.extend(child.blocks)
            child.last_used = tick
            node = child
        return PrefixMatch(blocks, node)

    def matched_length(self, tokens: Sequence[int]) -> int:
        """The length of `match(tokens)`, read only: no edge is split and no use is marked."""
        return self.block_size * sum(matched for _, matched in self._walk(tokens))

    def _walk(self, tokens: Sequence[int]) -> Iterator[tuple[_Node, int]]:
        """The edges along the longest cached prefix of `tokens` (whole blocks), each with how many of its
        blocks match: all of them, except perhaps on the last edge yielded. The caller may split that last
        edge (`match`) before the walk resumes, so whether it was the last is decided before it is yielded."""
        usable = len(tokens) - len(tokens) % self.block_size
        node, position = self.root, 0
        while position < usable:
            child = node.children.get(self._first_block(tokens, position))
            if child is None:
                return
            matched = self._common_blocks(child.key, tokens, position, usable)
            partial = matched < len(child.blocks)
            yield child, matched
            if partial:
                return
            position += len(child.key)
            node = child

    def _common_blocks(self, key: list[int], tokens: Sequence[int], start: int, end: int) -> int:
        """How many whole blocks of `key` equal `tokens[start:end]` from the first (at least one: the
        children are indexed by their first block)."""
        size = self.block_size
        count = 0
        limit = min(len(key), end - start)
        while (count + 1) * size <= limit:
            offset = count * size
            if list(tokens[start + offset : start + offset + size]) != key[offset : offset + size]:
                break
            count += 1
        return count

    def _split(self, node: _Node, num_blocks: int) -> _Node:
        """Cut `node`'s edge after `num_blocks` blocks; return the new upper part (which keeps the refs)."""
        assert node.parent is not None
        assert 0 < num_blocks < len(node.blocks)
        cut = num_blocks * self.block_size
        upper = _Node(node.parent, node.key[:cut], node.blocks[:num_blocks])
        upper.refs = node.refs
        upper.last_used = node.last_used
        node.parent.children[self._first_block(node.key, 0)] = upper
        node.parent = upper
        node.key = node.key[cut:]
        node.blocks = node.blocks[num_blocks:]
        upper.children[self._first_block(node.key, 0)] = node
        return upper

    def insert(self, match: PrefixMatch, tokens: Sequence[int], blocks: Sequence[int]) -> PrefixMatch:
        """Append `tokens` (whole blocks, held in `blocks`) below `match.node`, which must spell the prefix
        just before them and have no child starting with their first block (true of a fresh, maximal match).
        Returns the match of the whole sequence."""
        if len(tokens) != len(blocks) * self.block_size:
            raise ValueError(f"{len(tokens)} tokens do not fill {len(blocks)} blocks of {self.block_size}")
        if not blocks:
            return match
        first = self._first_block(tokens, 0)
        if first in match.node.children:
            raise ValueError("the match is stale: its node already has a child for these tokens")
        child = _Node(match.node, list(tokens), list(blocks))
        child.last_used = next(self._clock)
        match.node.children[first] = child
        self.num_blocks += len(blocks)
        return PrefixMatch([*match.blocks, *blocks], child)

    def lock(self, node: _Node) -> None:
        """Protect `node` and its ancestors from eviction until `unlock`."""
        current: _Node | None = node
        while current is not None:
            current.refs += 1
            current = current.parent

    def unlock(self, node: _Node) -> None:
        current: _Node | None = node
        while current is not None:
            if current.refs <= 0:
                raise RuntimeError("unlock without a matching lock")
            current.refs -= 1
            current = current.parent

    def evict(self, num_blocks: int) -> list[int]:
        """Free least-recently-used unreferenced leaves until at least `num_blocks` blocks are freed or no
        leaf is evictable; returns the freed block ids (possibly more than asked: leaves go whole)."""
        freed: list[int] = []
        heap = [(leaf.last_used, id(leaf), leaf) for leaf in self._evictable_leaves()]
        heapq.heapify(heap)
        while heap and len(freed) < num_blocks:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[self._first_block(leaf.key, 0)]
            freed.extend(leaf.blocks)
            self.num_blocks -= len(leaf.blocks)
            if parent is not self.root and not parent.children and parent.refs == 0:
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        return freed

    def _evictable_leaves(self) -> list[_Node]:
        leaves: list[_Node] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root and node.refs == 0:
                leaves.append(node)
        return leaves

    def clear(self) -> list[int]:
        """Drop every entry (locked ones too); returns all the block ids the tree held."""
        freed: list[int] = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            freed.extend(node.blocks)
            stack.extend(node.children.values())
        self.root.children.clear()
        self.num_blocks = 0
        return freed
