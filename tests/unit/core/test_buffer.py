"""The buffer facade `asyncrl_core.buffer`: payloads, typed errors that change nothing, metric names,
snapshots, and many Python threads against small limits."""

from __future__ import annotations

import math
import pickle
import threading
import time

import pytest
from buffer_testing import make_group

from asyncrl_core.buffer import Batch, BufferSnapshot, GroupBuffer
from asyncrl_core.config import load_config
from asyncrl_core.errors import (
    AsyncRLError,
    ConfigError,
    CorruptStateError,
    DropLimitExceededError,
    GroupBufferError,
    InvalidArgumentError,
    InvalidGroupError,
    VersionError,
)
from asyncrl_core.metrics import ADMISSION_WAIT_BUFFER_FULL, ADMISSION_WAIT_INFLIGHT_LIMIT
from asyncrl_core.types import NO_VERSION, Group


def make_buffer(
    inflight: int = 2, buffered: int = 4, max_dropped: int = 8, cap: int | None = None
) -> GroupBuffer:
    return GroupBuffer(
        max_inflight_groups=inflight,
        max_buffered_groups=buffered,
        max_dropped_groups_per_step=max_dropped,
        max_actor_accept_staleness=cap,
    )


def observed(buffer: GroupBuffer) -> tuple[object, ...]:
    return (
        buffer.num_inflight,
        buffer.num_buffered,
        buffer.inflight_groups(),
        [(group.group_id, id(group)) for group in buffer.buffered_groups()],
    )


def admit_and_complete(buffer: GroupBuffer, prompt_index: int, versions: list[int], finish: int) -> Group:
    group_id = buffer.try_admit(prompt_index)
    assert group_id is not None
    group = make_group(group_id, prompt_index, versions, finish)
    buffer.complete(group)
    return group


def test_groups_leave_oldest_first_with_their_payloads() -> None:
    buffer = make_buffer(inflight=4, buffered=4)
    newer = admit_and_complete(buffer, 10, [2, 3], 3)
    older = admit_and_complete(buffer, 11, [1, 3], 3)
    same_age_later = admit_and_complete(buffer, 12, [1], 3)
    batch = buffer.take_batch(3, actor_version=4)
    assert batch == Batch(
        groups=[older, same_age_later, newer], dropped_prompt_indices=[], actor_version=4, num_ready=3
    )
    assert batch.ready
    assert batch.groups[0] is older
    assert buffer.num_buffered == 0


def test_stale_groups_are_dropped_and_their_prompts_returned() -> None:
    buffer = make_buffer(inflight=3, buffered=3, cap=1)
    admit_and_complete(buffer, 20, [0], 2)
    admit_and_complete(buffer, 21, [1, 2], 2)
    fresh = admit_and_complete(buffer, 22, [2], 2)
    assert buffer.try_admit(23) is None
    batch = buffer.take_batch(1, actor_version=3)
    assert batch.dropped_prompt_indices == [20, 21]
    assert batch.groups == [fresh]
    assert buffer.try_admit(23) is not None, "the drops freed capacity"
    stats = buffer.end_step()
    assert stats.dropped_groups == 2
    assert stats.metrics()["rollout/dropped_groups"] == 2.0


def test_step_metrics_have_exactly_the_documented_names() -> None:
    buffer = make_buffer(inflight=4, buffered=4)
    admit_and_complete(buffer, 0, [1, 2], 3)  # staleness 3, span 1, queue 2
    admit_and_complete(buffer, 1, [3], 3)  # staleness 1, span 0, queue 1
    admit_and_complete(buffer, 2, [2, 3], 3)  # staleness 2, span 1, queue 1
    admit_and_complete(buffer, 3, [3, 3], 4)  # staleness 1, span 0, queue 1
    buffer.take_batch(4, actor_version=4)
    metrics = buffer.end_step().metrics()
    assert metrics == {
        "rollout/dropped_groups": 0.0,
        "rollout/buffer/admission_wait_inflight_limit": 0.0,
        "rollout/buffer/admission_wait_buffer_full": 0.0,
        "rollout/data_staleness/mean": pytest.approx(7 / 4),
        "rollout/data_staleness/max": 3.0,
        "rollout/data_staleness/ratio_1": 0.5,
        "rollout/data_staleness/ratio_2": 0.25,
        "rollout/data_staleness/ratio_3": 0.25,
        "rollout/version_span/mean": 0.5,
        "rollout/queue_steps/mean": 1.25,
    }
    # The next step starts from zero and, without training data, reports no staleness.
    assert set(buffer.end_step().metrics()) == {
        "rollout/dropped_groups",
        "rollout/buffer/admission_wait_inflight_limit",
        "rollout/buffer/admission_wait_buffer_full",
    }


