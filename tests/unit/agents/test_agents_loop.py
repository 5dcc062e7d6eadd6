"""The agent loop against a scripted engine (the model's words fixed) and the real searchr1-mini retriever."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import pytest
from agents_testing import ScriptedEngine, check_alignment, mini_reader, smollm2_tokenizer
from pydantic import ValidationError

from asyncrl_agents.loop import MultiTurnAgentLoop
from asyncrl_agents.tasks.searchr1 import INVALID_TURN_OBSERVATION, SearchR1MiniArguments, SearchR1MiniTask
from asyncrl_core import metrics
from asyncrl_core.errors import AsyncRLError, EngineUnavailableError, GenerationError, PromptTooLongError
from asyncrl_core.runner.workers import group_metrics
from asyncrl_core.types import NO_VERSION, Generation, SamplingParams, TaskSample

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def retriever_url() -> Iterator[str]:
    with SearchR1MiniTask().serve() as args:
        yield args["retriever_url"]


@pytest.fixture
async def task(retriever_url: str) -> AsyncIterator[SearchR1MiniTask]:
    task = SearchR1MiniTask(retriever_url=retriever_url)
    yield task
    await task.aclose()


def find(task: SearchR1MiniTask, prefix: str) -> tuple[int, TaskSample]:
    samples = task.dataset("train")
    index = next(
        i for i, s in enumerate(samples) if s.messages[-1].content.split("Question: ")[1].startswith(prefix)
    )
    return index, samples[index]


def make_loop(task: SearchR1MiniTask, engine: ScriptedEngine, **kwargs: object) -> MultiTurnAgentLoop:
    options: dict[str, object] = {
        "group_size": 2,
        "sampling": SamplingParams(max_new_tokens=64, temperature=1.0),
        "max_prompt_len": 512,
        "max_response_len": 1024,
    }
    options.update(kwargs)
    return MultiTurnAgentLoop(task, engine, smollm2_tokenizer(), **options)  # type: ignore[arg-type]


async def test_single_hop_search_then_answer(task: SearchR1MiniTask) -> None:
    tokenizer = smollm2_tokenizer()
    engine = ScriptedEngine(tokenizer, mini_reader)
    loop = make_loop(task, engine)
    index, sample = find(task, "Who founded")
    group = await loop.run_group(index, sample, group_id=7)
    assert group.group_id == 7
    assert group.prompt_index == index
    assert len(group.trajectories) == 2
    prompt = loop.prompt_ids(sample)
    for trajectory in group.trajectories:
        assert trajectory.finish_reason == "answer"
        assert trajectory.num_turns == 2
        assert trajectory.reward == 1.0, tokenizer.decode(trajectory.token_ids[trajectory.prompt_len :])
        check_alignment(trajectory, engine.calls, prompt)
        response = tokenizer.decode(trajectory.token_ids[trajectory.prompt_len :])
        # The search stopped at its closing tag (kept), then Search-R1's observation followed.
        assert re.search(r"</search>\n\n<information>Doc 1\(Title: \"", response)
        assert response.rstrip().endswith("</answer>")
        assert trajectory.metrics["num_tool_calls"] == 1
        assert trajectory.metrics["num_tool_errors"] == 0
        assert trajectory.metrics["tool_s"] > 0
    # The first turn was generated from the prompt, the second from prompt + turn + observation.
    assert [len(call.input_ids) == len(prompt) for call in engine.calls].count(True) == 2


async def test_multi_hop_answer_needs_the_retrieved_passages(task: SearchR1MiniTask) -> None:
    engine = ScriptedEngine(smollm2_tokenizer(), mini_reader)
    loop = make_loop(task, engine, group_size=3)
    index, sample = find(task, "In which city was the founder of")
    group = await loop.run_group(index, sample)
    prompt = loop.prompt_ids(sample)
    for trajectory in group.trajectories:
        assert trajectory.finish_reason == "answer"
        assert trajectory.num_turns == 3
        assert trajectory.reward == 1.0
        assert trajectory.metrics["num_tool_calls"] == 2
        check_alignment(trajectory, engine.calls, prompt)


async def test_wrong_answer_scores_zero_and_answer_with_inner_tags_is_parsed(task: SearchR1MiniTask) -> None:
    index, sample = find(task, "Who founded")
    engine = ScriptedEngine(smollm2_tokenizer(), lambda _: "<answer> The <b>Nobody</b> </answer>")
    group = await make_loop(task, engine, group_size=1).run_group(index, sample)
    (trajectory,) = group.trajectories
    assert trajectory.finish_reason == "answer"
    assert trajectory.reward == 0.0
    assert trajectory.num_turns == 1

    engine = ScriptedEngine(smollm2_tokenizer(), lambda _: f"<answer> {sample.answers[0]}. </answer>")
    group = await make_loop(task, engine, group_size=1).run_group(index, sample)
    assert group.trajectories[0].reward == 1.0  # normalised: case, punctuation and articles do not matter


async def test_version_spans_become_per_token_versions(task: SearchR1MiniTask) -> None:
    engine = ScriptedEngine(smollm2_tokenizer(), mini_reader, version=4, switch_version_at=3)
    index, sample = find(task, "Who founded")
    group = await make_loop(task, engine, group_size=1).run_group(index, sample)
    (trajectory,) = group.trajectories
    check_alignment(trajectory, engine.calls, make_loop(task, engine).prompt_ids(sample))
    assert trajectory.version_range() == (4, 5)
    assert (trajectory.earliest_version, trajectory.latest_version) == (4, 5)
    assert group.version_range() == (4, 5)
    assert group.finish_version == NO_VERSION, "the buffer stamps it"
    model_versions = [v for v, m in zip(trajectory.versions, trajectory.loss_mask, strict=True) if m]
    assert model_versions[:4] == [4, 4, 4, 5]


async def test_invalid_turn_gets_search_r1_correction(task: SearchR1MiniTask) -> None:
    tokenizer = smollm2_tokenizer()
    # The first turn has no closing tag and no end of message: `max_new_tokens` ends it.
    turns = iter(["I think <search> is never closed, and I keep talking on and on", "<answer> x </answer>"])
    engine = ScriptedEngine(tokenizer, lambda _: next(turns))
    index, sample = find(task, "Who founded")
    loop = make_loop(task, engine, group_size=1, sampling=SamplingParams(max_new_tokens=12))
    (trajectory,) = (await loop.run_group(index, sample)).trajectories
    response = tokenizer.decode(trajectory.token_ids[trajectory.prompt_len :])
    assert INVALID_TURN_OBSERVATION in response
    assert trajectory.metrics["num_invalid_turns"] == 1
    assert trajectory.num_turns == 2
    assert trajectory.finish_reason == "answer"


async def test_end_of_message_without_answer_ends_the_episode(task: SearchR1MiniTask) -> None:
    engine = ScriptedEngine(smollm2_tokenizer(), lambda _: "I do not know.<|im_end|>")
    index, sample = find(task, "Who founded")
    (trajectory,) = (await make_loop(task, engine, group_size=1).run_group(index, sample)).trajectories
    assert trajectory.finish_reason == "stop"
    assert trajectory.reward == 0.0
    assert trajectory.num_turns == 1
    assert trajectory.token_ids[-1] == smollm2_tokenizer().convert_tokens_to_ids("<|im_end|>")
    assert all(trajectory.loss_mask)


async def test_max_turns_ends_cleanly_without_running_the_last_tool(task: SearchR1MiniTask) -> None:
    engine = ScriptedEngine(smollm2_tokenizer(), lambda _: "<search> Who </search>")
    index, sample = find(task, "Who founded")
    (trajectory,) = (
        await make_loop(task, engine, group_size=1, max_turns=3).run_group(index, sample)
    ).trajectories
    assert trajectory.finish_reason == "max_turns"
    assert trajectory.num_turns == 3
    assert trajectory.metrics["num_tool_calls"] == 2
    assert trajectory.reward == 0.0
    assert trajectory.loss_mask[-1] == 1  # the trajectory ends with the model's last turn


async def test_context_budget_cuts_observations_and_ends_the_episode(task: SearchR1MiniTask) -> None:
    tokenizer = smollm2_tokenizer()
    engine = ScriptedEngine(tokenizer, lambda _: "<search> company founded by </search>")
    index, sample = find(task, "Who founded")
    budget = 100
    loop = make_loop(task, engine, group_size=1, max_response_len=budget, max_turns=10)
    (trajectory,) = (await loop.run_group(index, sample)).trajectories
    assert trajectory.finish_reason == "context"
    assert trajectory.response_len <= budget
    assert trajectory.metrics["num_observations_cut"] >= 1
    # A cut observation keeps its end, so the model still sees the tag close.
    assert "</information>" in tokenizer.decode(trajectory.token_ids[trajectory.prompt_len :])
    for call in engine.calls:
        assert len(call.input_ids) - trajectory.prompt_len + call.sampling.max_new_tokens <= budget

    context_len = trajectory.prompt_len + 40
    engine = ScriptedEngine(tokenizer, lambda _: "<search> company founded by </search>")
    loop = make_loop(
        task,
        engine,
        group_size=1,
        context_len=context_len,
        max_prompt_len=trajectory.prompt_len,
        max_turns=10,
    )
    (trajectory,) = (await loop.run_group(index, sample)).trajectories
    assert trajectory.finish_reason == "context"
    assert len(trajectory.token_ids) <= context_len


async def test_tool_failure_becomes_an_observation_a_warning_and_a_step_metric(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A retriever that is not there: every search fails, the episode goes on; the outage is logged as a
    # warning and counted in the metrics of the step that trains on the group.
    task = SearchR1MiniTask(retriever_url="http://127.0.0.1:9/retrieve", search_timeout_s=2.0)
    try:
        tokenizer = smollm2_tokenizer()
        turns = iter(["<search> anything </search>", "<answer> x </answer>"])
        engine = ScriptedEngine(tokenizer, lambda _: next(turns))
        index, sample = find(task, "Who founded")
        with caplog.at_level(logging.WARNING, logger="asyncrl_agents.loop"):
            group = await make_loop(task, engine, group_size=1).run_group(index, sample)
        (trajectory,) = group.trajectories
        assert trajectory.finish_reason == "answer"
        assert trajectory.metrics["num_tool_errors"] == 1
        response = tokenizer.decode(trajectory.token_ids[trajectory.prompt_len :])
        assert (
            "<information>Search failed: search failed: AsyncRLError: retrieval server "
            "http://127.0.0.1:9/retrieve did not answer: ConnectError"
        ) in response
        assert "tool call search('anything') failed (1 in a row)" in caplog.text
        step = group_metrics([group])
        assert step[metrics.TOOL_CALLS] == step[metrics.TOOL_ERRORS] == 1
        assert step[metrics.TOOL_ERROR_RATE] == 1.0
        assert step[metrics.trajectory_mean(metrics.TRAJECTORY_TOOL_S)] > 0.0
    finally:
        await task.aclose()


class SlowTool:
    name = "search"

    async def __call__(self, arguments: str) -> str:
        await asyncio.sleep(30)
        return "too late"


async def test_tool_timeout_becomes_an_observation(task: SearchR1MiniTask) -> None:
    tokenizer = smollm2_tokenizer()
    turns = iter(["<search> anything </search>", "<answer> x </answer>"])
    engine = ScriptedEngine(tokenizer, lambda _: next(turns))
    loop = make_loop(task, engine, group_size=1, tool_timeout_s=0.2)
    loop._tools = {"search": SlowTool()}  # the task's own tools are real; this one hangs on purpose
    index, sample = find(task, "Who founded")
    (trajectory,) = (await loop.run_group(index, sample)).trajectories
    assert trajectory.finish_reason == "answer"
    assert "timed out after 0.2 s" in tokenizer.decode(trajectory.token_ids[trajectory.prompt_len :])


@dataclass
class FailingEngine:
    """An engine whose every request fails with `error`."""

    error: Exception

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        rid: str | None = None,
        routing_key: str | None = None,
    ) -> Generation:
        raise self.error


# A refused request (a 400) would be refused again: the group fails with that error, which the runner takes as
# permanent (the prompt is dropped with it as the reason), instead of training on empty trajectories. An
# engine no one reaches raises its own error, which the runner may retry.
@pytest.mark.parametrize(
    "error",
    [
        GenerationError("prompt too long for the context"),
        EngineUnavailableError("engine at http://127.0.0.1:1 is not reachable"),
    ],
    ids=["refused", "unreachable"],
)
async def test_an_engine_failure_fails_the_group_with_the_engines_error(
    task: SearchR1MiniTask, error: Exception
) -> None:
    loop = MultiTurnAgentLoop(
        task,
        FailingEngine(error),
        smollm2_tokenizer(),
        group_size=2,
        sampling=SamplingParams(max_new_tokens=8),
        max_prompt_len=512,
        max_response_len=64,
    )
    with pytest.raises(type(error), match=re.escape(str(error))):
        await loop.run_group(0)


async def test_prompt_too_long_is_refused(task: SearchR1MiniTask) -> None:
    engine = ScriptedEngine(smollm2_tokenizer(), mini_reader)
    with pytest.raises(PromptTooLongError, match="max_prompt_len"):
        await make_loop(task, engine, max_prompt_len=20).run_group(0)


async def test_many_groups_run_at_once_within_the_limit(task: SearchR1MiniTask) -> None:
    engine = ScriptedEngine(smollm2_tokenizer(), mini_reader, delay_s=0.02)
    loop = make_loop(task, engine, group_size=2, max_concurrent_groups=3)
    samples = task.dataset("train")
    indices = [i for i, s in enumerate(samples) if "Who founded" in s.messages[-1].content][:8]
    groups = await asyncio.gather(*(loop.run_group(i) for i in indices))
    assert [g.prompt_index for g in groups] == indices
    assert len({g.group_id for g in groups}) == 8
    assert all(t.reward == 1.0 for g in groups for t in g.trajectories)
    assert 2 < engine.max_in_flight <= 3 * 2


async def test_demonstrations_are_shown_as_earlier_turns(task: SearchR1MiniTask) -> None:
    engine = ScriptedEngine(smollm2_tokenizer(), mini_reader)
    loop = make_loop(task, engine, num_demonstrations=2, max_prompt_len=2048)
    index, sample = find(task, "In which city was the founder of")
    messages = loop.messages(sample)
    assert [m.role for m in messages] == ["user", "assistant", "user", "assistant", "user"]
    assert messages[-1] == sample.messages[-1]
    group = await loop.run_group(index, sample)
    assert all(t.reward == 1.0 for t in group.trajectories)


def test_loop_rejects_bad_settings(task: SearchR1MiniTask) -> None:
    engine = ScriptedEngine(smollm2_tokenizer(), mini_reader)
    bad: Mapping[str, object] = {"group_size": 0}
    with pytest.raises(ValueError, match="group_size"):
        make_loop(task, engine, **bad)
    with pytest.raises(ValueError, match="context_len"):
        make_loop(task, engine, context_len=100, max_prompt_len=512)


def searches_then_answer(num_searches: int, answer: str) -> Callable[[str], str]:
    """The model's words: a search until `num_searches` results are in the context, then `answer`."""

    def respond(context: str) -> str:
        if context.count("<information>Doc") < num_searches:  # the instruction names the tag too
            return "<search> Who founded </search>"
        return f"<answer> {answer} </answer>"

    return respond


