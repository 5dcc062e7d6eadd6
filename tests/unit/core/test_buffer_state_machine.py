"""The buffer's contract as one executable specification: a hypothesis state machine over the facade
`asyncrl_core.buffer.GroupBuffer` (and through it the Rust core), against a model kept the obvious way.

Random admit / complete (the finish version given or stamped, groups with and without model tokens) /
retried completions / abandon / take_batch (caps 0..3, stale drops that leave fewer than `num_groups`, the
drop guard) / end_step / snapshot-restore sequences. After every step: no limit exceeded, every admitted
group in exactly one place (in flight, buffered, handed out, dropped, abandoned) with its own payload,
every dropped prompt returned, and the step statistics equal to a direct recomputation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import hypothesis.strategies as st
import pytest
from buffer_testing import make_group
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from asyncrl_core.buffer import BufferSnapshot, GroupBuffer
from asyncrl_core.errors import (
    CorruptStateError,
    DropLimitExceededError,
    InvalidArgumentError,
    InvalidGroupError,
    VersionError,
)
from asyncrl_core.types import NO_VERSION, Group


@dataclass
class FinishedRecord:
    group: Group
    earliest_version: int
    latest_version: int


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

    def admit(self, prompt_index: int) -> int:
        group_id = self.next_group_id
        self.inflight[group_id] = prompt_index
        self.prompts[group_id] = prompt_index
        self.next_group_id += 1
        return group_id

    def accept(self, group: Group, versions: list[int], finish_version: int) -> int:
        """Record an accepted completion; returns the finish version the buffer must have stamped."""
        floor = self.last_actor_version or 0
        if versions:
            earliest, latest = min(versions), max(versions)
        else:
            earliest = latest = floor if finish_version == NO_VERSION else finish_version
        stamped = max(latest, floor) if finish_version == NO_VERSION else finish_version
        self.inflight.pop(group.group_id)
        self.finished[group.group_id] = FinishedRecord(group, earliest, latest)
        self.max_finish_version = max(self.max_finish_version or 0, stamped)
        return stamped


class BufferMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.buffer: GroupBuffer | None = None
        self.model: Model | None = None

    @initialize(
        max_inflight_groups=st.integers(1, 4),
        max_buffered_groups=st.integers(1, 7),
        max_dropped_groups_per_step=st.integers(0, 4),
        max_actor_accept_staleness=st.none() | st.integers(0, 3),
    )
    def build(
        self,
        max_inflight_groups: int,
        max_buffered_groups: int,
        max_dropped_groups_per_step: int,
        max_actor_accept_staleness: int | None,
    ) -> None:
        self.buffer = GroupBuffer(
            max_inflight_groups=max_inflight_groups,
            max_buffered_groups=max_buffered_groups,
            max_dropped_groups_per_step=max_dropped_groups_per_step,
            max_actor_accept_staleness=max_actor_accept_staleness,
        )
        self.model = Model(
            max_inflight_groups, max_buffered_groups, max_dropped_groups_per_step, max_actor_accept_staleness
        )

    @property
    def m(self) -> Model:
        assert self.model is not None
        return self.model

    @property
    def b(self) -> GroupBuffer:
        assert self.buffer is not None
        return self.buffer

    def observed(self) -> tuple[object, ...]:
        return (
            self.b.num_inflight,
            self.b.num_buffered,
            self.b.inflight_groups(),
            [(group.group_id, id(group), group.finish_version) for group in self.b.buffered_groups()],
        )

    def draw_versions(self, data: st.DataObject) -> tuple[list[int], int]:
        """Token versions (possibly none) within the last three versions, and a finish version that is
        either left to the buffer or the current version."""
        version = self.m.version
        versions = data.draw(st.lists(st.integers(max(0, version - 3), version), max_size=3))
        finish_version = data.draw(st.sampled_from([NO_VERSION, version]))
        return versions, finish_version

    @rule(prompt_index=st.integers(0, 10_000))
    def admit(self, prompt_index: int) -> None:
        expected = self.m.next_group_id if self.m.admissible() else None
        assert self.b.try_admit(prompt_index) == expected
        if expected is not None:
            self.m.admit(prompt_index)

    @rule(prompt_indices=st.lists(st.integers(0, 10_000), max_size=6))
    def admit_many(self, prompt_indices: list[int]) -> None:
        admitted = self.b.try_admit_many(prompt_indices)
        expected: list[int] = []
        for prompt_index in prompt_indices:
            if not self.m.admissible():
                break
            expected.append(self.m.admit(prompt_index))
        assert admitted == expected

    @precondition(lambda self: self.model is not None and self.model.inflight)
    @rule(data=st.data())
    def complete(self, data: st.DataObject) -> None:
        group_id = data.draw(st.sampled_from(sorted(self.m.inflight)))
        versions, finish_version = self.draw_versions(data)
        group = make_group(group_id, self.m.inflight[group_id], versions, finish_version)
        assert self.b.complete(group) is True
        assert group.finish_version == self.m.accept(group, versions, finish_version)

    @precondition(lambda self: self.model is not None and self.model.inflight)
    @rule(
        data=st.data(),
        duplicate=st.booleans(),
        invalid=st.sampled_from([None, "backwards", "unknown", "prompt"]),
    )
    def complete_many(self, data: st.DataObject, duplicate: bool, invalid: str | None) -> None:
        m = self.m
        group_ids = data.draw(st.lists(st.sampled_from(sorted(m.inflight)), min_size=1, unique=True))
        drawn = [self.draw_versions(data) for _ in group_ids]
        groups = [
            make_group(group_id, m.inflight[group_id], versions, finish)
            for group_id, (versions, finish) in zip(group_ids, drawn, strict=True)
        ]
        listed = [*groups, groups[0]] if duplicate else list(groups)
        if invalid is not None:
            first = groups[0]
            if invalid == "backwards":
                bad = make_group(first.group_id, first.prompt_index, [m.version + 1], m.version)
            elif invalid == "unknown":
                bad = make_group(m.next_group_id, 0, [m.version])
            else:
                bad = make_group(first.group_id, first.prompt_index + 1, [m.version])
            before = self.observed()
            with pytest.raises((InvalidGroupError, VersionError)):
                self.b.complete_many([*listed, bad])
            assert self.observed() == before
            return
        accepted = self.b.complete_many(listed)
        assert accepted == [True] * len(groups) + ([False] if duplicate else [])
        for group, (versions, finish) in zip(groups, drawn, strict=True):
            assert group.finish_version == m.accept(group, versions, finish)

    @precondition(
        lambda self: (
            self.model is not None
            and bool(
                set(self.model.finished) | self.model.handed_out | self.model.dropped | self.model.abandoned
            )
        )
    )
    @rule(data=st.data(), same_object=st.booleans())
    def retry_a_completion(self, data: st.DataObject, same_object: bool) -> None:
        m = self.m
        group_id = data.draw(
            st.sampled_from(sorted(set(m.finished) | m.handed_out | m.dropped | m.abandoned))
        )
        if same_object and group_id in m.finished:
            group = m.finished[group_id].group
        else:
            group = make_group(group_id, m.prompts[group_id], [m.version])
        before = self.observed()
        assert self.b.complete(group) is False
        assert self.b.complete_many([group]) == [False]
        assert self.observed() == before

    @rule(data=st.data(), kind=st.sampled_from(["backwards", "below_floor", "prompt", "unknown"]))
    def complete_invalid(self, data: st.DataObject, kind: str) -> None:
        m = self.m
        before = self.observed()
        version = m.version
        if kind != "unknown" and m.inflight:
            group_id = data.draw(st.sampled_from(sorted(m.inflight)))
            prompt_index = m.inflight[group_id]
            if kind == "backwards":
                group, error = make_group(group_id, prompt_index, [version + 1], version), VersionError
            elif kind == "below_floor" and m.last_actor_version:
                group, error = make_group(group_id, prompt_index, [], m.last_actor_version - 1), VersionError
            else:
                group, error = make_group(group_id, prompt_index + 1, [version]), InvalidGroupError
        else:
            group, error = make_group(m.next_group_id, 0, [version]), InvalidGroupError
        with pytest.raises(error) as raised:
            self.b.complete(group)
        assert raised.value.group_id == group.group_id
        assert self.observed() == before

    @precondition(lambda self: self.model is not None and self.model.inflight)
    @rule(data=st.data())
    def abandon(self, data: st.DataObject) -> None:
        group_id = data.draw(st.sampled_from(sorted(self.m.inflight)))
        assert self.b.abandon(group_id) == self.m.inflight.pop(group_id)
        self.m.abandoned.add(group_id)

    @rule(num_groups=st.integers(1, 8))
    def take_batch(self, num_groups: int) -> None:
        m = self.m
        actor_version = m.version
        before = self.observed()
        if num_groups > m.max_buffered_groups:
            with pytest.raises(InvalidArgumentError):
                self.b.take_batch(num_groups, actor_version)
            assert self.observed() == before
            return
        oldest = m.oldest_first()
        cap = m.max_actor_accept_staleness
        stale = [
            g for g in oldest if cap is not None and actor_version - m.finished[g].earliest_version > cap
        ]
        fresh = [g for g in oldest if g not in stale]
        if m.step_dropped + len(stale) > m.max_dropped_groups_per_step:
            with pytest.raises(DropLimitExceededError, match=r"rollout_buffer\.max_dropped_groups_per_step"):
                self.b.take_batch(num_groups, actor_version)
            assert self.observed() == before
            return
        batch = self.b.take_batch(num_groups, actor_version)
        # Stale groups go whether or not the batch is ready; their prompts come back.
        assert batch.dropped_prompt_indices == [m.finished[g].group.prompt_index for g in stale]
        for group_id in stale:
            m.returned_prompts.append(m.finished.pop(group_id).group.prompt_index)
            m.dropped.add(group_id)
        m.step_dropped += len(stale)
        m.last_actor_version = actor_version
        assert batch.num_ready == len(fresh)
        assert batch.ready == (len(fresh) >= num_groups)
        taken = fresh[:num_groups] if batch.ready else []
        assert [group.group_id for group in batch.groups] == taken
        for group_id, group in zip(taken, batch.groups, strict=True):
            record = m.finished.pop(group_id)
            assert group is record.group
            m.handed_out.add(group_id)
            m.step_groups.append(
                (
                    actor_version - record.earliest_version,
                    record.latest_version - record.earliest_version,
                    actor_version - record.latest_version,
                )
            )

    @rule()
    def take_batch_at_an_older_version(self) -> None:
        m = self.m
        newest = max(m.last_actor_version or 0, m.max_finish_version or 0)
        if newest == 0:
            return
        before = self.observed()
        with pytest.raises(VersionError):
            self.b.take_batch(1, newest - 1)
        assert self.observed() == before

    @rule()
    def bump_version(self) -> None:
        self.m.version += 1

    @rule()
    def end_step(self) -> None:
        stats = self.b.end_step()
        m = self.m
        staleness = [s for s, _, _ in m.step_groups]
        assert stats.num_groups == len(m.step_groups)
        assert stats.staleness_sum == sum(staleness)
        assert stats.staleness_max == max(staleness, default=0)
        assert stats.staleness_counts == {k: staleness.count(k) for k in set(staleness)}
        assert stats.version_span_sum == sum(span for _, span, _ in m.step_groups)
        assert stats.queue_steps_sum == sum(queue for _, _, queue in m.step_groups)
        assert stats.dropped_groups == m.step_dropped
        metrics = stats.metrics()
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
        self.buffer = GroupBuffer.restore(self.b.snapshot())
        assert self.observed() == before

    @rule(position=st.integers(0, 10_000), bit=st.integers(0, 7))
    def restore_corrupt_bytes(self, position: int, bit: int) -> None:
        snapshot = self.b.snapshot()
        data = bytearray(snapshot.core_state)
        data[position % len(data)] ^= 1 << bit
        with pytest.raises(CorruptStateError):
            GroupBuffer.restore(BufferSnapshot(bytes(data), snapshot.groups))

    @invariant()
    def limits_hold_and_every_group_is_in_exactly_one_place(self) -> None:
        if self.model is None:
            return
        m = self.m
        assert self.b.num_inflight <= m.max_inflight_groups
        assert self.b.num_inflight + self.b.num_buffered <= m.max_buffered_groups
        assert self.b.inflight_groups() == sorted(m.inflight.items())
        buffered = self.b.buffered_groups()
        assert [group.group_id for group in buffered] == m.oldest_first()
        assert all(group is m.finished[group.group_id].group for group in buffered)
        places = [set(m.inflight), set(m.finished), m.handed_out, m.dropped, m.abandoned]
        assert sum(len(place) for place in places) == m.next_group_id
        assert set().union(*places) == set(range(m.next_group_id))
        assert sorted(m.returned_prompts) == sorted(m.prompts[g] for g in m.dropped)


TestBufferContract = BufferMachine.TestCase
TestBufferContract.settings = settings(
    max_examples=80,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
