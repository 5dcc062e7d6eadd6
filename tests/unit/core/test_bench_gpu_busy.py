"""The sync-against-async benchmark's rollout figures: the GPU busy share averaged over each step's rollout
window (sync: the rollout phase; async: the whole step), the engines' prefill share, and `--gpu-utilization`
refused where `nvidia-smi` is missing."""

from __future__ import annotations

import datetime
import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

from asyncrl_core import metrics

SYSTEM = Path(__file__).resolve().parents[3] / "benchmarks" / "system"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> tuple[ModuleType, ModuleType]:
    """The benchmark's modules `gpu_busy` and `sync_vs_async`, imported as the script imports them."""
    monkeypatch.syspath_prepend(str(SYSTEM))
    return importlib.import_module("gpu_busy"), importlib.import_module("sync_vs_async")


def step(step_s: float, rollout_s: float, **extra: float) -> dict[str, float]:
    return {metrics.TIME_STEP: step_s, metrics.TIME_ROLLOUT: rollout_s, **extra}


def test_parse_sample_reads_nvidia_smi_lines(bench: tuple[ModuleType, ModuleType]) -> None:
    gpu_busy, _ = bench
    sample = gpu_busy.parse_sample("2026/12/04 17:45:12.345, 1, 87\n")
    expected = datetime.datetime(2026, 12, 4, 17, 45, 12, 345000).timestamp()  # local time, as nvidia-smi
    assert (sample.time, sample.index, sample.utilization) == (pytest.approx(expected), 1, 87.0)
    assert gpu_busy.parse_sample("2026/12/04 17:45:12.345, 0, [N/A]") is None
    assert gpu_busy.parse_sample("No devices were found") is None


def test_sync_windows_are_the_rollout_phases_after_the_warmup(bench: tuple[ModuleType, ModuleType]) -> None:
    gpu_busy, _ = bench
    records = [step(10.0, 6.0), step(10.0, 4.0), step(8.0, 5.0)]
    ends = [110.0, 120.0, 128.0]
    assert gpu_busy.step_windows(records, ends, 1, async_mode=False) == [(110.0, 114.0), (120.0, 125.0)]
    assert gpu_busy.step_windows(records, ends, 1, async_mode=True) == [(110.0, 120.0), (120.0, 128.0)]
    # Every step when the warm-up leaves none; a step whose end was not seen is left out.
    assert gpu_busy.step_windows(records[:1], ends[:1], 2, async_mode=False) == [(100.0, 106.0)]
    assert gpu_busy.step_windows(records, ends[:2], 1, async_mode=False) == [(110.0, 114.0)]


def test_window_mean_averages_the_rollout_gpus_samples_inside_the_windows(
    bench: tuple[ModuleType, ModuleType],
) -> None:
    gpu_busy, _ = bench
    sample = gpu_busy.GpuSample
    samples = [
        sample(109.0, 0, 100.0),  # before the first window
        sample(110.0, 0, 80.0),
        sample(112.0, 0, 60.0),
        sample(112.0, 1, 0.0),  # another GPU, not the rollout's
        sample(116.0, 0, 0.0),  # training, between the windows
        sample(121.0, 0, 40.0),
    ]
    windows = [(110.0, 114.0), (120.0, 125.0)]
    assert gpu_busy.window_mean(samples, windows, {0}) == pytest.approx(0.6)
    assert gpu_busy.window_mean(samples, windows, {0, 1}) == pytest.approx(0.45)
    assert gpu_busy.window_mean(samples, [(200.0, 210.0)], {0}) is None


def test_rollout_figures_divide_by_the_mode_s_window(bench: tuple[ModuleType, ModuleType]) -> None:
    _, sync_vs_async = bench
    engine = {metrics.NUM_MODEL_TOKENS: 400.0, metrics.ENGINE_PREFILL_S: 1.0}
    records = [step(10.0, 4.0, **engine), step(10.0, 4.0, **engine)]
    sync = sync_vs_async.rollout_figures(records, 0, async_mode=False, num_engines=2)
    assert sync == pytest.approx({"model_tokens_per_s": 100.0, "engine_prefill_share": 0.125})
    # Async: over the step; the engines' generated tokens where every measured step has them.
    records[1][metrics.ENGINE_NUM_GENERATED_TOKENS] = 500.0
    asynchronous = sync_vs_async.rollout_figures(records, 1, async_mode=True, num_engines=1)
    assert asynchronous == pytest.approx(
        {"model_tokens_per_s": 40.0, "engine_generated_tokens_per_s": 50.0, "engine_prefill_share": 0.1}
    )
    assert "engine_generated_tokens_per_s" not in sync_vs_async.rollout_figures(
        records, 0, async_mode=True, num_engines=1
    )


def test_gpu_utilization_without_nvidia_smi_is_refused(
    bench: tuple[ModuleType, ModuleType],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    gpu_busy, sync_vs_async = bench
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi there
    monkeypatch.setattr(sys, "argv", ["sync_vs_async.py", "--gpu-utilization"])
    with pytest.raises(SystemExit) as exit_info:
        sync_vs_async.main()
    assert exit_info.value.code == 2
    assert "--gpu-utilization samples nvidia-smi, which is not on PATH" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="nvidia-smi"):
        gpu_busy.GpuSampler()