def test_wait_shares_divide_by_the_step_wall_time() -> None:
    buffer = make_buffer(inflight=1, buffered=1)
    first = buffer.try_admit(0)
    assert first is not None
    assert buffer.try_admit(1) is None  # the in-flight limit blocks from here on
    time.sleep(0.02)
    stats = buffer.end_step()
    assert 0 < stats.admission_wait_inflight_limit_ns <= stats.wall_ns
    assert stats.admission_wait_buffer_full_ns == 0
    metrics = stats.metrics()
    assert metrics[ADMISSION_WAIT_INFLIGHT_LIMIT] == stats.admission_wait_inflight_limit_ns / stats.wall_ns
    assert metrics[ADMISSION_WAIT_BUFFER_FULL] == 0.0


def test_a_blocked_admission_is_woken_and_its_wait_charged_to_the_blocking_limit() -> None:
    buffer = make_buffer(inflight=1, buffered=2)
    first = buffer.try_admit(0)
    assert first is not None
    assert buffer.wait_admit(1, timeout_s=0.01) is None
    result: list[int | None] = []
    waiter = threading.Thread(target=lambda: result.append(buffer.wait_admit(1, timeout_s=30.0)))
    waiter.start()
    time.sleep(0.05)
    buffer.complete(make_group(first, 0, [0], 0))
    waiter.join(timeout=30.0)
    assert result == [1]
    stats = buffer.end_step()
    assert stats.admission_wait_inflight_limit_ns > 0
    assert stats.admission_wait_buffer_full_ns == 0
    assert 0 < stats.metrics()["rollout/buffer/admission_wait_inflight_limit"] <= 1


@pytest.mark.parametrize(
    ("limits", "key"),
    [
        ({"inflight": 0}, "rollout_buffer.max_inflight_groups"),
        ({"buffered": -1}, "rollout_buffer.max_buffered_groups"),
        ({"max_dropped": -1}, "rollout_buffer.max_dropped_groups_per_step"),
        ({"cap": -2}, "agentloop.max_actor_accept_staleness"),
    ],
)
def test_invalid_limits_name_their_key(limits: dict[str, int], key: str) -> None:
    with pytest.raises(InvalidArgumentError, match=key):
        make_buffer(**limits)


def test_every_buffer_error_is_an_asyncrl_error() -> None:
    for error in (
        InvalidArgumentError,
        InvalidGroupError,
        VersionError,
        DropLimitExceededError,
        CorruptStateError,
    ):
        assert issubclass(error, GroupBufferError)
        assert issubclass(error, AsyncRLError)
    assert issubclass(InvalidArgumentError, ValueError)


def test_each_typed_error_leaves_the_buffer_unchanged() -> None:
    buffer = make_buffer(inflight=2, buffered=3, max_dropped=0, cap=1)
    buffered = admit_and_complete(buffer, 0, [1], 1)
    inflight_id = buffer.try_admit(1)
    assert inflight_id is not None
    before = observed(buffer)
    failing_calls = [
        (InvalidArgumentError, lambda: buffer.try_admit(-1)),
        (InvalidArgumentError, lambda: buffer.wait_admit(2, timeout_s=-1.0)),
        (InvalidArgumentError, lambda: buffer.wait_admit(2, timeout_s=math.nan)),
        (InvalidArgumentError, lambda: buffer.take_batch(0, 1)),
        (InvalidArgumentError, lambda: buffer.take_batch(4, 1)),
        (InvalidArgumentError, lambda: buffer.take_batch(1, 1, timeout_s=-1.0)),
        (InvalidGroupError, lambda: buffer.complete(make_group(99, 0, [1], 1))),
        (InvalidGroupError, lambda: buffer.complete(make_group(inflight_id, 2, [1]))),
        (InvalidGroupError, lambda: buffer.abandon(buffered.group_id)),
        (InvalidGroupError, lambda: buffer.abandon(99)),
        (VersionError, lambda: buffer.complete(make_group(inflight_id, 1, [2], 1))),
        (VersionError, lambda: buffer.take_batch(1, 0)),
        # At actor version 3 the buffered group is stale, and no drop is allowed per step.
        (DropLimitExceededError, lambda: buffer.take_batch(1, 3)),
    ]
    for error, call in failing_calls:
        with pytest.raises(error):
            call()
        assert observed(buffer) == before, error
    with pytest.raises(DropLimitExceededError, match=r"rollout_buffer\.max_dropped_groups_per_step"):
        buffer.take_batch(1, 3)
    assert buffer.buffered_groups()[0] is buffered


