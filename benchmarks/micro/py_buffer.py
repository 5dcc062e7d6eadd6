"""A straightforward pure-Python implementation of the buffer contract: the baseline the Rust core is
measured against (`admission.py`), held to the same tests as the core (`test_buffer_state_machine.py`).

Same API and errors as `asyncrl_core._buffer_core.GroupBuffer`. One `threading.Condition` guards
everything; it is what a careful Python implementation would write, not a strawman.
"""

from __future__ import annotations

import heapq
import json
import struct
import threading
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from asyncrl_core.errors import (
    CorruptStateError,
    DropLimitExceededError,
    InvalidArgumentError,
    InvalidGroupError,
    VersionError,
)

_MAGIC = b"PYBUFST1"
_MAX_COUNT = 2**32 - 1


class _Blocked(Enum):
    INFLIGHT_LIMIT = "inflight"
    BUFFER_FULL = "buffer_full"


@dataclass(slots=True)
class StepTotals:
    """The same totals as `asyncrl_core._buffer_core.StepTotals`."""

    num_groups: int = 0
    staleness_sum: int = 0
    staleness_max: int = 0
    staleness_counts: dict[int, int] = field(default_factory=dict[int, int])
    version_span_sum: int = 0
    queue_steps_sum: int = 0
    dropped_groups: int = 0
    admission_wait_inflight_limit_s: float = 0.0
    admission_wait_buffer_full_s: float = 0.0
    wall_s: float = 0.0


def _count_limit(key: str, value: int) -> int:
    if not 1 <= value <= _MAX_COUNT:
        raise InvalidArgumentError(f"{key} must be between 1 and {_MAX_COUNT}, got {value}", argument=key)
    return value


def _non_negative(name: str, value: int) -> int:
    if value < 0:
        raise InvalidArgumentError(f"{name} must be 0 or more, got {value}", argument=name)
    return value


