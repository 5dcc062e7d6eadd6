"""`asyncrl-plot`: draw one run's metrics, or overlay several runs, from their `metrics.jsonl`.

Exit status: 0 the PNG was written (its path is printed), 2 a folder, a file line or a metric name is wrong
(the message says which).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

_PROGRAM = "asyncrl-plot"
EXIT_OK = 0
EXIT_INVALID = 2


def _metric_names(text: str) -> list[str]:
    found = [name.strip() for name in text.split(",") if name.strip()]
    if not found:
        raise argparse.ArgumentTypeError(
            "expected metric names separated by commas, e.g. rollout/reward/mean"
        )
    return found


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=_PROGRAM,
        description=(
            "Draw the metrics of a run folder, or overlay several runs (one colour per run, the legend "
            "names the folder). By default: reward (and eval reward), step time and staleness over steps."
        ),
        epilog=(
            "examples:\n"
            "  asyncrl-plot runs/searchr1-mini\n"
            "  asyncrl-plot runs/sync runs/async -o sync-vs-async.png\n"
            "  asyncrl-plot runs/a runs/b --metrics rollout/reward/mean,train/kl"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="run folder with metrics.jsonl"
    )
    parser.add_argument(
        "-o",
        "--output",
        type=Path,
        default=Path("curves.png"),
        metavar="OUT.png",
        help="the PNG to write (default: curves.png in the working directory)",
    )
    parser.add_argument(
        "--metrics",
        type=_metric_names,
        metavar="NAME,...",
        help="metric names to draw, one panel each (e.g. rollout/reward/mean,time/step)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    arguments = _parser().parse_args(argv)
    from asyncrl_core.errors import MetricsError
    from asyncrl_core.runner.tracking import plot_runs

    try:
        written = plot_runs(arguments.run_dirs, arguments.output, metrics=arguments.metrics)
    except MetricsError as error:
        print(f"{_PROGRAM}: {error}", file=sys.stderr)
        return EXIT_INVALID
    print(written)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
