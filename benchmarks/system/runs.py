"""What the benchmarks that run whole training runs share: their command line, one warm start for all their
runs, and the means of a run's step records."""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Iterable
from pathlib import Path

from asyncrl_core import metrics
from asyncrl_core.actor.warm_start import warm_start
from asyncrl_core.config import load_config
from asyncrl_core.runner.workers import build_task


def parser(description: str | None, *, steps: int, runs_dir: str, out: str) -> argparse.ArgumentParser:
    """`[CONFIG] [key=value ...] --steps --warmup-steps --runs-dir --out`."""
    result = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    result.add_argument("arguments", nargs="*", metavar="CONFIG key=value")
    result.add_argument("--steps", type=int, default=steps, help="training steps of each run")
    result.add_argument("--warmup-steps", type=int, default=2, help="first steps left out of the means")
    result.add_argument("--runs-dir", type=Path, default=Path(runs_dir))
    result.add_argument("--out", type=Path, default=Path(out))
    return result


def config_and_overrides(arguments: list[str]) -> tuple[str | None, list[str]]:
    """The configuration file (None: the embedded default) and the `key=value` overrides."""
    if arguments and "=" not in arguments[0]:
        return arguments[0], arguments[1:]
    return None, list(arguments)


def common_overrides(config_path: str | None, overrides: list[str]) -> list[str]:
    """`overrides` for runs compared with each other: no progress bar, evaluation or final checkpoint, and
    one warm start (when the configuration has one) that every run then starts from, made once into the
    user cache and reused by later invocations with the same inputs (`asyncrl_core.actor.warm_start`)."""
    overrides = [
        *overrides,
        "logging.progress_bar=false",
        "checkpoint.save_at_end=false",
        "runner.eval_every_steps=null",
    ]
    config = load_config(config_path, overrides)
    if config.warm_start.num_steps == 0:
        return overrides
    print(f"warm start: {config.warm_start.num_steps} steps, shared by every run", flush=True)
    folder = warm_start(config, build_task(config, {}))
    return [
        *overrides,
        f"actor.model_path={folder}",
        f"rollout.model_path={folder}",
        "warm_start.num_steps=0",
    ]


def step_records(run_dir: Path) -> list[dict[str, float]]:
    """The records of `metrics.jsonl` that end a training step."""
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as lines:
        return [record for line in lines if metrics.TIME_STEP in (record := json.loads(line))]


def measured_steps(records: list[dict[str, float]], warmup: int) -> list[dict[str, float]]:
    """The steps after the first `warmup` (all steps if none is left)."""
    return records[warmup:] or records


def means(records: list[dict[str, float]], warmup: int, names: Iterable[str]) -> dict[str, float]:
    """The mean of each of `names` over the measured steps (`measured_steps`).

    Means, not medians: the step rate is the number of steps over their total time, and async step times
    are often bimodal (a step that found its batch ready, one that waited for it), where a median picks
    one of the modes."""
    kept = measured_steps(records, warmup)
    result: dict[str, float] = {}
    for name in names:
        values = [record[name] for record in kept if name in record]
        if values:
            result[name] = statistics.fmean(values)
    return result
