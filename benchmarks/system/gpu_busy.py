"""The GPU busy share of a run's rollout windows: `nvidia-smi` samples of `utilization.gpu` taken beside the
run, the wall-clock end of each step seen as its line reaches `metrics.jsonl`, and the mean of the samples
inside each step's window.

Windows (unix seconds), from each step's end and its own `time/*` figures:
- sync mode, the rollout phase: `[end - time/step, end - time/step + time/rollout]`;
- async mode, the whole step (the engines generate throughout): `[end - time/step, end]`.

`utilization.gpu` is the share of the last sample period during which a kernel ran on the GPU: a GPU
shared by the actor and the engine is busy in either's work.

Standard library only.
"""

from __future__ import annotations

import datetime
import json
import shutil
import subprocess
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

SAMPLE_PERIOD_MS = 200
"""How often `nvidia-smi` samples the GPUs."""
QUERY = "timestamp,index,utilization.gpu"
STOP_TIMEOUT_S = 10.0
"""How long a sampler or watcher may take to stop."""
_STEP = "time/step"
_ROLLOUT = "time/rollout"


@dataclass(frozen=True, slots=True)
class GpuSample:
    time: float
    """Unix seconds at which `nvidia-smi` took it."""
    index: int
    """The GPU's `nvidia-smi` index."""
    utilization: float
    """Percent of the sample period the GPU was busy (0-100)."""


def parse_sample(line: str) -> GpuSample | None:
    """One line of `nvidia-smi --query-gpu=timestamp,index,utilization.gpu --format=csv,noheader,nounits`
    (`2026/12/04 17:45:12.345, 0, 87`, local time); None for a line that is not one (`[N/A]`, a message)."""
    parts = [part.strip() for part in line.split(",")]
    if len(parts) != 3:
        return None
    try:
        taken = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        return GpuSample(taken, int(parts[1]), float(parts[2]))
    except ValueError:
        return None


def step_windows(
    records: Sequence[dict[str, float]], step_ends: Sequence[float], warmup: int, *, async_mode: bool
) -> list[tuple[float, float]]:
    """The rollout window of each measured step (the steps after the first `warmup`), in unix seconds: the
    rollout phase in sync mode, the whole step in async mode (module docstring); every step when none is
    left after the warm-up. `step_ends[i]` is when step `records[i]` ended; steps without one are left out."""
    windows: list[tuple[float, float]] = []
    ended = list(zip(records, step_ends, strict=False))
    for record, end in ended[warmup:] if len(records) > warmup else ended:
        start = end - record[_STEP]
        windows.append((start, end) if async_mode else (start, start + record[_ROLLOUT]))
    return windows


def window_mean(
    samples: Sequence[GpuSample], windows: Sequence[tuple[float, float]], indices: Collection[int]
) -> float | None:
    """Mean utilization (0-1) of the samples of GPUs `indices` taken inside any of `windows` (`[start, end]`,
    unix seconds); None when no sample falls in one."""
    values = [
        sample.utilization
        for sample in samples
        if sample.index in indices and any(start <= sample.time <= end for start, end in windows)
    ]
    return sum(values) / len(values) / 100.0 if values else None


class GpuSampler:
    """`nvidia-smi` sampling every GPU each `SAMPLE_PERIOD_MS` in a subprocess from `start` to `stop`, its
    lines read by a thread; `samples` holds what it read."""

    def __init__(self) -> None:
        executable = shutil.which("nvidia-smi")
        if executable is None:
            raise FileNotFoundError("nvidia-smi is not on PATH: GPU utilization cannot be sampled here")
        command = [
            executable,
            f"--query-gpu={QUERY}",
            "--format=csv,noheader,nounits",
            "-lms",
            str(SAMPLE_PERIOD_MS),
        ]
        # Line-buffered output where `stdbuf` exists, so that no sample waits in a pipe buffer at the stop.
        stdbuf = shutil.which("stdbuf")
        self.command = [stdbuf, "-oL", *command] if stdbuf else command
        self.samples: list[GpuSample] = []
        self.num_unparsed = 0
        self._process: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        self._process = subprocess.Popen(
            self.command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        process = self._process

        def read() -> None:
            assert process.stdout is not None
            for line in process.stdout:
                sample = parse_sample(line)
                if sample is None:
                    self.num_unparsed += 1
                else:
                    self.samples.append(sample)

        self._reader = threading.Thread(target=read, name="nvidia-smi reader", daemon=True)
        self._reader.start()

    def stop(self) -> None:
        """End the sampling: SIGTERM, then SIGKILL after `STOP_TIMEOUT_S`; the reader gets as long again."""
        process, self._process = self._process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=STOP_TIMEOUT_S)
        if self._reader is not None:
            self._reader.join(timeout=STOP_TIMEOUT_S)


class StepEndWatcher:
    """The unix time at which each training step's line reached `run_dir/metrics.jsonl` (lines carrying
    `time/step`), polled from a thread every `poll_s` between `start` and `stop`."""

    def __init__(self, run_dir: Path, poll_s: float = 0.05) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.poll_s = poll_s
        self.step_ends: dict[int, float] = {}
        """Step number -> unix seconds when its record was first seen."""
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="metrics.jsonl watcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=STOP_TIMEOUT_S)

    def ends(self, records: Sequence[dict[str, float]]) -> list[float]:
        """The end times of `records`, in their order (stops at the first step that was not seen)."""
        ends: list[float] = []
        for record in records:
            end = self.step_ends.get(int(record["step"]))
            if end is None:
                break
            ends.append(end)
        return ends

    def _watch(self) -> None:
        offset, partial = 0, ""
        while not self._stopped.wait(self.poll_s):
            if not self.path.exists():
                continue
            with open(self.path, encoding="utf-8") as lines:
                lines.seek(offset)
                text = lines.read()
                offset = lines.tell()
            seen = time.time()
            partial += text
            *complete, partial = partial.split("\n")
            for line in complete:
                record = json.loads(line) if line.strip() else {}
                if _STEP in record:
                    self.step_ends.setdefault(int(record["step"]), seen)