def test_every_error_carries_typed_fields_and_survives_pickling() -> None:
    buffer = make_buffer(inflight=2, buffered=3, max_dropped=0, cap=0)
    admit_and_complete(buffer, 0, [1], 1)
    inflight_id = buffer.try_admit(1)
    assert inflight_id is not None
    with pytest.raises(InvalidArgumentError) as invalid:
        buffer.take_batch(4, 1)
    assert invalid.value.argument == "num_groups"
    with pytest.raises(InvalidArgumentError) as invalid_limit:
        make_buffer(inflight=0)
    assert invalid_limit.value.argument == "rollout_buffer.max_inflight_groups"
    with pytest.raises(InvalidGroupError) as mismatch:
        buffer.complete(make_group(inflight_id, 5, [1]))
    assert mismatch.value.group_id == inflight_id
    assert "admitted for prompt 1" in str(mismatch.value)
    with pytest.raises(VersionError) as group_version:
        buffer.complete(make_group(inflight_id, 1, [2], 1))
    assert group_version.value.group_id == inflight_id
    with pytest.raises(VersionError) as actor_version:
        buffer.take_batch(1, 0)
    assert actor_version.value.group_id is None
    with pytest.raises(DropLimitExceededError) as guard:
        buffer.take_batch(1, 2)
    assert (
        guard.value.dropped_this_step,
        guard.value.would_drop,
        guard.value.max_dropped_groups_per_step,
    ) == (
        0,
        1,
        0,
    )
    for error in (invalid.value, mismatch.value, actor_version.value, guard.value):
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error)
        assert str(copy) == str(error)
        assert vars(copy) == vars(error)


def test_a_retried_completion_is_a_no_op_that_loses_nothing() -> None:
    buffer = make_buffer(inflight=2, buffered=4)
    group = admit_and_complete(buffer, 3, [1], 1)
    before = observed(buffer)
    # The same object again (an in-process retry), and an equal copy (a retried remote call).
    assert buffer.complete(group) is False
    assert buffer.complete(make_group(group.group_id, 3, [1], 1)) is False
    assert buffer.complete_many([group]) == [False]
    assert observed(buffer) == before
    assert buffer.buffered_groups() == [group]
    batch = buffer.take_batch(1, actor_version=1)
    assert batch.groups == [group]
    assert batch.groups[0] is group
    # Once handed out, a late retry is still a no-op.
    assert buffer.complete(make_group(group.group_id, 3, [1], 1)) is False
    assert (buffer.num_inflight, buffer.num_buffered, buffer.buffered_groups()) == (0, 0, [])


def test_a_late_completion_of_an_abandoned_group_is_ignored() -> None:
    buffer = make_buffer(inflight=1, buffered=2)
    group_id = buffer.try_admit(4)
    assert group_id is not None
    assert buffer.abandon(group_id) == 4
    assert buffer.complete(make_group(group_id, 4, [0])) is False
    assert (buffer.num_inflight, buffer.num_buffered) == (0, 0)


@pytest.mark.parametrize("cap", [0, 1, 2, 3])
def test_stale_groups_never_hold_capacity_whatever_the_cap(cap: int) -> None:
    """The async loop with groups that finish `cap + 1` versions behind the actor: every one is stale at
    the hand-off. Drops must free capacity so admission continues, and every prompt comes back."""
    buffer = make_buffer(inflight=2, buffered=3, max_dropped=1000, cap=cap)
    issued: list[int] = []
    returned: list[int] = []
    for actor_version in range(cap + 1, cap + 30):
        while (group_id := buffer.try_admit(len(issued))) is not None:
            issued.append(len(issued))
            assert buffer.complete(make_group(group_id, issued[-1], [actor_version - cap - 1]))
        batch = buffer.take_batch(2, actor_version)
        assert not batch.ready
        assert batch.num_ready == 0
        returned.extend(batch.dropped_prompt_indices)
        assert (buffer.num_inflight, buffer.num_buffered) == (0, 0)
    assert returned == issued
    assert len(issued) > 3, "admission kept going"


