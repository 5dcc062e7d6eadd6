"""A run killed with SIGKILL and resumed loses and repeats nothing: `asyncrl-run` as a user runs it.

Async: killed once after a step's metrics line (before its checkpoint), once inside a checkpoint write; the
newest intact checkpoint is then truncated, so the last resume must pass over it with a warning naming the
file. Sync: killed once after a checkpoint; the resumed run trains the same prompts in the same steps as an
uninterrupted run of the same seed. Each chain runs once per module; the tests read its records.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kill_resume import KillPoint, logged_steps, read_json, run_to_end, run_until
from runner_testing import run_config

from asyncrl_core.cli import main
from asyncrl_core.runner.checkpoint import checkpoints, verify_checkpoint
from asyncrl_core.runner.ledger import audit, trained_by_step

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(2400)]

RESUME = ["checkpoint.resume_from=latest"]
BATCH = 2
ASYNC_STEPS = 9
SYNC_STEPS = 4


@dataclass
class Chain:
    run_dir: Path
    log: Path
    kills: list[int]
    damaged: Path | None = None


def _config(root: Path, model: Path, *, async_mode: bool, num_steps: int) -> Path:
    run_config(
        root,
        model,
        runner={"async_mode": async_mode, "num_steps": num_steps},
        checkpoint={"save_every_steps": 1},
        agentloop={"max_actor_accept_staleness": 1, "task_args": {"num_train": 6, "num_test": 2}},
        rollout_buffer={"max_dropped_groups_per_step": 100},
        logging={"tensorboard": False},
    )
    return root / "config.yaml"


@pytest.fixture(scope="module")
def async_chain(tmp_path_factory: pytest.TempPathFactory, tiny_llama_path: Path) -> Chain:
    root = tmp_path_factory.mktemp("async-chain")
    config = _config(root, tiny_llama_path, async_mode=True, num_steps=ASYNC_STEPS)
    run_dir, log = root / "run", root / "runs.log"
    chooser = random.Random(20)
    first = run_until(config, [], run_dir, KillPoint("after_log", chooser.randint(2, 3)), log)
    resumed_from = int(checkpoints(run_dir)[-1].name.removeprefix("step_"))
    second = run_until(config, RESUME, run_dir, KillPoint("in_checkpoint", resumed_from + 3), log)
    newest = checkpoints(run_dir)[-1]
    assert newest.name == f"step_{second - 1}"
    model = newest / "actor" / "model.safetensors"
    model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
    run_to_end(config, RESUME, log)
    return Chain(run_dir, log, [first, second], damaged=model)


@pytest.fixture(scope="module")
def sync_runs(tmp_path_factory: pytest.TempPathFactory, tiny_llama_path: Path) -> tuple[Chain, Path]:
    root = tmp_path_factory.mktemp("sync-chain")
    config = _config(root, tiny_llama_path, async_mode=False, num_steps=SYNC_STEPS)
    run_dir, log = root / "run", root / "runs.log"
    point = KillPoint("after_checkpoint", random.Random(7).randint(1, 2))
    killed = run_until(config, [], run_dir, point, log)
    run_to_end(config, RESUME, log)
    plain_root = tmp_path_factory.mktemp("sync-uninterrupted")
    run_to_end(_config(plain_root, tiny_llama_path, async_mode=False, num_steps=SYNC_STEPS), [], log)
    return Chain(run_dir, log, [killed]), plain_root / "run"


def _check_run(run_dir: Path, num_steps: int, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """Every prompt of the run accounted for, each step logged once, a summary of the whole run."""
    assert main(["--audit", str(run_dir)]) == 0, capsys.readouterr().out
    ledger = read_json(run_dir / "ledger.json")
    reports = audit(ledger)
    complete = [report for report in reports if report.complete]
    assert complete, "no epoch was issued completely"
    for report in complete:
        assert report.trained + sum(report.dropped.values()) + report.open == ledger["dataset_size"]
    assert logged_steps(run_dir) == list(range(1, num_steps + 1))
    summary = read_json(run_dir / "summary.json")
    prompts = summary["prompts"]
    assert summary["version"] == num_steps
    assert prompts["trained"] == num_steps * BATCH == ledger["totals"]["trained"]
    parts = ("trained", "handed_back", "dropped", "inflight", "buffered")
    assert prompts["issued"] == sum(prompts[part] for part in parts) == ledger["totals"]["issued"]
    assert sum(len(p) for p in trained_by_step(ledger).values()) == num_steps * BATCH
    assert not list((run_dir / "checkpoints").glob(".*")), "a temporary checkpoint folder was left"
    assert verify_checkpoint(checkpoints(run_dir)[-1]) == []
    return ledger


def _check_last_checkpoint_written_once(chain: Chain, num_steps: int) -> None:
    # num_steps is a multiple of save_every_steps: the periodic checkpoint is also the final one.
    final = chain.run_dir / "checkpoints" / f"step_{num_steps}"
    assert chain.log.read_text(encoding="utf-8").count(f"checkpoint {final} written") == 1


def test_async_kills_lose_and_repeat_no_prompt(
    async_chain: Chain, capsys: pytest.CaptureFixture[str]
) -> None:
    ledger = _check_run(async_chain.run_dir, ASYNC_STEPS, capsys)
    _check_last_checkpoint_written_once(async_chain, ASYNC_STEPS)
    # The groups in flight at each resumed checkpoint (how many depends on timing) were handed back and
    # issued again; nothing else was handed back.
    resumes = re.findall(r"resumed from .*: step \d+, (\d+) prompts in flight", async_chain.log.read_text())
    assert len(resumes) == 2
    assert ledger["totals"]["handed_back"] == sum(int(count) for count in resumes)
    # Each step trained one batch, across the three processes.
    assert [len(prompts) for prompts in trained_by_step(ledger).values()] == [BATCH] * ASYNC_STEPS


def test_async_resume_passes_over_a_damaged_checkpoint(async_chain: Chain) -> None:
    assert async_chain.damaged is not None
    damaged = str(async_chain.damaged)
    output = async_chain.log.read_text(encoding="utf-8")
    assert f"checkpoint {async_chain.damaged.parents[1]} is damaged, passed over: {damaged}" in output
    warnings = (async_chain.run_dir / "warnings.log").read_text(encoding="utf-8")
    assert damaged in warnings
    # The resume went back to the checkpoint before it: the step after it was trained again from there.
    second_kill = async_chain.kills[1]
    assert f"resumed from {async_chain.damaged.parents[2] / f'step_{second_kill - 2}'}" in output


def test_sync_kill_and_resume(sync_runs: tuple[Chain, Path], capsys: pytest.CaptureFixture[str]) -> None:
    chain, _ = sync_runs
    ledger = _check_run(chain.run_dir, SYNC_STEPS, capsys)
    _check_last_checkpoint_written_once(chain, SYNC_STEPS)
    assert ledger["totals"]["handed_back"] == 0  # sync checkpoints hold nothing in flight


def test_a_resumed_sync_run_trains_what_an_uninterrupted_one_does(sync_runs: tuple[Chain, Path]) -> None:
    chain, uninterrupted = sync_runs
    resumed = trained_by_step(read_json(chain.run_dir / "ledger.json"))
    assert resumed == trained_by_step(read_json(uninterrupted / "ledger.json"))
    assert list(resumed) == list(range(1, SYNC_STEPS + 1))
