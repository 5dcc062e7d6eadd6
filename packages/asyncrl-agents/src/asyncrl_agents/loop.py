"""The agent loop: multi-turn, tool-using trajectories of one prompt, run against the rollout engines.

Token-level invariants (what the actor trains on is exactly what the engine sampled):

- The prompt is the chat template applied to the task's messages with the generation prompt, tokenised once
  (`asyncrl_core.prompts`, which a warm start renders its demonstrations with too).
- A model turn's `Generation.output_ids` are appended verbatim, with loss mask 1, the engine's logprobs and
  the per-token weight versions of its spans. Model tokens are never decoded and encoded again: they are
  decoded only to be parsed.
- The task's stop strings (closing tags such as `</search>`) are requested with `no_stop_trim`, so the text
  the parser reads ends with the tag, and the output ids are what the engine sampled in any case (SGLang
  trims stop strings from the text only). A stop string may end inside a token (`</search>` + `\\n\\n` as one
  token): the extra characters stay, because the ids must.
- The observation is tokenised on its own and appended with mask 0, logprob 0.0 and `NO_VERSION`. The next
  turn is generated from the whole id sequence, so the engine conditions on exactly these ids.
- Like Search-R1, the episode continues inside one assistant message: observations are plain text after the
  model's tag, not new chat messages. A turn that ends with an end-of-message token (EOS, `<|im_end|>`, a
  `stop_token_ids` entry) ends the episode: nothing may follow the model's end of message. If that turn holds
  a final answer it counts; otherwise the episode ends with finish reason `stop` and no answer.

Budget: the response (model and observation tokens, all turns) stays within `max_response_len`, and prompt
plus response within the engine's `context_len`. A turn's `max_new_tokens` is cut to what is left; an
observation that does not fit is cut in its middle (its opening and closing survive) to leave
`min_turn_tokens` for the model; when even that is impossible the episode ends with finish reason `context`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl_core import prompts
from asyncrl_core.errors import AsyncRLError, PromptTooLongError
from asyncrl_core.metrics import (
    TRAJECTORY_BOOKKEEPING_S,
    TRAJECTORY_GENERATION_S,
    TRAJECTORY_LOOP_OVERHEAD_S,
    TRAJECTORY_NUM_INVALID_TURNS,
    TRAJECTORY_NUM_MODEL_TOKENS,
    TRAJECTORY_NUM_OBSERVATION_TOKENS,
    TRAJECTORY_NUM_OBSERVATIONS_CUT,
    TRAJECTORY_NUM_TOOL_CALLS,
    TRAJECTORY_NUM_TOOL_ERRORS,
    TRAJECTORY_PARSE_S,
    TRAJECTORY_TOOL_S,
    TRAJECTORY_TOTAL_S,
)
from asyncrl_core.protocols import GenerationClient, Task, Tool
from asyncrl_core.types import (
    NO_VERSION,
    ChatMessage,
    FinalAnswer,
    Generation,
    Group,
    InvalidTurn,
    SamplingParams,
    TaskSample,
    ToolCall,
    ToolHealth,
    ToolResult,
    Trajectory,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from asyncrl_core.protocols import AgentLoopFactory

logger = logging.getLogger(__name__)

OBSERVATION_TAIL_TOKENS = 16
"""Tokens kept from the end of a cut observation (its closing tag and separator)."""


@dataclass(slots=True)
class _Episode:
    """The growing token sequence of one trajectory and its per-token lists (aligned with the response)."""

    token_ids: list[int]
    prompt_len: int
    loss_mask: list[int] = field(default_factory=list[int])
    logprobs: list[float] = field(default_factory=list[float])
    versions: list[int] = field(default_factory=list[int])
    num_turns: int = 0
    answer: FinalAnswer | None = None
    finish_reason: str = ""
    generation_s: float = 0.0
    tool_s: float = 0.0
    parse_s: float = 0.0
    bookkeeping_s: float = 0.0
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    num_invalid_turns: int = 0
    num_observations_cut: int = 0
    earliest_version: int = NO_VERSION
    latest_version: int = NO_VERSION

    @property
    def response_len(self) -> int:
        return len(self.token_ids) - self.prompt_len

    def add_model_tokens(self, generation: Generation) -> None:
        ids = generation.output_ids
        if len(generation.logprobs) != len(ids):
            raise AsyncRLError(
                f"the engine returned {len(generation.logprobs)} logprobs for {len(ids)} output tokens"
            )
        versions = generation.token_versions()
        if ids and NO_VERSION in versions:
            raise AsyncRLError(
                f"the engine's version spans {generation.version_spans} do not cover {len(ids)} tokens"
            )
        self.token_ids.extend(ids)
        self.loss_mask.extend([1] * len(ids))
        self.logprobs.extend(generation.logprobs)
        self.versions.extend(versions)
        # The range follows from the spans; the tokens need not be read again.
        for span in generation.version_spans:
            if span.end > span.start:
                if self.earliest_version == NO_VERSION or span.version < self.earliest_version:
                    self.earliest_version = span.version
                self.latest_version = max(self.latest_version, span.version)

    def add_observation_tokens(self, ids: Sequence[int]) -> None:
        self.token_ids.extend(ids)
        self.loss_mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))
        self.versions.extend([NO_VERSION] * len(ids))


class MultiTurnAgentLoop:
    """Runs groups of multi-turn trajectories of a task against a `GenerationClient`, many groups at once.

    A plain class with async methods: build it in a test, or wrap it in a Ray actor. Every group runs its
    `group_size` trajectories concurrently; at most `max_concurrent_groups` groups run at a time (the others
    wait in `run_group`). A tool's exception or timeout becomes an observation (counted in the trajectory's
    `num_tool_errors`); an episode that outgrows `max_turns` or the context budget ends cleanly with that
    finish reason.

    Failures of a group are raised by `run_group`, typed by whether a retry can mend them (the runner drops
    or re-issues the prompt accordingly): `PromptTooLongError` (the prompt exceeds `max_prompt_len`) and
    `GenerationError` (the engine refused a request, a 400, or failed it on its own, a 500: retrying sends
    the same request) will not pass;
    `EngineUnavailableError` (no engine answered within the client's retries and timeouts) may.

    Args:
        task: the task (dataset, tools, parser, observations, reward).
        client: the rollout engines.
        tokenizer: the model's HuggingFace tokenizer, or the model folder to load it from.
        group_size: trajectories per prompt.
        sampling: sampling settings of every turn; `max_new_tokens` caps one turn (the budget may cut it
            further), `stop` is extended with the task's stop strings and `no_stop_trim` is forced on.
        max_prompt_len: longest prompt in tokens; a longer one raises `PromptTooLongError`.
        max_response_len: most response tokens of one trajectory, model and observation tokens alike.
        context_len: the engine's context length (prompt + response); unset means no limit beyond the two
            above.
        max_turns: most model turns; unset uses the task's.
        max_concurrent_groups: groups this loop runs at once.
        tool_timeout_s: longest a tool call may take before it counts as failed.
        num_demonstrations: the task's demonstrations to show before the question, as earlier chat turns.
        min_turn_tokens: the smallest model turn worth generating after an observation.
        on_tool_health: told when a tool starts failing (its first failed call after a success) and when it
            answers again, so that the runner can name a tool outage (a retriever that died) at once.
    """

    def __init__(
        self,
        task: Task,
        client: GenerationClient,
        tokenizer: PreTrainedTokenizerBase | str | Path,
        *,
        group_size: int,
        sampling: SamplingParams,
        max_prompt_len: int,
        max_response_len: int,
        context_len: int | None = None,
        max_turns: int | None = None,
        max_concurrent_groups: int = 8,
        tool_timeout_s: float = 30.0,
        num_demonstrations: int = 0,
        min_turn_tokens: int = 8,
        on_tool_health: Callable[[ToolHealth], None] | None = None,
    ) -> None:
        for name, value in (
            ("group_size", group_size),
            ("max_prompt_len", max_prompt_len),
            ("max_response_len", max_response_len),
            ("max_concurrent_groups", max_concurrent_groups),
            ("min_turn_tokens", min_turn_tokens),
            ("sampling.max_new_tokens", sampling.max_new_tokens),
        ):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if context_len is not None and context_len <= max_prompt_len:
            raise ValueError(f"context_len ({context_len}) must exceed max_prompt_len ({max_prompt_len})")
        if max_turns is not None and max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, got {max_turns}")
        if tool_timeout_s <= 0:
            raise ValueError(f"tool_timeout_s must be positive, got {tool_timeout_s}")
        if num_demonstrations < 0:
            raise ValueError(f"num_demonstrations must be non-negative, got {num_demonstrations}")
        self.task = task
        self.client = client
        self.tokenizer = (
            tokenizer if not isinstance(tokenizer, (str, Path)) else prompts.load_tokenizer(tokenizer)
        )
        self.group_size = group_size
        self.max_prompt_len = max_prompt_len
        self.max_response_len = max_response_len
        self.context_len = context_len
        self.max_turns = max_turns if max_turns is not None else task.max_turns
        self.tool_timeout_s = tool_timeout_s
        self.min_turn_tokens = min_turn_tokens
        self.sampling = replace(
            sampling, stop=tuple(dict.fromkeys((*sampling.stop, *task.stop))), no_stop_trim=True
        )
        self._tools: Mapping[str, Tool] = task.tools()
        self._demonstrations = list(task.demonstrations())[:num_demonstrations]
        self._end_of_message_ids = self._end_ids(sampling)
        self._slots = asyncio.Semaphore(max_concurrent_groups)
        self._rid_prefix = uuid.uuid4().hex[:12]
        self._next_group_id = 0
        self._dataset_cache: dict[str, Sequence[TaskSample]] = {}
        self._failing_tools: dict[str, int] = {}
        """Tool name -> calls that failed in a row (absent: the last call succeeded)."""
        self._on_tool_health = on_tool_health

    def _end_ids(self, sampling: SamplingParams) -> frozenset[int]:
        ids: set[int] = set(sampling.stop_token_ids)
        eos = self.tokenizer.eos_token_id
        if isinstance(eos, int):
            ids.add(eos)
        vocabulary: dict[str, int] = self.tokenizer.get_vocab()
        for token in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
            if token in vocabulary:
                ids.add(vocabulary[token])
        return frozenset(ids)

    def dataset(self, split: str = "train") -> Sequence[TaskSample]:
        """The task's prompts of `split` (read once, then cached)."""
        if split not in self._dataset_cache:
            self._dataset_cache[split] = self.task.dataset(split)
        return self._dataset_cache[split]

    def messages(self, sample: TaskSample) -> list[ChatMessage]:
        """The chat the model continues: system messages, demonstrations as earlier turns, the question."""
        return prompts.with_demonstrations(sample.messages, self._demonstrations)

    def prompt_ids(self, sample: TaskSample) -> list[int]:
        """The prompt's token ids: the chat template applied to `messages(sample)`, generation prompt added.

        Raises `PromptTooLongError` when it exceeds `max_prompt_len`.
        """
        ids = prompts.prompt_ids(self.tokenizer, self.messages(sample))
        if len(ids) > self.max_prompt_len:
            raise PromptTooLongError(
                f"prompt {sample.sample_id!r} has {len(ids)} tokens, more than max_prompt_len "
                f"({self.max_prompt_len}); raise data.max_prompt_len or skip it"
            )
        return ids

    async def run_group(
        self,
        prompt_index: int,
        sample: TaskSample | None = None,
        *,
        group_id: int | None = None,
        split: str = "train",
    ) -> Group:
        """Run `group_size` trajectories of one prompt and score them.

        `sample` defaults to `dataset(split)[prompt_index]`; `group_id` (the buffer's admission id) defaults
        to a counter of this loop. Each trajectory carries the earliest and latest weight version of its
        tokens (from the engine's version spans); `Group.finish_version` is left `NO_VERSION`: the buffer,
        which knows the actor's version, stamps it when it accepts the group.
        """
        if sample is None:
            sample = self.dataset(split)[prompt_index]
        if group_id is None:
            group_id = self._next_group_id
            self._next_group_id += 1
        prompt = self.prompt_ids(sample)
        try:
            async with self._slots, asyncio.TaskGroup() as tasks:
                running = [
                    tasks.create_task(
                        self._run_trajectory(sample, prompt, f"{self._rid_prefix}-{group_id}-{i}")
                    )
                    for i in range(self.group_size)
                ]
        except BaseExceptionGroup as failures:
            # The first failure cancelled the group's other trajectories; callers see that error itself
            # (an `EngineUnavailableError`, say), not an exception group.
            raise failures.exceptions[0] from None
        trajectories = [trajectory.result() for trajectory in running]
        return Group(group_id, prompt_index, trajectories)

    async def _run_trajectory(self, sample: TaskSample, prompt: list[int], rid: str) -> Trajectory:
        started = time.perf_counter()
        episode = _Episode(list(prompt), len(prompt))
        while episode.finish_reason == "":
            await self._turn(episode, f"{rid}-{episode.num_turns}", routing_key=rid)
        reward = self.task.reward(sample, episode.answer)
        total_s = time.perf_counter() - started
        metrics = {
            TRAJECTORY_GENERATION_S: episode.generation_s,
            TRAJECTORY_TOOL_S: episode.tool_s,
            TRAJECTORY_PARSE_S: episode.parse_s,
            TRAJECTORY_BOOKKEEPING_S: episode.bookkeeping_s,
            TRAJECTORY_LOOP_OVERHEAD_S: max(0.0, total_s - episode.generation_s - episode.tool_s),
            TRAJECTORY_TOTAL_S: total_s,
            TRAJECTORY_NUM_MODEL_TOKENS: float(sum(episode.loss_mask)),
            TRAJECTORY_NUM_OBSERVATION_TOKENS: float(episode.response_len - sum(episode.loss_mask)),
            TRAJECTORY_NUM_TOOL_CALLS: float(episode.num_tool_calls),
            TRAJECTORY_NUM_TOOL_ERRORS: float(episode.num_tool_errors),
            TRAJECTORY_NUM_INVALID_TURNS: float(episode.num_invalid_turns),
            TRAJECTORY_NUM_OBSERVATIONS_CUT: float(episode.num_observations_cut),
        }
        return Trajectory(
            token_ids=episode.token_ids,
            prompt_len=episode.prompt_len,
            loss_mask=episode.loss_mask,
            rollout_logprobs=episode.logprobs,
            versions=episode.versions,
            reward=reward,
            num_turns=episode.num_turns,
            finish_reason=episode.finish_reason,
            metrics=metrics,
            earliest_version=episode.earliest_version,
            latest_version=episode.latest_version,
        )

    def _budget(self, episode: _Episode) -> int:
        """Tokens the episode may still add: response budget and engine context, whichever is tighter."""
        left = self.max_response_len - episode.response_len
        if self.context_len is not None:
            left = min(left, self.context_len - len(episode.token_ids))
        return left

    async def _turn(self, episode: _Episode, rid: str, *, routing_key: str) -> None:
        """One model turn, then its observation unless the episode ends (then `finish_reason` is set).

        `routing_key` is the trajectory's id: every turn goes to the engine of the first (a pool keeps it
        there while that engine is up), whose prefix cache holds the turns before.
        """
        if episode.num_turns >= self.max_turns:
            episode.finish_reason = "max_turns"
            return
        budget = self._budget(episode)
        if budget < 1:
            episode.finish_reason = "context"
            return
        sampling = replace(self.sampling, max_new_tokens=min(self.sampling.max_new_tokens, budget))
        started = time.perf_counter()
        try:
            generation = await self.client.generate(
                episode.token_ids, sampling, rid=rid, routing_key=routing_key
            )
        finally:
            episode.generation_s += time.perf_counter() - started

        after_generation = time.perf_counter()
        episode.num_turns += 1
        episode.add_model_tokens(generation)
        ids = generation.output_ids
        ended_message = bool(ids) and ids[-1] in self._end_of_message_ids
        parse_started = time.perf_counter()
        text = str(self.tokenizer.decode(ids, skip_special_tokens=False))
        action = self.task.parse_turn(text)
        episode.parse_s += time.perf_counter() - parse_started
        episode.bookkeeping_s += parse_started - after_generation

        if generation.finish_reason == "abort":
            episode.finish_reason = "abort"
        elif isinstance(action, FinalAnswer):
            episode.answer = action
            episode.finish_reason = "answer"
        elif ended_message:
            episode.finish_reason = "stop"
        elif generation.finish_reason == "length" and len(ids) >= budget:
            episode.finish_reason = "context"
        elif episode.num_turns >= self.max_turns:
            # No turn is left to read a tool's result: do not run it.
            episode.finish_reason = "max_turns"
        if episode.finish_reason:
            return

        if isinstance(action, ToolCall):
            result = await self._call_tool(action)
            episode.num_tool_calls += 1
            episode.num_tool_errors += result.error is not None
            episode.tool_s += result.latency_s
            observation_action: ToolCall | InvalidTurn = action
        else:
            assert isinstance(action, InvalidTurn)  # a final answer ended the episode above
            result = None
            episode.num_invalid_turns += 1
            observation_action = action

        started = time.perf_counter()
        observation = self.task.observation(observation_action, result)
        observation_ids: list[int] = list(self.tokenizer.encode(observation, add_special_tokens=False))
        room = self._budget(episode) - self.min_turn_tokens
        if len(observation_ids) > room:
            if room < 2 * OBSERVATION_TAIL_TOKENS:
                episode.finish_reason = "context"
                episode.bookkeeping_s += time.perf_counter() - started
                return
            # Cut the middle: the model still sees where the observation starts and that it closed.
            observation_ids = (
                observation_ids[: room - OBSERVATION_TAIL_TOKENS] + observation_ids[-OBSERVATION_TAIL_TOKENS:]
            )
            episode.num_observations_cut += 1
        episode.add_observation_tokens(observation_ids)
        episode.bookkeeping_s += time.perf_counter() - started

    async def _call_tool(self, call: ToolCall) -> ToolResult:
        """Call the tool with a timeout; any failure is returned as `ToolResult.error`, never raised."""
        started = time.perf_counter()
        tool = self._tools.get(call.tool)
        if tool is None:
            known = ", ".join(sorted(self._tools)) or "none"
            return ToolResult(
                "", f"unknown tool {call.tool!r} (tools: {known})", time.perf_counter() - started
            )
        try:
            async with asyncio.timeout(self.tool_timeout_s):
                text = await tool(call.arguments)
        except TimeoutError:
            error = f"{call.tool} timed out after {self.tool_timeout_s:g} s"
        except Exception as failure:  # a tool may fail in any way; the model reads the error instead
            error = f"{call.tool} failed: {type(failure).__name__}: {failure}"
        else:
            if failed := self._failing_tools.pop(call.tool, 0):
                logger.warning("tool %s answers again", call.tool)
                self._tool_health(call.tool, False, f"answers again after {failed} failed calls in a row")
            return ToolResult(text, None, time.perf_counter() - started)
        # A tool that goes down fails every call: say so once when it starts, then every 100 failures.
        failures = self._failing_tools[call.tool] = self._failing_tools.get(call.tool, 0) + 1
        if failures % 100 == 1:
            logger.warning(
                "tool call %s(%r) failed (%d in a row): %s", call.tool, call.arguments, failures, error
            )
        if failures == 1:
            self._tool_health(call.tool, True, error)
        return ToolResult("", error, time.perf_counter() - started)

    def _tool_health(self, tool: str, failing: bool, message: str) -> None:
        if self._on_tool_health is not None:
            self._on_tool_health(ToolHealth(tool, failing, message, time.time()))

    async def aclose(self) -> None:
        """Release the task's resources in this process (HTTP connections of its tools)."""
        await self.task.aclose()


if TYPE_CHECKING:
    # The runner loads this class by its entry point `multi-turn` (`asyncrl.agent_loops`): the type checker
    # holds it to the protocol here.
    _AGENT_LOOP_FACTORY: AgentLoopFactory = MultiTurnAgentLoop
