"""The built-in engine's scheduler keeps requests apart: a request that makes a step fail, or whose callback
fails, ends alone (an abort with status 500, answered as an error); a step failure no request reproduces
alone costs nobody their output; the stop-string matcher, incremental, stops where a full decode of the
output would."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from asyncrl_engine.__main__ import _text_decoder  # pyright: ignore[reportPrivateUsage]
from asyncrl_engine.engine import Engine
from asyncrl_engine.model import EngineModel
from asyncrl_engine.options import SamplingOptions
from asyncrl_engine.request import INTERNAL_ERROR, Request
from asyncrl_engine.snapshot import WaitingQueue

WAIT_S = 120.0
LONG = SamplingOptions(max_new_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture
def engine(tiny_model: EngineModel) -> Iterator[Engine]:
    started = Engine(tiny_model, max_running_requests=8)
    started.start()
    yield started
    started.stop()


def _submit(
    engine: Engine,
    options: SamplingOptions = LONG,
    on_update: Callable[[Request, bool], None] | None = None,
    **fields: Any,
) -> tuple[Request, threading.Event]:
    done = threading.Event()

    def update(request: Request, finished: bool) -> None:
        if on_update is not None:
            on_update(request, finished)
        if finished:
            done.set()

    fields.setdefault("prompt_ids", [5, 6, 7])
    request = Request(rid=f"r{time.monotonic_ns()}", options=options, on_update=update, **fields)
    engine.call(lambda: engine.add_request(request), timeout_s=WAIT_S)
    return request, done


def _wait_tokens(request: Request, count: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while len(request.output_ids) < count:
        assert time.monotonic() < deadline, "the request made no progress"
        time.sleep(0.002)


def _assert_finished_normally(request: Request, done: threading.Event) -> None:
    assert done.wait(WAIT_S), "the request did not finish"
    assert request.finish_reason == {"type": "length", "length": LONG.max_new_tokens}
    assert len(request.output_ids) == LONG.max_new_tokens


def _answers_afterwards(engine: Engine) -> None:
    later, done = _submit(engine, SamplingOptions(max_new_tokens=3, ignore_eos=True))
    assert done.wait(WAIT_S), "the engine does not answer after the failure"
    assert len(later.output_ids) == 3


def test_a_request_that_fails_the_step_ends_alone(engine: Engine) -> None:
    """top_logprobs_num above the vocabulary makes the batched sampling raise (the HTTP and gRPC fronts refuse
    it before admission; the scheduler must still not let it take the others down)."""
    others = [_submit(engine) for _ in range(3)]
    for request, _ in others:
        _wait_tokens(request, 2)
    vocab = engine.model.config.vocab_size
    bad, bad_done = _submit(engine, return_logprob=True, top_logprobs_num=vocab + 1)
    assert bad_done.wait(WAIT_S)
    assert bad.finish_reason is not None
    assert bad.finish_reason["type"] == "abort"
    assert bad.finish_reason["status_code"] == INTERNAL_ERROR  # answered as an error, not a partial output
    assert "Internal engine error" in bad.finish_reason["message"]
    for request, done in others:
        _assert_finished_normally(request, done)
        assert request.num_retractions == 0
    _answers_afterwards(engine)


def test_a_failing_update_callback_ends_only_its_request(engine: Engine) -> None:
    others = [_submit(engine, stream=True) for _ in range(2)]

    def broken(request: Request, finished: bool) -> None:
        if len(request.output_ids) >= 2 and not finished:
            raise RuntimeError("the client's queue is gone")

    bad, bad_done = _submit(engine, on_update=broken, stream=True)
    assert bad_done.wait(WAIT_S)
    assert bad.finish_reason is not None
    assert bad.finish_reason["type"] == "abort"
    assert bad.finish_reason["status_code"] == INTERNAL_ERROR
    assert "update callback" in bad.finish_reason["message"]
    for request, done in others:
        _assert_finished_normally(request, done)
    _answers_afterwards(engine)


def test_a_step_failure_that_no_request_reproduces_alone_loses_nothing(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batched decode fails twice (say a transient allocation failure at that batch size): every request
    is retried alone, passes, goes back to the queue with its tokens, and finishes with all of them."""
    model = engine.model
    decode = model.decode
    failures = {"left": 2}

    def flaky_decode(input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if input_ids.shape[0] > 1 and failures["left"] > 0:
            failures["left"] -= 1
            raise RuntimeError("transient failure of a batched decode")
        return decode(input_ids, *args, **kwargs)

    requests = [_submit(engine) for _ in range(3)]
    for request, _ in requests:
        _wait_tokens(request, 1)
    monkeypatch.setattr(model, "decode", flaky_decode)
    for request, done in requests:
        _assert_finished_normally(request, done)
    assert failures["left"] == 0
    _answers_afterwards(engine)


# ---------------------------------------------------------------------------------------------- prefix cache
def test_a_prefix_cache_that_cannot_store_fails_no_request(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finishes and a retract pause store prefixes; a store that raises costs the cache, never a request."""
    assert engine.prefix_cache is not None

    def broken_store(*args: Any) -> None:
        raise RuntimeError("the block pool is corrupt")

    monkeypatch.setattr(engine.prefix_cache, "store", broken_store)
    requests = [_submit(engine) for _ in range(3)]
    for request, _ in requests:
        _wait_tokens(request, 2)
    engine.call(lambda: engine.pause("retract"), timeout_s=WAIT_S)
    engine.call(engine.resume, timeout_s=WAIT_S)
    for request, done in requests:
        assert done.wait(WAIT_S), "the request did not finish"
        assert request.finish_reason == {"type": "length", "length": LONG.max_new_tokens}
        assert request.num_retractions == 1
    _answers_afterwards(engine)


def test_a_request_whose_cached_prefix_cannot_load_ends_alone(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert engine.prefix_cache is not None
    load = engine.prefix_cache.load
    poisoned = [99] * 40

    def load_unless_poisoned(tokens: Any, *args: Any) -> int:
        if list(tokens[:40]) == poisoned:
            raise RuntimeError("a cached block of this prefix is unreadable")
        return load(tokens, *args)

    monkeypatch.setattr(engine.prefix_cache, "load", load_unless_poisoned)
    others = [_submit(engine) for _ in range(3)]
    for request, _ in others:
        _wait_tokens(request, 2)
    bad, bad_done = _submit(engine, prompt_ids=[*poisoned, 1])
    assert bad_done.wait(WAIT_S)
    assert bad.finish_reason is not None
    assert bad.finish_reason["type"] == "abort"
    assert bad.finish_reason["status_code"] == INTERNAL_ERROR
    assert "unreadable" in bad.finish_reason["message"]
    for request, done in others:
        _assert_finished_normally(request, done)
    _answers_afterwards(engine)


def test_the_waiting_queue_keeps_its_totals() -> None:
    class Item:
        def __init__(self, tokens: int, retractions: int) -> None:
            self.num_tokens = tokens
            self.num_retractions = retractions

    items = [Item(3, 0), Item(5, 1), Item(7, 0), Item(11, 2)]
    queue: WaitingQueue[Item] = WaitingQueue(items[:2])
    queue.appendleft(items[2])
    queue.append(items[3])
    assert (queue.num_tokens, queue.num_retracted) == (26, 2)
    assert queue.popleft() is items[2]
    queue.remove(items[3])
    assert (queue.num_tokens, queue.num_retracted) == (8, 1)
    queue.clear()
    assert (queue.num_tokens, queue.num_retracted, len(queue)) == (0, 0, 0)


# ---------------------------------------------------------------------------------------------- stop strings
NATURAL = (
    "naïve café — 日本語のテキスト 🙂🙃 and Ελληνικά, done. </answer> <search>query</search> final",
    'Step 1: 3 × 4 = 12; ¿qué? «ça va» — Ünïcödé ✓✓ <tool_call>{"a": 1}</tool_call>\n\nThe answer is',
)


def _first_stop_by_full_decode(
    decode: Callable[[list[int]], str], ids: list[int], stops: tuple[str, ...]
) -> Any:
    """(number of tokens, matched string) at the first output length whose full decode holds a stop string."""
    for length in range(1, len(ids) + 1):
        text = decode(ids[:length])
        hits = sorted((text.find(stop), stop) for stop in stops if stop in text)
        if hits:
            return length, hits[0][1]
    return None


def test_incremental_stop_strings_stop_where_the_full_decode_does(
    tiny_model: EngineModel, tokenizer: Any
) -> None:
    """Random token sequences (byte tokens that split multi-byte characters included) and natural text in
    several scripts; stop strings cut from the decoded text at random, spanning tokens, with spaces."""

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    engine = Engine(tiny_model, decode_text=decode)  # never started: only its matcher is used
    rng = random.Random(0)
    vocab = tiny_model.config.vocab_size
    checked = 0
    for trial in range(300):
        if trial % 2:
            ids = tokenizer.encode(NATURAL[trial % len(NATURAL)])
        else:
            ids = [rng.randrange(vocab) for _ in range(rng.randrange(5, 60))]
        text = decode(ids)
        start = rng.randrange(max(1, len(text) - 1))
        stop = text[start : start + rng.randint(1, 8)]
        if not stop or "\ufffd" in stop:
            continue
        stops = (stop, "never-in-the-text")
        request = Request(rid="s", prompt_ids=[1], options=SamplingOptions(stop=stops))
        matched = None
        for length, token in enumerate(ids, start=1):
            request.output_ids.append(token)
            found = engine.scheduler.match_stop_string(request)
            if found is not None:
                matched = (length, found)
                break
        assert matched == _first_stop_by_full_decode(decode, ids, stops), (ids, stops)
        checked += 1
    assert checked > 200


def test_the_servers_text_decoder_reads_as_the_tokenizer(tokenizer: Any) -> None:
    """The stop-string matcher's decoder in the server (`_text_decoder`: the Rust backend of a fast tokenizer
    that cleans up no spaces) gives `tokenizer.decode`'s text: random ids (special tokens and byte tokens
    that split characters included) and natural text in several scripts."""
    decode = _text_decoder(tokenizer)
    assert decode.__name__ == "decode_backend"  # SmolLM2's tokenizer takes the fast path
    rng = random.Random(1)
    vocab = len(tokenizer)
    for trial in range(300):
        if trial % 3 == 0:
            ids = tokenizer.encode(NATURAL[trial % len(NATURAL)])[: rng.randint(1, 40)]
        else:
            ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
        assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=True), ids
