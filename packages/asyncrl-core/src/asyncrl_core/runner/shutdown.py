"""Stopping a run from any phase: SIGINT and SIGTERM alike, a second signal forces, nothing left behind.

- The first SIGINT or SIGTERM raises `RunInterrupted` (a `KeyboardInterrupt`) in the driver's main thread,
  wherever it is (starting Ray, building the workers, a step, the final checkpoint), and the run's cleanup
  runs: the workers stop, Ray stops. Ray's own SIGTERM handler (installed by `ray.init`, a C++ failure
  handler that dumps a stack and exits without cleanup) is replaced.
- A signal that arrives while the run is already stopping only says how to force; the next one forces: every
  process of the run gets SIGKILL at once and the driver exits with `128 + signal`.
- Every process a local run starts carries the run's token in its environment (`RUN_TOKEN_ENV`, inherited:
  Ray's GCS, raylet and helpers such as `DashboardAgent` and `RuntimeEnvAgent`, the Ray workers, the engines
  and their children, a retrieval server). When the run ends, those still alive after Ray's own shutdown get
  SIGTERM, then SIGKILL after a grace period, so the command returns with none left.
- A watchdog process (`python -m asyncrl_core.runner.shutdown TOKEN`, in its own session, deaf to SIGINT
  and SIGTERM) holds the read end of a pipe from the driver: when the driver dies, even by SIGKILL, it sees
  the pipe close and stops the run's processes the same way. While the run lives it also remembers, every
  `WATCH_INTERVAL_S`, the processes the token's carriers started (their descendants, by process id and start
  time): Ray's `DashboardAgent` and `RuntimeEnvAgent` rename themselves, which blanks their environment, so
  the token alone would miss them, and they outlive a killed driver for minutes, deaf to SIGTERM.

With `runner.ray_address` (a cluster started with `ray start`) nothing of Ray's is the run's to stop: the
workers are killed through Ray and the engines, in their own process group, get SIGTERM when their Ray worker
dies (`asyncrl_core.server_process`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import psutil

RUN_TOKEN_ENV = "ASYNCRL_RUN_TOKEN"
"""Environment variable whose value marks every process of one local run."""
SETTLE_S = 2.0
"""Seconds the run's processes get to exit by themselves after Ray's shutdown (or the driver's death)."""
GRACE_S = 10.0
"""Seconds the run's processes get after SIGTERM, before SIGKILL."""
WATCHDOG_WAIT_S = SETTLE_S + 2 * GRACE_S
"""Longest the driver waits for the watchdog to finish stopping the run's processes."""
WATCH_INTERVAL_S = 2.0
"""How often the watchdog records the descendants of the run's processes."""
FINISHED = b"finished\n"
"""What the driver writes to the watchdog's pipe before it closes it at the end of a run."""
ORPHANED_SETTLE_S = 1.0
ORPHANED_GRACE_S = 5.0
"""Shorter settle and grace once the driver has died (nothing waits for a clean stop then), so that nothing
of the run lives past 15 s; Ray's agents ignore SIGTERM and are killed after the grace."""

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RunInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped the run. `stopped` is filled by the cleanup as it goes."""

    def __init__(self, signum: int, phase: str, stopped: list[str]) -> None:
        self.signum = signum
        self.phase = phase
        self.stopped = stopped
        super().__init__(f"{signal.Signals(signum).name} during {phase}")

    @property
    def exit_status(self) -> int:
        """`128 + signal`, as a shell reports a process its signal ended: 130 (SIGINT), 143 (SIGTERM)."""
        return 128 + self.signum

    def describe(self) -> str:
        """One line: the signal, the phase it came in, and what was stopped."""
        stopped = ", ".join(self.stopped) or "nothing had started"
        return f"interrupted by {signal.Signals(self.signum).name} during {self.phase}; stopped {stopped}"


class RunStopper:
    """The signal handling and the process cleanup of one run in this (the driver) process.

    `phase` names what the run is doing, for the message; `stopping` is set once the cleanup has begun.
    `local`: the run starts its own Ray instance, so every process carrying the token is the run's.
    """

    def __init__(self, *, local: bool) -> None:
        self.local = local
        self.phase = "start-up"
        self.stopping = False
        self.stopped: list[str] = []
        self.token = uuid.uuid4().hex if local else None
        self._signum: int | None = None
        self._interrupted: RunInterrupted | None = None
        self._previous: dict[int, object] = {}
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._token_before = os.environ.get(RUN_TOKEN_ENV)

    # --- start ----------------------------------------------------------------------------------------

    def start(self) -> None:
        """Mark this process's future children with the run's token, start the watchdog, take the signals."""
        if self.token is not None:
            os.environ[RUN_TOKEN_ENV] = self.token
            self._watchdog = subprocess.Popen(
                [sys.executable, "-m", "asyncrl_core.runner.shutdown", self.token],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
                env={key: value for key, value in os.environ.items() if key != RUN_TOKEN_ENV},
            )
        self.take_signals()

    def take_signals(self) -> None:
        """Handle SIGINT and SIGTERM here (again after `ray.init`, which installs its own); main thread only,
        where Python delivers signals."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in _SIGNALS:
            previous = signal.signal(signum, self._on_signal)
            self._previous.setdefault(signum, previous)

    def interruption(self) -> RunInterrupted | None:
        """The interruption a signal caused, or None. Ray's `ray.get` turns the exception a signal handler
        raises into a plain `KeyboardInterrupt`: the run re-raises this one in its place."""
        return self._interrupted

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self._signum is None:
            self._signum = signum
            if not self.stopping:
                print(f"asyncrl-run: {name}: stopping the run; send it again to force", file=sys.stderr)
                self.stopping = True
                self._interrupted = RunInterrupted(signum, self.phase, self.stopped)
                raise self._interrupted
            print(
                f"asyncrl-run: {name}: stopping already; send it again to force", file=sys.stderr, flush=True
            )
            return
        print(f"asyncrl-run: {name} again: killing the run's processes now", file=sys.stderr)
        if self.token is not None:
            for process in run_processes(self.token, exclude=self._own_pids()):
                _send(process, signal.SIGKILL)
        os._exit(128 + signum)

    # --- end --------------------------------------------------------------------------------------------

    def finish(self) -> None:
        """After Ray's shutdown: stop what is left of the run's processes (bounded), end the watchdog, give
        the signals back."""
        self.stopping = True
        if self.token is not None:
            left = stop_processes(self.token, exclude=self._own_pids())
            if left:
                self.stopped.append(f"{left} leftover process{'es' if left > 1 else ''} (Ray's helpers)")
        if self._watchdog is not None:
            stdin = self._watchdog.stdin
            if stdin is not None:
                # A driver that dies closes the pipe without the word; a watchdog that is gone already
                # (killed by someone) leaves a broken pipe, and nothing to tell.
                with contextlib.suppress(OSError):
                    stdin.write(FINISHED)
                    stdin.flush()
                with contextlib.suppress(OSError):
                    stdin.close()  # the watchdog finds nothing left and exits
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._watchdog.wait(WATCHDOG_WAIT_S)
        if self.token is not None:
            if self._token_before is None:
                os.environ.pop(RUN_TOKEN_ENV, None)
            else:
                os.environ[RUN_TOKEN_ENV] = self._token_before
        if threading.current_thread() is threading.main_thread():
            for signum, previous in self._previous.items():
                signal.signal(signum, previous)  # type: ignore[arg-type]  # a handler signal.signal returned
        self._previous.clear()

    def _own_pids(self) -> set[int]:
        pids = {os.getpid()}
        if self._watchdog is not None:
            pids.add(self._watchdog.pid)
        return pids


# ---------------------------------------------------------------------------------------------------------
# The run's processes


def run_processes(
    token: str, *, exclude: set[int] | None = None, known: dict[int, float] | None = None
) -> list[psutil.Process]:
    """The processes of this user whose environment carries `token`, and those of `known` (process id to
    start time, as `remember_descendants` records them) still alive with the same start time. Processes of
    others, and those that exit meanwhile, are skipped."""
    import psutil

    found: list[psutil.Process] = []
    skip = exclude or set()
    remembered = known or {}
    for process in psutil.process_iter():
        if process.pid in skip:
            continue
        try:
            # A zombie has exited already (its parent, or init, reaps it); it holds nothing.
            if process.status() == psutil.STATUS_ZOMBIE:
                continue
            if remembered.get(process.pid) == process.create_time() or (
                process.environ().get(RUN_TOKEN_ENV) == token
            ):
                found.append(process)
        except (psutil.Error, OSError):
            continue
    return found


def remember_descendants(token: str, known: dict[int, float], *, exclude: set[int]) -> None:
    """Add to `known` the processes carrying `token` and every descendant of theirs (process id to start
    time), whatever their environment says now. One pass over the process table for the parents, one for
    the environments."""
    import psutil

    children: dict[int, list[int]] = {}
    started: dict[int, float] = {}
    for process in psutil.process_iter(["ppid", "create_time"]):
        children.setdefault(process.info["ppid"], []).append(process.pid)
        started[process.pid] = process.info["create_time"]
    found = [process.pid for process in run_processes(token, exclude=exclude, known=known)]
    seen: set[int] = set()
    while found:
        pid = found.pop()
        if pid in seen or pid in exclude or pid not in started:
            continue
        seen.add(pid)
        known[pid] = started[pid]
        found.extend(children.get(pid, ()))


def stop_processes(
    token: str,
    *,
    exclude: set[int] | None = None,
    known: dict[int, float] | None = None,
    settle_s: float = SETTLE_S,
    grace_s: float = GRACE_S,
) -> int:
    """Wait up to `settle_s` for the processes carrying `token` (and those of `known`) to exit by
    themselves, then SIGTERM the rest (their process groups too, for a group leader such as an engine), then
    SIGKILL what is left after `grace_s`. Returns how many had to be signalled."""
    import psutil

    signalled: set[int] = set()
    deadline = time.monotonic() + settle_s
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        for _ in range(3):  # a process may start another while the first are stopped
            alive = run_processes(token, exclude=exclude, known=known)
            if not alive:
                return len(signalled)
            if sig is not None:
                for process in alive:
                    _send(process, sig)
                    signalled.add(process.pid)
            _, alive = psutil.wait_procs(alive, timeout=max(0.1, deadline - time.monotonic()))
            if not alive:
                break
        deadline = time.monotonic() + grace_s
    return len(signalled)


def _send(process: psutil.Process, sig: int) -> None:
    """`sig` to `process`, and to its process group when it leads one other than ours."""
    import psutil

    with contextlib.suppress(psutil.Error, OSError):
        process.send_signal(sig)
    with contextlib.suppress(OSError):
        if os.getpgid(process.pid) == process.pid and process.pid != os.getpgrp():
            os.killpg(process.pid, sig)


# ---------------------------------------------------------------------------------------------------------
# The watchdog


def _main(argv: list[str]) -> int:
    """The watchdog: remember the run's processes until the driver closes the pipe on stdin (done, or
    dead), then stop them."""
    if len(argv) != 1:
        print("usage: python -m asyncrl_core.runner.shutdown TOKEN", file=sys.stderr)
        return 2
    for signum in (*_SIGNALS, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)  # a Ctrl-C or `timeout` meant for the driver
    token, own = argv[0], {os.getpid(), os.getppid()}
    closed = threading.Event()

    said = [b""]

    def wait_for_the_driver() -> None:
        said[0] = sys.stdin.buffer.read()
        closed.set()

    threading.Thread(target=wait_for_the_driver, name="driver-pipe", daemon=True).start()
    known: dict[int, float] = {}
    while not closed.wait(WATCH_INTERVAL_S):
        remember_descendants(token, known, exclude=own)
    if said[0] == FINISHED:
        stop_processes(token, exclude=own, known=known)
    else:  # the pipe closed without a word: the driver died
        stop_processes(token, exclude=own, known=known, settle_s=ORPHANED_SETTLE_S, grace_s=ORPHANED_GRACE_S)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
