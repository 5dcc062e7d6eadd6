"""Fixtures shared by the built-in engine's tests and the client's tests that run against it: the tiny model
and its tokenizer, engines stopped at the end of a test, and an engine served over HTTP in process. The
engine and aiohttp are imported by the fixtures that use them, so other tests never load them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from aiohttp.test_utils import TestClient

    from asyncrl_engine.engine import Engine
    from asyncrl_engine.model import EngineModel
    from asyncrl_engine.server import BuiltinServer


@pytest.fixture(scope="module")
def tiny_model(tiny_llama_path: Path) -> EngineModel:
    """The tiny Llama as the engine's model, one per test module (weight updates change it in place)."""
    from asyncrl_engine.model import EngineModel

    return EngineModel.from_pretrained(tiny_llama_path)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_path: Path) -> Any:
    """The tiny Llama's tokenizer (SmolLM2's)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama_path))


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    """Engines a test starts (it appends them); each is stopped when the test ends."""
    started: list[Engine] = []
    yield started
    for engine in started:
        engine.stop()


@pytest.fixture
async def make_client(
    tiny_model: EngineModel, tokenizer: Any, tiny_llama_path: Path
) -> AsyncIterator[Callable[..., Any]]:
    """Start an engine over `tiny_model` (or `model=`) behind the HTTP routes, served on loopback by aiohttp's
    test server: `await make_client(**server_args_overrides)` gives `(client, server)`; everything stops at
    teardown."""
    from aiohttp.test_utils import TestClient, TestServer

    from asyncrl_engine.engine import Engine
    from asyncrl_engine.server import BuiltinServer, ServerArgs

    started: list[tuple[Engine, TestClient[Any, Any]]] = []

    async def make(
        model: EngineModel | None = None, **overrides: Any
    ) -> tuple[TestClient[Any, Any], BuiltinServer]:
        args = ServerArgs(
            model_path=str(tiny_llama_path),
            served_model_name="tiny",
            tokenizer_path=str(tiny_llama_path),
            **{"context_length": 2048, "max_running_requests": 8, **overrides},
        )
        engine = Engine(
            model or tiny_model,
            max_running_requests=args.max_running_requests,
            context_length=args.context_length,
            weight_version=args.weight_version,
            eos_token_ids=[tokenizer.eos_token_id],
            decode_text=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
            chunked_prefill_size=args.chunked_prefill_size,
        )
        engine.start()
        server = BuiltinServer(engine, tokenizer, args)
        server.ready = True
        client: TestClient[Any, Any] = TestClient(TestServer(server.app, host="127.0.0.1"))
        await client.start_server()
        started.append((engine, client))
        return client, server

    yield make
    for engine, client in started:
        await client.close()
        await asyncio.to_thread(engine.stop)
