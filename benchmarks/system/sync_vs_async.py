"""Sync against async on the same workload, seed and placement, in one invocation.

Runs `asyncrl-run`'s runner twice on one configuration (default: the embedded `searchr1-mini`, multi-turn
search with a long tail of trajectory lengths), first with `runner.async_mode=false`, then `true`, and prints
per mode the mean `time/step` and its parts, the measured speedup of the step rate, and the ideal speedup
from the sync run's own parts:

    ideal = (rollout + training + sync) / (max(rollout, training) + sync)

(async overlaps generation with training; the weight sync still stops the actor). The first
`--warmup-steps` steps of each run are left out of the means. Both reward curves are printed too.

Then, per mode, what the engines did in their rollout window (sync: the rollout phase, `time/rollout`;
async: the whole step, `time/step`, since generation never stops): model tokens per second of the window
(`rollout/num_model_tokens`: the trained groups' tokens), the engines' own generated tokens per second
(`rollout/engine/num_generated_tokens`), their prefill share (`rollout/engine/prefill_s` per engine over the
window) and, with `--gpu-utilization`, the rollout GPUs' busy share: `nvidia-smi`'s `utilization.gpu`
sampled every 200 ms and averaged over the measured steps' windows (`gpu_busy`).

    uv run python benchmarks/system/sync_vs_async.py [CONFIG] [key=value ...] [--steps 12] [--out FILE]
        [--gpu-utilization]

Writes the figures as JSON (default `benchmarks/results/sync_vs_async.json`) and the two run folders under
`--runs-dir`.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import gpu_busy
import runs
from asyncrl_core import metrics
from asyncrl_core.config import AsyncRLConfig, load_config
from asyncrl_core.runner import run

PARTS = (
    metrics.TIME_STEP,
    metrics.TIME_ROLLOUT,
    metrics.TIME_WAIT_DATA,
    metrics.TIME_TRAINING,
    metrics.TIME_SYNC_WEIGHTS,
)
PER_STEP = (*PARTS, metrics.TRAIN_NUM_TOKENS, metrics.TRAIN_NUM_LOSS_TOKENS)
"""Each step's figures in the JSON (`per_step`): its times, to see the first steps against the later ones."""
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


def rollout_figures(
    records: list[dict[str, float]], warmup: int, *, async_mode: bool, num_engines: int
) -> dict[str, float]:
    """What the engines did per second of their rollout window over the measured steps (sync: `time/rollout`;
    async: `time/step`): model tokens of the trained groups, tokens the engines generated, and the share of
    the window each engine spent in prefill (left out when a step lacks the engines' counters)."""
    kept = runs.measured_steps(records, warmup)
    window_s = sum(record[metrics.TIME_STEP if async_mode else metrics.TIME_ROLLOUT] for record in kept)
    figures = {"model_tokens_per_s": sum(record[metrics.NUM_MODEL_TOKENS] for record in kept) / window_s}
    if all(metrics.ENGINE_NUM_GENERATED_TOKENS in record for record in kept):
        generated = sum(record[metrics.ENGINE_NUM_GENERATED_TOKENS] for record in kept)
        figures["engine_generated_tokens_per_s"] = generated / window_s
    if all(metrics.ENGINE_PREFILL_S in record for record in kept):
        prefill_s = sum(record[metrics.ENGINE_PREFILL_S] for record in kept)
        figures["engine_prefill_share"] = prefill_s / num_engines / window_s
    return figures


def rollout_gpus(config: AsyncRLConfig) -> list[int] | None:
    """The GPUs whose busy share is reported: the rollout's (None: every GPU, on a CPU configuration)."""
    return list(config.cluster.devices_of("rollout")) if config.cluster.device_type == "gpu" else None


