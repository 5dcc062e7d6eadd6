"""The data that crosses component boundaries: generations, trajectories and groups.

Plain dataclasses with no heavy imports, so every package (and a test) can build them. Token-level lists
are indexed over the *response* part of a trajectory: every token after the initial prompt, model tokens
and tool/observation tokens alike, in the order they appear in `Trajectory.token_ids`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

FinishReason = Literal["stop", "length", "abort"]
"""Why a generation ended: a stop string or token, `max_new_tokens` or the context, or an abort."""

NO_VERSION = -1
"""The weight version recorded for tokens no model generated (prompt, tool and observation tokens)."""


@dataclass(frozen=True, slots=True)
class VersionSpan:
    """Output tokens `[start, end)` of one generation were sampled under actor weight version `version`."""

    version: int
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling settings for one generation, as the SGLang `sampling_params` object names them."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    no_stop_trim: bool = False
    """Keep a matched stop string in the output (agent loops need it to close a tool tag)."""


@dataclass(frozen=True, slots=True)
class Generation:
    """One finished generation, token ids in and out, as the rollout client returns it."""

    output_ids: list[int]
    logprobs: list[float]
    """Log-probability of each output token under the weights that sampled it; `len == len(output_ids)`."""
    text: str
    finish_reason: FinishReason
    version_spans: tuple[VersionSpan, ...]
    """Cover `output_ids` exactly, in order. One span when no weight update happened mid-request."""
    versions_verified: bool = True
    """False when the server reported only one version for the whole request (older SGLang builds)."""
    matched_stop: int | str | None = None
    prompt_tokens: int = 0
    num_retractions: int = 0

    def token_versions(self) -> list[int]:
        """The weight version of each output token, expanded from the spans."""
        versions = [NO_VERSION] * len(self.output_ids)
        for span in self.version_spans:
            versions[span.start : span.end] = [span.version] * (span.end - span.start)
        return versions


@dataclass(slots=True)
class Trajectory:
    """One multi-turn episode: the prompt, then model turns interleaved with tool observations.

    `token_ids[:prompt_len]` is the prompt; every per-token list below has length
    `len(token_ids) - prompt_len` and is aligned with `token_ids[prompt_len:]`.
    """

    token_ids: list[int]
    prompt_len: int
    loss_mask: list[int]
    """1 for tokens the model sampled (trained on), 0 for tool and observation tokens."""
    rollout_logprobs: list[float]
    """The engine's log-probability for each model token; 0.0 where `loss_mask` is 0."""
    versions: list[int]
    """The weight version that sampled each token; `NO_VERSION` where `loss_mask` is 0."""
    reward: float = 0.0
    num_turns: int = 0
    finish_reason: str = ""
    """Why the episode ended: `answer`, `max_turns`, `context`, `length`, `abort`, ..."""
    metrics: dict[str, float] = field(default_factory=dict[str, float])
    earliest_version: int = NO_VERSION
    """The oldest weight version that sampled any token; `NO_VERSION` when the model sampled none."""
    latest_version: int = NO_VERSION
    """The newest weight version that sampled any token; `NO_VERSION` when the model sampled none."""

    def __post_init__(self) -> None:
        # The builder usually knows the range from the engine's version spans and passes it; otherwise it
        # is read off `versions` once here, so that nobody scans the tokens again.
        if self.earliest_version == NO_VERSION and self.latest_version == NO_VERSION:
            model_versions = [version for version in self.versions if version != NO_VERSION]
            if model_versions:
                self.earliest_version, self.latest_version = min(model_versions), max(model_versions)

    @property
    def response_len(self) -> int:
        return len(self.token_ids) - self.prompt_len

    def version_range(self) -> tuple[int, int] | None:
        """(earliest, latest) version of the model tokens, or None if the model produced no token."""
        if self.latest_version == NO_VERSION:
            return None
        return self.earliest_version, self.latest_version


