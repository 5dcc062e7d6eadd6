"""A plain, idiomatic Python implementation of the buffer contract, as the benchmark's baseline.

What a careful Python programmer would write for `asyncrl_core.buffer.GroupBuffer`'s hot path, without the
Rust core: a dict of groups in flight, a heap of finished groups, two counters, one lock for what
correctness needs (the counters and the heap change together). Same calls and results as the facade
(`try_admit`, `complete(group) -> bool`, `take_batch -> Batch`, `end_step`), the same staleness
accounting per group handed out, and the same drop rule; it leaves out what the benchmark does not time
(blocking waits, snapshots, argument checks). It is not part of the contract's tests: the hypothesis
model in `tests/unit/core/test_buffer_state_machine.py` is the contract.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import Counter

from asyncrl_core.buffer import Batch
from asyncrl_core.errors import DropLimitExceededError, InvalidGroupError
from asyncrl_core.types import NO_VERSION, Group


class PlainGroupBuffer:
    def __init__(
        self,
        *,
        max_inflight_groups: int,
        max_buffered_groups: int,
        max_dropped_groups_per_step: int,
        max_actor_accept_staleness: int | None = None,
    ) -> None:
        self.max_inflight_groups = max_inflight_groups
        self.max_buffered_groups = max_buffered_groups
        self.max_dropped_groups_per_step = max_dropped_groups_per_step
        self.max_actor_accept_staleness = max_actor_accept_staleness
        self._lock = threading.Lock()
        self._next_group_id = 0
        self._inflight: dict[int, int] = {}  # group id -> prompt index
        self._heap: list[tuple[int, int, Group]] = []  # (earliest version, group id, group)
        self.num_inflight = 0
        self.num_buffered = 0
        self._last_actor_version = 0
        self._staleness: Counter[int] = Counter()
        self._version_span_sum = 0
        self._queue_steps_sum = 0
        self._dropped_groups = 0
        self._blocked_since: float | None = None
        self._wait_s = 0.0

    def try_admit(self, prompt_index: int) -> int | None:
        with self._lock:
            if (
                self.num_inflight >= self.max_inflight_groups
                or self.num_inflight + self.num_buffered >= self.max_buffered_groups
            ):
                if self._blocked_since is None:
                    self._blocked_since = time.monotonic()
                return None
            if self._blocked_since is not None:
                self._wait_s += time.monotonic() - self._blocked_since
                self._blocked_since = None
            group_id = self._next_group_id
            self._next_group_id += 1
            self._inflight[group_id] = prompt_index
            self.num_inflight += 1
            return group_id

    def complete(self, group: Group) -> bool:
        with self._lock:
            prompt_index = self._inflight.pop(group.group_id, None)
            if prompt_index is None:
                if group.group_id >= self._next_group_id:
                    raise InvalidGroupError(
                        f"group {group.group_id} was never admitted", group_id=group.group_id
                    )
                return False
            if prompt_index != group.prompt_index:
                self._inflight[group.group_id] = prompt_index
                raise InvalidGroupError(
                    f"group {group.group_id} names another prompt", group_id=group.group_id
                )
            floor = self._last_actor_version
            if group.latest_version == NO_VERSION:
                group.earliest_version = group.latest_version = floor
            if group.finish_version == NO_VERSION:
                group.finish_version = max(group.latest_version, floor)
            heapq.heappush(self._heap, (group.earliest_version, group.group_id, group))
            self.num_inflight -= 1
            self.num_buffered += 1
            return True

    def take_batch(self, num_groups: int, actor_version: int) -> Batch:
        with self._lock:
            heap = self._heap
            stale: list[tuple[int, int, Group]] = []
            cap = self.max_actor_accept_staleness
            if cap is not None:
                while heap and actor_version - heap[0][0] > cap:
                    stale.append(heapq.heappop(heap))
                if self._dropped_groups + len(stale) > self.max_dropped_groups_per_step:
                    for entry in stale:
                        heapq.heappush(heap, entry)
                    raise DropLimitExceededError(
                        "too many stale groups",
                        dropped_this_step=self._dropped_groups,
                        would_drop=len(stale),
                        max_dropped_groups_per_step=self.max_dropped_groups_per_step,
                    )
            dropped = [entry[2].prompt_index for entry in stale]
            self._dropped_groups += len(dropped)
            self._last_actor_version = actor_version
            num_ready = len(heap)
            groups = [heapq.heappop(heap)[2] for _ in range(num_groups)] if num_ready >= num_groups else []
            for group in groups:
                self._staleness[actor_version - group.earliest_version] += 1
                self._version_span_sum += group.latest_version - group.earliest_version
                self._queue_steps_sum += actor_version - group.latest_version
            self.num_buffered -= len(groups) + len(dropped)
            return Batch(groups, dropped, actor_version, num_ready)

    def end_step(self) -> dict[str, int]:
        with self._lock:
            totals = {
                "num_groups": self._staleness.total(),
                "staleness_sum": sum(k * count for k, count in self._staleness.items()),
                "dropped_groups": self._dropped_groups,
            }
            self._staleness.clear()
            self._version_span_sum = self._queue_steps_sum = self._dropped_groups = 0
            return totals
