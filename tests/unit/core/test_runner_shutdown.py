"""`asyncrl_core.runner.shutdown` without Ray: the processes of a run found by their token and stopped
(SIGTERM, then SIGKILL for one that ignores it), and the watchdog doing the same when its driver's pipe
closes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import psutil
import pytest

from asyncrl_core.runner.shutdown import RUN_TOKEN_ENV, RunInterrupted, run_processes, stop_processes

IGNORES_SIGTERM = (
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
    "time.sleep(600)"
)
WAIT_S = 60.0


SLEEPS = "import time; print('ready', flush=True); time.sleep(600)"


def start(token: str, code: str = SLEEPS) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-c", code],
        env={**os.environ, RUN_TOKEN_ENV: token},
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "ready"
    process.stdout.close()
    return process


def ignores(pid: int, signum: int) -> bool:
    """Whether process `pid` ignores `signum` (its `SigIgn` mask in /proc)."""
    with open(f"/proc/{pid}/status", encoding="utf-8") as status:
        for line in status:
            if line.startswith("SigIgn:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def gone(token: str, timeout_s: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while run_processes(token):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.fixture
def token() -> Iterator[str]:
    value = uuid.uuid4().hex
    yield value
    for process in run_processes(value):
        process.kill()


def test_stop_processes_terms_then_kills_what_ignores_sigterm(token: str) -> None:
    polite, stubborn = start(token), start(token, IGNORES_SIGTERM)
    other = start(uuid.uuid4().hex)  # another run's process is not touched
    try:
        assert {p.pid for p in run_processes(token)} == {polite.pid, stubborn.pid}
        assert stop_processes(token, settle_s=0.1, grace_s=1.0) == 2
        # stop_processes reaped them (they are this test's children): only that they are gone is visible.
        assert gone(token, timeout_s=0.0)
        assert not psutil.pid_exists(stubborn.pid)
        for process in (polite, stubborn):
            process.wait(WAIT_S)  # already reaped: sets its return code
        assert other.poll() is None
    finally:
        other.kill()
        other.wait(WAIT_S)


def test_the_watchdog_stops_the_run_when_the_driver_goes(token: str) -> None:
    watchdog = subprocess.Popen(
        [sys.executable, "-m", "asyncrl_core.runner.shutdown", token],
        stdin=subprocess.PIPE,
        start_new_session=True,
    )
    left = start(token)
    try:
        deadline = time.monotonic() + WAIT_S
        while not ignores(watchdog.pid, signal.SIGTERM):  # once started, deaf to the driver's signals
            assert time.monotonic() < deadline
            time.sleep(0.05)
        watchdog.send_signal(signal.SIGTERM)
        assert watchdog.stdin is not None
        watchdog.stdin.close()  # what the driver's death does to the pipe
        assert watchdog.wait(WAIT_S) == 0
        assert left.wait(WAIT_S) == -signal.SIGTERM  # the watchdog is not its parent: this test reaps it
        assert gone(token)
    finally:
        if watchdog.poll() is None:
            watchdog.kill()


def test_an_interruption_names_the_signal_the_phase_and_what_was_stopped() -> None:
    stopped: list[str] = []
    interrupted = RunInterrupted(signal.SIGTERM, "start-up", stopped)
    assert interrupted.exit_status == 143
    assert RunInterrupted(signal.SIGINT, "training", []).exit_status == 130
    assert isinstance(interrupted, KeyboardInterrupt)
    stopped += ["1 engine, 1 actor rank (still starting)", "Ray"]
    assert interrupted.describe() == (
        "interrupted by SIGTERM during start-up; stopped 1 engine, 1 actor rank (still starting), Ray"
    )
    assert psutil.pid_exists(os.getpid())
