"""A step's batch cut into the data-parallel ranks' shares: every row in exactly one share, each rank's
micro-batches equal to those it cuts from the whole packed mini-batch, a share refused by any rank but its
own, and the buffer worker's hand-off (arrays made when a group finishes, the ledger told what was
trained)."""

from __future__ import annotations

import random
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncrl_core.algorithms import BatchError, pack_mini_batches, rank_plan
from asyncrl_core.config import load_config
from asyncrl_core.runner.handoff import Handoff, ShareCutter, data_parallel_rank
from asyncrl_core.runner.workers import BufferWorker
from asyncrl_core.shares import deal_rows, split_batch
from asyncrl_core.types import NO_VERSION, BatchShare, Group, Trajectory

PAD = 0


def _trajectory(rng: random.Random, reward: float, max_version: int) -> Trajectory:
    prompt_len, response_len = rng.randint(1, 6), rng.randint(1, 12)
    mask = [rng.randint(0, 1) for _ in range(response_len)]
    mask[0] = 1  # every row trains at least one token
    return Trajectory(
        token_ids=[rng.randint(1, 99) for _ in range(prompt_len + response_len)],
        prompt_len=prompt_len,
        loss_mask=mask,
        rollout_logprobs=[-rng.random() if m else 0.0 for m in mask],
        versions=[rng.randint(0, max_version) if m else NO_VERSION for m in mask],
        reward=reward,
    )


def _groups(seed: int, num_groups: int, group_size: int, max_version: int = 3) -> list[Group]:
    rng = random.Random(seed)
    rewards = (0.0, 0.5, 1.0)
    return [
        Group(
            100 + index,
            index,
            [_trajectory(rng, rng.choice(rewards), max_version) for _ in range(group_size)],
        )
        for index in range(num_groups)
    ]


def _rows(share: BatchShare) -> list[tuple[int, int]]:
    return [(int(group), int(index)) for rows in share.mini_batches for group, index in rows.row_ids]


