"""One run at a time in a run folder: a second run is refused at once, naming the folder and the holder, and
changes nothing there; the lock dies with its holder, so it never blocks a resume."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_cli_run import HEAVY, MINI, imported_modules, run_cli

from asyncrl_core.cli import EXIT_INVALID
from asyncrl_core.runner.folder_lock import LOCK_FILE, RunFolderBusy, locked

HOLD = (
    "import sys, time; from pathlib import Path; from asyncrl_core.runner.folder_lock import locked\n"
    "with locked(Path(sys.argv[1])):\n"
    "    print('held', flush=True)\n"
    "    time.sleep(120)\n"
)


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process holding the lock of `tmp_path / "run"` (as a run in progress does)."""
    with subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True
    ) as process:
        try:
            assert process.stdout is not None
            assert process.stdout.readline() == "held\n"
            yield process
        finally:
            process.kill()
            process.wait(timeout=30)


def test_a_held_folder_is_refused_naming_its_holder(tmp_path: Path, holder: subprocess.Popen[str]) -> None:
    run_dir = tmp_path / "run"
    busy = rf"{run_dir} is in use by another run \(process {holder.pid}\)"
    with pytest.raises(RunFolderBusy, match=busy), locked(run_dir):
        pytest.fail("entered a folder another process holds")


def test_the_lock_dies_with_its_holder(tmp_path: Path, holder: subprocess.Popen[str]) -> None:
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(timeout=30)
    run_dir = tmp_path / "run"
    assert (run_dir / LOCK_FILE).exists()  # the dead holder's file stays, and blocks nothing
    with locked(run_dir):
        assert (run_dir / LOCK_FILE).read_text() == f"{os.getpid()}\n"


def test_the_lock_is_reentrant_within_a_process_and_released_at_the_end(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with locked(run_dir), locked(run_dir):
        pass
    probe = subprocess.run(
        [sys.executable, "-c", HOLD.replace("time.sleep(120)", "pass"), str(run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert probe.returncode == 0, probe.stderr  # another process takes it once this one has let go


def test_asyncrl_run_into_a_busy_folder_changes_nothing_there(
    tmp_path: Path, holder: subprocess.Popen[str]
) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "config.yaml").write_text("the running run's configuration\n")
    done = run_cli(str(MINI), f"runner.run_dir={run_dir}", cwd=tmp_path)
    assert done.returncode == EXIT_INVALID
    assert f"{run_dir} is in use by another run (process {holder.pid})" in done.stderr
    assert "nothing was started" in done.stderr
    assert "Traceback" not in done.stderr
    assert sorted(path.name for path in run_dir.iterdir()) == [LOCK_FILE, "config.yaml"]
    assert (run_dir / "config.yaml").read_text() == "the running run's configuration\n"
    assert imported_modules(done.stderr).isdisjoint(HEAVY)
