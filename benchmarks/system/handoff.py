"""The hand-off of a step's batch from the buffer worker to the actor ranks: by reference against through the
driver, in one run.

Both paths start from the same buffer worker (`asyncrl_core.runner.workers.BufferWorker` as a Ray actor,
`by_reference=True`, as the runner starts it) holding the step's finished groups, and end when every rank
has its data and has read it:

- `reference` (the product's path, `BufferWorker.hand_off` + `runner.handoff.train_calls`): the buffer worker
  cuts the batch into one `BatchShare` per data-parallel rank (NumPy arrays, made when each group finished)
  and puts each into the object store; the driver gets the references and passes each rank its own.
- `driver` (the path before it, reproduced here: the drivers called `take_batch`, then
  `train.remote(batch)` on every rank): the driver `ray.get`s the whole `Batch` of `Group`s (Python lists)
  and sends it to every rank, which reads its own rows (the rows `asyncrl_core.shares.deal_rows` gives it)
  and ignores the rest.

The ranks are light Ray actors that receive the data and read it (the sum of their rows' token ids), not
trainers. Every trajectory has 4,096 tokens (a 512-token prompt and 3,584 response tokens, a quarter of
them tool output), groups of 8. Per point: bytes the driver receives and sends (Ray's serialised sizes),
bytes each rank receives, and the time per step (hand-off request to every rank done), median of
`--repeats` steps; filling the buffer between steps is not timed.

    uv run python benchmarks/system/handoff.py [--trajectories 256 1024] [--ranks 1 2 4] [--repeats 3]

Ray runs locally with `--num-cpus` CPUs (2 by default), no dashboard. Prints a table and writes the figures
as JSON (`--out`, default `benchmarks/results/handoff.json`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray

from asyncrl_core.buffer import Batch
from asyncrl_core.config import AsyncRLConfig, load_config
from asyncrl_core.runner.handoff import Handoff, train_calls
from asyncrl_core.runner.workers import BufferWorker
from asyncrl_core.shares import deal_rows
from asyncrl_core.types import NO_VERSION, BatchShare, Group, Trajectory

GROUP_SIZE = 8
PROMPT_LEN = 512
RESPONSE_LEN = 3584
VOCAB_SIZE = 151_936
PATHS = ("driver", "reference")


class Rank:
    """One actor rank's data entry: receives its data and reads its own rows."""

    def __init__(self, rank: int, num_ranks: int) -> None:
        self.rank, self.num_ranks = rank, num_ranks

    def train(self, share: BatchShare) -> int:
        return sum(int(rows.token_ids.sum()) for rows in share.mini_batches)

    def train_groups(self, batch: Batch) -> int:
        trajectories = [trajectory for group in batch.groups for trajectory in group.trajectories]
        mine = deal_rows([len(trajectory.token_ids) for trajectory in trajectories], self.num_ranks)[
            self.rank
        ]
        return sum(sum(trajectories[row].token_ids) for row in mine)


