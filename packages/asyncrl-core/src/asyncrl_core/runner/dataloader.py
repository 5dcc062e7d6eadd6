"""The prompt order of a run: epochs over the dataset, shuffled per epoch from the run's seed.

A prompt handed back (its group was dropped as too stale, or its generation failed) is issued again in a
later epoch, after the prompts of the epoch that follows the one it came back in; so every prompt of an epoch
is issued before any returned one, and nothing handed back is lost.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoaderState:
    """Where a `PromptLoader` is, for checkpoints: enough to continue the same order after a restart."""

    epoch: int
    position: int
    returned: tuple[int, ...]
    """Prompts handed back and not yet issued again, in the order they will be."""
    next_returned: tuple[int, ...]
    """Prompts handed back during the current epoch (issued after the next epoch)."""


class PromptLoader:
    """Issues prompt indices `0 .. size-1`: one epoch after another, each shuffled with `seed + epoch`.

    Not thread-safe: its owner (`BufferWorker`) serialises the calls.
    """

    def __init__(self, size: int, *, shuffle: bool, seed: int) -> None:
        if size < 1:
            raise ValueError(f"the dataset has no prompts to train on (size {size})")
        self.size = size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self._position = 0
        self._order = self._epoch_order(0)
        self._returned: deque[int] = deque()
        """Handed back in an earlier epoch: issued now, before this epoch's remaining prompts run out."""
        self._next_returned: list[int] = []

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(self.size))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def peek(self) -> int:
        """The prompt `advance` will issue next."""
        if self._position == len(self._order) and not self._returned:
            self._next_epoch()
        if self._position < len(self._order):
            return self._order[self._position]
        return self._returned[0]

    def advance(self) -> int:
        """Issue the next prompt and return its index."""
        prompt_index = self.peek()
        if self._position < len(self._order):
            self._position += 1
        else:
            self._returned.popleft()
        return prompt_index

    def give_back(self, prompt_index: int) -> None:
        """Issue `prompt_index` again after the next epoch's own prompts."""
        if not 0 <= prompt_index < self.size:
            raise ValueError(f"prompt index {prompt_index} is outside the dataset (size {self.size})")
        self._next_returned.append(prompt_index)

    def _next_epoch(self) -> None:
        self.epoch += 1
        self._order = self._epoch_order(self.epoch)
        self._position = 0
        self._returned.extend(self._next_returned)
        self._next_returned = []

    def state(self) -> LoaderState:
        return LoaderState(self.epoch, self._position, tuple(self._returned), tuple(self._next_returned))

    def restore(self, state: LoaderState) -> None:
        """Continue from `state` (taken from a loader of the same size, shuffle and seed)."""
        self.epoch = state.epoch
        self._order = self._epoch_order(state.epoch)
        self._position = state.position
        self._returned = deque(state.returned)
        self._next_returned = list(state.next_returned)