def test_stale_groups_are_dropped_even_when_fewer_than_requested_remain() -> None:
    buffer = make_buffer(inflight=3, buffered=3, cap=0)
    admit_and_complete(buffer, 0, [0], 1)
    fresh = admit_and_complete(buffer, 1, [1], 1)
    assert buffer.try_admit(2) is not None
    batch = buffer.take_batch(2, actor_version=1)
    assert batch == Batch(
        groups=[], dropped_prompt_indices=[0], dropped_group_ids=[0], actor_version=1, num_ready=1
    )
    assert not batch.ready
    assert buffer.buffered_groups() == [fresh]
    assert buffer.try_admit(3) is not None, "the drop freed capacity"
    assert buffer.end_step().dropped_groups == 1


def test_a_waiting_hand_off_is_woken_by_completions() -> None:
    buffer = make_buffer(inflight=2, buffered=4)
    ids = buffer.try_admit_many([10, 11])
    assert buffer.take_batch(2, 0, timeout_s=0.01).num_ready == 0
    result: list[Batch] = []
    trainer = threading.Thread(target=lambda: result.append(buffer.take_batch(2, 0, timeout_s=60.0)))
    trainer.start()
    groups = [make_group(group_id, 10 + index, [0]) for index, group_id in enumerate(ids)]
    for group in groups:
        time.sleep(0.02)
        assert buffer.complete(group)
    trainer.join(timeout=60.0)
    assert not trainer.is_alive()
    (batch,) = result
    assert batch.ready
    assert batch.groups == groups


def test_the_buffer_stamps_finish_version() -> None:
    buffer = make_buffer(inflight=4, buffered=4)
    first = admit_and_complete(buffer, 0, [1, 2], NO_VERSION)
    assert first.finish_version == 2, "the group's latest version, before any hand-off"
    buffer.take_batch(1, actor_version=5)
    second = admit_and_complete(buffer, 1, [3], NO_VERSION)
    assert second.finish_version == 5, "the actor version of the last hand-off"
    no_tokens = admit_and_complete(buffer, 2, [], NO_VERSION)
    assert (no_tokens.finish_version, no_tokens.version_range()) == (5, None)
    assert [group.finish_version for group in buffer.buffered_groups()] == [5, 5]
    group_id = buffer.try_admit(3)
    assert group_id is not None
    with pytest.raises(VersionError, match="leave finish_version unset"):
        buffer.complete(make_group(group_id, 3, [3], 4))


def test_from_config_reads_both_sections() -> None:
    config = load_config(
        None,
        [
            "rollout_buffer.max_inflight_groups=5",
            "rollout_buffer.max_buffered_groups=9",
            "rollout_buffer.max_dropped_groups_per_step=4",
            "agentloop.max_actor_accept_staleness=2",
        ],
    )
    buffer = GroupBuffer.from_config(config)
    assert (
        buffer.max_inflight_groups,
        buffer.max_buffered_groups,
        buffer.max_dropped_groups_per_step,
        buffer.max_actor_accept_staleness,
    ) == (5, 9, 4, 2)
    unresolved = config.model_copy(
        update={"rollout_buffer": config.rollout_buffer.model_copy(update={"max_inflight_groups": None})}
    )
    with pytest.raises(ConfigError, match=r"rollout_buffer\.max_inflight_groups"):
        GroupBuffer.from_config(unresolved)


def test_batch_admission_and_completion() -> None:
    buffer = make_buffer(inflight=3, buffered=4)
    group_ids = buffer.try_admit_many([7, 8, 9, 10])
    assert group_ids == [0, 1, 2], "the admitted prefix, up to the in-flight limit"
    groups = [make_group(group_id, 7 + group_id, [group_id], 2) for group_id in group_ids]
    before = observed(buffer)
    with pytest.raises(InvalidGroupError):
        buffer.complete_many([*groups[:2], make_group(99, 0, [0], 2)])
    with pytest.raises(VersionError):
        buffer.complete_many([groups[0], make_group(group_ids[2], 9, [3], 2)])
    assert observed(buffer) == before, "all or nothing"
    assert buffer.complete_many([groups[0], groups[0], groups[1]]) == [True, False, True]
    assert buffer.complete_many([groups[2], groups[0]]) == [True, False]
    assert buffer.take_batch(3, actor_version=2).groups == groups


