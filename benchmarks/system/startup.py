"""Where a run's start-up goes: `asyncrl-run` started, timed to its first step, then stopped with SIGTERM.

    uv run python benchmarks/system/startup.py [CONFIG] [key=value ...] [--repeats 1] [--rebuild-cache]
        [--out FILE]

Default: the embedded `searchr1-mini` (its warm start from the cache once a first run has built it). Each
repeat is a fresh `asyncrl-run` in its own session (a run folder under a temporary directory); the stages
come from the run's own log line `started in ...` (Ray beside the task and model, then the workers, which
start together: when the engines, the actor, the agent loops and the buffer were each ready); the time to
the start of training (`training_s`, the line `training: ...`), to the end of the first step
(`first_step_s`) and the stop after SIGTERM are measured here. Prints one line per repeat and writes them as
JSON (default `benchmarks/results/startup.json`).
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

STARTED = re.compile(
    r"started in ([\d.]+) s: Ray ([\d.]+) s beside task and model ([\d.]+) s, workers ([\d.]+) s \((.*)\)"
)
STAGE = re.compile(r"([a-z ]+) ([\d.]+) s")
LIMIT_S = 900.0


def one_run(config: list[str], run_dir: Path) -> dict[str, Any]:
    started = time.monotonic()
    command = [sys.executable, "-m", "asyncrl_core.cli", *config, f"runner.run_dir={run_dir}"]
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    assert process.stderr is not None
    result: dict[str, Any] = {}
    try:
        for line in process.stderr:
            if (found := STARTED.search(line)) is not None:
                result["started_s"] = float(found[1])
                result["ray_s"] = float(found[2])
                result["task_and_model_s"] = float(found[3])
                result["workers_s"] = float(found[4])
                for stage, seconds in STAGE.findall(found[5]):
                    result[f"{stage.strip().replace(' ', '_')}_s"] = float(seconds)
            if "training: " in line and "training_s" not in result:
                result["training_s"] = time.monotonic() - started
            if "step 1/" in line:
                result["first_step_s"] = time.monotonic() - started
                break
            if time.monotonic() - started > LIMIT_S:
                break
        stopping = time.monotonic()
        process.send_signal(signal.SIGTERM)
        result["exit_status"] = process.wait(120)
        result["stop_s"] = time.monotonic() - stopping
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config", nargs="*", help="CONFIG and key=value overrides (default: searchr1-mini)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--rebuild-cache",
        action="store_true",
        help="pass --rebuild-cache to asyncrl-run: the start-up of a first run (warm start trained anew)",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parents[1] / "results" / "startup.json")
    args = parser.parse_args()
    config = [*args.config, *(["--rebuild-cache"] if args.rebuild_cache else [])]
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="asyncrl-startup-") as folder:
        for index in range(args.repeats):
            result = one_run(config, Path(folder) / f"run-{index}")
            print(json.dumps(result), flush=True)
            results.append(result)
    args.out.write_text(json.dumps({"config": config, "runs": results}, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
