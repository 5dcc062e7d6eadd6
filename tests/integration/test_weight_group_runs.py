"""Runs that end, by SIGTERM or by finishing, leave the `distributed` weight transport's group on engines
that outlive them (`launch: external`), so the next run against the same engine joins a group of its own.

One built-in engine started by this test serves two `asyncrl-run` commands in turn: the first is stopped by
SIGTERM once a step (and so a weight sync, which forms the group) is logged; the second trains one step and
ends. After each, the engine must hold no group: its `/destroy_weights_update_group` refuses, none by that
name (a group left behind made the next run fail with "already exists"). The second run also finds the
engine labelled with the first run's version: it must sync its own starting weights as version 0 first, or
its groups would look newer than its actor.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runner_testing import run_config

from asyncrl_core import metrics
from asyncrl_core.errors import EngineControlError

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1200)]

START_S = 600.0
"""Longest the first run may take to log its first step (start-up on a loaded 2-core machine)."""
STOP_S = 120.0
"""Longest a run may take to return once stopped, or to train its one step once started."""


def _start(config_path: Path, run_dir: Path, log_path: Path, *overrides: str) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "asyncrl_core.cli", str(config_path), f"runner.run_dir={run_dir}"]
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            [*command, *overrides], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def _logged_steps(run_dir: Path) -> list[dict[str, float]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    return [record for line in lines if metrics.TIME_STEP in (record := json.loads(line))]


def assert_holds_no_group(url: str) -> None:
    """The engine at `url` refuses to destroy the weight-update group: it holds none."""

    async def destroy() -> None:
        from asyncrl_sglang.client import SGLangClient

        async with SGLangClient(url) as client:
            await client.destroy_weights_update_group()

    with pytest.raises(EngineControlError, match="no weight update group named 'weight_update_group'"):
        asyncio.run(destroy())


async def _weight_version(url: str) -> int:
    from asyncrl_sglang.client import SGLangClient

    async with SGLangClient(url) as client:
        return await client.weight_version()


def test_a_stopped_run_and_a_finished_run_each_leave_the_weight_group(
    tmp_path: Path, tiny_llama_path: Path
) -> None:
    from engine_process import serve_builtin

    started: list[subprocess.Popen[bytes]] = []
    with serve_builtin(tiny_llama_path, max_running_requests=8) as engine:
        run_config(
            tmp_path,
            tiny_llama_path,
            runner={"num_steps": 1000},
            cluster={"component_placement": {"actor": 0}},
            rollout={
                "sglang": {"launch": "external", "urls": [engine.url], "weight_transport": "distributed"}
            },
            checkpoint={"save_at_end": False},
        )
        config_path = tmp_path / "config.yaml"
        try:
            first_dir, first_log = tmp_path / "first", tmp_path / "first.log"
            started.append(_start(config_path, first_dir, first_log))
            deadline = time.monotonic() + START_S
            while not _logged_steps(first_dir):
                assert started[0].poll() is None, first_log.read_text(errors="replace")
                assert time.monotonic() < deadline, first_log.read_text(errors="replace")
                time.sleep(0.5)
            assert metrics.TIME_SYNC_WEIGHTS in _logged_steps(first_dir)[0]
            started[0].send_signal(signal.SIGTERM)
            assert started[0].wait(STOP_S) == 143, first_log.read_text(errors="replace")
            assert_holds_no_group(engine.url)

            second_dir, second_log = tmp_path / "second", tmp_path / "second.log"
            started.append(_start(config_path, second_dir, second_log, "runner.num_steps=1"))
            assert started[1].wait(START_S) == 0, second_log.read_text(errors="replace")
            assert [record["step"] for record in _logged_steps(second_dir)] == [1]
            assert asyncio.run(_weight_version(engine.url)) == 1  # the second run's weights reached it
            assert_holds_no_group(engine.url)
        finally:
            for process in started:
                if process.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGKILL)
                    process.wait(30)