def test_snapshot_restores_state_and_payloads() -> None:
    buffer = make_buffer(inflight=2, buffered=4, cap=2)
    first = admit_and_complete(buffer, 5, [0, 1], 1)
    second = admit_and_complete(buffer, 6, [1], 1)
    inflight_id = buffer.try_admit(7)
    snapshot = buffer.snapshot()
    restored = GroupBuffer.restore(snapshot)
    assert observed(restored)[:3] == observed(buffer)[:3]
    assert restored.buffered_groups() == [first, second]
    assert restored.inflight_groups() == [(inflight_id, 7)]
    batch = restored.take_batch(2, actor_version=1)
    assert batch.groups == [first, second]


def test_corrupt_snapshots_are_typed_errors() -> None:
    buffer = make_buffer()
    group = admit_and_complete(buffer, 5, [0], 0)
    snapshot = buffer.snapshot()
    damaged = bytearray(snapshot.core_state)
    damaged[len(damaged) // 2] ^= 0x01
    for bad in (
        BufferSnapshot(core_state=bytes(damaged), groups=snapshot.groups),
        BufferSnapshot(core_state=snapshot.core_state[:-3], groups=snapshot.groups),
        BufferSnapshot(core_state=b"", groups=snapshot.groups),
        BufferSnapshot(core_state=snapshot.core_state, groups={}),
        BufferSnapshot(core_state=snapshot.core_state, groups={group.group_id: make_group(7, 5, [0], 0)}),
    ):
        with pytest.raises(CorruptStateError):
            GroupBuffer.restore(bad)


def test_eight_threads_admit_and_complete_against_small_limits() -> None:
    max_inflight, max_buffered, per_thread = 3, 5, 150
    buffer = make_buffer(inflight=max_inflight, buffered=max_buffered)
    trained: list[Group] = []
    failures: list[BaseException] = []
    agents_done = threading.Event()

    def agent(thread_index: int) -> None:
        try:
            for iteration in range(per_thread):
                prompt_index = thread_index * 1000 + iteration
                group_id = buffer.wait_admit(prompt_index, timeout_s=30.0)
                assert group_id is not None, "no capacity within 30 s"
                counts = (buffer.num_inflight, buffer.num_buffered)
                assert counts[0] <= max_inflight
                assert counts[0] + counts[1] <= max_buffered
                buffer.complete(make_group(group_id, prompt_index, [0], 0))
        except BaseException as error:
            failures.append(error)

    def trainer() -> None:
        try:
            while not (agents_done.is_set() and buffer.num_buffered == 0):
                trained.extend(buffer.take_batch(1, actor_version=0, timeout_s=0.01).groups)
        except BaseException as error:
            failures.append(error)

    agents = [threading.Thread(target=agent, args=(index,)) for index in range(8)]
    trainer_thread = threading.Thread(target=trainer)
    for thread in [*agents, trainer_thread]:
        thread.start()
    for thread in agents:
        thread.join(timeout=120.0)
    agents_done.set()
    trainer_thread.join(timeout=120.0)
    assert not any(thread.is_alive() for thread in [*agents, trainer_thread])
    assert failures == []
    prompts = sorted(group.prompt_index for group in trained)
    assert prompts == sorted(t * 1000 + i for t in range(8) for i in range(per_thread))
    assert len({group.group_id for group in trained}) == len(trained)
    assert (buffer.num_inflight, buffer.num_buffered) == (0, 0)


def test_concurrent_retries_of_one_completion_accept_it_exactly_once() -> None:
    for _ in range(20):
        buffer = make_buffer(inflight=2, buffered=4)
        group_id = buffer.try_admit(6)
        assert group_id is not None
        original = make_group(group_id, 6, [0])
        attempts = [original, original, make_group(group_id, 6, [0]), make_group(group_id, 6, [0])] * 2
        barrier = threading.Barrier(len(attempts))
        results: list[bool] = []

        def attempt(
            group: Group,
            buffer: GroupBuffer = buffer,
            barrier: threading.Barrier = barrier,
            results: list[bool] = results,
        ) -> None:
            barrier.wait(timeout=30.0)
            results.append(buffer.complete(group))

        threads = [threading.Thread(target=attempt, args=(group,)) for group in attempts]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30.0)
        assert sorted(results) == [False] * (len(attempts) - 1) + [True]
        (buffered,) = buffer.buffered_groups()
        assert any(buffered is group for group in attempts)
        assert buffer.take_batch(1, 0).groups == [buffered]
