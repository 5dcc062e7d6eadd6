"""The step's `rollout/engine/*` metrics: the engines' cumulative counters (prefill seconds, generated
tokens), read through their rollout workers at both ends of the step's rollout and differenced.

The drivers bound the window: sync mode reads before and after the rollout phase (so evaluation and weight
syncs stay out of it); async mode reads once before the first step and then at every step's end, so each
step counts what the engines did since the previous step ended.

Reading never fails a step: an engine that does not answer within `READ_TIMEOUT_S`, a worker that died, or
an engine that does not report a counter leaves the counter's metric out of the step (and the reading is
logged at DEBUG), since a sum over some engines would be a wrong figure.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from asyncrl_core.runner.workers import EngineCounters

if TYPE_CHECKING:
    from asyncrl_core.runner.groups import WorkerGroups

logger = logging.getLogger(__name__)

READ_TIMEOUT_S = 5.0
"""How long one reading of every engine's counters may take (the engines are read at once)."""


def counter_growth(
    before: Sequence[EngineCounters | None], after: Sequence[EngineCounters | None]
) -> dict[str, float]:
    """How much each counter grew from `before` to `after` (one reading per engine, in the same order; None
    for a reading that failed), summed over the engines.

    An engine restarted in between (another `launch`) or whose counter went back counts from 0: its growth
    is the value `after`. A counter is left out when any engine lacks a reading at either end or does not
    report it, so a figure is never the sum over part of the engines."""
    pairs = [
        (start, end)
        for start, end in zip(before, after, strict=False)
        if start is not None and end is not None
    ]
    if len(pairs) != len(before) or len(pairs) != len(after):
        return {}
    names = (
        set.intersection(*(set(start.values) & set(end.values) for start, end in pairs)) if pairs else set()
    )
    growth: dict[str, float] = {}
    for name in sorted(names):
        total = 0.0
        for start, end in pairs:
            now, then = end.values[name], start.values[name]
            total += now if end.launch != start.launch or now < then else now - then
        growth[name] = total
    return growth


class EngineCounterWindow:
    """The engines' counters at the start of the current window, and the step metrics of the window's end."""

    def __init__(self, workers: WorkerGroups, timeout_s: float = READ_TIMEOUT_S) -> None:
        self.workers = workers
        self.timeout_s = timeout_s
        self._start: list[EngineCounters | None] = []

    def start(self) -> None:
        """Open a window: read every engine's counters now."""
        self._start = self.read()

    def step_metrics(self) -> dict[str, float]:
        """Close the window: the counters' growth since `start` (or since the last call), summed over the
        engines (`counter_growth`); the next window starts now."""
        end = self.read()
        growth = counter_growth(self._start, end)
        self._start = end
        return growth

    def read(self) -> list[EngineCounters | None]:
        """Every engine's counters, read at once through its rollout worker; None for an engine that did not
        answer within the timeout or whose reading failed."""
        import ray

        rollouts = list(self.workers.rollouts)
        refs: list[Any] = [rollout.engine_counters.remote(self.timeout_s) for rollout in rollouts]
        if not refs:
            return []
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s + 1.0)
        readings: list[EngineCounters | None] = []
        for index, ref in enumerate(refs):
            if ref not in ready:
                logger.debug("engine %d: its counters were not read within %.0f s", index, self.timeout_s)
                readings.append(None)
                continue
            try:
                reading = ray.get(ref, timeout=0)
            except Exception as error:  # any failure: the metric is left out, the step goes on
                logger.debug("engine %d: its counters could not be read: %s", index, error)
                readings.append(None)
                continue
            readings.append(reading if isinstance(reading, EngineCounters) else None)
        return readings
