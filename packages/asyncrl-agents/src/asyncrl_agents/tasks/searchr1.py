"""Search-R1: answer a question by searching a corpus, `<search> q </search>` at a time.

The model reasons in `<think>`, searches with `<search> query </search>` (the retriever's top-k passages come
back as `<information> ... </information>`), and ends with `<answer> ... </answer>`. The prompt, the passage
format (`Doc 1(Title: "...") text`), the observation wrapping and the correction after an invalid turn are
Search-R1's, so models trained there behave the same here. The reward is the normalised exact match of the
answer with any golden answer (lowercase, punctuation and articles removed, whitespace collapsed);
`format_score` is paid for a wrong but well-formed answer (0 by default, as in Search-R1).

Turns. By default `task_args.max_turns` counts as Search-R1's `max_turns` does (its `run_llm_loop`): that many
turns whose action runs (a search, or the correction after an invalid turn), then one final turn in which no
tool runs, so that only an answer scores; an episode has at most `max_turns + 1` model turns, and a search in
the final turn ends it with reward 0. `turn_limit: model_turns` counts every model turn instead, the final one
included, so the same `max_turns` allows one search fewer.

Two tasks: `searchr1` reads FlashRAG/Search-R1 question files (`<data_path>/<split>.jsonl`, rows
`{"id", "question", "golden_answers"}`) and searches a corpus JSONL or an existing Search-R1 retriever;
`searchr1-mini` uses the generated offline world of `asyncrl_agents.tasks.mini_world`.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import string
from collections.abc import Generator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal, Self, cast

from pydantic import Field, model_validator

from asyncrl_agents.jsonl import read_jsonl, write_jsonl
from asyncrl_agents.parsing import TagParser
from asyncrl_agents.tasks import mini_world
from asyncrl_core import cache
from asyncrl_core.config import TaskArguments
from asyncrl_core.errors import AsyncRLError
from asyncrl_core.protocols import Tool
from asyncrl_core.types import (
    ChatMessage,
    Demonstration,
    FinalAnswer,
    InvalidTurn,
    TaskSample,
    ToolCall,
    ToolResult,
    TurnAction,
)

# The HTTP client and the retrieval server are imported where they are used, so that importing the task
# (which `asyncrl-run --dry-run` does to check its arguments) stays quick.
if TYPE_CHECKING:
    import httpx

PROMPT = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you "
    "get new information. After reasoning, if you find you lack some knowledge, you can call a search engine "
    "by <search> query </search> and it will return the top searched results between <information> and "
    "</information>. You can search as many times as your want. If you find no further external knowledge "
    "needed, you can directly provide the answer inside <answer> and </answer>, without detailed "
    "illustrations. For example, <answer> Beijing </answer>. Question: {question}\n"
)
"""Search-R1's instruction (its `nq_search` data preparation), sent as the user message."""

INVALID_TURN_OBSERVATION = (
    "\nMy previous action is invalid. If I want to search, I should put the query between <search> and "
    "</search>. If I want to give the final answer, I should put the answer between <answer> and </answer>. "
    "Let me try again.\n"
)
"""Search-R1's correction after a turn with neither a complete search nor an answer."""

