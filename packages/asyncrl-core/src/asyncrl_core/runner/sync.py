"""The synchronous driver: generate the whole batch, train on it, push the weights; repeat.

Rollout and training take turns, so `time/step = time/rollout + time/training + time/sync_weights` (plus
the buffer's bookkeeping): the baseline the asynchronous driver is measured against. An agent-loop worker
that dies during the rollout is restarted, and the groups the batch lacks run again (`RunContext.run_groups`).
"""

from __future__ import annotations

import time

from asyncrl_core import metrics
from asyncrl_core.runner.context import RunContext


def run_sync(ctx: RunContext) -> None:
    workers, liveness, batch_size = ctx.workers, ctx.liveness, ctx.config.data.rollout_batch_size
    for step in range(ctx.start_step, ctx.config.runner.num_steps):
        ctx.engine_counters.start()
        started = time.perf_counter()
        ctx.run_groups(lambda loop, num: loop.run_groups.remote(workers.buffer_port, num, ctx.timeout_s))
        rollout_s = time.perf_counter() - started
        engine_metrics = ctx.engine_counters.step_metrics()  # the engines' work of the rollout phase
        batch = ctx.wait_batch(lambda: workers.buffer.hand_off.remote(batch_size, ctx.version, 1.0))
        train_metrics = ctx.train(batch)
        sync_metrics = liveness.sync_weights(ctx.config.rollout.pause_mode)
        buffer_metrics = workers.get(workers.buffer.end_step.remote(), "buffer statistics")
        ctx.end_step(
            step,
            {
                **train_metrics,
                **sync_metrics,
                **buffer_metrics,
                **liveness.end_step(),
                **engine_metrics,
                metrics.TIME_ROLLOUT: rollout_s,
                metrics.TIME_STEP: time.perf_counter() - started,
            },
        )
