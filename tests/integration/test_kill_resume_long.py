"""Ten SIGKILLs in one async run, each at a random point (after a step's metrics line, after a checkpoint,
or inside a checkpoint write), each followed by a resume; then the run goes to its end and its ledger is
audited and reported. Marked `long` (about half an hour on two cores): not in the default suite, where
`test_kill_resume.py` covers the same behaviour with two kills per mode.

    uv run pytest tests/integration/test_kill_resume_long.py -m long -s
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from kill_resume import KillPoint, logged_steps, read_json, run_to_end, run_until
from runner_testing import run_config

from asyncrl_core.runner.checkpoint import checkpoints
from asyncrl_core.runner.ledger import audit_run, trained_by_step

pytestmark = [pytest.mark.long, pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(7200)]

NUM_KILLS = 10
NUM_STEPS = 30
BATCH = 2
KINDS = ("after_log", "after_checkpoint", "in_checkpoint")


def test_ten_kills_in_one_run(tmp_path: Path, tiny_llama_path: Path) -> None:
    run_config(
        tmp_path,
        tiny_llama_path,
        runner={"async_mode": True, "num_steps": NUM_STEPS},
        checkpoint={"save_every_steps": 1},
        agentloop={"max_actor_accept_staleness": 1, "task_args": {"num_train": 8, "num_test": 2}},
        rollout_buffer={"max_dropped_groups_per_step": 100},
        logging={"tensorboard": False},
    )
    config, run_dir, log = tmp_path / "config.yaml", tmp_path / "run", tmp_path / "runs.log"
    chooser = random.Random(2026)
    kills: list[tuple[str, int]] = []
    for number in range(NUM_KILLS):
        found = checkpoints(run_dir)
        last = int(found[-1].name.removeprefix("step_")) if found else 0
        step = min(max(2, last + chooser.randint(1, 3)), NUM_STEPS - 1)
        point = KillPoint(chooser.choice(KINDS), step)
        killed = run_until(config, ["checkpoint.resume_from=latest"] if number else [], run_dir, point, log)
        kills.append((point.kind, killed))
    run_to_end(config, ["checkpoint.resume_from=latest"], log)

    ok, lines = audit_run(run_dir)
    ledger = read_json(run_dir / "ledger.json")
    print(f"\nkills (kind, step): {kills}")
    print("\n".join(lines))
    print(f"summary prompts: {read_json(run_dir / 'summary.json')['prompts']}")
    assert ok, "\n".join(lines)
    assert logged_steps(run_dir) == list(range(1, NUM_STEPS + 1))
    assert ledger["totals"]["trained"] == NUM_STEPS * BATCH
    assert [len(prompts) for prompts in trained_by_step(ledger).values()] == [BATCH] * NUM_STEPS
