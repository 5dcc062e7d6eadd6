"""The extension points between asyncrl's components, as `Protocol`s.

The rollout side (asyncrl_sglang), the agent side (asyncrl_agents) and the actors (asyncrl_core.actor,
asyncrl_megatron) meet only here and in `asyncrl_core.types`, so none of them imports another; the runner
finds each through the plugin registry (`asyncrl_core.plugins`).
Heavy types appear under TYPE_CHECKING only: importing this module imports neither torch nor anything else
heavy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

from asyncrl_core.types import (
    BatchShare,
    Demonstration,
    FinalAnswer,
    Generation,
    Group,
    InvalidTurn,
    SamplingParams,
    TaskSample,
    ToolCall,
    ToolHealth,
    ToolResult,
    TurnAction,
)

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from asyncrl_core.config.models import RolloutConfig
    from asyncrl_core.server_process import ServerProcess

NamedTensors = list[tuple[str, "torch.Tensor"]]
"""One bucket of weights under HuggingFace parameter names."""

WeightExportRole = Literal["send", "join", "none"]
"""What one rank of an actor does when the weights go to the engines: `send` consumes `export_weights` and
pushes the buckets; `join` consumes it in step with the sender and drops the buckets (the export is a
collective there: tensor-parallel shards are gathered); `none` takes no part."""


@runtime_checkable
class GenerationClient(Protocol):
    """Generates from token ids on the rollout engines (token in, token out: no re-tokenisation)."""

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        rid: str | None = None,
        routing_key: str | None = None,
    ) -> Generation:
        """Sample a continuation of `input_ids`.

        `rid` names this request on the engine. `routing_key` (for example a trajectory's id) sends every
        request with the same key to the same engine while that engine is up, so the turns of one trajectory
        find their earlier turns in its prefix cache; a client of a single engine accepts it and ignores it.
        Returns when the request finishes. A request paused by a weight sync continues after it (retract or
        in_place) or is held back until the sync is done (drain); `Generation.version_spans` records which
        weights produced which tokens. Raises `asyncrl_core.errors.GenerationError` for a request the
        engine refused (too long for the context, bad sampling values) or failed on its own (an internal
        error), never a partial output in place of the model's end.
        """
        ...


class EngineClient(GenerationClient, Protocol):
    """A `GenerationClient` over every engine of a run, with the gate the `drain` pause mode closes."""

    def close_admission(self) -> None:
        """Hold new requests at this client (those in flight go on)."""
        ...

    def open_admission(self) -> None:
        """Let the held requests through."""
        ...

    async def wait_idle(self, timeout_s: float) -> None:
        """Return once no request sent through this client is in flight; raise after `timeout_s`."""
        ...

    async def aclose(self) -> None: ...


class RunningEngines(Protocol):
    """The engines a rollout backend started (or reached), as `RolloutBackend.launch` returns them."""

    @property
    def urls(self) -> Sequence[str]:
        """The HTTP base URL of each engine, at an address other nodes reach."""
        ...

    @property
    def grpc_targets(self) -> Sequence[str | None]:
        """Per engine, the gRPC address generation goes to, or None (HTTP)."""
        ...

    @property
    def processes(self) -> Sequence[ServerProcess]:
        """The processes started, one per engine (none for engines someone else runs)."""
        ...

    def stop(self) -> None:
        """Stop every process started."""
        ...


@dataclass(frozen=True, slots=True)
class WeightGroup:
    """Where the trainer meets the engines for a weight sync by broadcast (a process group), and how.

    The runner chooses it: the trainer (rank 0 of the actor) hosts the group's store at
    `master_address:master_port`, its node's address and, with `master_port` 0, a port the system gives the
    store when it binds there (the transport tells the engines which)."""

    master_address: str
    master_port: int
    backend: Literal["nccl", "gloo"]
    """NCCL between separate GPUs; gloo on CPUs and where trainer and engines share a GPU."""
    device: Literal["cuda", "cpu"]
    """Where the trainer stages each tensor for the broadcast."""
    timeout_s: float
    """Longest wait for the group to form and for one broadcast."""


class RolloutBackend(Protocol):
    """An engine family, `rollout.rollout_backend`: how the runner starts engines, reaches them and pushes
    weights into them. The plugin (entry-point group `asyncrl.rollout_backends`) is a factory called with
    the run's `AsyncRLConfig`; asyncrl-sglang's is `asyncrl_sglang.backend:SGLangBackend`."""

    def launch(
        self,
        rollout: RolloutConfig,
        *,
        run_dir: Path,
        devices: Sequence[int],
        gpu: bool,
        health_timeout_s: float,
        advertise_host: str,
        random_seed: int,
        start_paused: bool = False,
    ) -> RunningEngines:
        """Start the engines of `rollout` (one per rollout worker: `num_instances` is 1) on `devices` (GPU
        ids when `gpu`, else nothing to place) and return once they answer. They bind to
        `rollout.sglang.host`, which the runner resolves per node; `advertise_host` is their node's address,
        for URLs of engines bound to every interface. They sample with `random_seed` (`runner.seed` plus the
        engine's index). With `start_paused` the engines it starts hold every generation request, from before
        they answer, until a weight sync in `retract` or `in_place` mode continues them (a restarted engine
        serves nothing before it has the actor's weights); a backend whose engines cannot start so refuses
        it with an error."""
        ...

    def connect(self, urls: Sequence[str], grpc_targets: Sequence[str | None]) -> EngineClient:
        """One client over the running engines at `urls` (from another process than the one that started
        them)."""
        ...

    def weight_transport(self, group: WeightGroup) -> object:
        """How this run's weights reach the engines (the trainer keeps it for every sync); `group` is used
        when the transport broadcasts."""
        ...

    async def sync_weights(
        self,
        client: EngineClient,
        buckets: Iterable[NamedTensors],
        version: int,
        *,
        mode: str,
        transport: object,
    ) -> dict[str, float]:
        """Push `buckets` into every engine of `client` as weight `version`, pausing them by `mode`
        (`rollout.pause_mode`); returns the sync's step metrics (`time/sync_weights`, ...)."""
        ...

    async def engine_counters(self, url: str, *, timeout_s: float) -> Mapping[str, float]:
        """The cumulative counters of the engine at `url` now, each by the name of the step metric its
        growth makes (`metrics.ENGINE_PREFILL_S`, `metrics.ENGINE_NUM_GENERATED_TOKENS`); a counter the
        engine does not report is left out. Answers within `timeout_s` or raises."""
        ...

    async def close_weight_transport(self, client: EngineClient, transport: object) -> None:
        """Undo what `transport` set up with the engines of `client` (the process group of a broadcast
        transport: left on the engines and here), so that engines that outlive the run (`launch:
        external`) can join the next run's. The runner calls it once the run ends, however it ends (its
        last step, a failure, a signal). A transport that set up nothing, or was closed already, is left as
        it is: calling it again does nothing."""
        ...


class AgentLoop(Protocol):
    """Runs groups of a task's trajectories against the engines: turns, tool calls, token bookkeeping,
    reward. The runner's agent-loop workers drive one each (and one more, of single-trajectory groups, for
    evaluations); `AgentLoopFactory` builds it."""

    def dataset(self, split: str = "train") -> Sequence[TaskSample]:
        """The task's prompts of `split`."""
        ...

    async def run_group(
        self, prompt_index: int, *, group_id: int | None = None, split: str = "train"
    ) -> Group:
        """The group of prompt `prompt_index` of `split`, scored, under the buffer's `group_id`.

        Raises `PromptTooLongError` or `GenerationError` for a failure a retry cannot mend (the prompt is
        dropped), another `AsyncRLError` for one it may (the prompt is issued again).
        """
        ...

    async def aclose(self) -> None:
        """Release what the loop and its task hold in this process; the loop is not used afterwards."""
        ...


class AgentLoopFactory(Protocol):
    """An agent loop, `agentloop.agent_loop`: a plugin of the entry-point group `asyncrl.agent_loops`
    (asyncrl-agents declares `multi-turn`), usually the loop's class. Each agent-loop worker calls it with
    the run's task, a client over every engine, the model's tokenizer (loaded, or its model folder) and
    the run's settings."""

    def __call__(
        self,
        task: Task,
        client: GenerationClient,
        tokenizer: PreTrainedTokenizerBase | str,
        *,
        group_size: int,
        sampling: SamplingParams,
        max_prompt_len: int,
        max_response_len: int,
        context_len: int | None,
        max_turns: int | None,
        max_concurrent_groups: int,
        on_tool_health: Callable[[ToolHealth], None],
    ) -> AgentLoop:
        """A loop running `group_size` trajectories per group with `sampling` (the task's stop strings to be
        added), prompts of at most `max_prompt_len` tokens, responses of at most `max_response_len` tokens
        and `context_len` tokens in all, at most `max_turns` model turns (unset: the task's) and
        `max_concurrent_groups` groups at once; `on_tool_health` is told when a tool starts failing and when
        it answers again."""
        ...


@runtime_checkable
class Actor(Protocol):
    """A training backend: trains on groups, bumps its weight version, exports weights for the engines."""

    @property
    def version(self) -> int:
        """The weight version of the current parameters; 0 before the first step."""
        ...

    def train_step(self, batch: Sequence[Group] | BatchShare) -> dict[str, float]:
        """One optimiser step on this data-parallel rank's share of a batch (`asyncrl_core.shares`), or on
        the step's groups, which every rank is then given and cuts the same way (advantages are computed per
        group); returns `train/...` metrics. A share cut for another rank raises `BatchError`.

        Increments `version` by one.
        """
        ...

    def export_weights(self, bucket_bytes: int) -> Iterator[NamedTensors]:
        """The current weights under HuggingFace names, in buckets of about `bucket_bytes` each.

        Buckets are produced lazily, so a large model never needs a second full copy in memory.
        """
        ...

    @property
    def weight_export_role(self) -> WeightExportRole:
        """This rank's part in a weight sync: exactly one rank of the actor sends; every rank whose
        `export_weights` is a collective with the sender's joins."""
        ...

    def save_checkpoint(self, path: str) -> None:
        """Write model, optimiser state and version under the folder `path`."""
        ...

    def load_checkpoint(self, path: str) -> None:
        """Restore what `save_checkpoint` wrote."""
        ...


@runtime_checkable
class Tool(Protocol):
    """One tool a task offers the model, called with the text the model wrote between the tool's tags."""

    @property
    def name(self) -> str:
        """The name the task's parser puts in `ToolCall.tool`."""
        ...

    async def __call__(self, arguments: str) -> str:
        """Run the tool and return its output text.

        Any exception is a failed call: the agent loop turns it into an observation for the model (through
        `Task.observation`), never into a crashed trajectory. The loop also bounds the call with a timeout.
        """
        ...


@runtime_checkable
class Task(Protocol):
    """An agentic task: prompts with ground truth, tools, the parsing of a model turn, observations, reward.

    A task registers in the entry-point group `asyncrl.tasks`; the entry point is a factory (usually the
    class) called with the run's `agentloop.task_args` as keyword arguments. asyncrl-agents' agent loop
    (`multi-turn`) applies the chat template to `TaskSample.messages`, generates until one of `stop` (kept in
    the output), parses the turn, calls the tool, appends the observation as non-trained tokens, and repeats
    until a final answer, `max_turns` model turns or the context budget.
    """

    @property
    def name(self) -> str:
        """The task's name, as registered."""
        ...

    @property
    def max_turns(self) -> int:
        """Most model turns of one episode (a final answer may end it sooner)."""
        ...

    @property
    def stop(self) -> tuple[str, ...]:
        """Stop strings that close an action (`</search>`, `</answer>`): a turn's generation ends there."""
        ...

    def dataset(self, split: str) -> Sequence[TaskSample]:
        """The prompts of `split` (`train`, `test`, ...); raises `KeyError` naming the known splits."""
        ...

    def tools(self) -> Mapping[str, Tool]:
        """The tools by name; the parser's `ToolCall.tool` selects one."""
        ...

    def parse_turn(self, text: str) -> TurnAction:
        """What the model's turn `text` (its tokens decoded, the matched stop string included) asks for."""
        ...

    def observation(self, action: ToolCall | InvalidTurn, result: ToolResult | None) -> str:
        """The text appended after a turn that did not end the episode: the tool's result (or its error)
        for a `ToolCall`, a correction for an `InvalidTurn` (then `result` is None)."""
        ...

    def reward(self, sample: TaskSample, answer: FinalAnswer | None) -> float:
        """The episode's reward; `answer` is None when it ended without a final answer."""
        ...

    def demonstrations(self) -> Sequence[Demonstration]:
        """Worked examples (for few-shot prompts or a warm start); may be empty."""
        ...

    def serve(self) -> AbstractContextManager[Mapping[str, str]]:
        """Start the services the tools need for a run (a retrieval server, ...), stopped when the context
        exits. Yields keyword arguments to add to the `task_args` of the tasks the agent-loop workers build
        (e.g. `retriever_url`); yields `{}` when the task needs no service."""
        ...

    async def aclose(self) -> None:
        """Release what the tools hold in this process (HTTP connections); the task is not used afterwards."""
        ...
