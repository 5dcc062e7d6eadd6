"""Fault injection into a running run of this process: find its processes, kill or stop them at a step, and
read what the run recorded (`metrics.jsonl`, `faults.jsonl`).

The run's processes are found among the descendants of this process (the Ray instance a test module starts
here, its workers, and the engines they start): Ray workers by their process title (`ray::<Class>...`),
engines by their command line (`asyncrl_engine` and the model folder) and a parent other than this
process.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from asyncrl_core import metrics
from asyncrl_core.runner.liveness import FAULTS_FILE

WORKER_CLASSES = ("AgentLoopWorker", "RolloutWorker", "ActorWorker", "BufferWorker")
"""The Ray actor classes of a run, as their processes' titles begin (`ray::ActorWorker.train`)."""
ENGINE_MODULE = "asyncrl_engine"
"""Engines run as `python -m asyncrl_engine`; the launcher checks their flags with `asyncrl_engine.flags`."""


def _descendants() -> list[psutil.Process]:
    return psutil.Process().children(recursive=True)


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return []


def worker_pids(class_name: str) -> list[int]:
    """Processes of this process's Ray instance running an actor of `class_name`."""
    found = []
    for process in _descendants():
        line = _cmdline(process)
        if line and line[0].startswith(f"ray::{class_name}") and process.status() != psutil.STATUS_ZOMBIE:
            found.append(process.pid)
    return found


def engine_pids(model_path: Path) -> list[int]:
    """Built-in engine processes serving `model_path` that a run's workers started under this process.

    Engines this process started itself (a session's contract engines serve the same model) are not a run's.
    """
    found = []
    for process in _descendants():
        line = " ".join(_cmdline(process))
        if (
            f" -m {ENGINE_MODULE} " in f" {line} "
            and str(model_path) in line
            and process.ppid() != os.getpid()
            and process.status() != psutil.STATUS_ZOMBIE
        ):
            found.append(process.pid)
    return found


def leftovers(model_path: Path) -> list[str]:
    """The run's processes still alive: engines of `model_path` and Ray workers of the run's classes."""
    alive = [f"engine {pid}" for pid in engine_pids(model_path)]
    for class_name in WORKER_CLASSES:
        alive += [f"{class_name} {pid}" for pid in worker_pids(class_name)]
    return alive


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll `condition` (a record of the run, a process table) every 0.2 s; `TimeoutError` naming `what`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_s:.0f} s")
        time.sleep(0.2)


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            break  # a line being written
    return records


def steps_logged(run_dir: Path) -> int:
    """Training steps in `metrics.jsonl` so far."""
    return sum(1 for record in _jsonl(run_dir / "metrics.jsonl") if metrics.TIME_STEP in record)


def fault_events(run_dir: Path) -> list[dict[str, Any]]:
    """The records of `faults.jsonl` so far."""
    return _jsonl(run_dir / FAULTS_FILE)


@dataclass
class Injected:
    """One fault: the part it hits (as `faults.jsonl` names it) and when (unix time)."""

    part: str
    what: str
    at: float
    step: int = 0
    """Training steps logged when it was injected."""


@dataclass(eq=False)
class Injector(threading.Thread):
    """Runs `plan(injector)` beside a run; an error is kept for the test to raise."""

    run_dir: Path
    plan: Callable[[Injector], None]
    injected: list[Injected] = field(default_factory=list[Injected])
    error: BaseException | None = None

    def __post_init__(self) -> None:
        super().__init__(daemon=True)

    def run(self) -> None:
        try:
            self.plan(self)
        except BaseException as error:  # reported by the test
            self.error = error

    def after_steps(self, count: int, timeout_s: float = 300.0) -> None:
        wait_until(lambda: steps_logged(self.run_dir) >= count, timeout_s, f"step {count}")

    def signal(self, pid: int, signum: signal.Signals, part: str) -> None:
        self.injected.append(Injected(part, signum.name, time.time(), steps_logged(self.run_dir)))
        os.kill(pid, signum)

    def until_recovered(self, part: str, timeout_s: float = 120.0) -> None:
        """Wait for a `recovered` event of `part` after the last fault injected."""
        self.until_event(part, "recovered", timeout_s)

    def until_event(self, part: str, event: str, timeout_s: float = 120.0) -> None:
        """Wait for an `event` (`failed`, `recovered`) of `part` after the last fault injected."""
        since = self.injected[-1].at

        def recorded() -> bool:
            return any(
                record["part"] == part and record["event"] == event and record["time"] >= since
                for record in fault_events(self.run_dir)
            )

        wait_until(recorded, timeout_s, f"the {event} event of {part}")

    def until_step(
        self, condition: Callable[[dict[str, float]], bool], what: str, timeout_s: float = 120.0
    ) -> None:
        """Wait for a training step logged after the last fault was injected whose metrics meet
        `condition`."""
        since = self.injected[-1].step

        def logged() -> bool:
            return any(
                metrics.TIME_STEP in record and record["step"] > since and condition(record)
                for record in _jsonl(self.run_dir / "metrics.jsonl")
            )

        wait_until(logged, timeout_s, what)

    def until_driver_waits_in(self, function: str, for_s: float = 2.0, timeout_s: float = 120.0) -> None:
        """Wait until the run's driver (this process's main thread) has been inside one call of `function`
        (`wait_batch`) for `for_s`: it waits there for something that does not come."""
        main = threading.main_thread().ident
        seen: list[Any] = [None, 0.0]

        def waiting() -> bool:
            frame = sys._current_frames().get(main) if main is not None else None
            while frame is not None and frame.f_code.co_name != function:
                frame = frame.f_back
            if frame is None or frame is not seen[0]:
                seen[:] = [frame, time.monotonic()]
                return frame is not None and for_s <= 0
            return time.monotonic() - seen[1] >= for_s

        wait_until(waiting, timeout_s, f"a wait of the driver in {function} of {for_s:.0f} s")


def first_event(run_dir: Path, fault: Injected, event: str) -> dict[str, Any]:
    """The first `event` recorded for the part of `fault` after it was injected."""
    for record in fault_events(run_dir):
        if record["part"] == fault.part and record["event"] == event and record["time"] >= fault.at:
            return record
    raise AssertionError(f"no {event} event of {fault.part} after the {fault.what} at {fault.at}")
