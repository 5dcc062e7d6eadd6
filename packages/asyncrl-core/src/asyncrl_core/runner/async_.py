"""The asynchronous driver: the agent loops generate without pause while the actor trains on the oldest
finished groups and pushes its weights into the engines mid-generation.

The agent-loop workers admit prompts themselves, under the buffer's two limits, and return finished groups
to the buffer worker; the actor takes a batch whenever it is ready (`time/wait_data` is how long it waited),
and the staleness cap drops groups at hand-off. Weights go to the engines after every step in
`rollout.pause_mode`, while requests are in flight. The engines and agent loops are watched while the driver
waits (`runner.liveness`): a failed one is restarted, or the run stops naming it.
"""

from __future__ import annotations

import time

from asyncrl_core import metrics
from asyncrl_core.runner.context import RunContext


def run_async(ctx: RunContext) -> None:
    workers, liveness, batch_size = ctx.workers, ctx.liveness, ctx.config.data.rollout_batch_size
    ctx.engine_counters.start()  # each step's `rollout/engine/*` count from the previous step's end
    liveness.serve()  # every agent loop's `serve.remote(buffer)`, watched beside the engines
    for step in range(ctx.start_step, ctx.config.runner.num_steps):
        started = time.perf_counter()
        batch = ctx.wait_batch(lambda: workers.buffer.hand_off.remote(batch_size, ctx.version, 1.0))
        wait_s = time.perf_counter() - started
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
                **ctx.engine_counters.step_metrics(),
                metrics.TIME_WAIT_DATA: wait_s,
                metrics.TIME_STEP: time.perf_counter() - started,
            },
        )
    liveness.stop_serving()
