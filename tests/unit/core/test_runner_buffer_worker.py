"""The runner's buffer worker in one process: prompts issued under the limits, retried completions,
abandoned and dropped prompts handed back to the dataloader, and counts that add up."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from asyncrl_core import metrics
from asyncrl_core.config import AsyncRLConfig, load_config
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
    parts = ("trained", "dropped", "abandoned", "failed", "inflight", "buffered")
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
    assert (counts["abandoned"], counts["dropped"], counts["trained"], counts["buffered"]) == (1, 1, 2, 1)
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


def test_a_permanent_failure_drops_the_prompt_for_good_with_its_reason(tmp_path: Path) -> None:
    worker = BufferWorker(_config(tmp_path), dataset_size=3)
    (first, prompt_a), (second, prompt_b), (third, _) = worker.admit(3, timeout_s=0.0)
    worker.abandon(first, "PromptTooLongError: prompt 'x' has 900 tokens")
    worker.abandon(second)  # retryable: handed back
    worker.abandon(third)
    step = worker.end_step()
    assert (step[metrics.FAILED_GROUPS_DROPPED], step[metrics.FAILED_GROUPS_RETRIED]) == (1.0, 2.0)
    assert worker.failure_reasons == {prompt_a: "PromptTooLongError: prompt 'x' has 900 tokens"}
    counts = worker.counts()
    assert (counts["failed"], counts["abandoned"]) == (1, 2)
    assert _balanced(counts)
    # Epoch 1 skips the dropped prompt; the handed-back ones come again, never the dropped one.
    issued = [prompt for _, prompt in worker.admit(3, timeout_s=0.0)]
    assert prompt_a not in issued
    assert prompt_b in issued
    assert worker.end_step()[metrics.FAILED_GROUPS_DROPPED] == 0.0  # counted per step


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
    assert (counts["inflight"], counts["buffered"], counts["abandoned"]) == (1, 1, 1)
    assert _balanced(counts)
    worker.complete(_group(kept, kept_prompt, 0))
