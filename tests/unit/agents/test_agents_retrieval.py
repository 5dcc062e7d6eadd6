"""The retrieval server: Search-R1 requests, malformed ones (400, the server keeps serving), the launcher."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from asyncrl_agents.jsonl import write_jsonl
from asyncrl_agents.retrieval import BM25Index, Corpus, LsaIndex, RetrievalServer, make_app
from asyncrl_agents.tasks.mini_world import generate
from asyncrl_core.errors import AsyncRLError
from asyncrl_core.server_process import bound_port

pytestmark = pytest.mark.integration

ROWS = [
    {"id": "0", "contents": '"Paris"\nParis is the capital and largest city of France.'},
    {"id": "1", "contents": '"Berlin"\nBerlin is the capital of Germany, on the river Spree.'},
    {"id": "2", "contents": '"Lyon"\nLyon is a city in France known for its cuisine.', "url": "x"},
    {"id": "3", "title": "Spree", "text": "The Spree is a river that flows through Berlin."},
]


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    write_jsonl(path, ROWS)
    return path


@pytest.fixture(scope="module")
def server(corpus_file: Path) -> Iterator[RetrievalServer]:
    with RetrievalServer(corpus_file, topk=2) as running:
        yield running


def post(server: RetrievalServer, body: object) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        f"{server.url}/retrieve", content=content, headers={"Content-Type": "application/json"}, timeout=10
    )


def test_search_r1_request_with_scores(server: RetrievalServer) -> None:
    response = post(
        server, {"queries": ["capital of France", "river Spree Berlin"], "topk": 3, "return_scores": True}
    )
    assert response.status_code == 200
    result = response.json()["result"]
    assert len(result) == 2
    assert all(len(hits) == 3 for hits in result)
    first = result[0][0]
    assert set(first) == {"document", "score"}
    assert first["document"] == {"id": "0", "contents": ROWS[0]["contents"]}
    assert isinstance(first["score"], float)
    assert [hit["score"] for hit in result[0]] == sorted((hit["score"] for hit in result[0]), reverse=True)
    assert {hit["document"]["id"] for hit in result[1][:2]} == {"1", "3"}
    # A title/text row is served with Search-R1's `contents`; extra fields are kept.
    documents = {hit["document"]["id"]: hit["document"] for hits in result for hit in hits}
    assert documents["3"]["contents"] == '"Spree"\nThe Spree is a river that flows through Berlin.'


def test_without_scores_and_default_topk(server: RetrievalServer) -> None:
    response = post(server, {"queries": ["Lyon cuisine"]})
    assert response.status_code == 200
    (hits,) = response.json()["result"]
    assert len(hits) == 2  # the server's --topk
    assert hits[0] == {"id": "2", "contents": ROWS[2]["contents"], "url": "x"}


def test_topk_zero_is_the_server_default_and_query_count_is_unbounded(server: RetrievalServer) -> None:
    (hits,) = post(server, {"queries": ["Lyon cuisine"], "topk": 0}).json()["result"]
    assert len(hits) == 2  # the server's --topk, as Search-R1 means by 0
    queries = [f"river Spree {i}" for i in range(5000)]  # Search-R1 sends every active query at once
    response = post(server, {"queries": queries, "topk": 1})
    assert response.status_code == 200, response.text
    result = response.json()["result"]
    assert len(result) == 5000
    assert all(len(query_hits) == 1 for query_hits in result)


def test_topk_larger_than_corpus_and_empty_queries(server: RetrievalServer) -> None:
    assert len(post(server, {"queries": ["France"], "topk": 50}).json()["result"][0]) == len(ROWS)
    assert post(server, {"queries": []}).json() == {"result": []}
    assert len(post(server, {"queries": ["the of and"], "topk": 1}).json()["result"][0]) == 1


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        ([1, 2], "JSON object"),
        ({"topk": 3}, "`queries` must be a list of strings"),
        ({"queries": "France"}, "`queries` must be a list of strings"),
        ({"queries": ["a", 3]}, "`queries` must be a list of strings"),
        ({"queries": ["a"], "topk": -2}, "`topk` must be an integer"),
        ({"queries": ["a"], "topk": "3"}, "`topk` must be an integer"),
        ({"queries": ["a"], "topk": 2.5}, "`topk` must be an integer"),
        ({"queries": ["a"], "topk": True}, "`topk` must be an integer"),
        ({"queries": ["a"], "return_scores": "yes"}, "`return_scores` must be true or false"),
    ],
)
def test_malformed_requests_are_400_and_the_server_keeps_serving(
    server: RetrievalServer, body: object, message: str
) -> None:
    response = post(server, body)
    assert response.status_code == 400
    assert message in response.json()["error"]
    assert post(server, {"queries": ["Paris"], "topk": 1}).status_code == 200


def test_health_and_unknown_route(server: RetrievalServer) -> None:
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.json() == {"status": "ok", "num_documents": 4, "index": "bm25"}
    assert httpx.get(f"{server.url}/retrieve", timeout=10).status_code == 405
    assert server.url.startswith("http://127.0.0.1:")


def test_launcher_stops_the_process_group(corpus_file: Path) -> None:
    server = RetrievalServer(corpus_file, index="lsa")
    url = server.start()
    assert server._server is not None
    process = server._server.process
    assert httpx.get(f"{url}/health", timeout=10).json()["index"] == "lsa"
    server.stop()
    assert process.returncode is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    server.stop()  # idempotent
    with pytest.raises(AsyncRLError, match="not running"):
        _ = server.url


def test_launcher_reports_a_bad_corpus(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "contents": "ok"}\n{"id": 2}\n')
    with pytest.raises(AsyncRLError, match=r"row 1 has neither a `contents` string"), RetrievalServer(bad):
        pass
    with pytest.raises(AsyncRLError, match="does not exist"), RetrievalServer(tmp_path / "missing.jsonl"):
        pass


def test_corpus_rows_are_checked(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text('{"contents": "a"}\n\nnot json\n')
    with pytest.raises(AsyncRLError, match=r"c.jsonl:3: not JSON"):
        Corpus.load(path)
    with pytest.raises(AsyncRLError, match="empty"):
        Corpus.from_rows([])
    assert Corpus.from_rows([{"contents": "a"}]).documents[0]["id"] == "0"


@pytest.mark.parametrize("index_kind", [BM25Index, LsaIndex])
def test_indexes_find_the_supporting_passage_of_mini_world_questions(index_kind: type) -> None:
    world = generate(0)
    corpus = Corpus.from_rows(world.passages)
    index = index_kind(corpus.texts())
    questions = [q for q in world.questions if q.num_hops == 1][:100]
    hits = index.search([q.question for q in questions], 3)
    found = sum(
        q.support[0] in {corpus.documents[d]["id"] for d, _ in top}
        for q, top in zip(questions, hits, strict=True)
    )
    # Fictional names are rare words: lexical search finds nearly every supporting passage.
    assert found >= (95 if index_kind is BM25Index else 60)


def test_bm25_keeps_jax_on_the_cpu() -> None:
    # bm25s runs a JAX operation at import when JAX is installed; on a GPU machine JAX's GPU backend would
    # take three quarters of the GPU's memory. The index imports bm25s with JAX_PLATFORMS=cpu unless set.
    code = (
        "import os\n"
        "from asyncrl_agents.retrieval.index import BM25Index\n"
        "BM25Index(['a cat', 'a dog']).search(['cat'], 1)\n"
        "print(os.environ.get('JAX_PLATFORMS'))\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "JAX_PLATFORMS"}
    found = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == "cpu"
    mine = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "JAX_PLATFORMS": "cuda"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert mine.stdout.strip() == "cuda"


class HeldIndex:
    """A real BM25 index whose searches wait until the test lets them go (a large batch, in effect)."""

    def __init__(self, texts: list[str]) -> None:
        self.inner = BM25Index(texts)
        self.searching = threading.Event()
        self.release = threading.Event()

    def search(self, queries: Sequence[str], k: int) -> list[list[tuple[int, float]]]:
        self.searching.set()
        if not self.release.wait(timeout=60):
            raise TimeoutError("the test never released the search")
        return self.inner.search(queries, k)


async def test_health_answers_while_a_search_runs() -> None:
    corpus = Corpus.from_rows(ROWS)
    index = HeldIndex(corpus.texts())
    runner = web.AppRunner(make_app(corpus, index, index_name="bm25"))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{bound_port(runner, 0)}"
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30, trust_env=False) as client:
            search = asyncio.create_task(client.post("/retrieve", json={"queries": ["Paris"], "topk": 1}))
            assert await asyncio.to_thread(index.searching.wait, 30)
            health = await client.get("/health")  # the search is still held on its thread
            assert health.status_code == 200
            assert not search.done()
            index.release.set()
            response = await search
            assert response.json()["result"][0][0]["id"] == "0"
    finally:
        index.release.set()
        await runner.cleanup()
