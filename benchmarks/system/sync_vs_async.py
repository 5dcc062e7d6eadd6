"""Sync against async on the same workload, seed and placement, in one invocation.

Runs `asyncrl-run`'s runner twice on one configuration (default: the embedded `searchr1-mini`, multi-turn
search with a long tail of trajectory lengths), first with `runner.async_mode=false`, then `true`, and prints
per mode the median `time/step` and its parts, the measured speedup of the step rate, and the ideal speedup
from the sync run's own parts:

    ideal = (rollout + training + sync) / (max(rollout, training) + sync)

(async overlaps generation with training; the weight sync still stops the actor). The first
`--warmup-steps` steps of each run are left out of the medians. Both reward curves are printed too.

    uv run python benchmarks/system/sync_vs_async.py [CONFIG] [key=value ...] [--steps 12] [--out FILE]

Writes the figures as JSON (default `benchmarks/results/sync_vs_async.json`) and the two run folders under
`--runs-dir`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

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


def read_steps(run_dir: Path) -> list[dict[str, float]]:
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as lines:
        return [record for line in lines if metrics.TIME_STEP in (record := json.loads(line))]


def medians(records: list[dict[str, float]], warmup: int) -> dict[str, float]:
    kept = records[warmup:] or records
    result: dict[str, float] = {}
    for name in (*PARTS, metrics.DATA_STALENESS_MEAN, metrics.TOKENS_PER_S):
        values = [record[name] for record in kept if name in record]
        if values:
            result[name] = statistics.median(values)
    return result


def one_mode(config_path: str | None, overrides: list[str], *, async_mode: bool, run_dir: Path) -> Path:
    mode_overrides = [*overrides, f"runner.async_mode={str(async_mode).lower()}", f"runner.run_dir={run_dir}"]
    config = load_config(config_path, mode_overrides)
    started = time.perf_counter()
    run(config)
    print(f"  {'async' if async_mode else 'sync'} run: {time.perf_counter() - started:.0f} s", flush=True)
    return run_dir


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("arguments", nargs="*", metavar="CONFIG key=value")
    parser.add_argument("--steps", type=int, default=12, help="training steps of each run")
    parser.add_argument("--warmup-steps", type=int, default=2, help="first steps left out of the medians")
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/sync_vs_async"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/sync_vs_async.json"))
    args = parser.parse_args()
    config_path = args.arguments[0] if args.arguments and "=" not in args.arguments[0] else None
    overrides = args.arguments[1:] if config_path else args.arguments
    overrides = [
        *overrides,
        f"runner.num_steps={args.steps}",
        "logging.progress_bar=false",
        "checkpoint.save_at_end=false",
        "runner.eval_every_steps=null",
    ]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    runs: dict[str, list[dict[str, float]]] = {}
    for name, async_mode in (("sync", False), ("async", True)):
        run_dir = one_mode(
            config_path, overrides, async_mode=async_mode, run_dir=args.runs_dir / f"{stamp}-{name}"
        )
        runs[name] = read_steps(run_dir)

    sync, asynchronous = (medians(runs[name], args.warmup_steps) for name in ("sync", "async"))
    rollout, training = sync[metrics.TIME_ROLLOUT], sync[metrics.TIME_TRAINING]
    sync_s = sync[metrics.TIME_SYNC_WEIGHTS]
    ideal = (rollout + training + sync_s) / (max(rollout, training) + sync_s)
    speedup = sync[metrics.TIME_STEP] / asynchronous[metrics.TIME_STEP]

    print(f"\n{'median per step':<28}{'sync':>10}{'async':>10}")
    for name in (*PARTS, metrics.DATA_STALENESS_MEAN, metrics.TOKENS_PER_S):
        cells = [f"{m[name]:>10.3f}" if name in m else f"{'-':>10}" for m in (sync, asynchronous)]
        print(f"{name:<28}{''.join(cells)}")
    print(f"\nspeedup of the step rate (async over sync): {speedup:.2f}x")
    print(
        f"ideal from the sync run's parts:            {ideal:.2f}x  (measured = {speedup / ideal:.0%} of it)"
    )
    print("\nreward per step")
    for name, records in runs.items():
        print(
            f"  {name:<6}"
            + " ".join(f"{record.get(metrics.REWARD_MEAN, float('nan')):.2f}" for record in records)
        )

    result: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "median": {"sync": sync, "async": asynchronous},
        "speedup": speedup,
        "ideal_speedup": ideal,
        "share_of_ideal": speedup / ideal,
        "reward": {name: [r.get(metrics.REWARD_MEAN) for r in records] for name, records in runs.items()},
        "staleness_max": max(r.get(metrics.DATA_STALENESS_MAX, 0.0) for r in runs["async"]),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
