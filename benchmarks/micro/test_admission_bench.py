"""pytest-benchmark of the admission rounds of `admission.py`, Rust core against the pure-Python baseline.

    uv run pytest benchmarks/micro --benchmark-enable --benchmark-only

CI runs these once each with `--benchmark-disable`, as tests of the workload: after the rounds the buffer
holds exactly what it held before (every admitted group was handed out or dropped).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from admission import IMPLEMENTATIONS, ROUND, prefilled, run_rounds, run_rounds_batched, run_rounds_in_rust

NUM_ROUNDS = 20


@pytest.mark.parametrize("implementation", sorted(IMPLEMENTATIONS))
@pytest.mark.parametrize("run", [run_rounds, run_rounds_batched], ids=["per_group", "batched"])
@pytest.mark.parametrize("in_flight", [0, 1_000])
def test_admission_rounds(
    benchmark: Any, implementation: str, run: Callable[[Any, int], None], in_flight: int
) -> None:
    buffer = prefilled(IMPLEMENTATIONS[implementation], in_flight)
    benchmark.extra_info["groups_per_round"] = ROUND
    benchmark(run, buffer, NUM_ROUNDS)
    assert buffer.num_inflight == in_flight
    assert buffer.num_buffered == in_flight
    totals = buffer.end_step()
    assert totals.dropped_groups % (ROUND // 4) == 0
    assert totals.dropped_groups > 0


@pytest.mark.parametrize("in_flight", [0, 1_000])
def test_admission_rounds_in_rust(benchmark: Any, in_flight: int) -> None:
    """The same rounds run inside the Rust core (`run_admission_workload`)."""
    buffer = prefilled(IMPLEMENTATIONS["rust"], in_flight)
    benchmark.extra_info["groups_per_round"] = ROUND
    benchmark(run_rounds_in_rust, buffer, NUM_ROUNDS)
    assert buffer.num_inflight == in_flight
    assert buffer.num_buffered == in_flight
    totals = buffer.end_step()
    assert totals.dropped_groups % (ROUND // 4) == 0
    assert totals.dropped_groups > 0
