"""Batches by reference through Ray: the buffer worker's hand-off gives the driver object references only,
and the runner's dispatch (`train_calls`) gets each actor rank its own data-parallel rank's share, read
from the object store without a copy; no rank receives another rank's rows."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from asyncrl_core.config import load_config
from asyncrl_core.runner.handoff import Handoff, train_calls
from asyncrl_core.runner.workers import BufferWorker
from asyncrl_core.shares import BatchError
from asyncrl_core.types import NO_VERSION, BatchShare, Group, Trajectory

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> Iterator[None]:
    # The rank class below lives in this test module, which Ray's workers cannot import: send it by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


class Rank:
    """An actor rank's data entry as `ActorWorker.train` meets it: what arrived, for the test to read."""

    def train(self, share: BatchShare) -> dict[str, Any]:
        return {
            "type": type(share).__name__,
            "rank": share.rank,
            "num_ranks": share.num_ranks,
            "rows": [tuple(row) for rows in share.mini_batches for row in rows.row_ids.tolist()],
            "tokens": [rows.token_ids.tolist() for rows in share.mini_batches],
            # Arrays read in place from the object store's shared memory are read-only.
            "in_place": all(not rows.token_ids.flags.writeable for rows in share.mini_batches),
        }


def _group(group_id: int, prompt_index: int, length: int) -> Group:
    trajectories = [
        Trajectory(
            token_ids=[group_id * 1000 + index * 100 + token for token in range(length + index)],
            prompt_len=2,
            loss_mask=[1] * (length + index - 2),
            rollout_logprobs=[-0.5] * (length + index - 2),
            versions=[0] * (length + index - 2),
            reward=float(index % 2),
        )
        for index in range(4)
    ]
    return Group(group_id, prompt_index, trajectories, finish_version=NO_VERSION)


def test_each_rank_receives_its_own_share_by_reference(tmp_path: Path) -> None:
    pairs = {
        "runner.run_dir": str(tmp_path / "run"),
        "data.rollout_batch_size": 4,
        "algorithm.group_size": 4,
        "actor.ppo_mini_batch_size": 2,
        "actor.micro_batch_size": 1,
        # Two data-parallel ranks of two tensor-parallel ranks each (a layout of four GPUs; only the buffer
        # worker is built from it here, and the ranks are plain Ray actors).
        "actor.backend": "megatron",
        "actor.tensor_parallel_size": 2,
        "cluster.device_type": "gpu",
        "cluster.num_devices": 6,
        "cluster.component_placement": "{actor: 0-3, rollout: 4-5}",
    }
    config = load_config(None, [f"{key}={value}" for key, value in pairs.items()])
    assert config.actor_data_parallel_size == 2
    buffer = ray.remote(BufferWorker).options(num_cpus=0).remote(config, 16, by_reference=True)
    admitted = ray.get(buffer.admit.remote(4, 5.0), timeout=60)
    groups = [_group(group_id, prompt, 20 + 7 * group_id) for group_id, prompt in admitted]
    assert all(ray.get([buffer.complete.remote(group) for group in groups], timeout=60))

    handoff: Handoff = ray.get(buffer.hand_off.remote(4, 0, 5.0), timeout=60)
    # The driver holds references and counts, never the data.
    assert len(handoff.shares) == 2
    assert all(isinstance(share, ray.ObjectRef) for share in handoff.shares)
    assert handoff.group_ids == tuple(group_id for group_id, _ in admitted)

    ranks = [ray.remote(Rank).options(num_cpus=0).remote() for _ in range(4)]
    received = ray.get(train_calls(ranks, handoff, tensor_parallel_size=2), timeout=60)
    assert [r["rank"] for r in received] == [0, 0, 1, 1]  # tensor-parallel fastest
    assert all(r["type"] == "BatchShare" and r["num_ranks"] == 2 and r["in_place"] for r in received)
    assert received[0]["rows"] == received[1]["rows"]
    assert received[2]["rows"] == received[3]["rows"]
    rows_0, rows_1 = set(received[0]["rows"]), set(received[2]["rows"])
    assert not rows_0 & rows_1  # no rank receives a row of the other's share
    assert rows_0 | rows_1 == {(group.group_id, index) for group in groups for index in range(4)}
    # The tokens a rank received are its own rows' tokens and nothing else.
    by_row = {(g.group_id, i): t.token_ids for g in groups for i, t in enumerate(g.trajectories)}
    for result in (received[0], received[2]):
        tokens = [token for mini_batch in result["tokens"] for token in mini_batch]
        assert tokens == [token for row in result["rows"] for token in by_row[row]]
    assert ray.get(buffer.counts.remote(), timeout=60)["trained"] == 4

    with pytest.raises(BatchError, match="cut into 2 shares for 4 data-parallel ranks"):
        train_calls(ranks, handoff, tensor_parallel_size=1)
    for handle in (buffer, *ranks):
        ray.kill(handle)
