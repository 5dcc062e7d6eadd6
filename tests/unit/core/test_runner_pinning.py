"""`pin_to_cores`: every thread of the process moves to the cores, also threads started before the call."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CHILD = """
import os, sys, threading
from asyncrl_core.runner.workers import pin_to_cores

core = int(sys.argv[1])
started, release = threading.Event(), threading.Event()
thread_id = []

def wait():
    thread_id.append(threading.get_native_id())
    started.set()
    release.wait(30)

other = threading.Thread(target=wait)
other.start()
started.wait(30)
pin_to_cores([core])
mine, theirs = os.sched_getaffinity(0), os.sched_getaffinity(thread_id[0])
print(sorted(mine), sorted(theirs), os.environ["OMP_NUM_THREADS"])
release.set()
other.join(30)
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to move a thread between")
def test_pin_moves_every_thread() -> None:
    core = max(os.sched_getaffinity(0))
    found = subprocess.run(
        [sys.executable, "-c", CHILD, str(core)], capture_output=True, text=True, timeout=120, check=False
    )
    assert found.returncode == 0, found.stderr
    assert found.stdout.split() == [f"[{core}]", f"[{core}]", "1"]


def test_pin_refuses_cores_not_available() -> None:
    missing = max(os.sched_getaffinity(0)) + 1000
    code = f"from asyncrl_core.runner.workers import pin_to_cores; pin_to_cores([{missing}])"
    found = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert found.returncode != 0
    assert f"none of the cores [{missing}] is available" in found.stderr


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin to one")
def test_pin_imports_no_torch_and_torch_takes_one_thread_per_core_later() -> None:
    # An engine or agent-loop worker never uses torch: pinning must not import it (seconds of its start).
    core = max(os.sched_getaffinity(0))
    code = (
        "import sys; from asyncrl_core.runner.workers import pin_to_cores; "
        f"pin_to_cores([{core}]); print('torch' in sys.modules); import torch; print(torch.get_num_threads())"
    )
    found = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert found.returncode == 0, found.stderr
    assert found.stdout.split() == ["False", "1"]