def one_mode(
    config_path: str | None,
    overrides: list[str],
    *,
    async_mode: bool,
    run_dir: Path,
    sample_gpus: bool,
    warmup: int,
) -> tuple[list[dict[str, float]], float | None]:
    """Run one mode; its step records and, when `sample_gpus`, the rollout GPUs' busy share (0-1) over the
    measured steps' rollout windows (`gpu_busy`)."""
    mode_overrides = [*overrides, f"runner.async_mode={str(async_mode).lower()}", f"runner.run_dir={run_dir}"]
    config = load_config(config_path, mode_overrides)
    sampler = gpu_busy.GpuSampler() if sample_gpus else None
    watcher = gpu_busy.StepEndWatcher(run_dir)
    started = time.perf_counter()
    if sampler is not None:
        sampler.start()
        watcher.start()
    try:
        run(config)
    finally:
        watcher.stop()
        if sampler is not None:
            sampler.stop()
    print(f"  {'async' if async_mode else 'sync'} run: {time.perf_counter() - started:.0f} s", flush=True)
    records = runs.step_records(run_dir)
    if sampler is None:
        return records, None
    print(f"  {len(sampler.samples)} GPU samples ({sampler.num_unparsed} lines unread)", flush=True)
    windows = gpu_busy.step_windows(records, watcher.ends(records), warmup, async_mode=async_mode)
    gpus = rollout_gpus(config)
    indices = set(gpus) if gpus is not None else {sample.index for sample in sampler.samples}
    return records, gpu_busy.window_mean(sampler.samples, windows, indices)


def main() -> int:
    parser = runs.parser(
        __doc__, steps=12, runs_dir="runs/sync_vs_async", out="benchmarks/results/sync_vs_async.json"
    )
    parser.add_argument(
        "--gpu-utilization",
        action="store_true",
        help="sample nvidia-smi's utilization.gpu every 200 ms and report the rollout GPUs' busy share",
    )
    args = parser.parse_args()
    if args.gpu_utilization and shutil.which("nvidia-smi") is None:
        parser.error("--gpu-utilization samples nvidia-smi, which is not on PATH on this machine")
    config_path, overrides = runs.config_and_overrides(args.arguments)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    overrides = runs.common_overrides(config_path, [*overrides, f"runner.num_steps={args.steps}"])
    records: dict[str, list[dict[str, float]]] = {}
    gpu_busy_shares: dict[str, float | None] = {}
    for name, async_mode in (("sync", False), ("async", True)):
        records[name], gpu_busy_shares[name] = one_mode(
            config_path,
            overrides,
            async_mode=async_mode,
            run_dir=args.runs_dir / stamp / name,
            sample_gpus=args.gpu_utilization,
            warmup=args.warmup_steps,
        )

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
    num_engines = config.rollout.num_instances or 1
    per_rollout_s = {
        name: rollout_figures(steps, args.warmup_steps, async_mode=name == "async", num_engines=num_engines)
        for name, steps in records.items()
    }
    for name, share in gpu_busy_shares.items():
        if share is not None:
            per_rollout_s[name]["gpu_busy_share"] = share

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
    print(f"\n{'rollout window (sync: time/rollout, async: time/step)':<56}{'sync':>10}{'async':>10}")
    gpus = rollout_gpus(config)
    for key, label, form in (
        ("model_tokens_per_s", "model tokens per second (rollout/num_model_tokens)", ".0f"),
        ("engine_generated_tokens_per_s", "engine generated tokens per second", ".0f"),
        ("engine_prefill_share", "engine prefill share (per engine)", ".3f"),
        ("gpu_busy_share", f"GPU busy share (GPUs {gpus if gpus is not None else 'all'})", ".3f"),
    ):
        cells = [
            f"{figures[key]:>10{form}}" if key in figures else f"{'-':>10}"
            for figures in (per_rollout_s["sync"], per_rollout_s["async"])
        ]
        print(f"{label:<56}{''.join(cells)}")
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
        "rollout_window": {"sync": metrics.TIME_ROLLOUT, "async": metrics.TIME_STEP},
        "per_rollout_s": per_rollout_s,
        "reward": {name: [r.get(metrics.REWARD_MEAN) for r in steps] for name, steps in records.items()},
        "per_step": {
            name: [{key: r[key] for key in PER_STEP if key in r} for r in steps]
            for name, steps in records.items()
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
