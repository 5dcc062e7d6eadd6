"""Short training runs through Ray on the CPU with tiny models: sync and async drivers, every pause mode, a
staleness cap that forces drops, evaluation and checkpoints. One local Ray instance serves the module."""

from __future__ import annotations

import errno
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from runner_testing import read_metrics, read_summary, run_config

from asyncrl_core import metrics
from asyncrl_core.runner import checkpoint, run
from asyncrl_core.runner.workers import BufferState, RunnerError

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> Iterator[None]:
    ray = pytest.importorskip("ray")

    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


def _check_every_step_logged(run_dir: Path, num_steps: int, names: tuple[str, ...]) -> list[dict[str, float]]:
    records = [record for record in read_metrics(run_dir) if metrics.TIME_STEP in record]
    assert [record["step"] for record in records] == list(range(1, num_steps + 1))
    for record in records:
        missing = [name for name in names if name not in record]
        assert not missing, f"step {record['step']} lacks {missing}"
        # The shares of the step's groups by staleness (`rollout/data_staleness/ratio_<k>`) add up to 1.
        ratios = [
            value for name, value in record.items() if name.startswith(metrics.DATA_STALENESS_RATIO_PREFIX)
        ]
        assert ratios, f"step {record['step']} lacks {metrics.DATA_STALENESS_RATIO_PREFIX}<k>"
        assert sum(ratios) == pytest.approx(1.0)
    return records


@pytest.mark.parametrize("pause_mode", ["retract", "in_place", "drain"])
def test_async_run_in_each_pause_mode(tmp_path: Path, tiny_llama_path: Path, pause_mode: str) -> None:
    # With `kl_coef` > 0 (run_config's) and an evaluation, an async run logs every name of ARCHITECTURE.md
    # section 8: each step's names, the async-only ones, and the evaluation's.
    config = run_config(
        tmp_path, tiny_llama_path, runner={"eval_every_steps": 2}, rollout={"pause_mode": pause_mode}
    )
    run_dir = run(config)
    records = _check_every_step_logged(run_dir, 2, (*metrics.EVERY_STEP, *metrics.ASYNC_MODE_ONLY))
    assert [record[metrics.WEIGHT_VERSION] for record in records] == [1.0, 2.0]
    # The engines' work between step ends, from their counters: present every step, some in the run.
    for name in (metrics.ENGINE_PREFILL_S, metrics.ENGINE_NUM_GENERATED_TOKENS):
        assert all(record[name] >= 0 for record in records)
        assert sum(record[name] for record in records) > 0
    assert records[0][metrics.TRAIN_KL] == pytest.approx(0.0, abs=1e-6)  # the policy starts as the reference
    # The evaluation started at the last step runs beside training and is logged when it ends.
    evaluations = [record for record in read_metrics(run_dir) if metrics.EVAL_REWARD_MEAN in record]
    assert len(evaluations) == 1
    assert all(name in evaluations[0] for name in metrics.EVAL_STEP)
    assert 0.0 <= evaluations[0][metrics.EVAL_REWARD_MEAN] <= 1.0
    summary = read_summary(run_dir)
    assert summary["version"] == 2
    prompts = summary["prompts"]
    assert prompts["trained"] == 4
    assert prompts["issued"] == sum(prompts[key] for key in ("trained", "dropped", "handed_back", "buffered"))
    assert prompts["inflight"] == 0
    assert (run_dir / "curves.png").stat().st_size > 0
    assert (run_dir / "checkpoints" / "step_2" / "runner_state.json").is_file()


