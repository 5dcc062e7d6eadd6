"""The run folder's outputs (`RunTracker`), `plot_runs` and the `asyncrl-plot` command."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl_core import metrics as names
from asyncrl_core.config import LoggingConfig
from asyncrl_core.errors import MetricsError
from asyncrl_core.plot import main as plot_main
from asyncrl_core.runner.tracking import RunTracker, plot_runs, read_metrics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def step_metrics(step: int) -> dict[str, float]:
    return {
        names.REWARD_MEAN: 0.1 * step,
        names.TIME_STEP: 2.0 + step,
        names.DATA_STALENESS_MEAN: 0.5,
        names.TOKENS_PER_S: 1000.0 + step,
        names.TRAIN_LOSS: 1.0 / step,
    }


def jsonl_records(run_dir: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def write_run(run_dir: Path, num_steps: int, *, eval_at: int | None = None) -> None:
    with RunTracker(run_dir, LoggingConfig(tensorboard=False), num_steps=num_steps) as tracker:
        for step in range(1, num_steps + 1):
            tracker.log_step(step, step_metrics(step))
            if step == eval_at:
                tracker.log_step(step, {names.EVAL_REWARD_MEAN: 0.3, names.TIME_EVAL: 1.5})


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 10_000  # three panels of lines, not an empty canvas


def test_a_short_run_writes_jsonl_tensorboard_and_curves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    tracker = RunTracker(run_dir, LoggingConfig(), num_steps=4)
    for step in range(1, 5):
        tracker.log_step(step, step_metrics(step))
        # flushed at once: a crash after this point loses nothing
        assert jsonl_records(run_dir)[-1] == {"step": step, **step_metrics(step)}
    tracker.close()
    tracker.close()  # idempotent

    assert jsonl_records(run_dir) == [{"step": s, **step_metrics(s)} for s in range(1, 5)]
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert set(step_metrics(1)) <= set(events.Tags()["scalars"])
    rewards = events.Scalars(names.REWARD_MEAN)
    assert [event.step for event in rewards] == [1, 2, 3, 4]
    assert [event.value for event in rewards] == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert_png(run_dir / "curves.png")
    lines = capsys.readouterr().err.splitlines()  # stderr is no terminal here: one plain line per step
    assert lines[0] == "step 1/4  reward 0.100  staleness 0.50  tokens/s 1001"
    assert len(lines) == 4


def test_log_every_steps_keeps_the_last_step_and_evaluations(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    with RunTracker(run_dir, LoggingConfig(tensorboard=False, log_every_steps=3), num_steps=7) as tracker:
        for step in range(1, 8):
            tracker.log_step(step, step_metrics(step))
            if step == 4:
                tracker.log_step(step, {names.EVAL_REWARD_MEAN: 0.25})
    assert [record["step"] for record in jsonl_records(run_dir)] == [3, 4, 6, 7]
    assert jsonl_records(run_dir)[1] == {"step": 4, names.EVAL_REWARD_MEAN: 0.25}
    # The line of a step shows the latest evaluation's reward once there is one.
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "step 3/7  reward 0.300  staleness 0.50  tokens/s 1003"
    assert lines[1] == "step 4/7  reward 0.400  staleness 0.50  tokens/s 1004  eval reward 0.250"


def test_non_finite_values_are_null_in_jsonl_and_nan_when_read(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with RunTracker(run_dir, LoggingConfig(tensorboard=False), num_steps=1) as tracker:
        tracker.log_step(1, {names.TRAIN_LOSS: math.nan, names.TRAIN_GRAD_NORM: math.inf})
    assert jsonl_records(run_dir) == [{"step": 1, names.TRAIN_LOSS: None, names.TRAIN_GRAD_NORM: None}]
    assert math.isnan(read_metrics(run_dir / "metrics.jsonl")[1][names.TRAIN_LOSS])


def test_bad_calls_are_refused_and_write_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with RunTracker(run_dir, LoggingConfig(tensorboard=False), num_steps=5) as tracker:
        tracker.log_step(2, step_metrics(2))
        with pytest.raises(ValueError, match="step 1 is out of order: the last step was 2 of 5"):
            tracker.log_step(1, step_metrics(1))
        with pytest.raises(ValueError, match="step 6 is out of order"):
            tracker.log_step(6, step_metrics(1))
        with pytest.raises(TypeError, match="metric train/loss of step 3 is str, not a number"):
            tracker.log_step(3, {names.REWARD_MEAN: 1.0, names.TRAIN_LOSS: "low"})  # type: ignore[dict-item]
        with pytest.raises(ValueError, match="`step` is the record's step number"):
            tracker.log_step(3, {"step": 3.0})
    assert [record["step"] for record in jsonl_records(run_dir)] == [2]
    with pytest.raises(ValueError, match="closed"):
        tracker.log_step(5, step_metrics(5))
    with pytest.raises(ValueError, match="start_step must be in"):
        RunTracker(run_dir, LoggingConfig(), num_steps=5, start_step=6)


def test_warnings_go_to_the_log_and_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    with RunTracker(run_dir, LoggingConfig(tensorboard=False, jsonl=False), num_steps=3) as tracker:
        tracker.log_step(1, step_metrics(1))
        tracker.warn("engine 0 restarted")
    assert (run_dir / "warnings.log").read_text() == "step 1: engine 0 restarted\n"
    assert "warning: engine 0 restarted" in capsys.readouterr().err
    assert not (run_dir / "metrics.jsonl").exists()
    assert_png(run_dir / "curves.png")  # drawn from the steps logged in memory


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_terminal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with RunTracker(tmp_path / "run", LoggingConfig(tensorboard=False), num_steps=2) as tracker:
        tracker.log_step(1, step_metrics(1))
        tracker.warn("slow engine")
        tracker.log_step(2, step_metrics(2))
    shown = terminal.getvalue()
    assert "2/2" in shown
    assert "reward 0.200" in shown
    assert "staleness 0.50" in shown
    assert "tokens/s 1002" in shown
    assert "warning: slow engine" in shown
    assert "step 1/2" not in shown  # the bar replaces the plain lines


def test_resume_removes_later_steps_and_repairs_a_torn_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    write_run(run_dir, 4)
    with open(run_dir / "metrics.jsonl", "a") as file:
        file.write('{"step": 5, "rollout/rew')  # a crash in the middle of a write
    with RunTracker(run_dir, LoggingConfig(), num_steps=6, start_step=2) as tracker:
        # The lines of steps 3 and 4 (logged after the checkpoint of step 2) are gone before any new one.
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == [1, 2]
        for step in (3, 4, 5, 6):
            tracker.log_step(step, {names.REWARD_MEAN: 1.0})
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines]
    assert steps == [1, 2, 3, 4, 5, 6]  # each step once
    history = read_metrics(run_dir / "metrics.jsonl")
    assert history[2][names.REWARD_MEAN] == pytest.approx(0.2)
    assert history[4][names.REWARD_MEAN] == 1.0
    assert "dropped an incomplete last line" in (run_dir / "warnings.log").read_text()
    assert not list(run_dir.glob(".*"))  # the rewrite left no temporary file


def test_plot_runs_overlays_runs(tmp_path: Path) -> None:
    write_run(tmp_path / "sync", 30, eval_at=10)
    write_run(tmp_path / "async", 25)
    out = plot_runs([tmp_path / "sync", tmp_path / "async"], tmp_path / "plots" / "both.png")
    assert out == tmp_path / "plots" / "both.png"
    assert_png(out)
    with pytest.raises(MetricsError, match="no run folder given"):
        plot_runs([], tmp_path / "none.png")


def test_asyncrl_plot_draws_two_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_run(tmp_path / "a", 3)
    write_run(tmp_path / "b", 3)
    out = tmp_path / "ab.png"
    arguments = [str(tmp_path / "a"), str(tmp_path / "b"), "-o", str(out)]
    assert plot_main([*arguments, "--metrics", f"{names.TRAIN_LOSS},{names.TOKENS_PER_S}"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert out.read_bytes().startswith(PNG_SIGNATURE)

    script = Path(sys.executable).parent / "asyncrl-plot"
    done = subprocess.run([str(script), *arguments], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert_png(out)


def test_asyncrl_plot_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_run(tmp_path / "good", 2)
    (tmp_path / "empty").mkdir()
    assert plot_main([str(tmp_path / "good"), str(tmp_path / "empty")]) == 2
    assert f"{tmp_path / 'empty'} has no metrics.jsonl" in capsys.readouterr().err
    assert plot_main([str(tmp_path / "missing")]) == 2
    assert f"{tmp_path / 'missing'} is not a folder" in capsys.readouterr().err

    bad = tmp_path / "bad"
    bad.mkdir()
    path = bad / "metrics.jsonl"
    for line, message in [
        ("{nope", "not valid JSON"),
        ("[1, 2]", "expected a JSON object, found list"),
        ('{"loss": 1.0}', "`step` must be an integer >= 0, found None"),
        ('{"step": 3, "train/loss": "high"}', "metric train/loss must be a number or null, found 'high'"),
    ]:
        path.write_text('{"step": 1, "train/loss": 1.0}\n\n' + line + "\n")
        assert plot_main([str(bad), "-o", str(tmp_path / "bad.png")]) == 2
        assert f"asyncrl-plot: {path}:3: {message}" in capsys.readouterr().err
    assert not (tmp_path / "bad.png").exists()

    assert plot_main([str(tmp_path / "good"), "--metrics", "train/nothing"]) == 2
    error = capsys.readouterr().err
    assert "no run logged train/nothing; logged metrics: rollout/data_staleness/mean" in error


def test_importing_the_tracker_is_light() -> None:
    code = (
        "import json, sys; import asyncrl_core.runner.tracking, asyncrl_core.plot; "
        "print(json.dumps(sorted({name.split('.')[0] for name in sys.modules})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    loaded = set(json.loads(done.stdout))
    assert loaded.isdisjoint({"torch", "tensorboard", "matplotlib", "tqdm", "numpy", "pydantic"}), loaded
