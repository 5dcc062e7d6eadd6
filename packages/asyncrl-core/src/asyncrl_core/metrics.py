"""The names of every logged metric, in one place.

Every emitter (the buffer's step statistics, the actors, weight sync, the runner's drivers) and every reader
(the run tracker, `asyncrl-plot`, tests, benchmarks) uses these constants, never a string literal. A name is
`<area>/<what>[/<statistic>]`: `time/*` are seconds per step, `rollout/*` describe the data the step trained
on and how it was produced, `train/*` the optimiser step, `eval/*` the evaluation on the task's test split.

This module imports only the standard library.
"""

from typing import Final

# --- time/*: seconds of one step, measured by the driver

TIME_STEP: Final = "time/step"
"""Wall time of the whole step."""
TIME_ROLLOUT: Final = "time/rollout"
"""Generating the step's batch (sync mode: the engines work while the actor waits)."""
TIME_TRAINING: Final = "time/training"
"""The actor's optimiser step on the batch."""
TIME_SYNC_WEIGHTS: Final = "time/sync_weights"
"""Pushing the new weights into the engines, pause to continue."""
TIME_WAIT_DATA: Final = "time/wait_data"
"""Async mode: the actor waiting for enough finished groups (0 when rollout keeps ahead of training)."""
TIME_EVAL: Final = "time/eval"
"""Evaluation on the test split (logged at evaluation steps only)."""

# --- rollout/buffer/*: admission, as shares of the step's wall time

ADMISSION_WAIT_INFLIGHT_LIMIT: Final = "rollout/buffer/admission_wait_inflight_limit"
"""Share of the step during which admission was refused by `max_inflight_groups` (it wins a tie)."""
ADMISSION_WAIT_BUFFER_FULL: Final = "rollout/buffer/admission_wait_buffer_full"
"""Share of the step during which admission was refused because `max_buffered_groups` was reached."""

# --- rollout/*: staleness of the groups the step trained on

DATA_STALENESS_MEAN: Final = "rollout/data_staleness/mean"
"""Mean of `actor_version - earliest_version` over the step's groups."""
DATA_STALENESS_MAX: Final = "rollout/data_staleness/max"
"""Largest staleness among the step's groups."""
DATA_STALENESS_RATIO_PREFIX: Final = "rollout/data_staleness/ratio_"
"""Prefix of the per-staleness shares; `data_staleness_ratio(k)` builds a full name."""
VERSION_SPAN_MEAN: Final = "rollout/version_span/mean"
"""Mean of `latest_version - earliest_version`: weight versions that passed while a group generated."""
QUEUE_STEPS_MEAN: Final = "rollout/queue_steps/mean"
"""Mean of `actor_version - latest_version`: versions a group waited in the buffer."""
DROPPED_GROUPS: Final = "rollout/dropped_groups"
"""Groups dropped by the staleness cap during the step (their prompts return to the dataloader)."""


FAILED_GROUPS_RETRIED: Final = "rollout/failed_groups/retried"
"""Groups whose generation failed during the step for a reason that may pass (an engine that died or did not
answer, a worker that died): their prompts are issued again."""
FAILED_GROUPS_DROPPED: Final = "rollout/failed_groups/dropped"
"""Groups whose generation failed during the step for a reason that will not pass (a prompt too long, a
request the engine refused): their prompts are dropped for good, each with its reason."""
ENGINE_RESTARTS: Final = "rollout/engine_restarts"
"""Engine processes restarted during the step (they died or stopped answering `/health`)."""
AGENT_LOOP_RESTARTS: Final = "rollout/agent_loop_restarts"
"""Agent-loop workers restarted during the step (their process died); their groups were issued again."""
ROLLOUT_WORKER_RESTARTS: Final = "rollout/rollout_worker_restarts"
"""Rollout workers restarted during the step (their process died), each with its engine."""


def data_staleness_ratio(staleness: int) -> str:
    """The name of the share of the step's groups whose staleness is exactly `staleness` (>= 0)."""
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    return f"{DATA_STALENESS_RATIO_PREFIX}{staleness}"


# --- rollout/*: what the step's groups hold, and the engines

