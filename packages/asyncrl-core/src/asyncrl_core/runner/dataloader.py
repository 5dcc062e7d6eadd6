"""The prompt order of a run: epochs over the dataset, shuffled per epoch from the run's seed.

A prompt handed back (its group was dropped as too stale, or its generation failed) is issued again in a
later epoch, after the prompts of the epoch that follows the one it came back in; so every prompt of an epoch
is issued before any returned one, and nothing handed back is lost. Prompts that were in flight when a run
was stopped are issued again first of all when it resumes (`reissue_first`).

Every issue belongs to a *ticket*, `(prompt_index, epoch)`: the epoch whose order issued the prompt first.
A prompt handed back keeps its ticket when it is issued again, so the run's ledger can say, per epoch,
whether each of its prompts was trained once or dropped.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

Ticket = tuple[int, int]
"""`(prompt_index, epoch)`: one prompt of one epoch's order, however many times it is issued."""


@dataclass(frozen=True, slots=True)
class LoaderState:
    """Where a `PromptLoader` is, for checkpoints: enough to continue the same order after a restart."""

    epoch: int
    position: int
    returned: tuple[Ticket, ...]
    """Prompts handed back and not yet issued again, in the order they will be."""
    next_returned: tuple[Ticket, ...]
    """Prompts handed back during the current epoch (issued after the next epoch)."""
    first: tuple[Ticket, ...] = ()
    """Prompts to issue again before any other (those in flight when the run was stopped)."""


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
        self._first: deque[Ticket] = deque()
        """Issued before anything else (prompts in flight when a run stopped)."""
        self._returned: deque[Ticket] = deque()
        """Handed back in an earlier epoch: issued now, before this epoch's remaining prompts run out."""
        self._next_returned: list[Ticket] = []

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(self.size))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def peek_ticket(self) -> Ticket:
        """The ticket `advance` will issue next."""
        if self._first:
            return self._first[0]
        if self._position == len(self._order) and not self._returned:
            self._next_epoch()
        if self._position < len(self._order):
            return self._order[self._position], self.epoch
        return self._returned[0]

    def peek(self) -> int:
        """The prompt `advance` will issue next."""
        return self.peek_ticket()[0]

    def advance_ticket(self) -> Ticket:
        """Issue the next prompt and return its ticket."""
        ticket = self.peek_ticket()
        if self._first:
            self._first.popleft()
        elif self._position < len(self._order):
            self._position += 1
        else:
            self._returned.popleft()
        return ticket

    def advance(self) -> int:
        """Issue the next prompt and return its index."""
        return self.advance_ticket()[0]

    def give_back(self, prompt_index: int, epoch: int | None = None) -> None:
        """Issue `prompt_index` again after the next epoch's own prompts; `epoch` is the epoch of its ticket
        (default: the current one)."""
        self._check(prompt_index)
        self._next_returned.append((prompt_index, self.epoch if epoch is None else epoch))

    def reissue_first(self, tickets: list[Ticket]) -> None:
        """Issue these tickets again before any other prompt, in this order."""
        for prompt_index, _ in tickets:
            self._check(prompt_index)
        self._first.extend(tickets)

    def _check(self, prompt_index: int) -> None:
        if not 0 <= prompt_index < self.size:
            raise ValueError(f"prompt index {prompt_index} is outside the dataset (size {self.size})")

    def _next_epoch(self) -> None:
        self.epoch += 1
        self._order = self._epoch_order(self.epoch)
        self._position = 0
        self._returned.extend(self._next_returned)
        self._next_returned = []

    @property
    def order_done(self) -> int:
        """Epochs whose own order has been issued completely (their returned prompts may still be due)."""
        return self.epoch + (self._position == len(self._order))

    def pending(self) -> list[Ticket]:
        """Tickets waiting to be issued again (to be issued first, handed back), in the order they will be."""
        return [*self._first, *self._returned, *self._next_returned]

    def state(self) -> LoaderState:
        return LoaderState(
            self.epoch,
            self._position,
            tuple(self._returned),
            tuple(self._next_returned),
            tuple(self._first),
        )

    def restore(self, state: LoaderState) -> None:
        """Continue from `state` (taken from a loader of the same size, shuffle and seed)."""
        self.epoch = state.epoch
        self._order = self._epoch_order(state.epoch)
        self._position = state.position
        self._first = deque(state.first)
        self._returned = deque(state.returned)
        self._next_returned = list(state.next_returned)
