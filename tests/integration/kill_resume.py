"""Kill `asyncrl-run` with SIGKILL at chosen points and resume it: what the kill-and-resume tests and the
long run share.

A run is a subprocess in its own session; a kill sends SIGKILL to its process group and to every process
descended from it (Ray's helpers start sessions of their own), then waits until each is gone. Kill points
are events of the run folder, never delays: a step's line in `metrics.jsonl` (before its checkpoint), a
checkpoint folder (after it), or a checkpoint's temporary folder (inside its write).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl_core import metrics
from asyncrl_core.runner.checkpoint import CHECKPOINT_PREFIX, temporary_folder

POLL_S = 0.005
RUN_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class KillPoint:
    """Where to kill: `after_log` (step `step`'s metrics line is written), `after_checkpoint` (its checkpoint
    folder is complete) or `in_checkpoint` (its checkpoint's temporary folder exists; when a write is too
    quick to catch, the next step's is tried)."""

    kind: str
    step: int


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _processes() -> list[tuple[int, int, int]]:
    """`(pid, parent pid, session id)` of every process, from `/proc`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        found.append((int(entry), int(fields[1]), int(fields[4])))
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


class RunProcess:
    """One `asyncrl-run` in its own session, and every process seen below it or in its session."""

    def __init__(self, config_path: Path, overrides: list[str], log: Path) -> None:
        self.log = log
        # A port of its own for the engine: another run on the machine may hold the default one.
        port = f"rollout.sglang.base_port={free_port()}"
        with open(log, "ab") as output:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "asyncrl_core.cli", str(config_path), *overrides, port],
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.seen: set[int] = {self.process.pid}

    def observe(self) -> None:
        """Note the processes now below the run or in its session (a helper outliving it is found later)."""
        table = _processes()
        children: dict[int, list[int]] = {}
        for pid, parent, session in table:
            children.setdefault(parent, []).append(pid)
            if session == self.process.pid:
                self.seen.add(pid)
        todo = list(self.seen)
        while todo:
            for child in children.get(todo.pop(), []):
                if child not in self.seen:
                    self.seen.add(child)
                    todo.append(child)

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGKILL the run's group and every process seen; wait until all are gone."""
        self.observe()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        for pid in self.seen:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait(timeout=timeout_s)
        deadline = time.monotonic() + timeout_s
        while alive := [pid for pid in self.seen if _alive(pid)]:
            if time.monotonic() > deadline:
                raise AssertionError(f"processes still alive {timeout_s} s after SIGKILL: {alive}")
            time.sleep(0.05)


def logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    steps = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line being written
            continue
        if metrics.TIME_STEP in record:
            steps.append(int(record["step"]))
    return steps


def _reached(run_dir: Path, point: KillPoint, step: int) -> bool:
    final = run_dir / "checkpoints" / f"{CHECKPOINT_PREFIX}{step}"
    if point.kind == "after_log":
        return step in logged_steps(run_dir)
    if point.kind == "after_checkpoint":
        return final.is_dir()
    return temporary_folder(final).is_dir()


def run_until(config_path: Path, overrides: list[str], run_dir: Path, point: KillPoint, log: Path) -> int:
    """Start the run and SIGKILL it (and everything it started) at `point`; returns the step it was killed
    at. Raises when the run ended before."""
    trainings = _trainings(log)
    run = RunProcess(config_path, overrides, log)
    step = point.step
    deadline = time.monotonic() + RUN_TIMEOUT_S
    looks = 0
    try:
        # A step's line counts once this run has started training: by then it has removed the lines that a
        # killed run logged after its checkpoint.
        training = False
        while not (training and _reached(run_dir, point, step)):
            training = training or _trainings(log) > trainings
            final = run_dir / "checkpoints" / f"{CHECKPOINT_PREFIX}{step}"
            if training and point.kind == "in_checkpoint" and final.is_dir():
                step += 1  # that write was over between two looks: catch the next one
            if run.process.poll() is not None:
                raise AssertionError(f"the run ended ({run.process.returncode}) before {point}:\n{tail(log)}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{point} not reached in {RUN_TIMEOUT_S} s:\n{tail(log)}")
            looks += 1
            if looks % 200 == 0:
                run.observe()
            time.sleep(POLL_S)
    finally:
        run.stop()
    return step


def run_to_end(config_path: Path, overrides: list[str], log: Path) -> None:
    """Run to its end (exit status 0 required); then stop whatever it left behind."""
    run = RunProcess(config_path, overrides, log)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while run.process.poll() is None and time.monotonic() < deadline:
            run.observe()
            with contextlib.suppress(subprocess.TimeoutExpired):
                run.process.wait(timeout=1.0)
    finally:
        run.stop()
    assert run.process.returncode == 0, f"asyncrl-run exited with {run.process.returncode}:\n{tail(log)}"


def _trainings(log: Path) -> int:
    """How many runs logging to `log` have started training."""
    if not log.exists():
        return 0
    return log.read_text(encoding="utf-8", errors="replace").count("asyncrl-run: training:")


def tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))
