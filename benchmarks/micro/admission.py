"""The buffer's hot path as the runner calls it: the facade, the Rust core called directly, and a plain
Python implementation of the same contract, side by side in one process.

    uv run python benchmarks/micro/admission.py [--quick] [--json PATH]

The workload: batches of B = 64 groups, `max_inflight_groups` 77, `max_buffered_groups` 128,
`max_actor_accept_staleness` 2; each group holds 8 trajectories of 512 response tokens whose versions come
from engine-style version spans (a weight update in the middle of some requests), so each `Trajectory`
carries the earliest and latest version its builder read off the spans. A *round* admits 64 prompts
(`try_admit`), completes the 64 groups (`complete`), and hands them out (`take_batch(64)`); a *cycle* is
one group through the buffer: the round's admit + complete + hand-off time divided by 64. Building the
`Group` objects is the agent loop's work and is not timed.

Three implementations, driven by the same loop:
- `facade`: `asyncrl_core.buffer.GroupBuffer`, what the runner uses (payloads, typed results).
- `core`: `asyncrl_core._buffer_core.GroupBuffer` called directly with ids and versions (the group id as
  the payload): what the Rust core costs from Python, the facade's own layer left out.
- `plain`: `py_buffer.PlainGroupBuffer`, an idiomatic pure-Python buffer (a dict, a heap, two counters,
  one lock).

Also measured: the cycle with 1e3 to 1e6 groups in flight beside the workload (they stay generating), and
one hand-off of 64 groups from a buffer holding 1e3 or 1e5 finished groups. Figures are process CPU time
(`time.process_time_ns`), best of the timed runs, so other processes sharing the cores do not inflate them;
wall time is printed beside.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from asyncrl_core import _buffer_core
from asyncrl_core.buffer import GroupBuffer
from asyncrl_core.types import Group, Trajectory, VersionSpan

sys.path.insert(0, str(Path(__file__).resolve().parent))
from py_buffer import PlainGroupBuffer

BATCH = 64
MAX_INFLIGHT = 77
MAX_BUFFERED = 128
CAP = 2
GROUP_SIZE = 8
RESPONSE_LEN = 512
VERSION = 1_000
"""The actor version of every hand-off; groups were sampled at VERSION - 2 .. VERSION."""
IMPLEMENTATIONS = ("facade", "core", "plain")


def trajectory(spans: tuple[VersionSpan, ...]) -> Trajectory:
    """A trajectory as the agent loop builds it from one generation: per-token versions expanded from the
    spans, and the version range read off the spans (never off the tokens)."""
    versions = [span.version for span in spans for _ in range(span.start, span.end)]
    used = [span.version for span in spans if span.end > span.start]
    return Trajectory(
        token_ids=[1] * (16 + RESPONSE_LEN),
        prompt_len=16,
        loss_mask=[1] * RESPONSE_LEN,
        rollout_logprobs=[-0.5] * RESPONSE_LEN,
        versions=versions,
        earliest_version=min(used),
        latest_version=max(used),
    )


def group_trajectories(offset: int) -> list[Trajectory]:
    """Eight trajectories; half of them saw a weight update at token 200."""
    old, new = VERSION - offset % 3, VERSION
    updated = (VersionSpan(old, 0, 200), VersionSpan(new, 200, RESPONSE_LEN))
    steady = (VersionSpan(old, 0, RESPONSE_LEN),)
    return [trajectory(updated if index % 2 else steady) for index in range(GROUP_SIZE)]


TRAJECTORIES = [group_trajectories(offset) for offset in range(3)]


def make_buffer(implementation: str, max_inflight_groups: int, max_buffered_groups: int) -> Any:
    cls: Callable[..., Any] = {
        "facade": GroupBuffer,
        "core": _buffer_core.GroupBuffer,
        "plain": PlainGroupBuffer,
    }[implementation]
    return cls(
        max_inflight_groups=max_inflight_groups,
        max_buffered_groups=max_buffered_groups,
        max_dropped_groups_per_step=2**62,
        max_actor_accept_staleness=CAP,
    )


def complete_all(implementation: str, buffer: Any, group_ids: list[int], first_prompt: int) -> None:
    """Complete freshly admitted groups, untimed (prefills)."""
    for offset, group_id in enumerate(group_ids):
        prompt_index = first_prompt + offset
        if implementation == "core":
            buffer.complete(group_id, prompt_index, (VERSION - offset % 3, VERSION), None, group_id)
        else:
            buffer.complete(Group(group_id, prompt_index, TRAJECTORIES[offset % 3]))


@dataclass(slots=True)
class Phases:
    """CPU and wall nanoseconds per group of each phase of the best round set."""

    admit_ns: float
    complete_ns: float
    hand_off_ns: float
    cycle_ns: float
    cycle_wall_ns: float


@contextmanager
def no_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def run_rounds(implementation: str, buffer: Any, num_rounds: int) -> Phases:
    """`num_rounds` rounds; the CPU time of each phase summed over the rounds, per group."""
    prompts = range(BATCH)
    cpu = time.process_time_ns
    admit = complete = hand_off = wall = 0
    try_admit, take_batch = buffer.try_admit, buffer.take_batch
    for _ in range(num_rounds):
        start_wall, start = time.perf_counter_ns(), cpu()
        group_ids = [try_admit(prompt_index) for prompt_index in prompts]
        admitted_wall, admitted = time.perf_counter_ns(), cpu()
        if implementation == "core":
            versions = [(VERSION - offset % 3, VERSION) for offset in prompts]
            built_wall, built = time.perf_counter_ns(), cpu()
            core_complete = buffer.complete
            for group_id, prompt_index, version_range in zip(group_ids, prompts, versions, strict=True):
                core_complete(group_id, prompt_index, version_range, None, group_id)
        else:
            groups = [
                Group(group_id, prompt_index, TRAJECTORIES[prompt_index % 3])
                for group_id, prompt_index in zip(group_ids, prompts, strict=True)
            ]
            built_wall, built = time.perf_counter_ns(), cpu()
            facade_complete = buffer.complete
            for group in groups:
                facade_complete(group)
        completed = cpu()
        result = take_batch(BATCH, VERSION)
        taken, taken_wall = cpu(), time.perf_counter_ns()
        handed_out = len(result[0]) if implementation == "core" else len(result.groups)
        if handed_out != BATCH:
            raise RuntimeError(f"{implementation}: the hand-off gave {handed_out} groups, not {BATCH}")
        # The batch is freed outside the timed phases, as a trainer frees it after its step.
        del result
        admit += admitted - start
        complete += completed - built
        hand_off += taken - completed
        wall += (admitted_wall - start_wall) + (taken_wall - built_wall)
    per_group = num_rounds * BATCH
    return Phases(
        admit / per_group,
        complete / per_group,
        hand_off / per_group,
        (admit + complete + hand_off) / per_group,
        wall / per_group,
    )


def best(measure: Callable[[], Phases], repeats: int) -> Phases:
    runs = []
    for _ in range(repeats):
        with no_gc():
            runs.append(measure())
    return min(runs, key=lambda phases: phases.cycle_ns)


def cycle(implementation: str, in_flight: int, num_rounds: int, repeats: int) -> Phases:
    """The workload's cycle with `in_flight` more groups generating beside it."""
    buffer = make_buffer(implementation, MAX_INFLIGHT + in_flight, MAX_BUFFERED + in_flight)
    for prompt_index in range(in_flight):
        if buffer.try_admit(prompt_index) is None:
            raise RuntimeError("the prefill must fit the limits")
    run_rounds(implementation, buffer, 2)  # warm-up
    return best(lambda: run_rounds(implementation, buffer, num_rounds), repeats)


