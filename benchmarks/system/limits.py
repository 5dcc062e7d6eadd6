"""The two admission limits swept on one async workload: what each costs or buys.

- `rollout_buffer.max_buffered_groups` at 1 x B and 2 x B (B = `data.rollout_batch_size`, in-flight limit B
  in both): with room for one batch, the next batch's groups are admitted only when the actor takes the
  current one, so every step waits for the slowest group of that batch whenever it outlasts the training
  step, even when the engines' throughput keeps up with training; with 2 x B the engines keep a second
  batch going and the actor takes the first B groups to finish. So 1 x B is slower when training is the
  bottleneck on average but a batch's tail is longer than a training step.
- `rollout_buffer.max_inflight_groups` below and above what the engines can run at once (their saturation:
  `rollout.max_running_requests * instances / group_size`): past saturation, more groups in flight only wait
  in the engines' queues, so throughput stays flat while the data gets staler.

    uv run python benchmarks/system/limits.py [CONFIG] [key=value ...] [--steps 8] [--points buffer]
      [--out FILE]

Every point is one run of the runner (same seed and placement); prints per point the mean step time, the
admission waits per limit, the staleness and the engines' tokens per second, and writes them as JSON
(default `benchmarks/results/limits.json`).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import runs
from asyncrl_core import metrics
from asyncrl_core.config import load_config
from asyncrl_core.runner import run

REPORTED = (
    metrics.TIME_STEP,
    metrics.TIME_WAIT_DATA,
    metrics.TIME_TRAINING,
    metrics.ADMISSION_WAIT_INFLIGHT_LIMIT,
    metrics.ADMISSION_WAIT_BUFFER_FULL,
    metrics.DATA_STALENESS_MEAN,
    metrics.DATA_STALENESS_MAX,
    metrics.TOKENS_PER_S,
    metrics.TRAIN_NUM_LOSS_TOKENS,
)


def run_point(config_path: str | None, overrides: list[str], run_dir: Path, warmup: int) -> dict[str, float]:
    run(load_config(config_path, [*overrides, f"runner.run_dir={run_dir}"]))
    return runs.means(runs.step_records(run_dir), warmup, REPORTED)


def main() -> int:
    parser = runs.parser(__doc__, steps=8, runs_dir="runs/limits", out="benchmarks/results/limits.json")
    parser.add_argument(
        "--points",
        choices=("all", "buffer", "inflight"),
        default="all",
        help="sweep both limits (default) or only one",
    )
    args = parser.parse_args()
    config_path, overrides = runs.config_and_overrides(args.arguments)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    overrides = [
        *overrides,
        "runner.async_mode=true",
        f"runner.num_steps={args.steps}",
        "agentloop.max_actor_accept_staleness=null",
    ]
    overrides = runs.common_overrides(config_path, overrides)
    base = load_config(config_path, overrides)
    batch = base.data.rollout_batch_size
    instances = base.rollout.num_instances or 1
    saturation = math.ceil(base.rollout.max_running_requests * instances / base.algorithm.group_size)
    large = 4 * saturation + batch
    points = {
        "buffer 1xB": [
            f"rollout_buffer.max_buffered_groups={batch}",
            f"rollout_buffer.max_inflight_groups={batch}",
        ],
        "buffer 2xB": [
            f"rollout_buffer.max_buffered_groups={2 * batch}",
            f"rollout_buffer.max_inflight_groups={batch}",
        ],
        f"inflight {max(1, saturation // 2)} (below saturation {saturation})": [
            f"rollout_buffer.max_inflight_groups={max(1, saturation // 2)}",
            f"rollout_buffer.max_buffered_groups={large + batch}",
        ],
        f"inflight {saturation} (saturation)": [
            f"rollout_buffer.max_inflight_groups={saturation}",
            f"rollout_buffer.max_buffered_groups={large + batch}",
        ],
        f"inflight {large} (4x saturation)": [
            f"rollout_buffer.max_inflight_groups={large}",
            f"rollout_buffer.max_buffered_groups={large + batch}",
        ],
    }
    if args.points != "all":
        points = {name: point for name, point in points.items() if name.startswith(args.points)}
    results: dict[str, dict[str, float]] = {}
    for index, (name, point) in enumerate(points.items()):
        print(f"point {name} ...", flush=True)
        run_dir = args.runs_dir / stamp / str(index)
        results[name] = run_point(config_path, [*overrides, *point], run_dir, args.warmup_steps)

    short = [name.split("/")[-1] for name in REPORTED]
    print(f"\n{'point':<40}" + "".join(f"{name:>22}" for name in short))
    for name, values in results.items():
        print(f"{name:<40}" + "".join(f"{values.get(metric, float('nan')):>22.3f}" for metric in REPORTED))
    out: dict[str, Any] = {"command": " ".join(sys.argv), "saturation_groups": saturation, "points": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
