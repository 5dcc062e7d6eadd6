"""The workers of a run (ARCHITECTURE.md section 5), as plain classes a test can build in one process.

- `BufferWorker` (`workers.buffer`) owns the dataloader (`PromptLoader`), the `GroupBuffer` and the prompt
  ledger: it issues prompts under the two admission limits, buffers finished groups, hands the oldest to
  the actor and records where every prompt went.
- `AgentLoopWorker` (`workers.agent_loop`) runs a task's trajectories against the engines: a fixed number of
  groups (sync mode), or continuously while admission allows (async mode), and evaluations on the task's
  test split.
- `RolloutWorker` (`workers.rollout`) owns one engine server process on its devices.
- `ActorWorker` (`workers.actor`) trains on batches and pushes its weights into the engines after each step.

What they share (`RunnerError`, the failures of a group that retrying cannot mend, the pinning to cores) is
in `workers.common`; this package exports every name of them.

`asyncrl_core.runner.groups` puts each of them in Ray actors; the drivers (`runner.sync`, `runner.async_`)
call them. asyncrl-core never imports asyncrl-sglang, asyncrl-agents or asyncrl-megatron: the rollout backend,
the actor and the agent loop are found through the plugin registry (`asyncrl_core.plugins`) when a worker
starts.
"""

from asyncrl_core.runner.workers.actor import ActorWorker, RankSettings, weight_transport
from asyncrl_core.runner.workers.agent_loop import AgentLoopWorker, agent_loop_factory, build_task
from asyncrl_core.runner.workers.buffer import (
    BufferPort,
    BufferState,
    BufferWorker,
    LocalBufferPort,
    group_metrics,
)
from asyncrl_core.runner.workers.common import PERMANENT_ERRORS, RunnerError, pin_to_cores
from asyncrl_core.runner.workers.rollout import (
    EngineCounters,
    EngineEndpoint,
    EngineFailure,
    RolloutWorker,
)

__all__ = [
    "PERMANENT_ERRORS",
    "ActorWorker",
    "AgentLoopWorker",
    "BufferPort",
    "BufferState",
    "BufferWorker",
    "EngineCounters",
    "EngineEndpoint",
    "EngineFailure",
    "LocalBufferPort",
    "RankSettings",
    "RolloutWorker",
    "RunnerError",
    "agent_loop_factory",
    "build_task",
    "group_metrics",
    "pin_to_cores",
    "weight_transport",
]
