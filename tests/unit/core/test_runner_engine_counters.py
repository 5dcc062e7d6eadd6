"""The step's `rollout/engine/*` metrics from the engines' cumulative counters read at both ends of the step:
growth summed over engines, a restarted engine counted from 0, and nothing rather than a partial sum."""

from __future__ import annotations

import pytest

from asyncrl_core import metrics
from asyncrl_core.runner.engine_counters import counter_growth
from asyncrl_core.runner.workers import EngineCounters

PREFILL, TOKENS = metrics.ENGINE_PREFILL_S, metrics.ENGINE_NUM_GENERATED_TOKENS


def reading(prefill_s: float, tokens: float | None = None, launch: int = 0) -> EngineCounters:
    values = {PREFILL: prefill_s} | ({TOKENS: tokens} if tokens is not None else {})
    return EngineCounters(launch, values)


def test_growth_is_summed_over_the_engines() -> None:
    before = [reading(1.0, 100), reading(2.0, 50)]
    after = [reading(1.5, 160), reading(2.25, 90)]
    assert counter_growth(before, after) == pytest.approx({PREFILL: 0.75, TOKENS: 100})


def test_a_restarted_engine_counts_from_zero() -> None:
    # The process was restarted (another launch): its counter started again, whatever its value now.
    before = [reading(5.0, 500), reading(1.0, 10)]
    after = [reading(7.0, 700, launch=1), reading(1.5, 20)]
    assert counter_growth(before, after) == pytest.approx({PREFILL: 7.5, TOKENS: 710})
    # A counter that went back (an engine restarted behind the runner's back, `launch: external`).
    assert counter_growth([reading(5.0, 500)], [reading(0.5, 40)]) == pytest.approx(
        {PREFILL: 0.5, TOKENS: 40}
    )


def test_a_counter_one_engine_does_not_report_is_left_out() -> None:
    before = [reading(1.0, 100), reading(2.0)]
    after = [reading(1.5, 160), reading(2.5)]
    assert counter_growth(before, after) == pytest.approx({PREFILL: 1.0})
    assert counter_growth([reading(1.0, 100)], [reading(1.5)]) == pytest.approx({PREFILL: 0.5})
    assert counter_growth([EngineCounters(0, {})], [EngineCounters(0, {})]) == {}


def test_a_failed_reading_leaves_every_counter_out() -> None:
    assert counter_growth([reading(1.0, 100), None], [reading(1.5, 160), reading(2.0, 1)]) == {}
    assert counter_growth([reading(1.0, 100), reading(2.0, 1)], [None, reading(2.5, 2)]) == {}
    assert counter_growth([], [reading(1.0)]) == {}  # no reading at the start of the window
    assert counter_growth([], []) == {}
