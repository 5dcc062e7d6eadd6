"""What the scheduler thread publishes for everyone else to read: `EngineSnapshot` (with a copy of the
engine's `EngineCounters`), and the waiting queue that keeps its totals as it changes (`WaitingQueue`).

The HTTP and gRPC handlers run on the event loop while the scheduler thread mutates its running batch and its
waiting queue; iterating either from the loop can fail (`deque mutated during iteration`) or read a half-done
step. The scheduler therefore builds immutable snapshots (after each loop iteration and each control call,
and before it tells any client of a token or a finish) and swaps each in with one attribute assignment
(atomic in CPython); readers take `engine.snapshot` once and use only it.
Building it costs O(running requests), never O(queue): the queue keeps its token and retraction totals.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar


class Queued(Protocol):
    """What the waiting queue reads of a request to keep its totals."""

    @property
    def num_tokens(self) -> int: ...

    num_retractions: int


R = TypeVar("R", bound=Queued)


class WaitingQueue(deque[R], Generic[R]):
    """A deque of waiting requests that keeps `num_tokens` (their prompt plus output tokens) and
    `num_retracted` (those with `num_retractions > 0`) as requests enter and leave. A request's tokens and
    retraction count do not change while it waits (it only grows while running), so the totals stay exact."""

    def __init__(self, items: Iterable[R] = ()) -> None:
        super().__init__()
        self.num_tokens = 0
        self.num_retracted = 0
        self.extend(items)

    def _enter(self, request: R) -> None:
        self.num_tokens += request.num_tokens
        self.num_retracted += request.num_retractions > 0

    def _leave(self, request: R) -> None:
        self.num_tokens -= request.num_tokens
        self.num_retracted -= request.num_retractions > 0

    def append(self, request: R, /) -> None:
        self._enter(request)
        super().append(request)

    def appendleft(self, request: R, /) -> None:
        self._enter(request)
        super().appendleft(request)

    def extend(self, requests: Iterable[R], /) -> None:
        for request in requests:
            self.append(request)

    def extendleft(self, requests: Iterable[R], /) -> None:
        for request in requests:
            self.appendleft(request)

    def pop(self) -> R:
        request = super().pop()
        self._leave(request)
        return request

    def popleft(self) -> R:
        request = super().popleft()
        self._leave(request)
        return request

    def remove(self, request: R, /) -> None:
        super().remove(request)
        self._leave(request)

    def clear(self) -> None:
        super().clear()
        self.num_tokens = 0
        self.num_retracted = 0


@dataclass(slots=True)
class EngineCounters:
    """Totals since start, read by `/metrics` (plain ints: written by the scheduler thread only)."""

    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_requests_total: int = 0
    num_aborted_requests_total: int = 0
    num_retracted_requests_total: int = 0
    num_retracted_output_tokens_total: int = 0
    prefill_tokens_total: int = 0
    """Tokens run through prefill, re-prefills after a retraction included (prefix-cache hits excluded)."""
    cached_tokens_total: int = 0
    """Tokens whose KV a prefill took from the prefix cache."""
    cache_hit_rate: float = 0.0
    """Share of the latest prefill batch's tokens whose KV came from the prefix cache (SGLang's
    `cache_hit_rate`: hit tokens over hit plus computed tokens of the last prefill; 0 before any)."""
    prefill_busy_us: int = 0
    """Microseconds spent in prefill steps."""
    gen_throughput: float = 0.0
    """Decode tokens per second over the last decode steps (zeroed on a retract pause)."""


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """The engine's state at one moment of the scheduler thread (the `/v1/loads`, `/metrics`, gRPC `GetLoads`
    and `/server_info` reading). Immutable: a reader holds one and sees one consistent moment."""

    num_running: int = 0
    num_waiting: int = 0
    num_waiting_tokens: int = 0
    """Prompt plus output tokens of the waiting requests (what their prefill will compute)."""
    num_retracted_waiting: int = 0
    """Waiting requests that were retracted at least once."""
    num_used_tokens: int = 0
    """Tokens of the running requests (their KV)."""
    counters: EngineCounters = field(default_factory=EngineCounters)
    """A copy of the engine's totals at this moment."""
    kv_cache_bytes: int = 0
    cuda_graph_batch_sizes: tuple[int, ...] = ()
    cuda_graph_bytes: int = 0
