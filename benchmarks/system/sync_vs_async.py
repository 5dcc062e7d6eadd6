"""Sync against async on the same workload, seed and placement, in one invocation.

Runs `asyncrl-run`'s runner twice on one configuration (default: the embedded `searchr1-mini`, multi-turn
search with a long tail of trajectory lengths), first with `runner.async_mode=false`, then `true`, and prints
per mode the mean `time/step` and its parts, the measured speedup of the step rate, and the ideal speedup
from the sync run's own parts:

    ideal = (rollout + training + sync) / (max(rollout, training) + sync)

(async overlaps generation with training; the weight sync still stops the actor). The first
`--warmup-steps` steps of each run are left out of the means. Both reward curves are printed too.

    uv run python benchmarks/system/sync_vs_async.py [CONFIG] [key=value ...] [--steps 12] [--out FILE]

Writes the figures as JSON (default `benchmarks/results/sync_vs_async.json`) and the two run folders under
`--runs-dir`.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import runs

from asyncrl_core import metrics
from asyncrl_core.config import load_config
from asyncrl_core.runner import run

PARTS = (
    metrics.TIME_STEP,
    metrics.TIME_ROLLOUT,
    metrics.TIME_WAIT_DATA,
    metrics.TIME_TRAINING,
    metrics.TIME_SYNC_WEIGHTS,
)
REPORTED = (
    *PARTS,
    metrics.DATA_STALENESS_MEAN,
    metrics.DATA_STALENESS_MAX,
    metrics.TOKENS_PER_S,
    metrics.TRAIN_NUM_TOKENS,
    metrics.TRAIN_NUM_LOSS_TOKENS,
)


def trained_tokens_per_s(records: list[dict[str, float]], warmup: int) -> float:
    """Trained (loss) tokens per second of step time over the measured steps: the step rate weighted by
    each step's work, which differs between the modes as soon as their policies drift apart."""
    kept = runs.measured_steps(records, warmup)
    return sum(r[metrics.TRAIN_NUM_LOSS_TOKENS] for r in kept) / sum(r[metrics.TIME_STEP] for r in kept)


def one_mode(config_path: str | None, overrides: list[str], *, async_mode: bool, run_dir: Path) -> Path:
    mode_overrides = [*overrides, f"runner.async_mode={str(async_mode).lower()}", f"runner.run_dir={run_dir}"]
    config = load_config(config_path, mode_overrides)
    started = time.perf_counter()
    run(config)
    print(f"  {'async' if async_mode else 'sync'} run: {time.perf_counter() - started:.0f} s", flush=True)
    return run_dir


def main() -> int:
    parser = runs.parser(
        __doc__, steps=12, runs_dir="runs/sync_vs_async", out="benchmarks/results/sync_vs_async.json"
    )
    args = parser.parse_args()
    config_path, overrides = runs.config_and_overrides(args.arguments)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    overrides = runs.common_overrides(
        config_path, [*overrides, f"runner.num_steps={args.steps}"], args.runs_dir
    )
    records: dict[str, list[dict[str, float]]] = {}
    for name, async_mode in (("sync", False), ("async", True)):
        run_dir = one_mode(
            config_path, overrides, async_mode=async_mode, run_dir=args.runs_dir / stamp / name
        )
        records[name] = runs.step_records(run_dir)

    sync, asynchronous = (
        runs.means(records[name], args.warmup_steps, REPORTED) for name in ("sync", "async")
    )
    rollout, training = sync[metrics.TIME_ROLLOUT], sync[metrics.TIME_TRAINING]
    sync_s = sync[metrics.TIME_SYNC_WEIGHTS]
    ideal = (rollout + training + sync_s) / (max(rollout, training) + sync_s)
    speedup = sync[metrics.TIME_STEP] / asynchronous[metrics.TIME_STEP]
    token_rates = {name: trained_tokens_per_s(steps, args.warmup_steps) for name, steps in records.items()}
    token_speedup = token_rates["async"] / token_rates["sync"]
    config = load_config(config_path, [*overrides, "runner.async_mode=true"])
    assert config.rollout_buffer.max_buffered_groups is not None  # derived
    bound = config.rollout_buffer.max_buffered_groups / config.data.rollout_batch_size
    cap = config.agentloop.max_actor_accept_staleness
    staleness_max = max(record.get(metrics.DATA_STALENESS_MAX, 0.0) for record in records["async"])

    print(f"\n{'mean per step':<30}{'sync':>10}{'async':>10}")
    for name in REPORTED:
        cells = [f"{m[name]:>10.3f}" if name in m else f"{'-':>10}" for m in (sync, asynchronous)]
        print(f"{name:<30}{''.join(cells)}")
    print(f"\nspeedup of the step rate (async over sync): {speedup:.2f}x")
    print(
        f"ideal from the sync run's parts:            {ideal:.2f}x  (measured = {speedup / ideal:.0%} of it)"
    )
    print(
        f"trained tokens per second, async over sync: {token_speedup:.2f}x  "
        f"({token_rates['sync']:.0f} and {token_rates['async']:.0f}: the same ratio when both modes' steps "
        "carry the same work)"
    )
    print(
        f"async staleness: max {staleness_max:.0f} over all steps; the buffer bounds it by "
        f"max_buffered_groups / rollout_batch_size = {bound:.1f}"
        + (f", the cap (max_actor_accept_staleness) by {cap}" if cap is not None else "")
    )
    print("\nreward per step")
    for name, steps in records.items():
        print(f"  {name:<6}" + " ".join(f"{r.get(metrics.REWARD_MEAN, float('nan')):.2f}" for r in steps))

    result: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "mean": {"sync": sync, "async": asynchronous},
        "speedup": speedup,
        "ideal_speedup": ideal,
        "share_of_ideal": speedup / ideal,
        "trained_tokens_per_s": token_rates,
        "trained_tokens_speedup": token_speedup,
        "staleness_max": staleness_max,
        "staleness_bound": bound,
        "reward": {name: [r.get(metrics.REWARD_MEAN) for r in steps] for name, steps in records.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