@pytest.mark.parametrize("max_turns", [0, 1, 2])
async def test_searchr1_gives_a_final_answer_turn_after_max_turns(retriever_url: str, max_turns: int) -> None:
    """Search-R1's count (the default): `max_turns` turns whose search runs, then one turn to answer."""
    task = SearchR1MiniTask(retriever_url=retriever_url, max_turns=max_turns)
    assert task.max_turns == max_turns + 1
    index, sample = find(task, "Who founded")
    engine = ScriptedEngine(smollm2_tokenizer(), searches_then_answer(max_turns, sample.answers[0]))
    (answered,) = (await make_loop(task, engine, group_size=1).run_group(index, sample)).trajectories
    assert answered.finish_reason == "answer"
    assert answered.num_turns == max_turns + 1
    assert answered.metrics["num_tool_calls"] == max_turns
    assert answered.reward == 1.0
    # A model that keeps searching: the final turn's search is not run, and no answer scores 0.
    searching = ScriptedEngine(smollm2_tokenizer(), lambda _: "<search> Who </search>")
    (exhausted,) = (await make_loop(task, searching, group_size=1).run_group(index, sample)).trajectories
    assert exhausted.finish_reason == "max_turns"
    assert exhausted.num_turns == max_turns + 1
    assert exhausted.metrics["num_tool_calls"] == max_turns
    assert exhausted.reward == 0.0
    await task.aclose()