def test_sync_run_evaluates_and_resumes(
    tmp_path: Path, tiny_llama_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = run_config(
        tmp_path, tiny_llama_path, runner={"async_mode": False, "eval_every_steps": 1, "num_steps": 2}
    )
    run_dir = run(config)
    records = _check_every_step_logged(run_dir, 2, (*metrics.EVERY_STEP, metrics.TIME_ROLLOUT))
    for record in records:
        assert record[metrics.DATA_STALENESS_MEAN] == 0.0  # sync mode trains on fresh data only
        # Every rollout phase prefills the batch's prompts and generates its tokens.
        assert record[metrics.ENGINE_PREFILL_S] > 0
        assert record[metrics.ENGINE_NUM_GENERATED_TOKENS] >= record[metrics.NUM_MODEL_TOKENS] > 0
        assert metrics.EVAL_REWARD_MEAN in record
    resumed = run_config(
        tmp_path,
        tiny_llama_path,
        runner={"async_mode": False, "num_steps": 3},
        checkpoint={"resume_from": "latest"},
    )
    run(resumed)
    steps = [record["step"] for record in read_metrics(run_dir) if metrics.TIME_STEP in record]
    assert steps == [1, 2, 3]
    assert read_summary(run_dir)["version"] == 3
    # Resumed once more, the finished run says so and stops before anything starts.
    logged = (run_dir / "metrics.jsonl").read_text()
    checkpoints = sorted(path.name for path in (run_dir / "checkpoints").iterdir())
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="asyncrl_core"):
        run(resumed)
    assert "the run has finished: " in caplog.text
    assert "is after step 3, and runner.num_steps is 3; nothing to train" in caplog.text
    assert "starting the engines" not in caplog.text
    assert (run_dir / "metrics.jsonl").read_text() == logged
    assert sorted(path.name for path in (run_dir / "checkpoints").iterdir()) == checkpoints


def test_staleness_cap_drops_and_returns_prompts(tmp_path: Path, tiny_llama_path: Path) -> None:
    config = run_config(
        tmp_path,
        tiny_llama_path,
        runner={"num_steps": 4},
        agentloop={"max_actor_accept_staleness": 0, "task_args": {"num_train": 4, "num_test": 2}},
        rollout_buffer={"max_dropped_groups_per_step": 100},
    )
    run_dir = run(config)
    records = _check_every_step_logged(run_dir, 4, metrics.EVERY_STEP)
    assert all(record[metrics.DATA_STALENESS_MAX] == 0.0 for record in records)
    prompts = read_summary(run_dir)["prompts"]
    assert prompts["dropped"] == sum(record[metrics.DROPPED_GROUPS] for record in records)
    assert prompts["dropped"] > 0
    assert prompts["issued"] == sum(prompts[key] for key in ("trained", "dropped", "handed_back", "buffered"))
    assert prompts["epoch"] >= 2  # 4 prompts, more than 8 issued: dropped ones came back in later epochs


def test_a_checkpoint_that_cannot_be_written_stops_the_run_naming_it(
    tmp_path: Path, tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills up while step 2's checkpoint is written (the driver's write of the buffer's groups
    fails as a full disk does), on a disk reported nearly full from the start."""
    config = run_config(
        tmp_path,
        tiny_llama_path,
        runner={"async_mode": False, "num_steps": 3},
        checkpoint={"save_every_steps": 1},
    )
    write_buffer_state = checkpoint.write_buffer_state
    writes = 0

    def filling_disk(folder: Path, state: BufferState) -> None:
        nonlocal writes
        writes += 1
        if writes == 2:
            full = os.strerror(errno.ENOSPC)
            raise OSError(errno.ENOSPC, full, str(folder / checkpoint.BUFFER_GROUPS_FILE))
        write_buffer_state(folder, state)

    monkeypatch.setattr(checkpoint, "write_buffer_state", filling_disk)
    monkeypatch.setattr(checkpoint, "free_bytes", lambda folder: 1 << 10)
    with pytest.raises(RunnerError) as stopped:
        run(config)
    saved = tmp_path / "run" / "checkpoints"
    assert f"checkpoint {saved / 'step_2'} could not be written: OSError: [Errno 28] " in str(stopped.value)
    assert f"Resume the run from its last checkpoint ({saved / 'step_1'})" in str(stopped.value)
    assert sorted(path.name for path in saved.iterdir()) == ["step_1"]  # no temporary folder left
    faults = [json.loads(line) for line in (tmp_path / "run" / "faults.jsonl").read_text().splitlines()]
    assert [(fault["part"], fault["event"]) for fault in faults] == [("checkpoint", "fatal")]
    warnings = (tmp_path / "run" / "warnings.log").read_text()
    assert "checkpoint: 0.0 MiB free on the disk of " in warnings
    assert "less than the last checkpoint (step_1) took" in warnings
