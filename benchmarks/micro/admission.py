"""The admission path from Python: the Rust core against the pure-Python baseline, side by side.

    uv run python benchmarks/micro/admission.py [--quick] [--json PATH]

One round puts `ROUND` groups through a buffer: admit each (`try_admit`), complete each with its
versions (a quarter of them three versions old), then one `take_batch(3 * ROUND / 4)` at the current
actor version with `max_actor_accept_staleness = 2`, which drops the stale quarter and hands out the
rest. A cycle is one group through the buffer, so its cost is the round's wall time divided by
`ROUND`. Two ways of calling: `per_group` makes one `try_admit` and one `complete` call per group;
`batched` makes one `try_admit_many` and one `complete_many` call per round. Both take one
`take_batch` per round.

Both implementations are driven by the same Python loop, so the Rust figures include the pyo3 call
overhead (two calls per group per_group, three calls per round batched) and the loop's own cost. The
Rust-only cycle, without Python, is measured by criterion on the same workload:
`cargo bench -p buffer_core --bench admission`. Each figure is the best of `repeats` timed runs, in
process CPU time (robust to other processes sharing the cores) and in wall time.
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

ROUND = 64
VERSION = 1_000
THREADS = 8
IN_FLIGHT = (0, 1_000, 100_000, 1_000_000)
CALLS = ("per_group", "batched")

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
    for group_id in finished:
        complete(group_id, VERSION, VERSION, VERSION)
    return buffer


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
                (group_id, earliest_version, VERSION, VERSION)
                for group_id, earliest_version in zip(group_ids, earliest_versions, strict=True)
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
        for group_id, earliest_version in zip(group_ids, earliest_versions, strict=True):
            complete(group_id, earliest_version, VERSION, VERSION)
        take_batch(num_taken, VERSION)


@dataclass(frozen=True, slots=True)
class Cost:
    """Best cost per cycle over the timed runs, in nanoseconds."""

    wall_ns: float
    cpu_ns: float
    """CPU time of the process (all threads) per cycle: unlike wall time, not inflated when other
    processes compete for the cores."""


def cycle_cost(
    buffer: Any, num_rounds: int, repeats: int, num_threads: int = 1, batched: bool = False
) -> Cost:
    """Best wall and CPU time per cycle of `num_rounds` rounds split over `num_threads` threads."""
    run = run_rounds_batched if batched else run_rounds
    best_wall, best_cpu = math.inf, math.inf
    rounds_per_thread = max(1, num_rounds // num_threads)
    num_cycles = rounds_per_thread * num_threads * ROUND
    for _ in range(repeats):
        if num_threads == 1:
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
    """`per_group` (try_admit, complete per group) or `batched` (try_admit_many, complete_many)."""
    threads: int
    in_flight: int
    cycle_wall_ns: float
    cycle_cpu_ns: float


def measure(num_rounds: int, repeats: int, sizes: tuple[int, ...]) -> list[Row]:
    rows: list[Row] = []
    for name, implementation in IMPLEMENTATIONS.items():
        for in_flight in sizes:
            buffer = prefilled(implementation, in_flight)
            for calls in CALLS:
                cost = cycle_cost(buffer, num_rounds, repeats, batched=calls == "batched")
                rows.append(Row(name, calls, 1, in_flight, cost.wall_ns, cost.cpu_ns))
            del buffer
        buffer = prefilled(implementation, 1_000)
        for calls in CALLS:
            cost = cycle_cost(buffer, num_rounds, repeats, THREADS, batched=calls == "batched")
            rows.append(Row(name, calls, THREADS, 1_000, cost.wall_ns, cost.cpu_ns))
    return rows


def report(rows: list[Row]) -> dict[str, float]:
    """Print the table and the ratios; return the headline figures (ratios on CPU time)."""
    cost = {(row.implementation, row.calls, row.threads, row.in_flight): row for row in rows}
    sizes = sorted({row.in_flight for row in rows if row.threads == 1})
    print(f"admission cycle: ns per group through the buffer (round of {ROUND}, best of the runs)")
    print("  cpu = process CPU time per cycle, wall = elapsed time per cycle")
    header = f"{'calls':>10} {'in flight':>10} {'threads':>7}"
    columns = f"{'rust cpu':>9} {'py cpu':>9} {'py/rust':>8} {'rust wall':>10} {'py wall':>9} {'py/rust':>8}"
    print(f"{header} {columns}")
    for calls in CALLS:
        for threads, in_flights in [(1, sizes), (THREADS, [1_000])]:
            for in_flight in in_flights:
                rust = cost[("rust", calls, threads, in_flight)]
                python = cost[("python", calls, threads, in_flight)]
                print(
                    f"{calls:>10} {in_flight:>10} {threads:>7} "
                    f"{rust.cycle_cpu_ns:>9.0f} {python.cycle_cpu_ns:>9.0f} "
                    f"{python.cycle_cpu_ns / rust.cycle_cpu_ns:>7.1f}x "
                    f"{rust.cycle_wall_ns:>10.0f} {python.cycle_wall_ns:>9.0f} "
                    f"{python.cycle_wall_ns / rust.cycle_wall_ns:>7.1f}x"
                )
    summary: dict[str, float] = {}
    base = 1_000 if 1_000 in sizes else sizes[0]
    largest = sizes[-1]
    for calls in CALLS:
        for threads in (1, THREADS):
            rust, python = cost[("rust", calls, threads, base)], cost[("python", calls, threads, base)]
            summary[f"ratio_cpu_python_over_rust_{calls}_{threads}_threads"] = (
                python.cycle_cpu_ns / rust.cycle_cpu_ns
            )
        summary[f"rust_cycle_cpu_ns_{calls}_1_thread"] = cost[("rust", calls, 1, base)].cycle_cpu_ns
        if largest > base:
            growth = (
                cost[("rust", calls, 1, largest)].cycle_cpu_ns / cost[("rust", calls, 1, base)].cycle_cpu_ns
            )
            summary[f"rust_cpu_growth_{largest}_over_{base}_{calls}"] = growth
            print(f"rust, {calls}: CPU cost per cycle at {largest} in flight / at {base}: {growth:.2f}x")
    if largest > base:
        # The heap holds about `in_flight` groups, so a heap operation grows with log2(in_flight).
        summary["heap_log_growth"] = math.log2(largest) / math.log2(base)
        print(f"  (log2 of the heap size grows {summary['heap_log_growth']:.2f}x)")
    for calls in CALLS:
        print(
            f"python baseline / rust core, CPU per cycle, {calls}: "
            f"{summary[f'ratio_cpu_python_over_rust_{calls}_1_threads']:.1f}x single-threaded, "
            f"{summary[f'ratio_cpu_python_over_rust_{calls}_{THREADS}_threads']:.1f}x with {THREADS} threads"
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