@dataclass(slots=True)
class Group:
    """`group_size` trajectories of one prompt: the unit of admission, buffering and advantage."""

    group_id: int
    """The admission id the buffer gave this group."""
    prompt_index: int
    """Index of the prompt in the task's dataset (returned to the dataloader if the group is dropped)."""
    trajectories: list[Trajectory]
    finish_version: int = NO_VERSION
    """The actor version current when the group finished. Left `NO_VERSION` by its producer, the buffer
    stamps it on acceptance: the actor version of the last batch handed out (0 before the first), or the
    group's latest version when that is newer. A producer that knows the actor's version may set it; the
    buffer then checks it."""
    earliest_version: int = NO_VERSION
    """The oldest weight version that sampled any token of the group; `NO_VERSION` when the model sampled
    none. Read off the trajectories when the group is built (unless given)."""
    latest_version: int = NO_VERSION
    """The newest weight version that sampled any token of the group; `NO_VERSION` when none."""

    def __post_init__(self) -> None:
        if self.earliest_version == NO_VERSION and self.latest_version == NO_VERSION:
            ranges = [
                (t.earliest_version, t.latest_version) for t in self.trajectories if t.latest_version >= 0
            ]
            if ranges:
                self.earliest_version = min(earliest for earliest, _ in ranges)
                self.latest_version = max(latest for _, latest in ranges)

    def version_range(self) -> tuple[int, int] | None:
        """(earliest, latest) weight version over all model tokens of the group, or None if the model
        produced no token (the buffer then attributes the group to its finish version)."""
        if self.latest_version == NO_VERSION:
            return None
        return self.earliest_version, self.latest_version


# The actor side: a step's batch as each data-parallel rank of the actor receives it
# (`asyncrl_core.shares` cuts it; NumPy arrays, so Ray's object store hands them over without copies).


@dataclass(frozen=True, slots=True)
class MiniBatchShare:
    """One data-parallel rank's rows of one mini-batch (one optimiser update), in the order the rank trains
    them, with the counts of the whole mini-batch that fix each token's share of the loss.

    Per-token arrays hold the rows one after the other and are aligned with `token_ids`: row `r` is
    `token_ids[row_offsets[r]:row_offsets[r + 1]]`, its prompt included (where `loss_mask` is 0,
    `rollout_logprobs` 0.0 and `versions` `NO_VERSION`, as on tool and observation tokens).
    """

    token_ids: NDArray[np.int32]
    """Prompt and response tokens of every row, concatenated."""
    row_offsets: NDArray[np.int64]
    """`[R + 1]`: where each of the `R` rows starts in the per-token arrays, then their total length."""
    loss_mask: NDArray[np.int8]
    """1 on tokens the model sampled (trained on), 0 on prompt, tool and observation tokens."""
    rollout_logprobs: NDArray[np.float32]
    """The engine's log-probability of each trained token; 0.0 elsewhere."""
    versions: NDArray[np.int32]
    """The weight version that sampled each trained token; `NO_VERSION` elsewhere."""
    advantages: NDArray[np.float32]
    """`[R]`: each row's group-relative advantage (computed over its whole group, on every rank)."""
    row_ids: NDArray[np.int64]
    """`[R, 2]`: `(group_id, index of the trajectory in its group)` of each row."""
    num_rows: int
    """Rows of the whole mini-batch, over all ranks."""
    num_tokens: int
    """Prompt and response tokens of the whole mini-batch."""
    num_loss_tokens: int
    """Trained tokens of the whole mini-batch (the `token_mean` loss divides by it)."""
    num_trained_rows: int
    """Rows of the whole mini-batch with at least one trained token (the `sequence_mean` loss divides by
    it)."""

    @property
    def num_share_rows(self) -> int:
        """Rows of this share."""
        return len(self.row_offsets) - 1

    @property
    def nbytes(self) -> int:
        """Bytes of the share's arrays."""
        arrays = (self.token_ids, self.row_offsets, self.loss_mask, self.rollout_logprobs, self.versions)
        return sum(array.nbytes for array in (*arrays, self.advantages, self.row_ids))


