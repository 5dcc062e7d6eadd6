"""The admission gate of the built-in engine: pauses and weight updates against in-flight generation.

A generation call takes a `Ticket` for its requests and waits at the gate while the server is paused or a
weight update holds the writer side; once through, it counts as in flight until it leaves. A weight update
outside a pause takes the writer side: the gate closes to new calls and the update waits until nothing is in
flight (the reader/writer lock of SGLang's tokenizer manager). Inside a pause an update applies at once. A
weight-update session (`/begin_weight_update` .. `/end_weight_update`) holds the writer side for its whole
length when it opens outside a pause, so the buckets of one update are never sampled from half-applied.

The gate lives on the asyncio loop; every method must be called from it. It does not touch the engine:
callers pause the scheduler and abort requests themselves.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from asyncrl_sglang.wire import PauseMode


@dataclass(slots=True)
class Ticket:
    """One generation call's place at the gate: how many requests it holds and whether they were aborted
    while they waited (then they never reach the engine)."""

    num_requests: int
    aborted: bool = False


class AdmissionGate:
    """Reader/writer gate: generation calls are readers, weight updates writers, a pause closes it."""

    def __init__(self) -> None:
        self._condition = asyncio.Condition()
        self.paused: PauseMode | None = None
        """The mode of the current pause, None when generation runs."""
        self.num_in_flight = 0
        """Generation calls past the gate that have not answered yet."""
        self.num_waiting = 0
        """Requests of calls blocked at the gate (SGLang's `num_paused_reqs`)."""
        self._writers = 0
        self._session_open = False
        self._session_writer = False
        self._stopped = False

    @property
    def closed(self) -> bool:
        return not self._stopped and (self.paused is not None or self._writers > 0)

    @property
    def session_open(self) -> bool:
        return self._session_open

    # ------------------------------------------------------------------------------------------ readers
    @asynccontextmanager
    async def admitted(self, ticket: Ticket) -> AsyncGenerator[bool]:
        """Wait until the gate is open; yields True once admitted (counted in flight until the block ends),
        False if the ticket was aborted while it waited (nothing is counted)."""
        async with self._condition:
            if self.closed:
                self.num_waiting += ticket.num_requests
                try:
                    await self._condition.wait_for(lambda: not self.closed or ticket.aborted)
                finally:
                    self.num_waiting -= ticket.num_requests
            if ticket.aborted:
                admitted = False
            else:
                admitted = True
                self.num_in_flight += 1
        if not admitted:
            yield False
            return
        try:
            yield True
        finally:
            self.num_in_flight -= 1
            if self.num_in_flight == 0:
                async with self._condition:
                    self._condition.notify_all()

    async def abort_waiting(self, tickets: list[Ticket]) -> None:
        """Mark `tickets` aborted and wake them: the calls still at the gate answer at once."""
        async with self._condition:
            for ticket in tickets:
                ticket.aborted = True
            self._condition.notify_all()

    async def stop(self) -> None:
        """Open the gate for good: the server is shutting down and its engine has stopped, so the calls that
        wait here go on to be refused by it (503, as every call that reaches it now), rather than wait for a
        continue that never comes. No pause or weight update closes the gate again."""
        async with self._condition:
            self._stopped = True
            self._condition.notify_all()

    # ------------------------------------------------------------------------------------------ pauses
    async def pause(self, mode: PauseMode) -> None:
        async with self._condition:
            self.paused = mode

    async def resume(self) -> None:
        async with self._condition:
            self.paused = None
            self._condition.notify_all()

    # ------------------------------------------------------------------------------------------ writers
    async def acquire_writer(self) -> None:
        """Close the gate and wait until no generation call is in flight."""
        async with self._condition:
            self._writers += 1
            await self._condition.wait_for(lambda: self.num_in_flight == 0)

    async def release_writer(self) -> None:
        async with self._condition:
            self._writers -= 1
            self._condition.notify_all()

    @asynccontextmanager
    async def update(self) -> AsyncGenerator[None]:
        """The exclusion one weight update needs: the writer side, unless a pause or a session already
        keeps generation away from the weights."""
        holds_writer = self.paused is None and not self._session_open
        if holds_writer:
            await self.acquire_writer()
        try:
            yield
        finally:
            if holds_writer:
                await self.release_writer()

    async def open_session(self) -> bool:
        """Open a weight-update session; False if one was already open (nothing changes)."""
        if self._session_open:
            return False
        self._session_open = True
        self._session_writer = self.paused is None
        if self._session_writer:
            await self.acquire_writer()
        return True

    async def close_session(self) -> bool:
        """Close the open session; False if none was open."""
        if not self._session_open:
            return False
        self._session_open = False
        if self._session_writer:
            self._session_writer = False
            await self.release_writer()
        return True