def hand_off_us(implementation: str, buffered: int, num_hand_offs: int, repeats: int) -> float:
    """CPU microseconds of one `take_batch(64)` from a buffer holding `buffered` finished groups (refilled
    with 64 fresh ones, untimed, after each hand-off)."""
    buffer = make_buffer(implementation, buffered + BATCH, buffered + BATCH)
    next_prompt = 0
    while next_prompt < buffered:
        size = min(BATCH, buffered - next_prompt)
        group_ids = [buffer.try_admit(next_prompt + offset) for offset in range(size)]
        complete_all(implementation, buffer, group_ids, next_prompt)
        next_prompt += size

    def measure() -> float:
        nonlocal next_prompt
        total = 0
        for _ in range(num_hand_offs):
            start = time.process_time_ns()
            batch = buffer.take_batch(BATCH, VERSION)
            total += time.process_time_ns() - start
            del batch
            group_ids = [buffer.try_admit(next_prompt + offset) for offset in range(BATCH)]
            complete_all(implementation, buffer, group_ids, next_prompt)
            next_prompt += BATCH
        return total / num_hand_offs / 1e3

    runs = []
    for _ in range(repeats):
        with no_gc():
            runs.append(measure())
    return min(runs)


@dataclass(frozen=True, slots=True)
class Row:
    implementation: str
    in_flight: int
    admit_ns: float
    complete_ns: float
    hand_off_ns: float
    cycle_ns: float
    cycle_wall_ns: float


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small sizes and few rounds (a smoke run)")
    parser.add_argument("--rounds", type=int, default=300, help="rounds per timed run (default 300)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure; the best is kept")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    sizes = (0, 1_000, 10_000) if args.quick else (0, 1_000, 10_000, 100_000, 1_000_000)
    buffered_sizes = (1_000, 10_000) if args.quick else (1_000, 100_000)
    num_rounds = 20 if args.quick else args.rounds
    repeats = 1 if args.quick else args.repeats

    rows = [
        Row(name, in_flight, **asdict(cycle(name, in_flight, num_rounds, repeats)))
        for in_flight in sizes
        for name in IMPLEMENTATIONS
    ]
    hand_offs = {
        (name, buffered): hand_off_us(name, buffered, max(20, num_rounds // 5), repeats)
        for buffered in buffered_sizes
        for name in IMPLEMENTATIONS
    }

    print(f"cycle: CPU ns per group (admit + complete + hand-off of {BATCH}; {GROUP_SIZE} trajectories x")
    print(f"{RESPONSE_LEN} tokens per group), best of {repeats} runs of {num_rounds} rounds; wall ns beside")
    print(
        f"{'in flight':>10} {'impl':>7} {'admit':>7} {'complete':>9} {'hand-off':>9} {'cycle':>7} {'wall':>7}"
    )
    for row in rows:
        print(
            f"{row.in_flight:>10} {row.implementation:>7} {row.admit_ns:>7.0f} {row.complete_ns:>9.0f} "
            f"{row.hand_off_ns:>9.0f} {row.cycle_ns:>7.0f} {row.cycle_wall_ns:>7.0f}"
        )
    cost = {(row.implementation, row.in_flight): row.cycle_ns for row in rows}
    summary: dict[str, float] = {}
    print("\nratios of CPU per cycle, same run:")
    for in_flight in sizes:
        facade, core, plain = (cost[(name, in_flight)] for name in IMPLEMENTATIONS)
        print(
            f"  {in_flight:>9} in flight: facade {facade:.0f} ns, core {core:.0f} ns, plain {plain:.0f} ns; "
            f"plain / facade {plain / facade:.1f}x, facade / core {facade / core:.1f}x"
        )
        summary[f"facade_cycle_ns_{in_flight}"] = facade
        summary[f"core_cycle_ns_{in_flight}"] = core
        summary[f"plain_cycle_ns_{in_flight}"] = plain
    low, high = sizes[1], sizes[-1]
    for name in IMPLEMENTATIONS:
        growth = cost[(name, high)] / cost[(name, low)]
        summary[f"{name}_growth_{high}_over_{low}"] = growth
        print(f"  {name}: cycle at {high} in flight / at {low}: {growth:.2f}x")
    print(f"\none hand-off of {BATCH} groups, CPU microseconds:")
    for buffered in buffered_sizes:
        figures = ", ".join(f"{name} {hand_offs[(name, buffered)]:.1f}" for name in IMPLEMENTATIONS)
        print(f"  {buffered:>7} buffered: {figures}")
        for name in IMPLEMENTATIONS:
            summary[f"{name}_hand_off_us_{buffered}_buffered"] = hand_offs[(name, buffered)]
    if args.json is not None:
        args.json.write_text(
            json.dumps({"rows": [asdict(row) for row in rows], "summary": summary}, indent=2) + "\n"
        )
    if not all(math.isfinite(value) for value in summary.values()):
        raise SystemExit("a figure is not finite")


if __name__ == "__main__":
    main()