REWARD_MEAN: Final = "rollout/reward/mean"
"""Mean reward of the step's trajectories."""
TURNS_MEAN: Final = "rollout/turns/mean"
"""Mean number of model turns per trajectory."""
TOKENS_PER_S: Final = "rollout/tokens_per_s"
"""Tokens the engines generated for the step's groups, per second of the step's wall time."""
SYNC_PAUSED_REQUESTS: Final = "rollout/sync_paused_requests"
"""Requests in flight on the engines that the weight sync paused, running or queued once paused (retracted
or frozen), as the engines count them in their `/metrics` (0 in `drain` mode)."""
RESPONSE_LEN_MEAN: Final = "rollout/response_len/mean"
"""Mean response length of the step's trajectories (tokens after the prompt, observations included)."""
NUM_MODEL_TOKENS: Final = "rollout/num_model_tokens"
"""Tokens the model generated for the step's trajectories (observation tokens excluded)."""

# --- rollout/engine/*: what the engines did during the step's rollout (sync mode: the rollout phase; async
# mode: from the previous step's end to this one's), from their cumulative counters read at both ends and
# summed over the engines. A counter that went back (a restarted engine) counts from 0. Left out of a step
# when an engine does not report the counter or could not be read.

ENGINE_PREFILL_S: Final = "rollout/engine/prefill_s"
"""Seconds the engines spent in prefill (`total_prefill_busy_us` of SGLang's `/v1/loads`), summed over the
engines: over `time/rollout` (sync) or `time/step` (async), the share of the rollout that went to prefill."""
ENGINE_NUM_GENERATED_TOKENS: Final = "rollout/engine/num_generated_tokens"
"""Tokens the engines generated (`sglang:generation_tokens_total` of their `/metrics`), whichever group they
went to: in async mode the work of the step's window, where `rollout/num_model_tokens` counts the trained
groups' tokens, generated in earlier steps too."""

# --- rollout/*: what the step's trajectories did, summed or averaged from their `Trajectory.metrics`

TOOL_CALLS: Final = "rollout/tool_calls"
"""Tool calls made by the step's trajectories."""
TOOL_ERRORS: Final = "rollout/tool_errors"
"""Tool calls of the step's trajectories that failed (the tool raised, timed out or was unknown); a tool that
is down shows here, its error text being what the model read instead of a result."""
TOOL_ERROR_RATE: Final = "rollout/tool_error_rate"
"""`tool_errors / tool_calls` of the step (0 when no tool was called)."""
INVALID_TURNS: Final = "rollout/invalid_turns"
"""Model turns of the step's trajectories whose output could not be parsed."""
OBSERVATIONS_CUT: Final = "rollout/observations_cut"
"""Observations of the step's trajectories cut to fit the response budget."""
PER_TRAJECTORY_PREFIX: Final = "rollout/trajectory/"
"""Prefix of the per-trajectory time means; `trajectory_mean(key)` builds a full name
(`rollout/trajectory/generation_s/mean`)."""


def trajectory_mean(key: str) -> str:
    """The name of the step's mean of the per-trajectory measurement `key` (a `TRAJECTORY_*` key)."""
    return f"{PER_TRAJECTORY_PREFIX}{key}/mean"


# --- train/*: the training step, summed over micro-batches and ranks (and, with several optimiser updates per
# step, the mean over its updates)

TRAIN_LOSS: Final = "train/loss"
"""The optimised loss (policy term, KL penalty and entropy bonus), token-weighted over the batch."""
TRAIN_PG_LOSS: Final = "train/pg_loss"
"""The policy-gradient term of the loss alone."""
TRAIN_KL: Final = "train/kl"
"""KL estimate of the policy against the reference model."""
TRAIN_ENTROPY: Final = "train/entropy"
"""Mean token entropy of the policy."""
TRAIN_CLIP_FRAC: Final = "train/clip_frac"
"""Share of tokens whose clipped PPO term is the active one."""
TRAIN_PPO_RATIO_MEAN: Final = "train/ppo_ratio/mean"
"""Mean importance ratio of the policy against the proximal (old) policy."""
TRAIN_OFF_POLICY_WEIGHT_MEAN: Final = "train/off_policy/weight_mean"
"""Decoupled correction: mean importance weight of proximal over behaviour policy, after truncation."""
TRAIN_OFF_POLICY_TRUNCATED_FRAC: Final = "train/off_policy/truncated_frac"
"""Decoupled correction: share of tokens whose importance weight was truncated."""
TRAIN_OFF_POLICY_BEHAVIOUR_KL: Final = "train/off_policy/behaviour_kl"
"""Decoupled correction: k3 estimate of KL(behaviour || proximal), a measure of staleness."""
TRAIN_GRAD_NORM: Final = "train/grad_norm"
"""Gradient norm before clipping."""
TRAIN_LR: Final = "train/lr"
"""Learning rate of the step."""
TRAIN_NUM_TRAJECTORIES: Final = "train/num_trajectories"
"""Trajectories in the batch."""
TRAIN_NUM_TOKENS: Final = "train/num_tokens"
"""Prompt and response tokens in the batch, all ranks."""
TRAIN_NUM_LOSS_TOKENS: Final = "train/num_loss_tokens"
"""Tokens that carry loss (model-generated response tokens), all ranks."""
TRAIN_NUM_UPDATES: Final = "train/num_updates"
"""Optimiser updates of the step: `actor.ppo_epochs` x the step's mini-batches."""
WEIGHT_VERSION: Final = "train/weight_version"
"""The actor's weight version after the step."""

