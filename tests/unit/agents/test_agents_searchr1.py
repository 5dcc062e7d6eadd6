"""The searchr1 and searchr1-mini tasks: reward, passages, generated world, registration as plugins."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from asyncrl_agents.tasks import mini_world
from asyncrl_agents.tasks.searchr1 import (
    PROMPT,
    SearchR1MiniTask,
    SearchR1Task,
    SearchTool,
    exact_match,
    format_passages,
    normalize_answer,
)
from asyncrl_core import plugins
from asyncrl_core.errors import AsyncRLError
from asyncrl_core.protocols import Task, Tool
from asyncrl_core.types import FinalAnswer, InvalidTurn, TaskSample, ToolCall, ToolResult


@pytest.mark.parametrize(
    ("text", "normalized"),
    [
        ("The Eiffel Tower!", "eiffel tower"),
        ("  a   Tale of Two   Cities. ", "tale of two cities"),
        ("An apple, the pear", "apple pear"),
        ("Theatre", "theatre"),
        ("U.S.A.", "usa"),
        ("", ""),
    ],
)
def test_normalize_answer(text: str, normalized: str) -> None:
    assert normalize_answer(text) == normalized


def test_reward_is_normalised_exact_match() -> None:
    task = SearchR1MiniTask()
    sample = TaskSample("s", (), ("Barack Obama", "Obama"))
    assert task.reward(sample, FinalAnswer("barack obama.")) == 1.0
    assert task.reward(sample, FinalAnswer("The Obama")) == 1.0
    assert task.reward(sample, FinalAnswer("Obama Barack")) == 0.0
    assert task.reward(sample, FinalAnswer("President Obama")) == 0.0
    assert task.reward(sample, None) == 0.0
    assert SearchR1MiniTask(format_score=0.1).reward(sample, FinalAnswer("no")) == 0.1
    assert not exact_match("x", [])


def test_passages_are_formatted_as_search_r1_shows_them() -> None:
    result = [
        {"document": {"id": "1", "contents": '"Paris"\nParis is in France.\nIt is large.'}, "score": 3.0},
        {"id": "2", "contents": '"Lyon"\nLyon too.'},
    ]
    assert format_passages(result) == (
        'Doc 1(Title: "Paris") Paris is in France.\nIt is large.\nDoc 2(Title: "Lyon") Lyon too.'
    )
    with pytest.raises(AsyncRLError, match="no `contents`"):
        format_passages([{"document": {"id": "1"}}])


def test_observations() -> None:
    task = SearchR1MiniTask()
    call = ToolCall("search", "q")
    assert task.observation(call, ToolResult(" Doc 1 \n")) == "\n\n<information>Doc 1</information>\n\n"
    failed = task.observation(call, ToolResult("", "search timed out after 30 s"))
    assert failed == "\n\n<information>Search failed: search timed out after 30 s</information>\n\n"
    assert "My previous action is invalid" in task.observation(InvalidTurn("no action"), None)


def test_prompt_follows_search_r1() -> None:
    (sample,) = SearchR1MiniTask().dataset("test")[:1]
    (message,) = sample.messages
    assert message.role == "user"
    assert message.content.startswith("Answer the given question. You must conduct reasoning inside <think>")
    assert message.content.endswith("?\n")
    assert PROMPT.format(question="Q?").endswith("For example, <answer> Beijing </answer>. Question: Q?\n")


def test_mini_world_is_deterministic_and_sized_as_documented(tmp_path: Path) -> None:
    world = mini_world.generate(0)
    assert world == mini_world.generate(0)
    assert world != mini_world.generate(1)
    assert len(world.passages) == 460
    assert (len(world.split("train")), len(world.split("test"))) == (846, 94)
    hops = [q.num_hops for q in world.questions]
    assert (hops.count(1), hops.count(2), hops.count(3)) == (540, 320, 80)
    assert len({q.question for q in world.questions}) == len(world.questions)
    contents = {p["id"]: p["contents"] for p in world.passages}
    for question in world.questions:
        # The answer is written in the last supporting passage: searching can find it.
        assert question.answers[0] in contents[question.support[-1]]
    mini_world.write(world, tmp_path / "a")
    mini_world.main(["--out", str(tmp_path / "b"), "--seed", "0"])
    for name in ("corpus.jsonl", "train.jsonl", "test.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    first = json.loads((tmp_path / "a" / "train.jsonl").read_text().splitlines()[0])
    assert set(first) >= {"id", "question", "golden_answers"}


def test_mini_demonstrations_parse_as_the_task_reads_them() -> None:
    task = SearchR1MiniTask()
    demonstrations = task.demonstrations()
    samples = {sample.messages: sample for sample in task.dataset("train")}
    assert len(demonstrations) == len(samples)  # one per train question
    # The few-shot pair comes first: one hop, then two.
    assert "Who founded" in demonstrations[0].messages[-1].content
    assert "In which city was the founder" in demonstrations[1].messages[-1].content
    for demonstration in demonstrations:
        # The model's turns parse as the task reads them; the observations are what the task would show.
        model_turns = [text for text, is_model_text in demonstration.segments() if is_model_text]
        for turn in model_turns[:-1]:
            assert isinstance(task.parse_turn(turn), ToolCall)
        answer = task.parse_turn(model_turns[-1])
        assert isinstance(answer, FinalAnswer)
        assert task.reward(samples[demonstration.messages], answer) == 1.0
        observations = [text for text, is_model_text in demonstration.segments() if not is_model_text]
        assert len(observations) == len(model_turns) - 1
        for observation in observations:
            assert observation.startswith("\n\n<information>Doc 1(Title: ")
            assert observation.count("Doc ") == task.topk


def test_mini_max_hops_keeps_the_easy_questions() -> None:
    easy = SearchR1MiniTask(max_hops=1)
    assert 0 < len(easy.dataset("train")) < len(SearchR1MiniTask().dataset("train"))
    assert len(easy.demonstrations()) == len(easy.dataset("train"))
    assert all(len(d.observation_spans) == 1 for d in easy.demonstrations())
    with pytest.raises(AsyncRLError, match="max_hops must be at least 1"):
        SearchR1MiniTask(max_hops=0)


def test_tasks_are_registered_and_meet_the_protocol() -> None:
    assert {"searchr1", "searchr1-mini"} <= set(plugins.names("asyncrl.tasks"))
    factory = plugins.load("asyncrl.tasks", "searchr1-mini")
    assert factory is SearchR1MiniTask
    task = SearchR1MiniTask(retriever_url="http://127.0.0.1:1")
    assert isinstance(task, Task)
    assert all(isinstance(tool, Tool) for tool in task.tools().values())
    assert plugins.load("asyncrl.tasks", "searchr1") is SearchR1Task
    assert task.stop == ("</search>", "</answer>")


def test_missing_retriever_and_data_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(AsyncRLError, match="retriever_url"):
        SearchR1MiniTask().tools()
    with pytest.raises(AsyncRLError, match="data_path"):
        SearchR1Task().dataset("train")
    with pytest.raises(KeyError, match="splits: none"):
        SearchR1Task(data_path=str(tmp_path)).dataset("train")
    with pytest.raises(KeyError, match="train, test"):
        SearchR1MiniTask().dataset("dev")
    with pytest.raises(AsyncRLError, match="corpus_path"), SearchR1Task().serve():
        pass
    (tmp_path / "train.jsonl").write_text('{"question": "q"}\n')
    with pytest.raises(AsyncRLError, match="golden_answers"):
        SearchR1Task(data_path=str(tmp_path)).dataset("train")


@pytest.mark.integration
def test_searchr1_on_files_serves_its_corpus_and_searches_it(tmp_path: Path) -> None:
    world = mini_world.generate(3)
    mini_world.write(world, tmp_path)
    task = SearchR1Task(data_path=str(tmp_path), corpus_path=str(tmp_path / "corpus.jsonl"), topk=2)
    samples = task.dataset("test")
    assert len(samples) == len(world.split("test"))
    question = world.split("test")[0]
    with task.serve() as args:
        worker_task = SearchR1Task(data_path=str(tmp_path), topk=2, **args)
        search = worker_task.tools()["search"]

        async def run() -> str:
            try:
                return await search(question.question)
            finally:
                await worker_task.aclose()

        text = asyncio.run(run())
    assert text.startswith("Doc 1(Title: ")
    assert "\nDoc 2(Title: " in text
    assert [line[:4] for line in text.splitlines()] == ["Doc ", "Doc "]


def test_load_task_builds_registered_tasks_and_names_problems() -> None:
    from asyncrl_core.errors import PluginError
    from asyncrl_core.tasks import load_task

    task = load_task("searchr1-mini", {"seed": 2, "topk": 5})
    assert isinstance(task, SearchR1MiniTask)
    assert (task.seed, task.topk) == (2, 5)
    with pytest.raises(PluginError, match=r"rejected agentloop\.task_args"):
        load_task("searchr1-mini", {"bogus": 1})
    with pytest.raises(PluginError, match=r"agentloop\.task_args\.topk: Input should be a valid integer"):
        load_task("searchr1-mini", {"topk": "5"})  # checked against the task's arguments model
    with pytest.raises(PluginError, match="no plugin named 'nope'"):
        load_task("nope")
    with pytest.raises(PluginError, match=r"not a Task \(missing: .*max_turns"):
        load_task("collections:OrderedDict")


class CountingTransport(httpx.AsyncHTTPTransport):
    """The real network transport, counting the requests it sends."""

    def __init__(self) -> None:
        super().__init__()
        self.num_requests = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.num_requests += 1
        return await super().handle_async_request(request)


@pytest.mark.integration
async def test_concurrent_searches_share_one_request_and_get_their_own_passages() -> None:
    task = SearchR1MiniTask()
    people = [passage["contents"].split("\n")[0].strip('"') for passage in task.world.passages[60:72:2]]
    with task.serve() as args:
        transport = CountingTransport()
        search = SearchTool(args["retriever_url"], topk=2, transport=transport, max_batch=4)
        try:
            texts = await asyncio.gather(*(search(person) for person in people))
            assert transport.num_requests == 2  # six queries, batches of at most four
            for person, text in zip(people, texts, strict=True):
                assert text.startswith(f'Doc 1(Title: "{person}")')
            assert (await search(people[0])).startswith(f'Doc 1(Title: "{people[0]}")')
            assert transport.num_requests == 3
        finally:
            await search.aclose()
    failing = SearchTool("http://127.0.0.1:9", timeout_s=2.0)
    try:
        results = await asyncio.gather(failing("a"), failing("b"), return_exceptions=True)
        for result in results:  # the error names the retriever, and what the socket said
            assert isinstance(result, AsyncRLError)
            assert str(result).startswith("retrieval server http://127.0.0.1:9/retrieve did not answer")
            assert isinstance(result.__cause__, httpx.ConnectError)
    finally:
        await failing.aclose()
