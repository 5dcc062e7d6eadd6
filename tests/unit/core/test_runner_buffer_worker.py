"""The runner's buffer worker in one process: prompts issued under the limits, retried completions,
abandoned and dropped prompts handed back to the dataloader, permanent failures dropped with their reason,
counts that add up, the ledger, and the state a checkpoint takes and a resume restores."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from asyncrl_core import metrics
from asyncrl_core.config import AsyncRLConfig, load_config
from asyncrl_core.errors import InvalidGroupError
from asyncrl_core.runner.ledger import audit
from asyncrl_core.runner.workers import BufferWorker, LocalBufferPort, RunnerError
from asyncrl_core.types import NO_VERSION, Group, Trajectory


def _config(tmp_path: Path, **overrides: object) -> AsyncRLConfig:
    pairs = {
        "runner.run_dir": str(tmp_path / "run"),
        "data.rollout_batch_size": 2,
        "data.shuffle": False,
        "rollout_buffer.max_inflight_groups": 3,
        "rollout_buffer.max_buffered_groups": 4,
        **overrides,
    }
    return load_config(None, [f"{key}={value}" for key, value in pairs.items()])


def _group(group_id: int, prompt_index: int, version: int) -> Group:
    trajectory = Trajectory(
        token_ids=[1, 2, 3],
        prompt_len=2,
        loss_mask=[1],
        rollout_logprobs=[-0.1],
        versions=[version],
    )
    return Group(group_id, prompt_index, [trajectory], finish_version=NO_VERSION)


def _balanced(counts: dict[str, int]) -> bool:
    parts = ("trained", "dropped", "handed_back", "inflight", "buffered")
    return counts["issued"] == sum(counts[part] for part in parts)


def test_admission_follows_the_limits_and_the_dataset_order(tmp_path: Path) -> None:
    worker = BufferWorker(_config(tmp_path), dataset_size=5)
    admitted = worker.admit(10, timeout_s=0.0)
    assert admitted == [(0, 0), (1, 1), (2, 2)]  # the in-flight limit is 3
    assert worker.admit(1, timeout_s=0.01) == []
    assert worker.complete(_group(0, 0, 0))
    assert not worker.complete(_group(0, 0, 0))  # a retried completion changes nothing
    assert worker.admit(10, timeout_s=0.0) == [(3, 3)]  # in flight 3, buffered 1: the buffer limit
    assert _balanced(worker.counts())


def test_abandoned_and_dropped_prompts_come_back_in_a_later_epoch(tmp_path: Path) -> None:
    config = _config(tmp_path, **{"agentloop.max_actor_accept_staleness": 0})
    worker = BufferWorker(config, dataset_size=3)
    (first, prompt_a), (second, prompt_b), (third, prompt_c) = worker.admit(3, timeout_s=0.0)
    worker.abandon(first)
    worker.complete(_group(second, prompt_b, 0))
    worker.complete(_group(third, prompt_c, 0))
    assert worker.take_batch(2, actor_version=0, timeout_s=0.0) is not None
    assert worker.end_step()[metrics.DROPPED_GROUPS] == 0.0
    (fourth, prompt_d), (fifth, prompt_e) = worker.admit(2, timeout_s=0.0)
    worker.complete(_group(fourth, prompt_d, 0))
    worker.complete(_group(fifth, prompt_e, 1))
    # At version 1 the group sampled at version 0 is stale: dropped, its prompt returned.
    assert worker.take_batch(2, actor_version=1, timeout_s=0.0) is None
    assert worker.end_step()[metrics.DROPPED_GROUPS] == 1.0
    counts = worker.counts()
    assert (counts["handed_back"], counts["dropped"], counts["trained"], counts["buffered"]) == (1, 1, 2, 1)
    assert counts["dropped_stale"] == 1
    assert _balanced(counts)
    assert [prompt_a, prompt_b, prompt_c, prompt_d, prompt_e] == [0, 1, 2, 0, 1]
    # The rest of epoch 1, then the prompt abandoned in epoch 0, then epoch 2 opens; the prompt dropped in
    # epoch 1 waits until epoch 2's own prompts are issued.
    issued = [prompt for _, prompt in worker.admit(3, timeout_s=0.0)]
    assert issued == [2, 0, 0]
    assert _balanced(worker.counts())


def test_the_local_port_serves_async_callers(tmp_path: Path) -> None:
    worker = BufferWorker(_config(tmp_path), dataset_size=4)
    port = LocalBufferPort(worker)

    async def scenario() -> list[bool]:
        admitted = await port.admit(2, 0.0)
        return [await port.complete(_group(group_id, prompt, 0)) for group_id, prompt in admitted]

    assert asyncio.run(scenario()) == [True, True]
    batch = worker.take_batch(2, actor_version=0, timeout_s=1.0)
    assert batch is not None
    assert [group.prompt_index for group in batch.groups] == [0, 1]


def test_a_permanent_failure_drops_the_prompt_with_its_reason(tmp_path: Path) -> None:
    worker = BufferWorker(_config(tmp_path), dataset_size=3)
    port = LocalBufferPort(worker)
    (first, prompt_a), (second, _), (third, prompt_c) = worker.admit(3, timeout_s=0.0)

    async def fail() -> None:
        await port.abandon(first, "prompt too long")  # permanent: dropped, never issued again
        await port.abandon(third)  # retryable: handed back

    asyncio.run(fail())
    step = worker.end_step()
    assert (step[metrics.FAILED_GROUPS_DROPPED], step[metrics.FAILED_GROUPS_RETRIED]) == (1.0, 1.0)
    assert worker.failure_reasons == {prompt_a: "prompt too long"}
    with pytest.raises(InvalidGroupError):  # no longer in flight: nothing changes
        worker.abandon(first, "prompt too long")
    with pytest.raises(ValueError, match="non-empty reason"):
        worker.abandon(second, " ")
    assert worker.complete(_group(second, 1, 0))
    counts = worker.counts()
    assert (counts["dropped"], counts["handed_back"], counts["buffered"]) == (1, 1, 1)
    assert _balanced(counts)
    ledger = worker.ledger_json()
    assert ledger["prompts"][str(prompt_a)]["dropped"] == {"prompt too long": 1}
    assert ledger["prompts"][str(prompt_c)]["handed_back"] == 1
    # Epoch 1 without the prompt dropped for good (its ticket is dropped for the same reason), then the
    # handed-back prompt of epoch 0.
    issued = [prompt for _, prompt in worker.admit(3, timeout_s=0.0)]
    assert (prompt_a, prompt_c) == (0, 2)
    assert issued == [1, 2, 2]
    assert [prompt_a, 1, [], "prompt too long"] in worker.ledger_json()["tickets"]
    assert worker.end_step()[metrics.FAILED_GROUPS_DROPPED] == 0.0  # counted per step


def test_the_ledger_audits_every_ticket_of_each_issued_epoch(tmp_path: Path) -> None:
    worker = BufferWorker(_config(tmp_path, **{"rollout_buffer.max_inflight_groups": 4}), dataset_size=2)
    for _ in range(3):  # three epochs of two prompts, each trained once
        admitted = worker.admit(2, timeout_s=0.0)
        for group_id, prompt in admitted:
            assert worker.complete(_group(group_id, prompt, 0))
        assert worker.take_batch(2, actor_version=0, timeout_s=0.0) is not None
    reports = audit(worker.ledger_json())
    assert [(r.epoch, r.complete, r.trained, r.problems) for r in reports] == [
        (0, True, 2, []),
        (1, True, 2, []),
        (2, True, 2, []),
    ]
    # A group in flight when its ledger is written is open, not lost; one the buffer no longer holds is lost.
    (group_id, _), *_ = worker.admit(1, timeout_s=0.0)
    assert audit(worker.ledger_json())[3].open == 1
    worker.buffer.abandon(group_id)  # behind the ledger's back: the prompt is lost
    (report,) = [r for r in audit(worker.ledger_json()) if r.epoch == 3]
    assert report.problems == ["prompt 0 was issued and then lost (neither trained, dropped nor held)"]


def test_restored_state_reissues_the_inflight_prompts_first_and_keeps_the_buffered(tmp_path: Path) -> None:
    worker = BufferWorker(_config(tmp_path), dataset_size=5)
    (first, prompt_a), (second, prompt_b), (_third, prompt_c) = worker.admit(3, timeout_s=0.0)
    worker.complete(_group(second, prompt_b, 0))
    state = worker.state()
    worker.admit(1, timeout_s=0.0)  # after the checkpoint: forgotten by the restart

    resumed = BufferWorker(_config(tmp_path), dataset_size=5)
    assert resumed.restore(state) == [prompt_a, prompt_c]
    counts = resumed.counts()
    assert (counts["issued"], counts["handed_back"], counts["buffered"], counts["inflight"]) == (3, 2, 1, 0)
    # The prompts in flight come first, then the dataset's order where the checkpoint left it.
    assert [prompt for _, prompt in resumed.admit(3, timeout_s=0.0)] == [prompt_a, prompt_c, 3]
    for group_id, prompt in resumed.buffer.inflight_groups():
        resumed.complete(_group(group_id, prompt, 0))
    batch = resumed.take_batch(4, actor_version=0, timeout_s=0.0)
    assert batch is not None
    assert sorted(group.prompt_index for group in batch.groups) == [0, 1, 2, 3]
    assert batch.groups[0].group_id == first + 1 == second  # the buffered group, kept with its id
    assert all(not r.problems for r in audit(resumed.ledger_json()))


def test_every_prompt_failing_for_good_is_an_error_not_a_loop(tmp_path: Path) -> None:
    worker = BufferWorker(_config(tmp_path), dataset_size=2)
    for group_id, _ in worker.admit(2, timeout_s=0.0):
        worker.abandon(group_id, "GenerationError: refused")
    with pytest.raises(RunnerError, match="every prompt of the dataset \\(2\\) failed for good"):
        worker.admit(1, timeout_s=0.0)


def test_failures_beyond_the_step_limit_stop_the_run_naming_the_setting(tmp_path: Path) -> None:
    worker = BufferWorker(
        _config(tmp_path, **{"rollout_buffer.max_failed_groups_per_step": 2}), dataset_size=8
    )
    for group_id, _ in worker.admit(3, timeout_s=0.0):
        worker.abandon(group_id)
    with pytest.raises(RunnerError, match="max_failed_groups_per_step \\(2\\)"):
        worker.take_batch(2, actor_version=0, timeout_s=0.0)
    with pytest.raises(RunnerError, match="max_failed_groups_per_step"):
        worker.admit(1, timeout_s=0.0)


def test_a_dead_workers_groups_are_handed_back(tmp_path: Path) -> None:
    worker = BufferWorker(_config(tmp_path), dataset_size=8)
    ((kept, kept_prompt),) = worker.admit(1, timeout_s=0.0, worker_index=0)
    lost = worker.admit(2, timeout_s=0.0, worker_index=1)
    worker.complete(_group(lost[0][0], lost[0][1], 0))  # finished before the worker died: kept
    assert worker.hand_back(1) == 1
    assert worker.hand_back(1) == 0  # nothing is handed back twice
    counts = worker.counts()
    assert (counts["inflight"], counts["buffered"], counts["handed_back"]) == (1, 1, 1)
    assert _balanced(counts)
    worker.complete(_group(kept, kept_prompt, 0))
