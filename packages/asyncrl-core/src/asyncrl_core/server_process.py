"""A local HTTP server run as a child process: both ends of it, in one place.

The parent side (`ServerProcess`): start a command in its own process group with its output in a log file,
the child set to get SIGTERM when the parent process dies (Linux), also by SIGKILL; wait for the port it
writes to a port file (when started on port 0) and for a health URL to answer 200; stop the whole group
(SIGTERM, then SIGKILL after a grace period).

Linux sends the parent-death signal (`PR_SET_PDEATHSIG`) when the *thread* that forked the child exits, not
the process. So every server is started from one thread of this module (`_Spawner`) that lives as long as
the process: a server started from a short-lived thread (an executor's, a Ray thread pool's) outlives that
thread and still dies with the process.

The child side: `write_port_file` (atomic) and `bound_port`, the port an aiohttp runner listens on, read
through its public `addresses`.

Used by the engine launcher, the built-in engine's test helper and the retrieval server's launcher. Nothing
here imports an HTTP framework: readiness is polled with the standard library.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Protocol, cast

from asyncrl_core.errors import AsyncRLError

POLL_S = 0.1
SPAWN_TIMEOUT_S = 120.0
"""Longest a start (fork and exec, run by the spawning thread) may take before it fails."""


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port free on `address` (IPv4 or IPv6) now, for a store or server that binds it right after:
    another process may take it first. A server that can bind port 0 and report its port should."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((address, 0))
        return int(probe.getsockname()[1])


class ServerStartError(AsyncRLError):
    """The server exited or did not become ready in time; the message ends with the end of its log."""


def _die_with_parent(parent_pid: int) -> Callable[[], None]:
    """What the child runs before exec: get SIGTERM when the spawning thread, so the parent process, dies
    (Linux; a no-op elsewhere), and exit at once if the parent is already gone."""

    def preexec() -> None:
        if sys.platform.startswith("linux"):
            pr_set_pdeathsig = 1
            with contextlib.suppress(OSError, AttributeError):
                ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
            if os.getppid() != parent_pid:  # the parent died before the signal was set
                os._exit(1)

    return preexec


_Job = tuple[Callable[[], subprocess.Popen[bytes]], Future[subprocess.Popen[bytes]]]


class _Spawner:
    """The one thread of this process that starts servers: a daemon thread that lives until the process
    exits, so the parent-death signal, tied to the forking thread, fires only when the process dies. A
    process forked from this one starts its own spawner on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        # A forked child has only the forking thread: the spawner's thread and lock are the parent's.
        self._lock = threading.Lock()
        self._jobs = queue.SimpleQueue()
        self._thread = None

    def _run(self, jobs: queue.SimpleQueue[_Job]) -> None:
        while True:
            start, result = jobs.get()
            if not result.set_running_or_notify_cancel():
                continue
            try:
                result.set_result(start())
            except BaseException as error:
                result.set_exception(error)

    def spawn(self, start: Callable[[], subprocess.Popen[bytes]], what: str) -> subprocess.Popen[bytes]:
        """`start()` run on the spawning thread; its process, or its exception."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, args=(self._jobs,), name="asyncrl-server-spawner", daemon=True
                )
                self._thread.start()
            jobs = self._jobs
        result: Future[subprocess.Popen[bytes]] = Future()
        jobs.put((start, result))
        try:
            return result.result(timeout=SPAWN_TIMEOUT_S)
        except BaseException as error:  # a timeout or an interruption: no process may be left behind
            if not result.cancel():
                result.add_done_callback(_stop_late)
            if isinstance(error, TimeoutError):
                raise ServerStartError(f"{what} was not started within {SPAWN_TIMEOUT_S:g} s") from None
            raise


def _stop_late(result: Future[subprocess.Popen[bytes]]) -> None:
    """Kill the group of a process whose start was given up on, once it exists."""
    if not result.cancelled() and result.exception() is None:
        process = result.result()
        with contextlib.suppress(OSError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=SPAWN_TIMEOUT_S)


_SPAWNER = _Spawner()


class ServerProcess:
    """One server process and its process group, its output appended to `log_path`."""

    def __init__(
        self,
        argv: Sequence[str],
        log_path: Path,
        *,
        env: Mapping[str, str] | None = None,
        name: str = "server",
    ) -> None:
        self.argv = tuple(argv)
        self.log_path = log_path
        self.name = name
        log_path.parent.mkdir(parents=True, exist_ok=True)
        environment = {**os.environ, **(env or {})}
        preexec = _die_with_parent(os.getpid())

        def start() -> subprocess.Popen[bytes]:
            with open(log_path, "ab") as log:
                return subprocess.Popen(
                    self.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=environment,
                    start_new_session=True,
                    preexec_fn=preexec,  # only prctl and getppid: safe between fork and exec
                )

        self._popen = _SPAWNER.spawn(start, name)

    def __repr__(self) -> str:
        return f"ServerProcess({self.name!r}, pid={self.pid})"

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def process(self) -> subprocess.Popen[bytes]:
        return self._popen

    def returncode(self) -> int | None:
        """The exit status once the process has exited, else None."""
        return self._popen.poll()

    def log_tail(self, num_lines: int = 40) -> str:
        """The last lines of the server's output."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(0, os.SEEK_END)
                log.seek(max(0, log.tell() - 64 * 1024))
                lines = log.read().decode("utf-8", errors="replace").splitlines()
        except OSError as exc:
            return f"(cannot read {self.log_path}: {exc})"
        return "\n".join(lines[-num_lines:]) or "(no output)"

    def failure(self, what: str) -> ServerStartError:
        return ServerStartError(f"{self.name} {what}; the end of {self.log_path}:\n{self.log_tail()}")

    def check_alive(self) -> None:
        """`ServerStartError` if the process has exited."""
        code = self.returncode()
        if code is not None:
            raise self.failure(f"exited with status {code}")

    def wait_port_file(self, port_file: Path, timeout_s: float) -> int:
        """The port the server wrote to `port_file` (see `write_port_file`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.check_alive()
            with contextlib.suppress(OSError, ValueError):
                return int(port_file.read_text().strip())
            if time.monotonic() >= deadline:
                raise self.failure(f"wrote no port to {port_file} within {timeout_s:g} s")
            time.sleep(POLL_S)

    def wait_ready(self, url: str, timeout_s: float, *, headers: Mapping[str, str] | None = None) -> None:
        """Poll `url` until it answers 200."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.check_alive()
            if http_ok(url, headers=headers):
                return
            if time.monotonic() >= deadline:
                raise self.failure(f"did not answer 200 at {url} within {timeout_s:g} s")
            time.sleep(POLL_S)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to the process group, SIGKILL after `grace_s`; returns once the process is reaped.
        Idempotent."""
        if self._popen.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self._popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self._popen.wait(timeout=grace_s)
        # Children that outlived the leader still share its process group.
        self._signal_group(signal.SIGKILL)

    def _signal_group(self, signum: int) -> None:
        try:
            os.killpg(self._popen.pid, signum)
        except ProcessLookupError:
            pass
        except OSError as exc:
            if exc.errno not in (errno.ESRCH, errno.EPERM):
                raise


def end_orphaned_group(pid: int, timeout_s: float = 10.0) -> bool:
    """SIGKILL the process group that the server process `pid` leads after its parent died (nothing holds
    its `ServerProcess` any more; its parent-death SIGTERM may still be running its shutdown), and wait up
    to `timeout_s` for its leader to end, so that its ports are free. Nothing happens when `pid` is gone or
    leads no group of its own (another process took its id). Whether it is gone (or a zombie) in time."""
    import psutil

    try:
        if os.getpgid(pid) != pid:
            return True
        os.killpg(pid, signal.SIGKILL)
        leader = psutil.Process(pid)
        deadline = time.monotonic() + timeout_s
        # Whoever adopted it reaps it; a zombie holds no port.
        while leader.status() != psutil.STATUS_ZOMBIE:
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
    except (ProcessLookupError, psutil.NoSuchProcess):
        pass
    return True


def http_ok(url: str, *, headers: Mapping[str, str] | None = None, timeout_s: float = 5.0) -> bool:
    """Whether a GET of `url` answers 200 (any failure to connect is False). Never goes through a proxy."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(url, headers=dict(headers or {}))
    try:
        with opener.open(request, timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


# ------------------------------------------------------------------------------------------------ child side
class _Runner(Protocol):
    @property
    def addresses(self) -> list[object]: ...


def bound_port(runner: _Runner, requested: int) -> int:
    """The TCP port an aiohttp `AppRunner` listens on (the one chosen for port 0), else `requested`."""
    for address in runner.addresses:
        if isinstance(address, tuple):
            parts = cast(tuple[object, ...], address)
            if len(parts) >= 2 and isinstance(parts[1], int):
                return parts[1]
    return requested


def write_port_file(path: Path, port: int) -> None:
    """Write `port` atomically, so a reader never sees a half-written number."""
    staging = path.with_name(path.name + ".tmp")
    staging.write_text(f"{port}\n")
    staging.replace(path)