def make_groups(num_trajectories: int, seed: int) -> list[Group]:
    """Groups of `GROUP_SIZE` distinct trajectories of `PROMPT_LEN + RESPONSE_LEN` tokens, as lists."""
    rng = np.random.default_rng(seed)
    groups: list[Group] = []
    for index in range(num_trajectories // GROUP_SIZE):
        trajectories: list[Trajectory] = []
        for _ in range(GROUP_SIZE):
            mask = np.ones(RESPONSE_LEN, dtype=np.int64)
            for start in rng.choice(RESPONSE_LEN - 224, size=4, replace=False):
                mask[start : start + 224] = 0  # tool output: a quarter of the response
            trajectories.append(
                Trajectory(
                    token_ids=rng.integers(0, VOCAB_SIZE, PROMPT_LEN + RESPONSE_LEN).tolist(),
                    prompt_len=PROMPT_LEN,
                    loss_mask=mask.tolist(),
                    rollout_logprobs=np.where(mask > 0, -rng.random(RESPONSE_LEN), 0.0).tolist(),
                    versions=np.where(mask > 0, 0, NO_VERSION).tolist(),
                    reward=float(rng.integers(0, 2)),
                )
            )
        groups.append(Group(index, index, trajectories))
    return groups


def config_for(num_trajectories: int, num_ranks: int, run_dir: str) -> AsyncRLConfig:
    """A run whose actor has `num_ranks` data-parallel ranks (one GPU each, in the configuration only: the
    buffer worker reads the layout, nothing here uses a GPU) and steps of `num_trajectories`."""
    pairs = {
        "runner.run_dir": run_dir,
        "data.rollout_batch_size": num_trajectories // GROUP_SIZE,
        "rollout_buffer.max_inflight_groups": num_trajectories // GROUP_SIZE,
        "rollout_buffer.max_buffered_groups": 2 * num_trajectories // GROUP_SIZE,
        "algorithm.group_size": GROUP_SIZE,
        "actor.micro_batch_size": 1,
        "cluster.device_type": "gpu",
        "cluster.num_devices": num_ranks + 1,
        "cluster.component_placement": f"{{actor: 0-{num_ranks - 1}, rollout: {num_ranks}}}",
    }
    config = load_config(None, [f"{key}={value}" for key, value in pairs.items()])
    assert config.actor_data_parallel_size == num_ranks
    return config


def serialized_bytes(value: Any) -> int:
    """Bytes Ray's serialiser makes of `value` (what a call argument or a return value costs in transit)."""
    context = ray._private.worker.global_worker.get_serialization_context()  # pyright: ignore[reportPrivateUsage]
    return int(context.serialize(value).total_bytes)


def fill(buffer: Any, groups: list[Group]) -> None:
    """Admit and finish one batch of groups in the buffer worker (not timed)."""
    admitted = ray.get(buffer.admit.remote(len(groups), 10.0))
    assert len(admitted) == len(groups), f"{len(admitted)} of {len(groups)} admitted"
    for (group_id, prompt_index), group in zip(admitted, groups, strict=True):
        group.group_id, group.prompt_index = group_id, prompt_index
    assert all(ray.get([buffer.complete.remote(group) for group in groups]))


def step(path: str, buffer: Any, ranks: list[Any], num_groups: int) -> tuple[float, float, int, int, int]:
    """One hand-off: (seconds until the driver had what it waits for, seconds until every rank had read its
    data, bytes the driver received, bytes it sent, bytes one rank received)."""
    started = time.perf_counter()
    if path == "reference":
        handoff: Handoff = ray.get(buffer.hand_off.remote(num_groups, 0, 10.0))
        received_s = time.perf_counter() - started
        sums = ray.get(train_calls(ranks, handoff, tensor_parallel_size=1))
        done_s = time.perf_counter() - started
        received = serialized_bytes(handoff)
        sent = sum(serialized_bytes(share) for share in handoff.shares)  # the references
        per_rank = max(serialized_bytes(ray.get(share)) for share in handoff.shares)
    else:
        batch: Batch = ray.get(buffer.take_batch.remote(num_groups, 0, 10.0))
        received_s = time.perf_counter() - started
        sums = ray.get([rank.train_groups.remote(batch) for rank in ranks])
        done_s = time.perf_counter() - started
        received = serialized_bytes(batch)
        sent = received * len(ranks)  # the batch is serialised again for every call
        per_rank = received
    assert all(isinstance(value, int) for value in sums)
    return received_s, done_s, received, sent, per_rank


def measure(num_trajectories: int, num_ranks: int, repeats: int, groups: list[Group]) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="asyncrl-handoff-") as run_dir:
        config = config_for(num_trajectories, num_ranks, run_dir)
        buffer = ray.remote(BufferWorker).options(num_cpus=0, max_concurrency=16)
        buffer = buffer.remote(config, len(groups) * (2 * repeats + 2), by_reference=True)
        ranks = [ray.remote(Rank).options(num_cpus=0).remote(rank, num_ranks) for rank in range(num_ranks)]
        ray.get([rank.__ray_ready__.remote() for rank in ranks])
        results: dict[str, list[tuple[float, float, int, int, int]]] = {path: [] for path in PATHS}
        for repeat in range(repeats + 1):  # the first round warms both paths up and is not kept
            for path in PATHS if repeat % 2 == 0 else PATHS[::-1]:
                fill(buffer, groups)
                measured = step(path, buffer, ranks, len(groups))
                if repeat:
                    results[path].append(measured)
        for handle in (buffer, *ranks):
            ray.kill(handle)
    rows: list[dict[str, Any]] = []
    for path in PATHS:
        steps = results[path]
        rows.append(
            {
                "trajectories": num_trajectories,
                "ranks": num_ranks,
                "path": path,
                "driver_received_bytes": steps[-1][2],
                "driver_sent_bytes": steps[-1][3],
                "rank_bytes": steps[-1][4],
                "wait_s": statistics.median(s[0] for s in steps),
                "step_s": statistics.median(s[1] for s in steps),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trajectories", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-cpus", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/handoff.json"))
    args = parser.parse_args()

    # As the runner starts Ray: the workers run this interpreter (no `uv run` hook), no usage reporting.
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, logging_level="WARNING")
    rows: list[dict[str, Any]] = []
    try:
        for num_trajectories in args.trajectories:
            groups = make_groups(num_trajectories, seed=num_trajectories)
            for num_ranks in args.ranks:
                rows += measure(num_trajectories, num_ranks, args.repeats, groups)
                for row in rows[-2:]:
                    print(json.dumps(row), flush=True)
    finally:
        ray.shutdown()

    columns = ("trajectories", "ranks", "path", "driver in (MB)", "driver out (MB)", "per rank (MB)")
    print("\n| " + " | ".join((*columns, "wait (s)", "step (s)")) + " |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    for row in rows:
        sizes = (row["driver_received_bytes"], row["driver_sent_bytes"], row["rank_bytes"])
        cells = [
            str(row["trajectories"]),
            str(row["ranks"]),
            row["path"],
            *(f"{size / 1e6:.3f}" for size in sizes),
        ]
        print("| " + " | ".join([*cells, f"{row['wait_s']:.3f}", f"{row['step_s']:.3f}"]) + " |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "ray_num_cpus": args.num_cpus}
    args.out.write_text(json.dumps({"machine": machine, "rows": rows}, indent=1) + "\n", encoding="utf-8")
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
