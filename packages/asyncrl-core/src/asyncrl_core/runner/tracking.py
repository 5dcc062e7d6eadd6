"""The run folder's outputs: TensorBoard events, `metrics.jsonl`, `warnings.log`, progress, `curves.png`.

`RunTracker` writes them while a run goes; `plot_runs` (and the `asyncrl-plot` command) draws one run or
overlays several from their `metrics.jsonl`. TensorBoard (through `torch.utils.tensorboard`), matplotlib and
tqdm are imported only when a tracker or a plot needs them, so importing this module stays light.

`metrics.jsonl` holds one JSON object per logged step, `{"step": n, "<metric name>": value, ...}`; a value
that is not finite (a NaN loss, say) is written as `null`. A step may appear on several lines (training
metrics, then an evaluation's): readers merge the lines of a step in file order, the later value winning.
A resume from the checkpoint of step `k` first removes the lines of steps after `k` (the run that stopped
logged them after its checkpoint; the resumed run logs them again), so each step is logged by one run.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Never, Self

from asyncrl_core import metrics as names
from asyncrl_core.errors import MetricsError
from asyncrl_core.runner.atomic import atomic_write_bytes

if TYPE_CHECKING:
    from types import TracebackType

    from torch.utils.tensorboard import SummaryWriter
    from tqdm import tqdm

    from asyncrl_core.config import LoggingConfig

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
WARNINGS_FILE = "warnings.log"
CURVES_FILE = "curves.png"

History = dict[int, dict[str, float]]
"""Logged metrics by step; a value written as `null` reads back as NaN."""

Panel = tuple[str, tuple[str, ...]]
"""A plot panel: its title and the metric names it draws."""

DEFAULT_PANELS: tuple[Panel, ...] = (
    ("reward", (names.REWARD_MEAN, names.EVAL_REWARD_MEAN)),
    ("step time (s)", (names.TIME_STEP,)),
    ("staleness (versions)", (names.DATA_STALENESS_MEAN,)),
)
"""What `curves.png` shows: reward (and eval reward when present), step time and mean staleness."""


class RunTracker:
    """Writes a run's per-step metrics and warnings into its run folder, and shows its progress.

    - `<run_dir>/tensorboard/`: TensorBoard scalars (when `logging.tensorboard`).
    - `<run_dir>/metrics.jsonl`: one line per logged step (when `logging.jsonl`), flushed at once, so a
      crash loses no logged step.
    - `<run_dir>/warnings.log`: `warn` messages, appended.
    - `<run_dir>/curves.png`: drawn by `close`, from every logged step of the run folder.
    - stderr: a tqdm bar with step, reward, staleness, tokens/s and the latest evaluation's reward when
      `logging.progress_bar` is set and stderr is a terminal; otherwise a short line per logged step.

    A step is logged when it is a multiple of `logging.log_every_steps`, the last step, or carries
    evaluation metrics (so no evaluation is skipped). Resuming (`start_step > 0`) appends to the folder's
    files: TensorBoard events after `start_step` are purged, and `metrics.jsonl` lines of later steps are
    removed first.
    """

    def __init__(self, run_dir: Path, logging: LoggingConfig, *, num_steps: int, start_step: int = 0) -> None:
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        if not 0 <= start_step <= num_steps:
            raise ValueError(f"start_step must be in [0, num_steps={num_steps}], got {start_step}")
        self.run_dir = Path(run_dir)
        self._logging = logging
        self._num_steps = num_steps
        self._last_step = start_step
        self._latest: dict[str, float] = {}
        self._closed = False
        self._jsonl: IO[str] | None = None
        self._writer: SummaryWriter | None = None
        self._bar: tqdm[Never] | None = None

        self.run_dir.mkdir(parents=True, exist_ok=True)
        metrics_path = self.run_dir / METRICS_FILE
        self._history: History = {}
        if metrics_path.exists():
            self._drop_partial_last_line(metrics_path)
            self._drop_steps_after(metrics_path, start_step)
            self._history = read_metrics(metrics_path)
        try:
            if logging.jsonl:
                self._jsonl = open(metrics_path, "a", encoding="utf-8")  # noqa: SIM115 - held until close
            if logging.tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self._writer = SummaryWriter(
                    str(self.run_dir / TENSORBOARD_DIR), purge_step=start_step + 1 if start_step > 0 else None
                )
            if logging.progress_bar and sys.stderr.isatty():
                from tqdm import tqdm

                self._bar = tqdm(
                    total=num_steps, initial=start_step, unit="step", file=sys.stderr, dynamic_ncols=True
                )
        except BaseException:
            self._release()
            raise

    def log_step(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record `metrics` of `step` (1-based; 0 for an evaluation before training).

        Steps never go backwards; a step may be given again (evaluation results after the training
        metrics, say), its lines then merge. Raises `ValueError` for a step out of order or out of range
        and `TypeError` for a value that is not a number; nothing is written then.
        """
        if self._closed:
            raise ValueError("log_step on a closed RunTracker")
        if not self._last_step <= step <= self._num_steps:
            raise ValueError(
                f"step {step} is out of order: the last step was {self._last_step} of {self._num_steps}"
            )
        values: dict[str, float] = {}
        for name, value in metrics.items():
            if name == "step":
                raise ValueError("`step` is the record's step number, not a metric name")
            number = _number(value)
            if number is None:
                raise TypeError(f"metric {name} of step {step} is {type(value).__name__}, not a number")
            values[name] = number

        self._last_step = step
        self._latest.update(values)
        due = (
            step % self._logging.log_every_steps == 0
            or step == self._num_steps
            or not values.keys().isdisjoint(names.EVAL_STEP)
        )
        if due:
            self._history.setdefault(step, {}).update(values)
            if self._jsonl is not None:
                record = {"step": step} | {k: v if math.isfinite(v) else None for k, v in values.items()}
                self._jsonl.write(json.dumps(record, allow_nan=False) + "\n")
                self._jsonl.flush()
            if self._writer is not None:
                for name, value in values.items():
                    self._writer.add_scalar(name, value, global_step=step)
                self._writer.flush()
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            self._bar.set_postfix_str(self._summary(), refresh=True)
        elif due:
            print(f"step {step}/{self._num_steps}  {self._summary()}".rstrip(), file=sys.stderr, flush=True)

    def warn(self, message: str) -> None:
        """Append `message` to `warnings.log` (marked with the last step) and show it on stderr."""
        with open(self.run_dir / WARNINGS_FILE, "a", encoding="utf-8") as log:
            log.write(f"step {self._last_step}: {message}\n")
        line = f"warning: {message}"
        if self._bar is not None:
            self._bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        """Close the writers and the bar, then draw `curves.png`. Calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        self._release()
        draw_curves({"": self._history}, DEFAULT_PANELS, self.run_dir / CURVES_FILE)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _summary(self) -> str:
        parts: list[str] = []
        for label, name, spec in (
            ("reward", names.REWARD_MEAN, ".3f"),
            ("staleness", names.DATA_STALENESS_MEAN, ".2f"),
            ("tokens/s", names.TOKENS_PER_S, ".0f"),
            ("eval reward", names.EVAL_REWARD_MEAN, ".3f"),  # the latest evaluation's, once there is one
        ):
            if name in self._latest:
                parts.append(f"{label} {self._latest[name]:{spec}}")
        return "  ".join(parts)

    def _release(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _drop_steps_after(self, path: Path, start_step: int) -> None:
        """Remove the lines of steps after `start_step` (logged by a run that stopped after its checkpoint
        was taken, and about to be logged again), rewriting the file atomically."""
        lines = path.read_bytes().splitlines(keepends=True)
        kept = [
            line
            for number, line in enumerate(lines, start=1)
            if line.strip() and _parse_record(line.decode(), f"{path}:{number}")[0] <= start_step
        ]
        if len(kept) != len(lines):
            atomic_write_bytes(path, b"".join(kept))

    def _drop_partial_last_line(self, path: Path) -> None:
        """Cut a last line left without its newline by a crash mid-write, so appending starts a new line."""
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            kept = data.rfind(b"\n") + 1
            path.write_bytes(data[:kept])
            self.warn(f"{path}: dropped an incomplete last line ({len(data) - kept} bytes) left by a crash")


def read_metrics(path: Path) -> History:
    """The logged steps of one `metrics.jsonl`, merged by step. Raises `MetricsError` naming the file and
    line of the first line that is not a metrics record."""
    history: History = {}
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            step, values = _parse_record(line, f"{path}:{number}")
            history.setdefault(step, {}).update(values)
    return history


def _parse_record(line: str, where: str) -> tuple[int, dict[str, float]]:
    try:
        record: object = json.loads(line)
    except json.JSONDecodeError as error:
        raise MetricsError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(record, dict):
        raise MetricsError(f"{where}: expected a JSON object, found {type(record).__name__}")
    fields: dict[str, object] = record  # pyright: ignore[reportUnknownVariableType]
    step = fields.pop("step", None)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise MetricsError(f"{where}: `step` must be an integer >= 0, found {step!r}")
    values: dict[str, float] = {}
    for name, value in fields.items():
        number = math.nan if value is None else _number(value)
        if number is None:
            raise MetricsError(f"{where}: metric {name} must be a number or null, found {value!r}")
        values[name] = number
    return step, values


def _number(value: object) -> float | None:
    """`value` as a float if it is an int or a float (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def plot_runs(run_dirs: Sequence[Path], out: Path, *, metrics: Sequence[str] | None = None) -> Path:
    """Draw the `metrics.jsonl` of each run folder into one PNG at `out`, one line per run (the legend is
    the run folder's name); returns `out`.

    `metrics` picks the panels, one per name; by default reward (and eval reward), step time and
    staleness. Raises `MetricsError` for a folder without `metrics.jsonl`, a malformed line (naming file
    and line), or a requested metric that no run logged (listing those that were).
    """
    if not run_dirs:
        raise MetricsError("no run folder given")
    runs: dict[str, History] = {}
    labels = [Path(run_dir).name or str(run_dir) for run_dir in run_dirs]
    if len(set(labels)) < len(labels):  # two folders of the same name: tell them apart by their path
        labels = [str(run_dir) for run_dir in run_dirs]
    for label, run_dir in zip(labels, run_dirs, strict=True):
        path = Path(run_dir) / METRICS_FILE
        if not Path(run_dir).is_dir():
            raise MetricsError(f"{run_dir} is not a folder")
        if not path.is_file():
            raise MetricsError(
                f"{run_dir} has no {METRICS_FILE}: is it a run folder, and was `logging.jsonl` on?"
            )
        runs[label] = read_metrics(path)
    if metrics is None:
        panels = DEFAULT_PANELS
    else:
        logged = {name for history in runs.values() for values in history.values() for name in values}
        missing = [name for name in metrics if name not in logged]
        if missing:
            raise MetricsError(
                f"no run logged {', '.join(missing)}; logged metrics: {', '.join(sorted(logged)) or 'none'}"
            )
        panels = tuple((name, (name,)) for name in metrics)
    return draw_curves(runs, panels, out)


def draw_curves(runs: Mapping[str, History], panels: Sequence[Panel], out: Path) -> Path:
    """Draw `panels` side by side, each over steps, one colour per run, into the PNG `out`; returns `out`.

    A line is labelled with its run's name, and with its metric where the panel draws several (or the
    run has no name). Over many steps the raw values are drawn faintly under a moving average.
    """
    from matplotlib.figure import Figure

    figure = Figure(figsize=(4.8 * len(panels), 3.6), layout="constrained")
    axes = figure.subplots(1, len(panels), squeeze=False)[0]
    for ax, (title, metric_names) in zip(axes, panels, strict=True):
        drawn = False
        for index, (run_name, history) in enumerate(runs.items()):
            for position, metric in enumerate(metric_names):
                points = [
                    (s, v[metric])
                    for s, v in sorted(history.items())
                    if math.isfinite(v.get(metric, math.nan))
                ]
                if not points:
                    continue
                steps = [s for s, _ in points]
                values = [v for _, v in points]
                label_parts = [run_name] if run_name else []
                if len(metric_names) > 1 or not run_name:
                    label_parts.append(metric)
                style = {"color": f"C{index}", "linestyle": "-" if position == 0 else "--"}
                if len(points) >= 20:
                    ax.plot(steps, values, alpha=0.3, linewidth=0.8, **style)
                    ax.plot(
                        steps,
                        _moving_average(values, max(2, len(points) // 15)),
                        label=" ".join(label_parts),
                        **style,
                    )
                else:
                    ax.plot(steps, values, marker="o", markersize=3, label=" ".join(label_parts), **style)
                drawn = True
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    return out


def _moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over up to `window` values (shorter at the start), same length as `values`."""
    averaged: list[float] = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        averaged.append(total / min(index + 1, window))
    return averaged