@pytest.mark.parametrize("num_ranks", [1, 2, 4])
@pytest.mark.parametrize("mini_batch_size", [None, 2])
def test_every_row_goes_to_exactly_one_rank(num_ranks: int, mini_batch_size: int | None) -> None:
    groups = _groups(0, 4, 4)
    shares = split_batch(groups, num_ranks, mini_batch_size, normalize_std=True)
    assert [(share.rank, share.num_ranks) for share in shares] == [
        (rank, num_ranks) for rank in range(num_ranks)
    ]
    received = [_rows(share) for share in shares]
    every = [row for rows in received for row in rows]
    assert len(every) == len(set(every))  # no row in two shares
    assert sorted(every) == sorted((g.group_id, i) for g in groups for i in range(len(g.trajectories)))
    assert all(len(rows) == 16 // num_ranks for rows in received)
    # A share's arrays hold its own rows only: its tokens are exactly its rows' tokens.
    by_id = {(g.group_id, i): t for g in groups for i, t in enumerate(g.trajectories)}
    for share in shares:
        for rows in share.mini_batches:
            expected = [token for row in rows.row_ids.tolist() for token in by_id[tuple(row)].token_ids]
            assert rows.token_ids.tolist() == expected


@pytest.mark.parametrize("num_ranks", [1, 2, 4])
@pytest.mark.parametrize("mini_batch_size", [None, 1, 2])
@pytest.mark.parametrize("micro_batch_size", [1, 3])
@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_a_rank_trains_on_its_share_as_on_its_rows_of_the_whole_batch(
    num_ranks: int, mini_batch_size: int | None, micro_batch_size: int, aggregation: str
) -> None:
    # The reference: every rank packs the whole mini-batch and takes its rows (`rank_micro_batches`).
    groups = _groups(num_ranks * 10 + micro_batch_size, 4, 2)
    whole = pack_mini_batches(groups, PAD, mini_batch_size, normalize_std=True, aggregation=aggregation)  # type: ignore[arg-type]
    shares = split_batch(groups, num_ranks, mini_batch_size, normalize_std=True)
    for rank in range(num_ranks):
        plan = rank_plan(
            shares[rank],
            rank,
            num_ranks,
            PAD,
            mini_batch_size=mini_batch_size,
            micro_batch_size=micro_batch_size,
            normalize_std=True,
            aggregation=aggregation,  # type: ignore[arg-type]
        )
        expected = [batch.rank_micro_batches(rank, num_ranks, micro_batch_size) for batch in whole]
        assert len(plan.micro_batches) == len(expected)
        for batch, parts, expected_parts in zip(whole, plan.micro_batches, expected, strict=True):
            assert len(parts) == len(expected_parts)
            num_mine = len(deal_rows(batch.lengths.tolist(), num_ranks)[rank])
            for index, (part, expected_part) in enumerate(zip(parts, expected_parts, strict=True)):
                if index * micro_batch_size >= num_mine:  # a rank short of rows runs a zero-weight one
                    assert not part.loss_weights.any()
                    assert part.num_rows == 1
                    continue
                for spec in fields(part):
                    got, want = getattr(part, spec.name), getattr(expected_part, spec.name)
                    if not isinstance(got, torch.Tensor):  # the packed layout's fields
                        assert got == want, spec.name
                        continue
                    assert got.dtype == want.dtype, spec.name
                    assert torch.equal(got, want), spec.name
        assert plan.num_rows == sum(batch.num_rows for batch in whole)
        assert plan.num_tokens == sum(batch.num_tokens for batch in whole)
        assert plan.num_loss_tokens == sum(batch.num_loss_tokens for batch in whole)


def test_the_loss_weights_of_all_shares_add_up_to_one_per_mini_batch() -> None:
    groups = _groups(5, 4, 3)
    shares = split_batch(groups, 3, 2, normalize_std=False)
    totals = [0.0, 0.0]
    for rank, share in enumerate(shares):
        plan = rank_plan(
            share,
            rank,
            3,
            PAD,
            mini_batch_size=2,
            micro_batch_size=2,
            normalize_std=False,
            aggregation="token_mean",
        )
        for update, parts in enumerate(plan.micro_batches):
            totals[update] += sum(float(part.loss_weights.sum()) for part in parts)
    assert totals == pytest.approx([1.0, 1.0])


def test_a_rank_refuses_another_ranks_share() -> None:
    shares = split_batch(_groups(1, 2, 2), 2, None, normalize_std=True)
    settings = {
        "mini_batch_size": None,
        "micro_batch_size": 1,
        "normalize_std": True,
        "aggregation": "token_mean",
    }
    with pytest.raises(BatchError, match="rank 1 of 2 was handed the share of rank 0 of 2"):
        rank_plan(shares[0], 1, 2, PAD, **settings)  # type: ignore[arg-type]
    with pytest.raises(BatchError, match="rank 0 of 1 was handed the share of rank 0 of 2"):
        rank_plan(shares[0], 0, 1, PAD, **settings)  # type: ignore[arg-type]


def test_rows_are_dealt_longest_first_round_robin() -> None:
    assert deal_rows([3, 9, 5, 9, 1], 2) == [[1, 2, 4], [3, 0]]
    assert deal_rows([2, 2], 4) == [[0], [1], [], []]


def test_tensor_parallel_ranks_of_one_replica_share_a_data_parallel_rank() -> None:
    assert [data_parallel_rank(rank, 2) for rank in range(6)] == [0, 0, 1, 1, 2, 2]


def test_the_cutter_makes_one_share_per_rank_from_the_arrays_made_when_groups_finished() -> None:
    groups = _groups(2, 2, 4)
    cutter = ShareCutter(2, None, normalize_std=True, by_reference=False)
    for group in groups:
        cutter.prepare(group)
    # The arrays were made when the groups finished: the hand-off uses them, not the groups' lists.
    for group in groups:
        group.trajectories[0].token_ids[0] = 12345
    from asyncrl_core.buffer import Batch

    handoff = cutter.cut(Batch(groups, [], actor_version=3, num_ready=2), {"rollout/reward/mean": 0.5})
    assert handoff.group_ids == (100, 101)
    assert handoff.actor_version == 3
    shares = [share for share in handoff.shares if isinstance(share, BatchShare)]
    assert len(shares) == 2
    assert handoff.share_bytes == tuple(share.nbytes for share in shares)
    assert 12345 not in np.concatenate([rows.token_ids for share in shares for rows in share.mini_batches])
    # Each group's arrays are used once: a group handed out again would be cut from its lists.
    again = cutter.cut(Batch(groups, [], actor_version=4, num_ready=2), {})
    assert 12345 in np.concatenate([rows.token_ids for share in again.shares for rows in share.mini_batches])


def _worker(tmp_path: Path) -> BufferWorker:
    pairs = {
        "runner.run_dir": str(tmp_path / "run"),
        "data.rollout_batch_size": 2,
        "data.shuffle": False,
        "algorithm.group_size": 2,
        "actor.micro_batch_size": 1,
        # Two data-parallel ranks: the configuration of two GPUs for the actor (only the buffer worker is
        # built from it here).
        "cluster.device_type": "gpu",
        "cluster.num_devices": 4,
        "cluster.component_placement": "{actor: 0-1, rollout: 2-3}",
    }
    config = load_config(None, [f"{key}={value}" for key, value in pairs.items()])
    assert config.actor_data_parallel_size == 2
    return BufferWorker(config, dataset_size=8)


def test_the_buffer_worker_hands_off_shares_and_records_the_trained_groups(tmp_path: Path) -> None:
    worker = _worker(tmp_path)
    admitted = worker.admit(2, timeout_s=0.0)
    groups = _groups(3, 2, 2, max_version=0)
    for (group_id, prompt_index), group in zip(admitted, groups, strict=True):
        group.group_id, group.prompt_index = group_id, prompt_index
        assert worker.complete(group)
    handoff = worker.hand_off(2, actor_version=0, timeout_s=1.0)
    assert isinstance(handoff, Handoff)
    assert handoff.group_ids == tuple(group_id for group_id, _ in admitted)
    assert handoff.metrics["rollout/reward/mean"] == pytest.approx(
        np.mean([t.reward for g in groups for t in g.trajectories])
    )
    shares = [share for share in handoff.shares if isinstance(share, BatchShare)]
    assert [share.rank for share in shares] == [0, 1]
    assert sorted(row for share in shares for row in _rows(share)) == sorted(
        (g.group_id, i) for g in groups for i in range(2)
    )
    assert worker.counts()["trained"] == 2
    assert worker.hand_off(2, actor_version=1, timeout_s=0.01) is None  # nothing left
