"""pytest-benchmark of the rounds of `admission.py`: the facade, the Rust core from Python and the plain
Python buffer.

    uv run pytest benchmarks/micro --benchmark-enable --benchmark-only

CI runs these once each with `--benchmark-disable`, as tests of the workload: every round hands out the 64
groups it admitted, and the groups kept in flight beside it stay there.
"""

from __future__ import annotations

from typing import Any

import pytest

from admission import IMPLEMENTATIONS, MAX_BUFFERED, MAX_INFLIGHT, make_buffer, run_rounds

NUM_ROUNDS = 10


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("in_flight", [0, 1_000])
def test_admission_rounds(benchmark: Any, implementation: str, in_flight: int) -> None:
    buffer = make_buffer(implementation, MAX_INFLIGHT + in_flight, MAX_BUFFERED + in_flight)
    for prompt_index in range(in_flight):
        assert buffer.try_admit(prompt_index) is not None
    phases = benchmark(run_rounds, implementation, buffer, NUM_ROUNDS)
    assert phases.cycle_ns > 0
    assert (buffer.num_inflight, buffer.num_buffered) == (in_flight, 0)
