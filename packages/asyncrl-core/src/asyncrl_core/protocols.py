"""The extension points between asyncrl's components, as `Protocol`s.

The rollout side (asyncrl_sglang), the agent side (asyncrl_agents) and the actors (asyncrl_core.actor,
asyncrl_megatron) meet only here and in `asyncrl_core.types`, so none of them imports another.
Heavy types appear under TYPE_CHECKING only: importing this module imports neither torch nor anything else
heavy.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
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
    ToolResult,
    TurnAction,
)

if TYPE_CHECKING:
    import torch

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
        self, input_ids: Sequence[int], sampling: SamplingParams, *, rid: str | None = None
    ) -> Generation:
        """Sample a continuation of `input_ids`.

        Returns when the request finishes. A request paused by a weight sync continues after it (retract or
        in_place) or is held back until the sync is done (drain); `Generation.version_spans` records which
        weights produced which tokens. Raises `asyncrl_core.errors.GenerationError` for a request the
        engine refused (too long for the context, bad sampling values).
        """
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
    class) called with the run's `agentloop.task_args` as keyword arguments. The agent loop (asyncrl_agents)
    applies the chat template to `TaskSample.messages`, generates until one of `stop` (kept in the output),
    parses the turn, calls the tool, appends the observation as non-trained tokens, and repeats until a final
    answer, `max_turns` model turns or the context budget.
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
