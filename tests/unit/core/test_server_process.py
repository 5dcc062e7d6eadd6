"""`asyncrl_core.server_process` on Linux: a server dies with the process that started it (also when that
process is killed with SIGKILL), not with the thread that started it, and a process forked after a start can
start servers of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's"
)

WAIT_S = 60.0
SETTLE_S = 1.0
"""How long a server is watched after the thread that started it ended (the signal, if any, comes at once)."""

# The server: reports a SIGTERM in its log, then exits.
SERVER = (
    "import signal, sys, time\n"
    "def stop(signum, frame):\n"
    "    print('SIGTERM', flush=True)\n"
    "    sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, stop)\n"
    "print('serving', flush=True)\n"
    "time.sleep(600)\n"
)

# The parent: starts the server from a thread that ends at once, then lives until it is killed.
PARENT = textwrap.dedent(
    """
    import sys, threading, time
    from pathlib import Path
    from asyncrl_core.server_process import ServerProcess

    started = []
    thread = threading.Thread(
        target=lambda: started.append(ServerProcess([sys.executable, "-c", sys.argv[2]], Path(sys.argv[1])))
    )
    thread.start()
    thread.join()
    print(started[0].pid, flush=True)
    time.sleep(600)
    """
)

# Starts a server, forks; the child starts one of its own and reports both.
FORKED = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from asyncrl_core.server_process import ServerProcess

    argv = [sys.executable, "-c", "import time; time.sleep(600)"]
    first = ServerProcess(argv, Path(sys.argv[1]) / "first.log")
    pid = os.fork()
    if pid == 0:
        second = ServerProcess(argv, Path(sys.argv[1]) / "second.log")
        alive = second.returncode() is None
        second.stop(grace_s=10)
        print("child started", second.pid, "alive", alive, flush=True)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    first.stop(grace_s=10)
    print("child exit", os.waitstatus_to_exitcode(status), flush=True)
    """
)


def gone(pid: int) -> bool:
    """Whether `pid` has exited (a zombie counts: PID 1 may not reap it)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def parent(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], int, Path]]:
    """The parent process, the server's pid and the server's log; both are killed at the end."""
    log_path = tmp_path / "server.log"
    process = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(log_path), SERVER], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    server_pid = 0
    try:
        server_pid = int(process.stdout.readline())
        yield process, server_pid, log_path
    finally:
        process.kill()
        process.wait(timeout=WAIT_S)
        process.stdout.close()
        if server_pid and not gone(server_pid):
            os.killpg(server_pid, signal.SIGKILL)


def test_a_server_outlives_the_thread_that_started_it_and_dies_with_its_process(
    parent: tuple[subprocess.Popen[str], int, Path],
) -> None:
    process, server_pid, log_path = parent
    time.sleep(SETTLE_S)  # the starting thread has ended: a signal sent then has arrived
    assert not gone(server_pid), f"the server exited when its starting thread ended: {log_path.read_text()!r}"
    assert "SIGTERM" not in log_path.read_text()

    process.kill()  # the parent crashes: nothing of it runs to stop the server
    process.wait(timeout=WAIT_S)
    deadline = time.monotonic() + WAIT_S
    while not gone(server_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(server_pid), "the server outlived the process that started it"
    assert "SIGTERM" in log_path.read_text()


def test_a_process_forked_after_a_start_starts_servers_of_its_own(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", FORKED, str(tmp_path)], capture_output=True, text=True, timeout=WAIT_S
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == "child exit 0", result.stdout + result.stderr
    assert lines[0].startswith("child started "), result.stdout
    assert lines[0].endswith(" alive True"), result.stdout


def test_the_orphaned_group_of_a_server_is_ended_and_nothing_else() -> None:
    from asyncrl_core.server_process import end_orphaned_group

    # A server that ignores SIGTERM, leading its own group with a child of its own.
    script = "import signal, subprocess, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    script += "subprocess.Popen(['sleep', '600'])\nprint('serving', flush=True)\ntime.sleep(600)\n"
    server = subprocess.Popen(
        [sys.executable, "-c", script], start_new_session=True, stdout=subprocess.PIPE, text=True
    )
    bystander = subprocess.Popen(["sleep", "600"])  # in this process's group
    try:
        assert server.stdout is not None
        assert server.stdout.readline() == "serving\n"
        (child,) = psutil.Process(server.pid).children()
        assert end_orphaned_group(bystander.pid)  # it leads no group: left alone
        assert bystander.poll() is None
        assert end_orphaned_group(server.pid, timeout_s=WAIT_S)
        assert server.wait(timeout=WAIT_S) == -signal.SIGKILL
        psutil.wait_procs([child], timeout=WAIT_S)
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
        assert end_orphaned_group(server.pid)  # gone: nothing to do
    finally:
        for process in (server, bystander):
            process.kill()
            process.wait(timeout=WAIT_S)
        if server.stdout is not None:
            server.stdout.close()