@dataclass(frozen=True, slots=True)
class BatchShare:
    """What data-parallel rank `rank` of `num_ranks` trains on in one step: its rows of each mini-batch."""

    rank: int
    num_ranks: int
    mini_batches: tuple[MiniBatchShare, ...]
    """One per optimiser update of a pass over the step, in order."""

    @property
    def nbytes(self) -> int:
        """Bytes of the share's arrays."""
        return sum(mini_batch.nbytes for mini_batch in self.mini_batches)


# The task side: what a task plugin (`asyncrl_core.protocols.Task`) hands the agent loop and gets back.


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One message of a chat, in the `{"role", "content"}` shape chat templates read."""

    role: Literal["system", "user", "assistant"]
    content: str


@dataclass(frozen=True, slots=True)
class TaskSample:
    """One prompt of a task's dataset, with the answers that earn the reward."""

    sample_id: str
    """Stable id within the task's dataset (for logs and evaluation reports)."""
    messages: tuple[ChatMessage, ...]
    """The conversation the model continues: system prompt, question; the chat template is applied by the
    agent loop, with the generation prompt."""
    answers: tuple[str, ...]
    """Accepted ground-truth answers (the reward compares a final answer with each)."""


@dataclass(frozen=True, slots=True)
class Demonstration:
    """A worked example: a conversation and the full assistant response, tool observations included."""

    messages: tuple[ChatMessage, ...]
    response: str
    """The whole assistant response: the model's turns and the observations between them, in order."""
    observation_spans: tuple[tuple[int, int], ...] = ()
    """Character ranges `[start, end)` of `response` that tools wrote (the observations), in order and
    disjoint; the rest is the model's own text. A warm start trains on the model's text only."""

    def __post_init__(self) -> None:
        end = 0
        for start, stop in self.observation_spans:
            if not end <= start <= stop <= len(self.response):
                raise ValueError(
                    f"observation span ({start}, {stop}) is out of order or outside the response "
                    f"({len(self.response)} characters)"
                )
            end = stop

    def segments(self) -> list[tuple[str, bool]]:
        """The response as consecutive `(text, is_model_text)` pieces, empty pieces left out."""
        pieces: list[tuple[str, bool]] = []
        end = 0
        for start, stop in self.observation_spans:
            pieces += [(self.response[end:start], True), (self.response[start:stop], False)]
            end = stop
        pieces.append((self.response[end:], True))
        return [(text, is_model) for text, is_model in pieces if text]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """The model asked for tool `tool` with `arguments` (the text between the tool's tags, stripped)."""

    tool: str
    arguments: str


@dataclass(frozen=True, slots=True)
class FinalAnswer:
    """The model gave its final answer; the episode ends."""

    text: str


@dataclass(frozen=True, slots=True)
class InvalidTurn:
    """The turn is neither a tool call nor a final answer (no tag, an unclosed tag, an empty call)."""

    reason: str


TurnAction = ToolCall | FinalAnswer | InvalidTurn
"""What one model turn amounts to, as the task parses it."""


@dataclass(frozen=True, slots=True)
class ToolResult:
    """What a tool call produced: its text, or the error that stopped it (then `text` is empty)."""

    text: str
    error: str | None = None
    latency_s: float = 0.0


@dataclass(frozen=True, slots=True)
class ToolHealth:
    """A tool went down or came back, as an agent loop saw its calls: the first failure after a success
    (`failing`), or the first success after failures. The run records it in `faults.jsonl`."""

    tool: str
    failing: bool
    message: str
    """The failure (`search failed: ...`), or how many calls failed in a row before it answered again."""
    at: float
    """Unix time of the call that changed the tool's state."""