async def test_model_turns_count_every_turn(retriever_url: str) -> None:
    """`turn_limit: model_turns`: `max_turns` model turns, the last included, so one search fewer."""
    task = SearchR1MiniTask(retriever_url=retriever_url, max_turns=2, turn_limit="model_turns")
    assert task.max_turns == 2
    index, sample = find(task, "Who founded")
    engine = ScriptedEngine(smollm2_tokenizer(), searches_then_answer(2, sample.answers[0]))
    (trajectory,) = (await make_loop(task, engine, group_size=1).run_group(index, sample)).trajectories
    assert trajectory.finish_reason == "max_turns"
    assert trajectory.num_turns == 2
    assert trajectory.metrics["num_tool_calls"] == 1
    assert trajectory.reward == 0.0
    await task.aclose()
    with pytest.raises(AsyncRLError, match="turn_limit must be `searchr1` or `model_turns`"):
        SearchR1MiniTask(turn_limit="searches")  # type: ignore[arg-type]
    with pytest.raises(AsyncRLError, match="max_turns must be at least 1"):
        SearchR1MiniTask(max_turns=0, turn_limit="model_turns")
    with pytest.raises(ValidationError, match="max_turns must be at least 1 with turn_limit: model_turns"):
        SearchR1MiniArguments.model_validate({"max_turns": 0, "turn_limit": "model_turns"})
    assert SearchR1MiniArguments.model_validate({"max_turns": 0}).turn_limit == "searchr1"
