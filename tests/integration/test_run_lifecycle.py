"""`asyncrl-run` stopped by SIGINT or SIGTERM from start-up or training, by a second signal, and by SIGKILL
of the driver: the exit status, the one-line message (the signal named within 30 s of it), no process of the
run left behind (Ray's own helpers included), found by a tag this test puts in the run's environment, and a
ledger that accounts for every prompt. The run folder a stopped start leaves is used again by the same
command.

Each run is a real `asyncrl-run` subprocess in its own session, always killed by the test; the four runs
share one run folder in turn (the second is the first's command again)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from runner_testing import run_config

from asyncrl_core.runner.ledger import audit_run

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1200)]

TAG_ENV = "ASYNCRL_TEST_LIFECYCLE_TAG"
START_S = 600.0
"""Longest a run may take to reach the phase a check waits for (start-up on a loaded 2-core machine)."""
STOP_S = 120.0
"""Longest a stopped run may take to return (a bound for the test, not a measured figure)."""
KILLED_GONE_S = 15.0
"""The bound after SIGKILL of the driver: nothing of the run lives longer."""
NAMED_WITHIN_S = 30.0
"""The bound of the fault suite: a signalled run says it is stopping within this of the signal."""
STARTING = "starting the engines, the actor and the agent loops"
TRAINING = "training: "
CHECKPOINTED = "/checkpoints/step_1 written"


def tagged(tag: str) -> list[psutil.Process]:
    """The processes alive now that inherited `tag` (the driver's descendants, wherever they moved)."""
    found: list[psutil.Process] = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(TAG_ENV) == tag and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except (psutil.Error, OSError):
            continue
    return found


def describe(processes: list[psutil.Process]) -> list[str]:
    names: list[str] = []
    for process in processes:
        try:
            names.append(f"{process.pid} {' '.join(process.cmdline())[:100]}")
        except psutil.Error:
            continue
    return names


class Run:
    """One `asyncrl-run CONFIG` subprocess in its own session, its stderr in a file."""

    def __init__(self, config_path: Path, run_dir: Path, log_path: Path) -> None:
        self.tag = uuid.uuid4().hex
        self.descendants: dict[int, float] = {}
        self.log_path = log_path
        self.log = open(log_path, "wb")  # noqa: SIM115  # closed by stop()
        command = [sys.executable, "-m", "asyncrl_core.cli", str(config_path), f"runner.run_dir={run_dir}"]
        self.process = subprocess.Popen(
            command,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, TAG_ENV: self.tag},
            start_new_session=True,
        )

    def output(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def wait_for(self, text: str, timeout_s: float = START_S) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.output():
            assert self.process.poll() is None, f"the run ended before {text!r}:\n{self.output()}"
            assert time.monotonic() < deadline, f"no {text!r} within {timeout_s:.0f} s:\n{self.output()}"
            time.sleep(0.2)

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def wait(self, timeout_s: float = STOP_S) -> int:
        return self.process.wait(timeout_s)

    def remember_descendants(self) -> None:
        """Record the driver's descendants now (process id and start time): Ray's agents rename themselves,
        which blanks their environment, tag included, so only what the run created finds them later."""
        for process in psutil.Process(self.process.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                self.descendants[process.pid] = process.create_time()

    def alive(self) -> list[psutil.Process]:
        """The run's processes alive now: those that inherited the tag, and the remembered descendants."""
        found = {process.pid: process for process in tagged(self.tag)}
        for pid, created in self.descendants.items():
            with contextlib.suppress(psutil.Error):
                process = psutil.Process(pid)
                if process.create_time() == created and process.status() != psutil.STATUS_ZOMBIE:
                    found[pid] = process
        return list(found.values())

    def left(self, timeout_s: float = 0.0) -> list[str]:
        """What of the run is still alive, after waiting up to `timeout_s` for it to go."""
        deadline = time.monotonic() + timeout_s
        while (alive := self.alive()) and time.monotonic() < deadline:
            time.sleep(0.5)
        return describe(alive)

    def stop(self) -> None:
        """Whatever happened: nothing of this run survives the test."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)
        for process in self.alive():
            with contextlib.suppress(psutil.Error):
                process.kill()
        self.log.close()


@pytest.fixture(scope="module")
def config_path(tmp_path_factory: pytest.TempPathFactory, tiny_llama_path: Path) -> Path:
    """A long async run (it is always stopped), written as YAML for the command line."""
    folder = tmp_path_factory.mktemp("lifecycle")
    run_config(
        folder,
        tiny_llama_path,
        runner={"num_steps": 1000},
        agentloop={"task_name": "arith", "task_args": {"num_train": 64, "num_test": 4}, "max_turns": 2},
        checkpoint={"save_at_end": False, "save_every_steps": 1},
    )
    return folder / "config.yaml"


@pytest.fixture
def start(config_path: Path, tmp_path: Path) -> Iterator[Callable[[], Run]]:
    """Starts `asyncrl-run` on the module's configuration with `tmp_path / "run"` as its run folder."""
    runs: list[Run] = []

    def started() -> Run:
        runs.append(Run(config_path, tmp_path / "run", tmp_path / f"run-{len(runs)}.log"))
        return runs[-1]

    yield started
    for run in runs:
        run.stop()


def test_sigint_in_start_up_then_the_same_command_and_sigterm_in_training(
    start: Callable[[], Run], tmp_path: Path
) -> None:
    first = start()
    first.wait_for(STARTING)
    first.signal(signal.SIGINT)
    first.wait_for("SIGINT: stopping the run", NAMED_WITHIN_S)
    assert first.wait() == 130, first.output()
    assert "asyncrl-run: interrupted by SIGINT during start-up; stopped " in first.output()
    assert first.left() == []
    # The same command again: the folder of a start that trained nothing is used again.
    second = start()
    second.wait_for(CHECKPOINTED)
    second.wait_for(TRAINING)
    second.signal(signal.SIGTERM)  # what `timeout`, Slurm and `docker stop` send
    second.wait_for("SIGTERM: stopping the run", NAMED_WITHIN_S)
    assert second.wait() == 143, second.output()
    out = second.output()
    assert "asyncrl-run: interrupted by SIGTERM during training; stopped " in out
    assert "1 engine, 1 actor rank, 1 agent loop, Ray" in out
    assert second.left() == []
    assert (tmp_path / "run" / "config.1.yaml").is_file()
    # The ledger of the last checkpoint, the one a resume starts from, accounts for every prompt.
    sound, lines = audit_run(tmp_path / "run")
    assert sound, lines


def test_a_second_signal_forces_and_sigkill_of_the_driver_leaves_nothing(start: Callable[[], Run]) -> None:
    forced = start()
    forced.wait_for(STARTING)
    # Back to back, so that the second comes while the first one's cleanup runs (not after it ended).
    forced.signal(signal.SIGINT)
    forced.signal(signal.SIGTERM)
    assert forced.wait() == 143, forced.output()
    assert "SIGINT: stopping the run; send it again to force" in forced.output()
    assert "SIGTERM again: killing the run's processes now" in forced.output()
    assert forced.left(timeout_s=30.0) == []
    killed = start()
    killed.wait_for(STARTING)
    killed.remember_descendants()  # Ray's processes, its agents included (the workers carry the tag)
    assert any("DashboardAgent" in line for line in describe(killed.alive()))
    killed.process.kill()
    killed.wait()
    # The watchdog sees the driver's pipe close and stops the rest: Ray, its helpers, the engines.
    assert killed.left(timeout_s=KILLED_GONE_S) == []


def test_a_damaged_checkpoint_is_named_before_ray_starts(tmp_path: Path, tiny_llama_path: Path) -> None:
    import ray

    from asyncrl_core.runner import run
    from asyncrl_core.runner.workers import RunnerError

    damaged = tmp_path / "checkpoints" / "step_2"
    damaged.mkdir(parents=True)
    (damaged / "runner_state.json").write_text("{}", encoding="utf-8")
    config = run_config(tmp_path, tiny_llama_path, checkpoint={"resume_from": str(damaged)})
    assert not ray.is_initialized()
    with pytest.raises(RunnerError, match=r"checkpoint\.resume_from: .*step_2 is damaged: .*manifest"):
        run(config)
    assert not ray.is_initialized()