TurnLimit = Literal["searchr1", "model_turns"]
"""How `task_args.max_turns` counts: Search-R1's turns whose action runs, then one answer turn (`searchr1`),
or every model turn (`model_turns`)."""

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """Lowercase, drop punctuation and the articles a/an/the, collapse whitespace (SQuAD-style)."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def exact_match(prediction: str, answers: Sequence[str]) -> bool:
    """Whether `prediction` equals one of `answers` after `normalize_answer`."""
    normalized = normalize_answer(prediction)
    return any(normalized == normalize_answer(answer) for answer in answers)


def _json_object(value: object) -> dict[str, object] | None:
    """`value` as a JSON object (string keys, as `json.loads` makes them), or None if it is not one."""
    return cast("dict[str, object]", value) if isinstance(value, dict) else None


def format_passages(result: Sequence[object]) -> str:
    """One query's retrieval result as Search-R1 shows it: `Doc i(Title: "t") text`, one per line.

    Accepts both shapes of the `/retrieve` answer: `{"document": row, "score": s}` items or bare rows.
    """
    lines: list[str] = []
    for number, item in enumerate(result, start=1):
        wrapper = _json_object(item)
        document = _json_object(wrapper.get("document", wrapper)) if wrapper is not None else None
        contents = document.get("contents") if document is not None else None
        if not isinstance(contents, str):
            raise AsyncRLError(f"retrieval result {number} has no `contents` string: {str(item)[:200]}")
        from asyncrl_agents.retrieval import split_contents

        title, text = split_contents(contents)
        lines.append(f"Doc {number}(Title: {title}) {text}")
    return "\n".join(lines)


class SearchTool:
    """The `search` tool: queries to a `/retrieve` server (asyncrl's or Search-R1's), top-k passages back.

    Queries that arrive in the same event-loop iteration (trajectories whose turns ended together) go out
    as one request, at most `max_batch` queries each, as Search-R1 batches a turn's queries; a lone query
    waits for nothing. One HTTP connection pool per event loop, opened on first use. `transport` replaces
    httpx's network transport (to count requests, say).
    """

    name = "search"

    def __init__(
        self,
        url: str,
        *,
        topk: int = 3,
        timeout_s: float = 30.0,
        max_batch: int = 64,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if topk < 1:
            raise ValueError(f"topk must be at least 1, got {topk}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.url = url.rstrip("/")
        if not self.url.endswith("/retrieve"):
            self.url += "/retrieve"
        self.topk = topk
        self.timeout_s = timeout_s
        self.max_batch = max_batch
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: list[tuple[str, asyncio.Future[str]]] = []
        self._flush_scheduled = False
        self._requests: set[asyncio.Task[None]] = set()

    def _session(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            import httpx

            self._client = httpx.AsyncClient(
                timeout=self.timeout_s, trust_env=False, transport=self._transport
            )
            self._loop = loop
        return self._client

    async def __call__(self, arguments: str) -> str:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[str] = loop.create_future()
        self._pending.append((arguments, future))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        return await future

    def _flush(self) -> None:
        self._flush_scheduled = False
        pending, self._pending = self._pending, []
        for start in range(0, len(pending), self.max_batch):
            request = asyncio.ensure_future(self._send(pending[start : start + self.max_batch]))
            self._requests.add(request)
            request.add_done_callback(self._requests.discard)

    async def _send(self, batch: list[tuple[str, asyncio.Future[str]]]) -> None:
        """One `/retrieve` request for `batch`; each caller gets its passages or the error."""
        try:
            results = await self._retrieve([query for query, _ in batch])
        except Exception as error:  # every caller of the batch gets the failure as its own
            for _, future in batch:
                if not future.done():
                    future.set_exception(error)
            return
        for (_, future), result in zip(batch, results, strict=True):
            if future.done():  # the caller timed out or was cancelled
                continue
            try:
                future.set_result(format_passages(result))
            except AsyncRLError as error:
                future.set_exception(error)

    async def _retrieve(self, queries: list[str]) -> list[list[object]]:
        import httpx

        payload = {"queries": queries, "topk": self.topk, "return_scores": True}
        try:
            response = await self._session().post(self.url, json=payload)
        except httpx.HTTPError as error:  # the message names the retriever, not only the socket's error
            raise AsyncRLError(
                f"retrieval server {self.url} did not answer: {type(error).__name__}: {error}"
            ) from error
        if response.status_code != 200:
            raise AsyncRLError(f"retrieval server answered {response.status_code}: {response.text[:200]}")
        body = _json_object(response.json())
        results = body.get("result") if body is not None else None
        if (
            not isinstance(results, list)
            or len(cast("list[object]", results)) != len(queries)
            or not all(isinstance(result, list) for result in cast("list[object]", results))
        ):
            raise AsyncRLError(f"retrieval server answered an unexpected body: {response.text[:200]}")
        return cast("list[list[object]]", results)

    async def aclose(self) -> None:
        client, self._client, self._loop = self._client, None, None
        if client is not None:
            with contextlib.suppress(RuntimeError):  # its event loop may be closed already
                await client.aclose()


def _question_sample(row_id: str, question: str, answers: Sequence[str]) -> TaskSample:
    text = question.strip()
    if text and not text.endswith("?"):
        text += "?"
    return TaskSample(row_id, (ChatMessage("user", PROMPT.format(question=text)),), tuple(answers))


def load_questions(path: Path) -> list[TaskSample]:
    """FlashRAG/Search-R1 question rows (`id`, `question`, `golden_answers`) of a JSONL file."""
    samples: list[TaskSample] = []
    for number, fields in read_jsonl(path):
        question, answers = fields.get("question"), fields.get("golden_answers")
        if not isinstance(question, str) or not isinstance(answers, list) or not answers:
            raise AsyncRLError(
                f"{path}:{number}: a row needs `question` (a string) and `golden_answers` (a non-empty list)"
            )
        row_id = str(fields.get("id", f"{path.stem}-{number}"))
        golden = [str(answer) for answer in cast("list[object]", answers)]
        samples.append(_question_sample(row_id, question, golden))
    return samples


class _SearchArguments(TaskArguments):
    retriever_url: str | None = None
    """An already running `/retrieve` server (asyncrl's or Search-R1's); `serve()` then starts nothing."""
    index: Literal["bm25", "lsa"] = "bm25"
    """Index of the retrieval server `serve()` starts: `bm25`, or `lsa` (dense)."""
    topk: Annotated[int, Field(ge=1)] = 3
    """Passages per search."""
    max_turns: Annotated[int, Field(ge=0)] = 4
    """With `turn_limit: searchr1`, the turns that may search (Search-R1's `max_turns`), then one answer
    turn; with `turn_limit: model_turns` (then at least 1), every model turn, the answer's included."""
    turn_limit: TurnLimit = "searchr1"
    """How `max_turns` counts: `searchr1` (Search-R1's count, at most `max_turns + 1` model turns) or
    `model_turns`."""
    format_score: float = 0.0
    """Reward of a well-formed but wrong answer."""
    search_timeout_s: Annotated[float, Field(gt=0.0)] = 30.0
    """HTTP timeout of one search, in seconds."""

    @model_validator(mode="after")
    def _at_least_one_model_turn(self) -> Self:
        if self.turn_limit == "model_turns" and self.max_turns < 1:
            raise ValueError("max_turns must be at least 1 with turn_limit: model_turns")
        return self


class SearchR1Arguments(_SearchArguments):
    """Arguments of `searchr1`."""

    data_path: str | None = None
    """Folder of `<split>.jsonl` question files (`train.jsonl`, `test.jsonl`, ...)."""
    corpus_path: str | None = None
    """Corpus JSONL (`{"id", "contents"}` rows) that `serve()` indexes and serves; needed unless
    `retriever_url` is given."""


class SearchR1MiniArguments(_SearchArguments):
    """Arguments of `searchr1-mini`."""

    seed: Annotated[int, Field(ge=0)] = 0
    """Seed of the generated world (entities, corpus and questions)."""
    max_hops: Annotated[int, Field(ge=1)] | None = None
    """Keep only the questions of at most this many hops (both splits and the demonstrations); unset keeps
    all."""


class SearchR1Task:
    """The Search-R1 task on your data: questions from `data_path`, passages from a retriever.

    Args:
        data_path: folder of `<split>.jsonl` question files (`train.jsonl`, `test.jsonl`, ...).
        corpus_path: corpus JSONL (`{"id", "contents"}` rows) that `serve()` indexes and serves.
        retriever_url: an already running `/retrieve` server (asyncrl's or Search-R1's); `serve()` then starts
            nothing. One of `corpus_path` or `retriever_url` is needed to search.
        index: `bm25` (default) or `lsa` (dense), for the server `serve()` starts.
        topk: passages per search.
        max_turns: with `turn_limit: searchr1`, the turns whose action runs (a search, or the correction
            after an invalid turn), after which the model gets one final turn in which no tool runs, so only
            an answer scores: at most `max_turns + 1` model turns, as in Search-R1. With `turn_limit:
            model_turns`, the most model turns, the last included (a search in the last turn is not run and
            the episode ends without an answer).
        turn_limit: `searchr1` (default) or `model_turns`: how `max_turns` counts, as above.
        format_score: reward of a well-formed but wrong answer.
        search_timeout_s: HTTP timeout of one search.
    """

    name = "searchr1"
    arguments_model: ClassVar[type[TaskArguments]] = SearchR1Arguments

    def __init__(
        self,
        data_path: str | None = None,
        corpus_path: str | None = None,
        retriever_url: str | None = None,
        index: str = "bm25",
        topk: int = 3,
        max_turns: int = 4,
        turn_limit: TurnLimit = "searchr1",
        format_score: float = 0.0,
        search_timeout_s: float = 30.0,
    ) -> None:
        if topk < 1:
            raise AsyncRLError(f"task_args.topk must be at least 1, got {topk}")
        if turn_limit not in ("searchr1", "model_turns"):
            raise AsyncRLError(
                f"task_args.turn_limit must be `searchr1` or `model_turns`, got {turn_limit!r}"
            )
        smallest = 0 if turn_limit == "searchr1" else 1
        if max_turns < smallest:
            raise AsyncRLError(f"task_args.max_turns must be at least {smallest}, got {max_turns}")
        self.data_path = Path(data_path) if data_path is not None else None
        self.corpus_path = Path(corpus_path) if corpus_path is not None else None
        self.retriever_url = retriever_url
        self.index = index
        self.topk = topk
        self.turn_limit: TurnLimit = turn_limit
        self.max_turns = max_turns + 1 if turn_limit == "searchr1" else max_turns
        """Most model turns of an episode (the `Task` protocol's count): `task_args.max_turns`, plus the
        final answer turn under Search-R1's count."""
        self.format_score = format_score
        self.search_timeout_s = search_timeout_s
        self._parser = TagParser({"search": "search"}, answer_tag="answer")
        self.stop: tuple[str, ...] = self._parser.stop
        self._search: SearchTool | None = None

    def dataset(self, split: str) -> Sequence[TaskSample]:
        if self.data_path is None:
            raise AsyncRLError("searchr1 needs task_args.data_path: a folder of <split>.jsonl question files")
        path = self.data_path / f"{split}.jsonl"
        if not path.is_file():
            known = sorted(p.stem for p in self.data_path.glob("*.jsonl")) if self.data_path.is_dir() else []
            raise KeyError(f"no split {split!r} in {self.data_path} (splits: {', '.join(known) or 'none'})")
        return load_questions(path)

    def tools(self) -> Mapping[str, Tool]:
        if self.retriever_url is None:
            raise AsyncRLError(
                f"{self.name}: no retriever; set task_args.retriever_url, or start the task's retrieval "
                "server with Task.serve() and pass the `retriever_url` it yields"
            )
        if self._search is None:
            self._search = SearchTool(self.retriever_url, topk=self.topk, timeout_s=self.search_timeout_s)
        return {"search": self._search}

    def parse_turn(self, text: str) -> TurnAction:
        return self._parser.parse(text)

    def observation(self, action: ToolCall | InvalidTurn, result: ToolResult | None) -> str:
        if isinstance(action, InvalidTurn) or result is None:
            return INVALID_TURN_OBSERVATION
        text = result.text.strip() if result.error is None else f"Search failed: {result.error}"
        return f"\n\n<information>{text}</information>\n\n"

    def reward(self, sample: TaskSample, answer: FinalAnswer | None) -> float:
        if answer is None:
            return 0.0
        return 1.0 if exact_match(answer.text, sample.answers) else self.format_score

    def demonstrations(self) -> Sequence[Demonstration]:
        return ()

    def _corpus(self) -> Path:
        if self.corpus_path is None:
            raise AsyncRLError(
                f"{self.name}: set task_args.corpus_path (a corpus JSONL) or task_args.retriever_url"
            )
        return self.corpus_path

    @contextlib.contextmanager
    def serve(self) -> Generator[Mapping[str, str]]:
        """Start a retrieval server on `corpus_path` unless `retriever_url` points to one already."""
        if self.retriever_url is not None:
            yield {"retriever_url": self.retriever_url}
            return
        from asyncrl_agents.retrieval import RetrievalServer

        with RetrievalServer(self._corpus(), index=self.index, topk=self.topk) as server:
            yield {"retriever_url": server.url}

    async def aclose(self) -> None:
        if self._search is not None:
            await self._search.aclose()


class SearchR1MiniTask(SearchR1Task):
    """Search-R1 on the generated world of `mini_world` (fictional entities, multi-hop questions), for a CPU.

    The world of `seed` is generated in memory; its corpus is written once to the cache
    (`asyncrl_core.cache`, kind `task-data`) for the retrieval server. Args as `SearchR1Task`, without the
    data paths, plus `seed` and `max_hops` (keep only the questions of at most that many hops, in both
    splits and in the demonstrations; unset keeps all).
    """

    name = "searchr1-mini"
    arguments_model: ClassVar[type[TaskArguments]] = SearchR1MiniArguments

    def __init__(
        self,
        seed: int = 0,
        retriever_url: str | None = None,
        index: str = "bm25",
        topk: int = 3,
        max_turns: int = 4,
        turn_limit: TurnLimit = "searchr1",
        format_score: float = 0.0,
        search_timeout_s: float = 30.0,
        max_hops: int | None = None,
    ) -> None:
        if max_hops is not None and max_hops < 1:
            raise AsyncRLError(f"task_args.max_hops must be at least 1, got {max_hops}")
        super().__init__(
            retriever_url=retriever_url,
            index=index,
            topk=topk,
            max_turns=max_turns,
            turn_limit=turn_limit,
            format_score=format_score,
            search_timeout_s=search_timeout_s,
        )
        self.seed = seed
        self.max_hops = max_hops
        self.world = mini_world.generate(seed)
        self._demonstrations: list[Demonstration] | None = None
        self._passages = {passage["id"]: passage["contents"] for passage in self.world.passages}

    def dataset(self, split: str) -> Sequence[TaskSample]:
        questions = self.world.split(split)
        if not questions:
            raise KeyError(f"no split {split!r} in searchr1-mini (splits: train, test)")
        if self.max_hops is not None:
            questions = [question for question in questions if question.num_hops <= self.max_hops]
        return [_question_sample(q.question_id, q.question, q.answers) for q in questions]

    def corpus_file(self) -> Path:
        """The world's corpus as JSONL in the cache (`asyncrl_core.cache`), written on first use."""
        inputs = {"task": self.name, "generator_version": mini_world.GENERATOR_VERSION, "seed": self.seed}
        entry = cache.cached(
            "task-data", inputs, lambda folder: write_jsonl(folder / "corpus.jsonl", self.world.passages)
        )
        return entry.path / "corpus.jsonl"

    def _corpus(self) -> Path:
        return self.corpus_file()

    def demonstrations(self) -> Sequence[Demonstration]:
        """A worked example per train question, as the task would see it played well.

        Each searches for the title of its supporting passages in turn, reads what the task's own index
        (`index`, `topk`) returns for that query, as the retrieval server would, and answers with the first
        golden answer. Two come first, for few-shot prompts: a one-hop "Who founded" question and a two-hop
        "In which city was the founder" question. The observations are marked in `observation_spans`.
        Built once per task object (a fraction of a second).
        """
        if self._demonstrations is None:
            self._demonstrations = self._worked_examples()
        return self._demonstrations

    def _worked_examples(self) -> list[Demonstration]:
        from asyncrl_agents.retrieval import INDEXES, split_contents

        questions = self.world.split("train")
        if self.max_hops is not None:
            questions = [q for q in questions if q.num_hops <= self.max_hops]
        shots = [
            next(
                (q for q in questions if q.num_hops == hops and q.question.startswith(prefix)),
                None,
            )
            for hops, prefix in ((1, "Who founded"), (2, "In which city was the founder"))
        ]
        first = [q for q in shots if q is not None]
        ordered = first + [q for q in questions if q not in first]
        queries = [
            [split_contents(self._passages[passage_id])[0].strip('"') for passage_id in q.support]
            for q in ordered
        ]
        documents = [passage["contents"] for passage in self.world.passages]
        index = INDEXES[self.index](documents)
        flat = [query for row in queries for query in row]
        hits = iter(index.search(flat, self.topk))
        demonstrations: list[Demonstration] = []
        for question, row in zip(ordered, queries, strict=True):
            response = ""
            spans: list[tuple[int, int]] = []
            for number, query in enumerate(row):
                thought = "I need to find" if number == 0 else f"The passage mentions {query}. Now I need"
                response += f"<think> {thought} information about {query}. </think>\n"
                response += f"<search> {query} </search>"
                passages = [{"document": {"contents": documents[document]}} for document, _ in next(hits)]
                observation = self.observation(
                    ToolCall("search", query), ToolResult(format_passages(passages), None, 0.0)
                )
                spans.append((len(response), len(response) + len(observation)))
                response += observation
            answer = question.answers[0]
            response += f"<think> The answer is {answer}. </think>\n<answer> {answer} </answer>"
            sample = _question_sample(question.question_id, question.question, question.answers)
            demonstrations.append(Demonstration(sample.messages, response, tuple(spans)))
        return demonstrations