# --- eval/*

EVAL_REWARD_MEAN: Final = "eval/reward/mean"
"""Mean reward on the task's test split (logged at evaluation steps only)."""
EVAL_WEIGHT_VERSION_MIN: Final = "eval/weight_version/min"
"""Earliest weight version that generated any token of the evaluation."""
EVAL_WEIGHT_VERSION_MAX: Final = "eval/weight_version/max"
"""Latest weight version that generated any token of the evaluation."""

# --- Per-trajectory measurements (keys of `Trajectory.metrics`, set by the agent loop)
# Not logged one by one: the actor worker aggregates them into the step's rollout/* metrics (the counts
# summed: TOOL_CALLS, TOOL_ERRORS, INVALID_TURNS, OBSERVATIONS_CUT; the times as `trajectory_mean(key)`).

TRAJECTORY_GENERATION_S: Final = "generation_s"
"""Seconds waiting for the engine's generations."""
TRAJECTORY_TOOL_S: Final = "tool_s"
"""Seconds in tool calls."""
TRAJECTORY_PARSE_S: Final = "parse_s"
"""Seconds parsing model output for tool calls and answers."""
TRAJECTORY_BOOKKEEPING_S: Final = "bookkeeping_s"
"""Seconds building prompts, masks and version spans between turns."""
TRAJECTORY_LOOP_OVERHEAD_S: Final = "loop_overhead_s"
"""Seconds of the trajectory spent neither generating nor in tools."""
TRAJECTORY_TOTAL_S: Final = "total_s"
"""Wall time of the trajectory."""
TRAJECTORY_NUM_MODEL_TOKENS: Final = "num_model_tokens"
"""Tokens the model generated (loss-mask 1)."""
TRAJECTORY_NUM_OBSERVATION_TOKENS: Final = "num_observation_tokens"
"""Tool-observation tokens inserted into the response (loss-mask 0)."""
TRAJECTORY_NUM_TOOL_CALLS: Final = "num_tool_calls"
"""Tool calls made."""
TRAJECTORY_NUM_TOOL_ERRORS: Final = "num_tool_errors"
"""Tool calls that failed."""
TRAJECTORY_NUM_INVALID_TURNS: Final = "num_invalid_turns"
"""Turns whose output could not be parsed."""
TRAJECTORY_NUM_OBSERVATIONS_CUT: Final = "num_observations_cut"
"""Observations truncated to fit the response budget."""

# --- Groupings

EVERY_STEP: Final[tuple[str, ...]] = (
    TIME_STEP,
    TIME_TRAINING,
    TIME_SYNC_WEIGHTS,
    ADMISSION_WAIT_INFLIGHT_LIMIT,
    ADMISSION_WAIT_BUFFER_FULL,
    DATA_STALENESS_MEAN,
    DATA_STALENESS_MAX,
    VERSION_SPAN_MEAN,
    QUEUE_STEPS_MEAN,
    REWARD_MEAN,
    TURNS_MEAN,
    TOKENS_PER_S,
    DROPPED_GROUPS,
    TRAIN_LOSS,
    TRAIN_KL,
    TRAIN_CLIP_FRAC,
    TRAIN_GRAD_NORM,
)
"""Names a training step logs in either mode (besides `data_staleness_ratio(k)` for each staleness seen)."""
SYNC_MODE_ONLY: Final[tuple[str, ...]] = (TIME_ROLLOUT,)
"""Names a step logs in sync mode only."""
ASYNC_MODE_ONLY: Final[tuple[str, ...]] = (TIME_WAIT_DATA,)
"""Names a step logs in async mode only."""
EVAL_STEP: Final[tuple[str, ...]] = (TIME_EVAL, EVAL_REWARD_MEAN)
"""Names logged at evaluation steps only (every `runner.eval_every_steps`)."""
