"""The retrieval HTTP server, compatible with the Search-R1 retrieval server.

`POST /retrieve` with `{"queries": [str, ...], "topk": int (optional; absent or 0: the server's default),
"return_scores": bool (optional)}`
answers `{"result": [...]}` with one list per query, best first: documents (the corpus rows,
`{"id", "contents", ...}`) or, with `return_scores`, `{"document": row, "score": float}` objects. A request
Search-R1's client sends works unchanged, and asyncrl's search tool works against Search-R1's own server.
A malformed request gets 400 `{"error": message}` and the server keeps serving. `GET /health` answers 200
`{"status": "ok", "num_documents": n, "index": kind}`, also while a search runs: searches run one at a time on
a thread of their own, off the event loop.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import cast

from aiohttp import web

from asyncrl_agents.retrieval.corpus import Corpus
from asyncrl_agents.retrieval.index import Index

MAX_BODY_BYTES = 256 << 20
"""Largest request body (256 MiB). There is no cap on the number of queries: Search-R1's client sends every
active query of a batch in one request."""

MAX_TOPK = 1000
"""Largest `topk` a request may ask for."""

SEARCH_THREAD = web.AppKey("search_thread", ThreadPoolExecutor)
"""The one thread searches run on, in arrival order (an index is searched by one thread at a time)."""


class BadRequest(ValueError):
    """The request is malformed; the message says what to send instead."""


@dataclass(frozen=True, slots=True)
class RetrieveRequest:
    queries: list[str]
    topk: int
    return_scores: bool

    @classmethod
    def parse(cls, body: object, default_topk: int) -> RetrieveRequest:
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object with `queries`")
        # Other fields are ignored, as Search-R1's server ignores them.
        fields = cast("dict[str, object]", body)
        queries = fields.get("queries")
        if not isinstance(queries, list):
            raise BadRequest("`queries` must be a list of strings")
        texts = [query for query in cast("list[object]", queries) if isinstance(query, str)]
        if len(texts) != len(cast("list[object]", queries)):
            raise BadRequest("`queries` must be a list of strings")
        topk = fields.get("topk")
        if topk is None or topk == 0:
            # Search-R1 sends 0 (and omits it) to mean the server's default.
            topk = default_topk
        elif isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= MAX_TOPK:
            raise BadRequest(f"`topk` must be an integer from 1 to {MAX_TOPK}, got {json.dumps(topk)}")
        return_scores = fields.get("return_scores", False)
        if not isinstance(return_scores, bool):
            raise BadRequest(f"`return_scores` must be true or false, got {json.dumps(return_scores)}")
        return cls(texts, topk, return_scores)


def make_app(corpus: Corpus, index: Index, *, index_name: str, default_topk: int = 3) -> web.Application:
    """The aiohttp application serving `/retrieve` and `/health` over `corpus` searched with `index`."""

    async def retrieve(request: web.Request) -> web.Response:
        try:
            body: object = await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            return _bad_request(f"the body is not valid JSON: {error}")
        try:
            parsed = RetrieveRequest.parse(body, default_topk)
        except BadRequest as error:
            return _bad_request(str(error))
        # The search runs on the app's search thread: the event loop keeps answering `/health` (and
        # reading the next requests) while a large batch is searched.
        hits = await asyncio.get_running_loop().run_in_executor(
            app[SEARCH_THREAD], index.search, parsed.queries, parsed.topk
        )
        if parsed.return_scores:
            result: list[list[object]] = [
                [{"document": corpus.documents[document], "score": score} for document, score in query_hits]
                for query_hits in hits
            ]
        else:
            result = [[corpus.documents[document] for document, _ in query_hits] for query_hits in hits]
        return web.json_response({"result": result})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "num_documents": len(corpus), "index": index_name})

    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app[SEARCH_THREAD] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="search")

    async def stop_search_thread(app: web.Application) -> None:
        app[SEARCH_THREAD].shutdown(wait=False, cancel_futures=True)

    app.on_cleanup.append(stop_search_thread)
    app.router.add_post("/retrieve", retrieve)
    app.router.add_get("/health", health)
    return app


def _bad_request(message: str) -> web.Response:
    return web.json_response({"error": message}, status=400)