class PyGroupBuffer:
    """The pure-Python buffer; see `asyncrl_core.buffer.GroupBuffer` for the contract."""

    def __init__(
        self,
        *,
        max_inflight_groups: int,
        max_buffered_groups: int,
        max_dropped_groups_per_step: int,
        max_actor_accept_staleness: int | None = None,
    ) -> None:
        self.max_inflight_groups = _count_limit("rollout_buffer.max_inflight_groups", max_inflight_groups)
        self.max_buffered_groups = _count_limit("rollout_buffer.max_buffered_groups", max_buffered_groups)
        if max_dropped_groups_per_step < 0:
            raise InvalidArgumentError(
                "rollout_buffer.max_dropped_groups_per_step must be 0 or more, got "
                f"{max_dropped_groups_per_step}",
                argument="rollout_buffer.max_dropped_groups_per_step",
            )
        if max_actor_accept_staleness is not None and max_actor_accept_staleness < 0:
            raise InvalidArgumentError(
                "agentloop.max_actor_accept_staleness must be 0 or more (or unset), got "
                f"{max_actor_accept_staleness}",
                argument="agentloop.max_actor_accept_staleness",
            )
        self.max_dropped_groups_per_step = max_dropped_groups_per_step
        self.max_actor_accept_staleness = max_actor_accept_staleness
        self._condition = threading.Condition(threading.Lock())
        self._next_group_id = 0
        self._inflight: dict[int, int] = {}
        # (earliest_version, group_id, prompt_index, latest_version, finish_version): a tuple heap
        # pops the oldest first.
        self._finished: list[tuple[int, int, int, int, int]] = []
        self._last_actor_version: int | None = None
        self._max_finish_version: int | None = None
        self._step = StepTotals()
        self._carried_wall_s = 0.0
        self._step_started = time.monotonic()
        self._blocked_since: tuple[_Blocked, float] | None = None

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    @property
    def num_buffered(self) -> int:
        return len(self._finished)

    def _blocked_by(self) -> _Blocked | None:
        inflight = len(self._inflight)
        if inflight >= self.max_inflight_groups:
            return _Blocked.INFLIGHT_LIMIT
        if inflight + len(self._finished) >= self.max_buffered_groups:
            return _Blocked.BUFFER_FULL
        return None

    def _switch(self, blocked: _Blocked | None, now: float) -> None:
        if self._blocked_since is not None:
            self._charge(self._step, *self._blocked_since, now)
        self._blocked_since = None if blocked is None else (blocked, now)

    @staticmethod
    def _charge(step: StepTotals, blocked: _Blocked, since: float, now: float) -> None:
        if blocked is _Blocked.INFLIGHT_LIMIT:
            step.admission_wait_inflight_limit_s += now - since
        else:
            step.admission_wait_buffer_full_s += now - since

    def _admit_locked(self, prompt_index: int) -> int | None:
        blocked = self._blocked_by()
        now = time.monotonic()
        if blocked is not None:
            if self._blocked_since is None or self._blocked_since[0] is not blocked:
                self._switch(blocked, now)
            return None
        group_id = self._next_group_id
        self._next_group_id += 1
        self._inflight[group_id] = prompt_index
        self._switch(None, now)
        return group_id

    def _released_locked(self) -> None:
        if self._blocked_since is not None:
            self._switch(self._blocked_by(), time.monotonic())
        self._condition.notify_all()

    def try_admit(self, prompt_index: int) -> int | None:
        _non_negative("prompt_index", prompt_index)
        with self._condition:
            return self._admit_locked(prompt_index)

    def try_admit_many(self, prompt_indices: Sequence[int]) -> list[int]:
        for prompt_index in prompt_indices:
            _non_negative("prompt_index", prompt_index)
        group_ids: list[int] = []
        with self._condition:
            for prompt_index in prompt_indices:
                group_id = self._admit_locked(prompt_index)
                if group_id is None:
                    break
                group_ids.append(group_id)
        return group_ids

    def wait_admit(self, prompt_index: int, timeout_s: float) -> int | None:
        _non_negative("prompt_index", prompt_index)
        if not timeout_s >= 0 or timeout_s == float("inf"):
            raise InvalidArgumentError(
                f"timeout_s must be a finite number of seconds, 0 or more, got {timeout_s}",
                argument="timeout_s",
            )
        deadline = time.monotonic() + timeout_s
        with self._condition:
            while True:
                group_id = self._admit_locked(prompt_index)
                if group_id is not None:
                    return group_id
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._condition.wait(remaining)

    def _missing(self, group_id: int) -> InvalidGroupError:
        if group_id >= self._next_group_id:
            return InvalidGroupError(
                f"group {group_id} was never admitted by this buffer "
                f"(ids so far are below {self._next_group_id})",
                group_id=group_id,
            )
        return InvalidGroupError(
            f"group {group_id} is not in flight: it already finished, was abandoned, or was dropped "
            "or handed out",
            group_id=group_id,
        )

    @staticmethod
    def _check_versions(
        group_id: int, earliest_version: int, latest_version: int, finish_version: int
    ) -> None:
        _non_negative("group_id", group_id)
        if earliest_version < 0:
            raise VersionError(
                f"group {group_id}: earliest_version {earliest_version} is negative", group_id=group_id
            )
        if latest_version < earliest_version:
            raise VersionError(
                f"group {group_id}: latest_version {latest_version} is older than "
                f"earliest_version {earliest_version}",
                group_id=group_id,
            )
        if finish_version < latest_version:
            raise VersionError(
                f"group {group_id}: finish_version {finish_version} is older than "
                f"latest_version {latest_version}",
                group_id=group_id,
            )

    def _check_completable_locked(self, group_id: int, finish_version: int) -> None:
        if group_id not in self._inflight:
            raise self._missing(group_id)
        if self._last_actor_version is not None and finish_version < self._last_actor_version:
            raise VersionError(
                f"group {group_id}: finish_version {finish_version} is older than actor version "
                f"{self._last_actor_version}, which a batch was already handed out at",
                group_id=group_id,
            )

    def _finish_locked(
        self, group_id: int, earliest_version: int, latest_version: int, finish_version: int
    ) -> None:
        prompt_index = self._inflight.pop(group_id)
        heapq.heappush(
            self._finished, (earliest_version, group_id, prompt_index, latest_version, finish_version)
        )
        if self._max_finish_version is None or finish_version > self._max_finish_version:
            self._max_finish_version = finish_version

    def complete(
        self, group_id: int, prompt_index: int, token_versions: tuple[int, int], finish_version: int
    ) -> int | None:
        earliest_version, latest_version = token_versions
        self._check_versions(group_id, earliest_version, latest_version, finish_version)
        with self._condition:
            if group_id not in self._inflight and group_id < self._next_group_id:
                return None
            self._check_completable_locked(group_id, finish_version)
            self._finish_locked(group_id, earliest_version, latest_version, finish_version)
            self._released_locked()
        return finish_version

    def complete_many(self, groups: Sequence[tuple[int, int, tuple[int, int], int]]) -> list[int | None]:
        for group_id, _, (earliest_version, latest_version), finish_version in groups:
            self._check_versions(group_id, earliest_version, latest_version, finish_version)
        with self._condition:
            for group_id, _, _, finish_version in groups:
                self._check_completable_locked(group_id, finish_version)
            for group_id, _, (earliest_version, latest_version), finish_version in groups:
                self._finish_locked(group_id, earliest_version, latest_version, finish_version)
            self._released_locked()
        return [finish_version for _, _, _, finish_version in groups]

    def abandon(self, group_id: int) -> int:
        _non_negative("group_id", group_id)
        with self._condition:
            prompt_index = self._inflight.pop(group_id, None)
            if prompt_index is None:
                raise self._missing(group_id)
            self._released_locked()
            return prompt_index

    def take_batch(self, num_groups: int, actor_version: int) -> tuple[list[int], list[tuple[int, int]], int]:
        if num_groups < 1:
            raise InvalidArgumentError(
                f"take_batch needs at least one group, got {num_groups}", argument="num_groups"
            )
        with self._condition:
            if actor_version < 0:
                raise VersionError(f"actor_version {actor_version} is negative", group_id=None)
            if self._last_actor_version is not None and actor_version < self._last_actor_version:
                raise VersionError(
                    f"actor_version {actor_version} is older than {self._last_actor_version}, "
                    "the version of the previous batch",
                    group_id=None,
                )
            if self._max_finish_version is not None and actor_version < self._max_finish_version:
                raise VersionError(
                    f"actor_version {actor_version} is older than {self._max_finish_version}, "
                    "a group's finish_version",
                    group_id=None,
                )
            dropped: list[tuple[int, int, int, int, int]] = []
            cap = self.max_actor_accept_staleness
            if cap is not None:
                while self._finished and actor_version - self._finished[0][0] > cap:
                    dropped.append(heapq.heappop(self._finished))
            dropped_this_step = self._step.dropped_groups
            if dropped_this_step + len(dropped) > self.max_dropped_groups_per_step:
                for entry in dropped:
                    heapq.heappush(self._finished, entry)
                raise DropLimitExceededError(
                    f"dropping {len(dropped)} stale groups would make {dropped_this_step + len(dropped)} "
                    "drops this step, more than rollout_buffer.max_dropped_groups_per_step="
                    f"{self.max_dropped_groups_per_step}",
                    dropped_this_step=dropped_this_step,
                    would_drop=len(dropped),
                    max_dropped_groups_per_step=self.max_dropped_groups_per_step,
                )
            num_ready = len(self._finished)
            ready = num_ready >= num_groups
            taken = [heapq.heappop(self._finished) for _ in range(num_groups if ready else 0)]
            step = self._step
            step.dropped_groups += len(dropped)
            for earliest_version, _, _, latest_version, _ in taken:
                staleness = actor_version - earliest_version
                step.num_groups += 1
                step.staleness_sum += staleness
                step.staleness_max = max(step.staleness_max, staleness)
                step.staleness_counts[staleness] = step.staleness_counts.get(staleness, 0) + 1
                step.version_span_sum += latest_version - earliest_version
                step.queue_steps_sum += actor_version - latest_version
            self._last_actor_version = actor_version
            self._released_locked()
            return [entry[1] for entry in taken], [(entry[1], entry[2]) for entry in dropped], num_ready

    def _totals_at(self, now: float) -> StepTotals:
        step = self._step
        totals = StepTotals(
            num_groups=step.num_groups,
            staleness_sum=step.staleness_sum,
            staleness_max=step.staleness_max,
            staleness_counts=dict(step.staleness_counts),
            version_span_sum=step.version_span_sum,
            queue_steps_sum=step.queue_steps_sum,
            dropped_groups=step.dropped_groups,
            admission_wait_inflight_limit_s=step.admission_wait_inflight_limit_s,
            admission_wait_buffer_full_s=step.admission_wait_buffer_full_s,
            wall_s=self._carried_wall_s + now - self._step_started,
        )
        if self._blocked_since is not None:
            self._charge(totals, *self._blocked_since, now)
        return totals

    def end_step(self) -> StepTotals:
        with self._condition:
            now = time.monotonic()
            totals = self._totals_at(now)
            self._step = StepTotals()
            self._carried_wall_s = 0.0
            self._step_started = now
            if self._blocked_since is not None:
                self._blocked_since = (self._blocked_since[0], now)
            return totals

    def inflight_groups(self) -> list[tuple[int, int]]:
        with self._condition:
            return sorted(self._inflight.items())

    def buffered_groups(self) -> list[tuple[int, int, int, int, int]]:
        with self._condition:
            return [
                (group_id, prompt_index, earliest, latest, finish)
                for earliest, group_id, prompt_index, latest, finish in sorted(self._finished)
            ]

    def state_bytes(self) -> bytes:
        """JSON of the whole state behind a magic and a CRC-32."""
        with self._condition:
            totals = self._totals_at(time.monotonic())
            state = {
                "limits": [
                    self.max_inflight_groups,
                    self.max_buffered_groups,
                    self.max_dropped_groups_per_step,
                    self.max_actor_accept_staleness,
                ],
                "next_group_id": self._next_group_id,
                "last_actor_version": self._last_actor_version,
                "max_finish_version": self._max_finish_version,
                "inflight": sorted(self._inflight.items()),
                "finished": sorted(self._finished),
                "step": {
                    "num_groups": totals.num_groups,
                    "staleness_sum": totals.staleness_sum,
                    "staleness_max": totals.staleness_max,
                    "staleness_counts": sorted(totals.staleness_counts.items()),
                    "version_span_sum": totals.version_span_sum,
                    "queue_steps_sum": totals.queue_steps_sum,
                    "dropped_groups": totals.dropped_groups,
                    "admission_wait_inflight_limit_s": totals.admission_wait_inflight_limit_s,
                    "admission_wait_buffer_full_s": totals.admission_wait_buffer_full_s,
                    "wall_s": totals.wall_s,
                },
            }
        payload = json.dumps(state, separators=(",", ":")).encode()
        body = _MAGIC + payload
        return body + struct.pack("<I", zlib.crc32(body))

    @staticmethod
    def from_state_bytes(data: bytes) -> PyGroupBuffer:
        if len(data) < len(_MAGIC) + 4 or not data.startswith(_MAGIC):
            raise CorruptStateError("corrupt buffer state: not a buffer snapshot")
        body, (checksum,) = data[:-4], struct.unpack("<I", data[-4:])
        if zlib.crc32(body) != checksum:
            raise CorruptStateError("corrupt buffer state: checksum mismatch")
        try:
            state = json.loads(body[len(_MAGIC) :])
            max_inflight, max_buffered, max_dropped, cap = state["limits"]
            buffer = PyGroupBuffer(
                max_inflight_groups=max_inflight,
                max_buffered_groups=max_buffered,
                max_dropped_groups_per_step=max_dropped,
                max_actor_accept_staleness=cap,
            )
            buffer._next_group_id = state["next_group_id"]
            buffer._last_actor_version = state["last_actor_version"]
            buffer._max_finish_version = state["max_finish_version"]
            buffer._inflight = {group_id: prompt_index for group_id, prompt_index in state["inflight"]}
            buffer._finished = [tuple(entry) for entry in state["finished"]]
            heapq.heapify(buffer._finished)
            step = state["step"]
            buffer._step = StepTotals(
                num_groups=step["num_groups"],
                staleness_sum=step["staleness_sum"],
                staleness_max=step["staleness_max"],
                staleness_counts=dict(step["staleness_counts"]),
                version_span_sum=step["version_span_sum"],
                queue_steps_sum=step["queue_steps_sum"],
                dropped_groups=step["dropped_groups"],
                admission_wait_inflight_limit_s=step["admission_wait_inflight_limit_s"],
                admission_wait_buffer_full_s=step["admission_wait_buffer_full_s"],
            )
            buffer._carried_wall_s = step["wall_s"]
        except (ValueError, KeyError, TypeError, InvalidArgumentError) as error:
            raise CorruptStateError(f"corrupt buffer state: {error}") from error
        if (
            len(buffer._inflight) > max_inflight
            or len(buffer._inflight) + len(buffer._finished) > max_buffered
        ):
            raise CorruptStateError("corrupt buffer state: more groups than the limits allow")
        return buffer
