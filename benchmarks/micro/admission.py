"""The admission path: the Rust core against the pure-Python baseline, side by side in one process.

    uv run python benchmarks/micro/admission.py [--quick] [--json PATH]

One round puts `ROUND` groups through a buffer: admit each (`try_admit`), complete each with its
versions (a quarter of them three versions old), then one `take_batch(3 * ROUND / 4)` at the current
actor version with `max_actor_accept_staleness = 2`, which drops the stale quarter and hands out the
rest. A cycle is one group through the buffer, so its cost is the round's time divided by `ROUND`.

Three ways of driving the rounds (`calls`):
- `in_rust`: the Rust core alone. `_buffer_core.run_admission_workload` runs the rounds in Rust
  (`buffer_core::workload`, the same code the criterion bench times) without the GIL, on the same
  prefilled buffer; Python only times the one call. This is what the core costs.
- `per_group`: a Python loop makes one `try_admit` and one `complete` call per group and one
  `take_batch` per round, the same operations in the same order. Through the Rust core this is what a
  Python caller pays (the loop and two pyo3 calls per group); through the baseline it is the baseline.
- `batched`: one `try_admit_many`, one `complete_many` and one `take_batch` call per round.

Each figure is the best of `repeats` timed runs, in process CPU time (all threads of the process, so
it is robust to other processes sharing the cores and counts the 8 threads' work) and in wall time.
The buffer starts with `in_flight` groups generating and as many finished in its heap.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from asyncrl_core import _buffer_core

sys.path.insert(0, str(Path(__file__).resolve().parent))
from py_buffer import PyGroupBuffer

ROUND = _buffer_core.WORKLOAD_ROUND
VERSION = _buffer_core.WORKLOAD_VERSION
THREADS = 8
IN_FLIGHT = (0, 1_000, 100_000, 1_000_000)
CALLS = ("in_rust", "per_group", "batched")
"""`in_rust` exists for the Rust core only."""
IN_RUST_ROUNDS_FACTOR = 5
"""`in_rust` runs this many times the rounds of the Python-driven loops, so that its much shorter
timed runs still last tens of milliseconds."""

Implementation = Callable[..., Any]
IMPLEMENTATIONS: dict[str, Implementation] = {
    "rust": _buffer_core.GroupBuffer,
    "python": PyGroupBuffer,
}


def prefilled(implementation: Implementation, in_flight: int) -> Any:
    """A buffer with `in_flight` groups generating and `in_flight` finished (at the newest version)."""
    # All 2 * in_flight are admitted before half of them finish.
    capacity = 2 * in_flight + THREADS * ROUND
    buffer = implementation(
        max_inflight_groups=capacity,
        max_buffered_groups=2 * capacity,
        max_dropped_groups_per_step=2**62,
        max_actor_accept_staleness=2,
    )
    try_admit, complete = buffer.try_admit, buffer.complete
    finished = [try_admit(prompt_index) for prompt_index in range(in_flight)]
    generating = [try_admit(prompt_index) for prompt_index in range(in_flight)]
    if None in finished or None in generating:
        raise RuntimeError("the prefill must fit the limits")
    for prompt_index, group_id in enumerate(finished):
        complete(group_id, prompt_index, (VERSION, VERSION), VERSION)
    return buffer


def run_rounds_in_rust(buffer: Any, rounds_per_thread: int, num_threads: int = 1) -> None:
    """The rounds run by the Rust core on `num_threads` Rust threads (the GIL released)."""
    counts = _buffer_core.run_admission_workload(buffer, rounds_per_thread, num_threads)
    if counts.num_rounds != rounds_per_thread * num_threads:
        raise RuntimeError(
            f"the workload ran {counts.num_rounds} rounds, not {rounds_per_thread * num_threads}"
        )


def run_rounds_batched(buffer: Any, num_rounds: int) -> None:
    """The same rounds through the batch calls: one `try_admit_many`, one `complete_many` and one
    `take_batch` per round."""
    try_admit_many, complete_many, take_batch = buffer.try_admit_many, buffer.complete_many, buffer.take_batch
    earliest_versions = [VERSION - offset % 4 for offset in range(ROUND)]
    prompt_indices = list(range(ROUND))
    num_taken = 3 * ROUND // 4
    for _ in range(num_rounds):
        group_ids = try_admit_many(prompt_indices)
        complete_many(
            [
                (group_id, prompt_index, (earliest_version, VERSION), VERSION)
                for prompt_index, group_id, earliest_version in zip(
                    prompt_indices, group_ids, earliest_versions, strict=True
                )
            ]
        )
        take_batch(num_taken, VERSION)


def run_rounds(buffer: Any, num_rounds: int) -> None:
    """`num_rounds` rounds of the workload (see the module docstring), one call per group."""
    try_admit, complete, take_batch = buffer.try_admit, buffer.complete, buffer.take_batch
    earliest_versions = [VERSION - offset % 4 for offset in range(ROUND)]
    prompt_indices = range(ROUND)
    num_taken = 3 * ROUND // 4
    for _ in range(num_rounds):
        group_ids = [try_admit(prompt_index) for prompt_index in prompt_indices]
        for prompt_index, group_id, earliest_version in zip(
            prompt_indices, group_ids, earliest_versions, strict=True
        ):
            complete(group_id, prompt_index, (earliest_version, VERSION), VERSION)
        take_batch(num_taken, VERSION)


@dataclass(frozen=True, slots=True)
class Cost:
    """Best cost per cycle over the timed runs, in nanoseconds."""

    wall_ns: float
    cpu_ns: float
    """CPU time of the process (all threads) per cycle: unlike wall time, not inflated when other
    processes compete for the cores."""


RUNS: dict[str, Callable[[Any, int], None]] = {
    "in_rust": run_rounds_in_rust,
    "per_group": run_rounds,
    "batched": run_rounds_batched,
}


def cycle_cost(
    buffer: Any, num_rounds: int, repeats: int, num_threads: int = 1, calls: str = "per_group"
) -> Cost:
    """Best wall and CPU time per cycle of `num_rounds` rounds split over `num_threads` threads."""
    run = RUNS[calls]
    best_wall, best_cpu = math.inf, math.inf
    rounds_per_thread = max(1, num_rounds // num_threads)
    num_cycles = rounds_per_thread * num_threads * ROUND
    for _ in range(repeats):
        if calls == "in_rust":
            # The Rust threads run inside the one call; process CPU time counts all of them.
            start_cpu, start = time.process_time_ns(), time.perf_counter_ns()
            run_rounds_in_rust(buffer, rounds_per_thread, num_threads)
            elapsed, elapsed_cpu = time.perf_counter_ns() - start, time.process_time_ns() - start_cpu
        elif num_threads == 1:
            start_cpu, start = time.process_time_ns(), time.perf_counter_ns()
            run(buffer, rounds_per_thread)
            elapsed, elapsed_cpu = time.perf_counter_ns() - start, time.process_time_ns() - start_cpu
        else:
            barrier = threading.Barrier(num_threads + 1)
            failures: list[BaseException] = []

            def worker(
                barrier: threading.Barrier = barrier, failures: list[BaseException] = failures
            ) -> None:
                barrier.wait(timeout=60)
                try:
                    run(buffer, rounds_per_thread)
                except BaseException as error:
                    failures.append(error)

            threads = [threading.Thread(target=worker) for _ in range(num_threads)]
            for thread in threads:
                thread.start()
            start_cpu = time.process_time_ns()
            barrier.wait(timeout=60)
            start = time.perf_counter_ns()
            for thread in threads:
                thread.join(timeout=600)
            elapsed, elapsed_cpu = time.perf_counter_ns() - start, time.process_time_ns() - start_cpu
            if failures:
                raise failures[0]
        best_wall = min(best_wall, elapsed / num_cycles)
        best_cpu = min(best_cpu, elapsed_cpu / num_cycles)
    return Cost(best_wall, best_cpu)


@dataclass(frozen=True, slots=True)
class Row:
    implementation: str
    calls: str
    """`in_rust` (rounds run by the Rust core), `per_group` (a Python loop calling try_admit and
    complete per group) or `batched` (try_admit_many, complete_many per round)."""
    threads: int
    in_flight: int
    cycle_wall_ns: float
    cycle_cpu_ns: float


def implementation_calls(name: str) -> tuple[str, ...]:
    return CALLS if name == "rust" else tuple(calls for calls in CALLS if calls != "in_rust")


def measure(num_rounds: int, repeats: int, sizes: tuple[int, ...]) -> list[Row]:
    rows: list[Row] = []

    def add(name: str, buffer: Any, threads: int, in_flight: int) -> None:
        for calls in implementation_calls(name):
            rounds = num_rounds * IN_RUST_ROUNDS_FACTOR if calls == "in_rust" else num_rounds
            cost = cycle_cost(buffer, rounds, repeats, threads, calls)
            rows.append(Row(name, calls, threads, in_flight, cost.wall_ns, cost.cpu_ns))

    for name, implementation in IMPLEMENTATIONS.items():
        for in_flight in sizes:
            buffer = prefilled(implementation, in_flight)
            add(name, buffer, 1, in_flight)
            del buffer
        add(name, prefilled(implementation, 1_000), THREADS, 1_000)
    return rows


def baseline_calls(calls: str) -> str:
    """The Python baseline's figure to compare with: the same calls, or per group for `in_rust`
    (the same operations, one at a time)."""
    return "per_group" if calls == "in_rust" else calls


def report(rows: list[Row]) -> dict[str, float]:
    """Print the table and the ratios; return the headline figures (ratios on CPU time)."""
    cost = {(row.implementation, row.calls, row.threads, row.in_flight): row for row in rows}
    sizes = sorted({row.in_flight for row in rows if row.threads == 1})
    print(f"admission cycle: ns per group through the buffer (round of {ROUND}, best of the runs)")
    print("  cpu = process CPU time per cycle (all threads), wall = elapsed time per cycle")
    print("  in_rust: rounds run inside the Rust core; per_group, batched: driven from a Python loop")
    print("  py: the Python baseline driven per_group (for in_rust: the same operations) or batched")
    header = f"{'calls':>10} {'in flight':>10} {'threads':>7}"
    columns = f"{'rust cpu':>9} {'py cpu':>9} {'py/rust':>8} {'rust wall':>10} {'py wall':>9} {'py/rust':>8}"
    print(f"{header} {columns}")
    for calls in CALLS:
        for threads, in_flights in [(1, sizes), (THREADS, [1_000])]:
            for in_flight in in_flights:
                rust = cost[("rust", calls, threads, in_flight)]
                python = cost[("python", baseline_calls(calls), threads, in_flight)]
                print(
                    f"{calls:>10} {in_flight:>10} {threads:>7} "
                    f"{rust.cycle_cpu_ns:>9.0f} {python.cycle_cpu_ns:>9.0f} "
                    f"{python.cycle_cpu_ns / rust.cycle_cpu_ns:>7.1f}x "
                    f"{rust.cycle_wall_ns:>10.0f} {python.cycle_wall_ns:>9.0f} "
                    f"{python.cycle_wall_ns / rust.cycle_wall_ns:>7.1f}x"
                )
    summary: dict[str, float] = {}
    base = 1_000 if 1_000 in sizes else sizes[0]
    print(f"\nat {base} in flight, CPU ns per cycle:")
    for threads in (1, THREADS):
        in_rust = cost[("rust", "in_rust", threads, base)].cycle_cpu_ns
        from_python = cost[("rust", "per_group", threads, base)].cycle_cpu_ns
        baseline = cost[("python", "per_group", threads, base)].cycle_cpu_ns
        baseline_batched = cost[("python", "batched", threads, base)].cycle_cpu_ns
        summary[f"rust_in_rust_cycle_cpu_ns_{threads}_threads"] = in_rust
        summary[f"rust_per_group_cycle_cpu_ns_{threads}_threads"] = from_python
        summary[f"python_per_group_cycle_cpu_ns_{threads}_threads"] = baseline
        for calls in CALLS:
            rust = cost[("rust", calls, threads, base)].cycle_cpu_ns
            python = cost[("python", baseline_calls(calls), threads, base)].cycle_cpu_ns
            summary[f"ratio_cpu_python_over_rust_{calls}_{threads}_threads"] = python / rust
        print(
            f"  {threads} thread(s): (1) rust core, in Rust {in_rust:.0f}; "
            f"(2) rust core from Python, per group {from_python:.0f}; "
            f"(3) python baseline, per group {baseline:.0f} (batched {baseline_batched:.0f})\n"
            f"    (3)/(1) = {baseline / in_rust:.1f}x, (3)/(2) = {baseline / from_python:.1f}x cheaper; "
            f"batched baseline / (1) = {baseline_batched / in_rust:.1f}x"
        )
    largest = sizes[-1]
    if largest > base:
        # The heap holds about `in_flight` groups, so a heap operation grows with log2(in_flight).
        summary["heap_log_growth"] = math.log2(largest) / math.log2(base)
        print(
            f"\ngrowth with groups in flight, 1 thread, CPU ns per cycle (ratio to {base}; "
            f"log2 of the heap size grows {summary['heap_log_growth']:.2f}x from {base} to {largest}):"
        )
        for calls in CALLS:
            at_base = cost[("rust", calls, 1, base)].cycle_cpu_ns
            figures = ", ".join(
                f"{size}: {cost[('rust', calls, 1, size)].cycle_cpu_ns:.0f} "
                f"({cost[('rust', calls, 1, size)].cycle_cpu_ns / at_base:.2f}x)"
                for size in sizes
                if size >= base
            )
            print(f"  rust {calls:>9}: {figures}")
            summary[f"rust_cpu_growth_{largest}_over_{base}_{calls}"] = (
                cost[("rust", calls, 1, largest)].cycle_cpu_ns / at_base
            )
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small sizes and few rounds (a smoke run)")
    parser.add_argument("--rounds", type=int, default=2_000, help="rounds per timed run (default 2000)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure; the best is kept")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    sizes = (0, 1_000, 10_000) if args.quick else IN_FLIGHT
    num_rounds = 50 if args.quick else args.rounds
    repeats = 1 if args.quick else args.repeats
    rows = measure(num_rounds, repeats, sizes)
    summary = report(rows)
    if args.json is not None:
        args.json.write_text(
            json.dumps({"round": ROUND, "rows": [asdict(row) for row in rows], "summary": summary}, indent=2)
            + "\n"
        )


if __name__ == "__main__":
    main()
