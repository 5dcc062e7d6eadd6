"""A hypothesis state machine over the buffer contract, run against the Rust core and against the
pure-Python baseline of the benchmarks (`benchmarks/micro/py_buffer.py`).

Random admit / complete / abandon / take_batch (with stale drops) / end_step / snapshot-restore
sequences; after every step: no limit exceeded, every admitted group in exactly one place (in flight,
buffered, handed out, dropped, abandoned), every dropped prompt returned, and the step statistics equal
to a direct recomputation from the groups handed out.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from asyncrl_core import _buffer_core
from asyncrl_core.buffer import StepStats
from asyncrl_core.errors import (
    BatchTooLargeError,
    CorruptStateError,
    DropLimitExceededError,
    InvalidArgumentError,
    InvalidGroupError,
    VersionError,
)


def _load_baseline() -> ModuleType:
    if "py_buffer" in sys.modules:
        return sys.modules["py_buffer"]
    path = Path(__file__).resolve().parents[3] / "benchmarks" / "micro" / "py_buffer.py"
    spec = importlib.util.spec_from_file_location("py_buffer", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["py_buffer"] = module
    spec.loader.exec_module(module)
    return module


py_buffer = _load_baseline()


@dataclass
class FinishedRecord:
    prompt_index: int
    earliest_version: int
    latest_version: int
    finish_version: int


@dataclass
class Model:
    """What the buffer must hold, kept the obvious way."""

    max_inflight_groups: int
    max_buffered_groups: int
    max_dropped_groups_per_step: int
    max_actor_accept_staleness: int | None
    next_group_id: int = 0
    version: int = 0
    last_actor_version: int | None = None
    max_finish_version: int | None = None
    inflight: dict[int, int] = field(default_factory=dict[int, int])
    finished: dict[int, FinishedRecord] = field(default_factory=dict[int, FinishedRecord])
    handed_out: set[int] = field(default_factory=set[int])
    dropped: set[int] = field(default_factory=set[int])
    abandoned: set[int] = field(default_factory=set[int])
    prompts: dict[int, int] = field(default_factory=dict[int, int])
    returned_prompts: list[int] = field(default_factory=list[int])
    # (staleness, version_span, queue_steps) of each group handed out this step.
    step_groups: list[tuple[int, int, int]] = field(default_factory=list[tuple[int, int, int]])
    step_dropped: int = 0

    def admissible(self) -> bool:
        inflight = len(self.inflight)
        return (
            inflight < self.max_inflight_groups and inflight + len(self.finished) < self.max_buffered_groups
        )

    def oldest_first(self) -> list[int]:
        return sorted(
            self.finished, key=lambda group_id: (self.finished[group_id].earliest_version, group_id)
        )


class BufferMachine(RuleBasedStateMachine):
    core_class: ClassVar[Any]

    def __init__(self) -> None:
        super().__init__()
        self.core: Any = None
        self.model: Model | None = None

    @initialize(
        max_inflight_groups=st.integers(1, 4),
        max_buffered_groups=st.integers(1, 7),
        max_dropped_groups_per_step=st.integers(0, 4),
        max_actor_accept_staleness=st.none() | st.integers(0, 2),
    )
    def build(
        self,
        max_inflight_groups: int,
        max_buffered_groups: int,
        max_dropped_groups_per_step: int,
        max_actor_accept_staleness: int | None,
    ) -> None:
        self.core = self.core_class(
            max_inflight_groups=max_inflight_groups,
            max_buffered_groups=max_buffered_groups,
            max_dropped_groups_per_step=max_dropped_groups_per_step,
            max_actor_accept_staleness=max_actor_accept_staleness,
        )
        self.model = Model(
            max_inflight_groups,
            max_buffered_groups,
            max_dropped_groups_per_step,
            max_actor_accept_staleness,
        )

    @property
    def m(self) -> Model:
        assert self.model is not None
        return self.model

    def observed(self) -> tuple[object, ...]:
        return (
            self.core.num_inflight,
            self.core.num_buffered,
            self.core.inflight_groups(),
            self.core.buffered_groups(),
        )

    @rule(prompt_index=st.integers(0, 10_000))
    def admit(self, prompt_index: int) -> None:
        expected = self.m.next_group_id if self.m.admissible() else None
        assert self.core.try_admit(prompt_index) == expected
        if expected is not None:
            self.m.inflight[expected] = prompt_index
            self.m.prompts[expected] = prompt_index
            self.m.next_group_id += 1

    @rule(prompt_indices=st.lists(st.integers(0, 10_000), max_size=6))
    def admit_many(self, prompt_indices: list[int]) -> None:
        admitted = self.core.try_admit_many(prompt_indices)
        expected: list[int] = []
        for prompt_index in prompt_indices:
            if not self.m.admissible():
                break
            group_id = self.m.next_group_id
            self.m.inflight[group_id] = prompt_index
            self.m.prompts[group_id] = prompt_index
            self.m.next_group_id += 1
            expected.append(group_id)
        assert admitted == expected

    @precondition(lambda self: self.model is not None and self.model.inflight)
    @rule(data=st.data(), invalid=st.sampled_from([None, "duplicate", "backwards", "finished"]))
    def complete_many(self, data: st.DataObject, invalid: str | None) -> None:
        m = self.m
        group_ids = data.draw(st.lists(st.sampled_from(sorted(m.inflight)), min_size=1, unique=True))
        version = m.version
        groups = []
        for group_id in group_ids:
            earliest = data.draw(st.integers(max(0, version - 3), version))
            groups.append((group_id, earliest, data.draw(st.integers(earliest, version)), version))
        if invalid is not None:
            if invalid == "duplicate":
                groups.append(groups[0])
            elif invalid == "backwards":
                groups.append((groups[0][0], version, version, version - 1))
            else:
                groups.append((m.next_group_id, version, version, version))
            before = self.observed()
            with pytest.raises((InvalidGroupError, VersionError)):
                self.core.complete_many(groups)
            assert self.observed() == before
            return
        self.core.complete_many(groups)
        for group_id, earliest, latest, finish in groups:
            m.finished[group_id] = FinishedRecord(m.inflight.pop(group_id), earliest, latest, finish)
            m.max_finish_version = max(m.max_finish_version or 0, finish)

    @precondition(lambda self: self.model is not None and self.model.inflight)
    @rule(data=st.data())
    def complete(self, data: st.DataObject) -> None:
        group_id = data.draw(st.sampled_from(sorted(self.m.inflight)))
        version = self.m.version
        earliest = data.draw(st.integers(max(0, version - 3), version))
        latest = data.draw(st.integers(earliest, version))
        self.core.complete(group_id, earliest, latest, version)
        self.m.finished[group_id] = FinishedRecord(self.m.inflight.pop(group_id), earliest, latest, version)
        self.m.max_finish_version = max(self.m.max_finish_version or 0, version)

    @rule(data=st.data(), kind=st.sampled_from(["backwards", "negative", "twice", "unknown"]))
    def complete_invalid(self, data: st.DataObject, kind: str) -> None:
        before = self.observed()
        version = self.m.version
        if kind in ("backwards", "negative") and self.m.inflight:
            group_id = data.draw(st.sampled_from(sorted(self.m.inflight)))
            versions = (version + 1, version, version + 1) if kind == "backwards" else (-1, 0, version)
            with pytest.raises(VersionError):
                self.core.complete(group_id, *versions)
        elif kind == "twice" and (self.m.finished or self.m.handed_out):
            group_id = data.draw(st.sampled_from(sorted(set(self.m.finished) | self.m.handed_out)))
            with pytest.raises(InvalidGroupError):
                self.core.complete(group_id, version, version, version)
        else:
            with pytest.raises(InvalidGroupError):
                self.core.complete(self.m.next_group_id, version, version, version)
        assert self.observed() == before

    @precondition(lambda self: self.model is not None and self.model.inflight)
    @rule(data=st.data())
    def abandon(self, data: st.DataObject) -> None:
        group_id = data.draw(st.sampled_from(sorted(self.m.inflight)))
        assert self.core.abandon(group_id) == self.m.inflight.pop(group_id)
        self.m.abandoned.add(group_id)

    @rule(num_groups=st.integers(1, 4))
    def take_batch(self, num_groups: int) -> None:
        m = self.m
        actor_version = m.version
        oldest = m.oldest_first()
        cap = m.max_actor_accept_staleness
        stale = [
            g for g in oldest if cap is not None and actor_version - m.finished[g].earliest_version > cap
        ]
        fresh = [g for g in oldest if g not in stale]
        before = self.observed()
        if m.step_dropped + len(stale) > m.max_dropped_groups_per_step:
            with pytest.raises(DropLimitExceededError, match=r"rollout_buffer\.max_dropped_groups_per_step"):
                self.core.take_batch(num_groups, actor_version)
            assert self.observed() == before
            return
        if len(fresh) < num_groups:
            with pytest.raises(BatchTooLargeError):
                self.core.take_batch(num_groups, actor_version)
            assert self.observed() == before
            return
        taken, dropped = self.core.take_batch(num_groups, actor_version)
        assert taken == fresh[:num_groups]
        assert dropped == [(g, m.finished[g].prompt_index) for g in stale]
        for group_id in stale:
            m.returned_prompts.append(m.finished.pop(group_id).prompt_index)
            m.dropped.add(group_id)
        for group_id in taken:
            record = m.finished.pop(group_id)
            m.handed_out.add(group_id)
            m.step_groups.append(
                (
                    actor_version - record.earliest_version,
                    record.latest_version - record.earliest_version,
                    actor_version - record.latest_version,
                )
            )
        m.step_dropped += len(stale)
        m.last_actor_version = actor_version

    @rule()
    def take_batch_at_an_older_version(self) -> None:
        m = self.m
        newest = max(m.last_actor_version or 0, m.max_finish_version or 0)
        if newest == 0:
            return
        before = self.observed()
        with pytest.raises(VersionError):
            self.core.take_batch(1, newest - 1)
        assert self.observed() == before

    @rule()
    def bump_version(self) -> None:
        self.m.version += 1

    @rule()
    def end_step(self) -> None:
        totals = self.core.end_step()
        m = self.m
        staleness = [s for s, _, _ in m.step_groups]
        assert totals.num_groups == len(m.step_groups)
        assert totals.staleness_sum == sum(staleness)
        assert totals.staleness_max == max(staleness, default=0)
        assert dict(totals.staleness_counts) == {k: staleness.count(k) for k in set(staleness)}
        assert totals.version_span_sum == sum(span for _, span, _ in m.step_groups)
        assert totals.queue_steps_sum == sum(queue for _, _, queue in m.step_groups)
        assert totals.dropped_groups == m.step_dropped
        metrics = StepStats.from_totals(totals).metrics()
        assert metrics["rollout/dropped_groups"] == m.step_dropped
        if m.step_groups:
            count = len(m.step_groups)
            assert metrics["rollout/data_staleness/mean"] == pytest.approx(sum(staleness) / count)
            assert metrics["rollout/data_staleness/max"] == max(staleness)
            for k in set(staleness):
                assert metrics[f"rollout/data_staleness/ratio_{k}"] == pytest.approx(
                    staleness.count(k) / count
                )
            assert metrics["rollout/version_span/mean"] == pytest.approx(
                sum(span for _, span, _ in m.step_groups) / count
            )
            assert metrics["rollout/queue_steps/mean"] == pytest.approx(
                sum(queue for _, _, queue in m.step_groups) / count
            )
        else:
            assert "rollout/data_staleness/mean" not in metrics
        m.step_groups = []
        m.step_dropped = 0

    @rule()
    def snapshot_and_restore(self) -> None:
        before = self.observed()
        data = self.core.state_bytes()
        self.core = type(self.core).from_state_bytes(data)
        assert self.observed() == before

    @rule(position=st.integers(0, 10_000), bit=st.integers(0, 7))
    def restore_corrupt_bytes(self, position: int, bit: int) -> None:
        data = bytearray(self.core.state_bytes())
        data[position % len(data)] ^= 1 << bit
        with pytest.raises(CorruptStateError):
            type(self.core).from_state_bytes(bytes(data))

    @invariant()
    def limits_hold_and_every_group_is_in_exactly_one_place(self) -> None:
        if self.model is None:
            return
        m = self.m
        assert self.core.num_inflight <= m.max_inflight_groups
        assert self.core.num_inflight + self.core.num_buffered <= m.max_buffered_groups
        assert self.core.inflight_groups() == sorted(m.inflight.items())
        assert [row[0] for row in self.core.buffered_groups()] == m.oldest_first()
        places = [set(m.inflight), set(m.finished), m.handed_out, m.dropped, m.abandoned]
        assert sum(len(place) for place in places) == m.next_group_id
        assert set().union(*places) == set(range(m.next_group_id))
        assert sorted(m.returned_prompts) == sorted(m.prompts[g] for g in m.dropped)


class RustCoreMachine(BufferMachine):
    core_class = _buffer_core.GroupBuffer


class PythonBaselineMachine(BufferMachine):
    core_class = py_buffer.PyGroupBuffer


_settings = settings(
    max_examples=60,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRustCore = RustCoreMachine.TestCase
TestRustCore.settings = _settings
TestPythonBaseline = PythonBaselineMachine.TestCase
TestPythonBaseline.settings = _settings


@pytest.mark.parametrize("core_class", [_buffer_core.GroupBuffer, py_buffer.PyGroupBuffer])
def test_invalid_limits_are_rejected_by_name(core_class: Any) -> None:
    valid = {
        "max_inflight_groups": 2,
        "max_buffered_groups": 4,
        "max_dropped_groups_per_step": 0,
        "max_actor_accept_staleness": None,
    }
    for key, value in [
        ("max_inflight_groups", 0),
        ("max_inflight_groups", -3),
        ("max_buffered_groups", 0),
        ("max_buffered_groups", 2**32),
        ("max_dropped_groups_per_step", -1),
        ("max_actor_accept_staleness", -1),
    ]:
        with pytest.raises(InvalidArgumentError, match=key):
            core_class(**{**valid, key: value})
