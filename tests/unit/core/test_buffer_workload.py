"""`_buffer_core.run_admission_workload`, the admission benchmark's rounds run by the Rust core: the
counts it returns add up with what the buffer holds afterwards, from one thread and from several."""

from __future__ import annotations

import pytest

from asyncrl_core import _buffer_core
from asyncrl_core.errors import InvalidArgumentError, VersionError

ROUND = _buffer_core.WORKLOAD_ROUND
BATCH_SIZE = _buffer_core.WORKLOAD_BATCH_SIZE
VERSION = _buffer_core.WORKLOAD_VERSION


def make_buffer(num_threads: int, num_finished: int = 0) -> _buffer_core.GroupBuffer:
    """A buffer with room for `num_threads` rounds at once and `num_finished` fresh finished groups."""
    capacity = num_threads * ROUND + num_finished
    buffer = _buffer_core.GroupBuffer(
        max_inflight_groups=capacity,
        max_buffered_groups=2 * capacity,
        max_dropped_groups_per_step=2**62,
        max_actor_accept_staleness=2,
    )
    for prompt_index in range(num_finished):
        group_id = buffer.try_admit(prompt_index)
        assert group_id is not None
        buffer.complete(group_id, prompt_index, (VERSION, VERSION), VERSION)
    return buffer


@pytest.mark.parametrize(("num_threads", "num_finished"), [(1, 0), (1, 100), (4, 0), (8, 1_000)])
def test_workload_counts_add_up(num_threads: int, num_finished: int) -> None:
    buffer = make_buffer(num_threads, num_finished)
    counts = _buffer_core.run_admission_workload(buffer, 25, num_threads)
    num_rounds = 25 * num_threads
    assert counts.num_rounds == num_rounds
    assert counts.admitted == counts.completed == num_rounds * ROUND
    # Every take hands out exactly BATCH_SIZE; every group is handed out, dropped or still buffered.
    assert counts.handed_out == num_rounds * BATCH_SIZE
    assert counts.handed_out + counts.dropped + buffer.num_buffered == counts.completed + num_finished
    assert buffer.num_inflight == 0
    # The buffered groups are all within the cap at VERSION: only stale groups were dropped.
    assert all(VERSION - earliest_version <= 2 for _, _, earliest_version, _, _ in buffer.buffered_groups())
    totals = buffer.end_step()
    assert totals.num_groups == counts.handed_out
    assert totals.dropped_groups == counts.dropped


def test_single_thread_drops_exactly_the_stale_quarter() -> None:
    buffer = make_buffer(1, 100)
    counts = _buffer_core.run_admission_workload(buffer, 10, 1)
    assert counts.dropped == 10 * (ROUND - BATCH_SIZE)
    assert buffer.num_buffered == 100


def test_no_room_is_refused_before_anything_changes() -> None:
    buffer = make_buffer(1)
    with pytest.raises(InvalidArgumentError, match="room"):
        _buffer_core.run_admission_workload(buffer, 1, 2)
    with pytest.raises(InvalidArgumentError, match="at least one thread"):
        _buffer_core.run_admission_workload(buffer, 1, 0)
    with pytest.raises(InvalidArgumentError, match="rounds_per_thread"):
        _buffer_core.run_admission_workload(buffer, -1, 1)
    assert (buffer.num_inflight, buffer.num_buffered) == (0, 0)
    assert buffer.end_step().num_groups == 0


def test_a_round_error_is_raised() -> None:
    """Completing at a finish version older than the last take's actor version is a version error."""
    buffer = make_buffer(1, 100)
    buffer.take_batch(1, VERSION + 1)
    with pytest.raises(VersionError):
        _buffer_core.run_admission_workload(buffer, 1, 1)
