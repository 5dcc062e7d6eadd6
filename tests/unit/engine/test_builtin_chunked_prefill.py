"""The built-in engine's chunked prefill (SGLang's `--chunked-prefill-size`): a prompt longer than the chunk
is prefilled one chunk per step while the running requests decode between the chunks, and gives what one
prefill gives (tokens, logprobs, prompt logprobs); aborts, pauses and failures in the middle of its chunks.

Some tests step the scheduler by hand (an engine that is not started, `_step` called in a loop, control
calls between two steps after reading the step in flight, as `Engine.call` runs them) so that a pause or an
abort lands between two given chunks."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp.test_utils import TestClient
from engine_testing import WAIT_S, generate_together, start_engine

from asyncrl_engine.engine import Engine
from asyncrl_engine.kv_cache import KVCache
from asyncrl_engine.model import EngineModel
from asyncrl_engine.options import SamplingOptions
from asyncrl_engine.request import Request

CHUNK = 16
LONG = [random.Random(7).randrange(3, 40000) for _ in range(100)]
"""A prompt of 100 tokens: 7 chunks of 16 (the last one of 4)."""
TOLERANCE = 1e-5


def _long_prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [LONG, [rng.randrange(3, 40000) for _ in range(37)], [5, 6, 7, 8, 9], LONG[:70] + [17] * 3]


def _assert_same(chunked: list[Request], whole: list[Request]) -> None:
    for got, want in zip(chunked, whole, strict=True):
        assert got.output_ids == want.output_ids
        assert got.output_logprobs == pytest.approx(want.output_logprobs, abs=TOLERANCE)
        assert len(got.input_logprobs) == len(want.input_logprobs)
        for got_logprob, want_logprob in zip(got.input_logprobs, want.input_logprobs, strict=True):
            if want_logprob is None:
                assert got_logprob is None
            else:
                assert got_logprob == pytest.approx(want_logprob, abs=TOLERANCE)


def _request(prompt: list[int], max_new_tokens: int = 8, **fields: Any) -> Request:
    return Request(
        rid=f"r{time.monotonic_ns()}",
        prompt_ids=list(prompt),
        options=SamplingOptions(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True),
        return_logprob=True,
        **fields,
    )


def _between_steps(engine: Engine, fn: Any) -> Any:
    """Run `fn` as `Engine.call` runs it: after the step in flight is read."""
    engine.batch.drain()
    result = fn()
    engine._publish()
    return result


def _run_to_end(engine: Engine) -> None:
    for _ in range(10_000):
        if not engine._has_work():
            break
        engine.batch.step()
    engine.batch.drain()
    assert engine.is_idle()


def _reference(model: EngineModel, requests: list[Request]) -> list[Request]:
    """The same requests through an unchunked engine (one prefill each) over `model`, stepped by hand."""
    engine = Engine(model, chunked_prefill_size=-1, max_running_requests=4)
    copies = [
        _request(r.prompt_ids, r.options.max_new_tokens or 0, logprob_start_len=r.logprob_start_len)
        for r in requests
    ]
    for copy in copies:
        engine.add_request(copy)
    _run_to_end(engine)
    return copies


# ---------------------------------------------------------------------------------------------- equality
@pytest.mark.parametrize("overlap_schedule", [True, False])
@pytest.mark.parametrize("num_prompt_logprobs", [100, 63])
def test_a_chunked_prefill_gives_what_one_prefill_gives(
    tiny_model: EngineModel, engines: list[Engine], overlap_schedule: bool, num_prompt_logprobs: int
) -> None:
    """Prompts of 100, 37, 5 and 73 tokens in chunks of 16 (two long ones: the second waits for the first's
    chunks), with prompt logprobs from the start or from inside a chunk, then a prompt that extends a cached
    one (its cached prefix loaded at its first chunk): tokens equal, logprobs within 1e-5."""
    kwargs: dict[str, Any] = {"max_running_requests": 4, "overlap_schedule": overlap_schedule}
    chunked = start_engine(engines, tiny_model, chunked_prefill_size=CHUNK, **kwargs)
    whole = start_engine(engines, tiny_model, chunked_prefill_size=-1, **kwargs)
    assert (chunked.chunked_prefill_size, whole.chunked_prefill_size) == (CHUNK, None)
    prompts = _long_prompts()
    got = generate_together(chunked, prompts, num_prompt_logprobs=num_prompt_logprobs)
    want = generate_together(whole, prompts, num_prompt_logprobs=num_prompt_logprobs)
    _assert_same(got, want)
    assert len(got[0].input_logprobs) == min(num_prompt_logprobs, len(LONG))
    # A prompt extending the first one: its cached prefix comes from the cache at its first chunk.
    extended = [LONG + [23] * 40]
    got = generate_together(chunked, extended, max_new_tokens=12)
    want = generate_together(whole, extended, max_new_tokens=12)
    _assert_same(got, want)
    assert got[0].cached_tokens == want[0].cached_tokens > CHUNK


def test_chunking_disabled_by_minus_one_or_zero(tiny_model: EngineModel) -> None:
    for disabled in (-1, 0, None):
        assert Engine(tiny_model, chunked_prefill_size=disabled).chunked_prefill_size is None


# ---------------------------------------------------------------------------------------------- interleaving
def _tokens_between_chunks(
    tiny_model: EngineModel, engines: list[Engine], chunked_prefill_size: int
) -> tuple[int, Request]:
    """How many tokens a running request was told of between a long prompt's queueing and its first token."""
    engine = start_engine(engines, tiny_model, chunked_prefill_size=chunked_prefill_size)
    log: list[str] = []  # appended on the scheduler thread only
    done = threading.Event()

    def on_short(request: Request, finished: bool) -> None:
        log.append("short")

    def on_long(request: Request, finished: bool) -> None:
        if request.output_ids and "long" not in log:
            log.append("long")
        if finished:
            done.set()

    short = _request([1, 2, 3], max_new_tokens=400, on_update=on_short, stream=True)
    long = _request(LONG, max_new_tokens=2, on_update=on_long, stream=True)
    engine.call(lambda: engine.add_request(short), timeout_s=WAIT_S)
    deadline = time.monotonic() + WAIT_S
    while not short.output_ids:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    engine.call(lambda: (log.append("queued"), engine.add_request(long)), timeout_s=WAIT_S)
    assert done.wait(WAIT_S)
    engine.call(lambda: engine.abort(short.rid), timeout_s=WAIT_S)
    between = log[log.index("queued") : log.index("long")]
    return between.count("short"), long


def test_running_requests_decode_between_the_chunks_of_a_long_prompt(
    tiny_model: EngineModel, engines: list[Engine]
) -> None:
    chunked, long = _tokens_between_chunks(tiny_model, engines, CHUNK)
    # 7 chunks, one a step, each step decoding the running request: a token between every two chunks.
    assert chunked >= -(-len(LONG) // CHUNK) - 1
    # One prefill: the long prompt joins at the next step (at most the token of the step in flight between).
    whole, long_whole = _tokens_between_chunks(tiny_model, engines, -1)
    assert whole <= 1
    assert long.output_ids == long_whole.output_ids


def test_a_half_prefilled_request_is_neither_running_nor_waiting(tiny_model: EngineModel) -> None:
    """As SGLang counts its chunked request: out of the waiting queue and the running batch (its KV counts
    in the tokens used); the engine is not idle."""
    engine = Engine(tiny_model, chunked_prefill_size=CHUNK, max_running_requests=2)
    short, long = _request([1, 2, 3, 4, 5], max_new_tokens=50), _request(LONG)
    engine.add_request(short)
    engine.add_request(long)
    # The short prompt (5 tokens) and the long one's first chunk (the 11 left of the budget).
    engine.batch.step()
    engine.batch.step()  # its second chunk
    _between_steps(engine, lambda: None)
    snapshot = engine.snapshot
    assert (snapshot.num_running, snapshot.num_waiting) == (1, 0)
    assert snapshot.num_used_tokens == short.num_tokens + 11 + CHUNK
    assert not engine.is_idle()
    assert long.output_ids == []
    _run_to_end(engine)
    _assert_same([short, long], _reference(tiny_model, [short, long]))


def test_a_cached_prefix_does_not_count_against_the_prefill_budget(tiny_model: EngineModel) -> None:
    """An agentic turn: 100 tokens of context cached, 8 new ones. It joins in one prefill of its 8 + the
    uncached tail, not in chunks as a 108-token prompt would."""
    engine = Engine(tiny_model, chunked_prefill_size=CHUNK, max_running_requests=2, kv_block_size=4)
    first = _request(LONG, max_new_tokens=4)
    engine.add_request(first)
    _run_to_end(engine)
    turn = _request(first.prompt_ids + first.output_ids + [11, 12, 13, 14, 15, 16, 17, 18])
    engine.add_request(turn)
    engine.batch.step()
    assert engine.scheduler.table.chunked is None
    assert engine.running == [turn]
    assert turn.cached_tokens == 100  # the context less its last token, in whole blocks of 4
    _run_to_end(engine)
    _assert_same([turn], _reference(tiny_model, [turn]))


# ---------------------------------------------------------------------------------------------- abort, pauses
def test_abort_in_the_middle_of_the_chunks(tiny_model: EngineModel) -> None:
    engine = Engine(tiny_model, chunked_prefill_size=CHUNK, max_running_requests=2)
    short, long = _request([1, 2, 3, 4, 5], max_new_tokens=30), _request(LONG)
    engine.add_request(short)
    engine.add_request(long)
    for _ in range(3):
        engine.batch.step()
    assert _between_steps(engine, lambda: engine.abort(long.rid))
    assert long.finish_reason is not None
    assert long.finish_reason["type"] == "abort"
    assert long.output_ids == []
    assert not long.was_running
    # The slot and the KV of its chunks (11 + 16 + 16 tokens: two whole blocks cached) serve the next one.
    again = _request(LONG)
    engine.add_request(again)
    _run_to_end(engine)
    assert again.cached_tokens == 2 * CHUNK
    _assert_same([short, again], _reference(tiny_model, [short, again]))


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_a_pause_in_the_middle_of_the_chunks_loses_nothing(tiny_model: EngineModel, mode: str) -> None:
    engine = Engine(tiny_model, chunked_prefill_size=CHUNK, max_running_requests=2)
    long = _request(LONG, logprob_start_len=60)
    engine.add_request(long)
    for _ in range(3):
        engine.batch.step()
    _between_steps(engine, lambda: engine.pause(mode))  # type: ignore[arg-type]
    waiting = 1 if mode == "retract" else 0
    assert (engine.snapshot.num_running, engine.snapshot.num_waiting) == (0, waiting)
    assert long.num_retractions == waiting
    _between_steps(engine, engine.resume)
    _run_to_end(engine)
    _assert_same([long], _reference(tiny_model, [long]))
    # Retracted: its three chunks (48 tokens, all before the prompt logprobs start) came from the cache.
    assert long.cached_tokens == (3 * CHUNK if mode == "retract" else 0)


def _perturbed(model: EngineModel, seed: int) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    out: list[tuple[str, torch.Tensor]] = []
    for name in sorted(model.required_names()):
        tensor = model.named[name].clone()
        out.append((name, tensor + tensor.std() * torch.randn(tensor.shape, generator=generator)))
    return out


def test_a_retract_in_the_middle_of_the_chunks_recomputes_under_new_weights(tiny_llama_path: Path) -> None:
    model = EngineModel.from_pretrained(tiny_llama_path)
    engine = Engine(model, chunked_prefill_size=CHUNK, max_running_requests=2)
    long = _request(LONG)
    engine.add_request(long)
    for _ in range(3):
        engine.batch.step()
    _between_steps(engine, lambda: engine.pause("retract"))
    new_weights = _perturbed(model, seed=3)
    _between_steps(engine, lambda: engine.load_weights(new_weights, "v2"))
    _between_steps(engine, engine.resume)
    _run_to_end(engine)
    assert long.cached_tokens == 0  # the chunks' KV was computed under the old weights
    _assert_same([long], _reference(model, [long]))  # the model holds the new weights now
    assert long.weight_versions() == [{"version": "v2", "start": 0, "end": 8}]


def test_an_in_place_weight_load_between_chunks_keeps_the_old_chunks(tiny_llama_path: Path) -> None:
    """`in_place`'s contract for a half-prefilled request, as for a running one: the KV computed before the
    load stays; its later chunks and its tokens are computed under the new weights."""
    model = EngineModel.from_pretrained(tiny_llama_path)
    engine = Engine(model, chunked_prefill_size=CHUNK, max_running_requests=2)
    long = _request(LONG)
    engine.add_request(long)
    for _ in range(3):
        engine.batch.step()  # 48 tokens prefilled under the old weights
    _between_steps(engine, lambda: engine.pause("in_place"))
    new_weights = _perturbed(model, seed=4)
    # The reference: the first 48 positions' KV under the old weights, every later one under the new.
    reference = EngineModel.from_pretrained(tiny_llama_path)
    cache = KVCache(reference.config, 1, 128, reference.device, reference.dtype)
    reference.prefill_packed([LONG[:48]], cache, [0], [0])
    reference.load_named_tensors(new_weights)
    hidden = reference.prefill_packed([LONG[48:]], cache, [0], [48])
    tokens = [int(reference.logits(hidden[-1:]).argmax())]
    while len(tokens) < 8:
        position = len(LONG) + len(tokens) - 1
        hidden = reference.decode(torch.tensor(tokens[-1:]), torch.tensor([position]), cache, position + 1)
        tokens.append(int(reference.logits(hidden).argmax()))
    _between_steps(engine, lambda: engine.load_weights(new_weights, "v2"))
    _between_steps(engine, engine.resume)
    _run_to_end(engine)
    assert long.output_ids == tokens
    # And the old chunks matter: a recompute under the new weights gives other logprobs.
    recomputed = _reference(model, [long])[0]
    assert long.output_logprobs != pytest.approx(recomputed.output_logprobs, abs=1e-3)


# ---------------------------------------------------------------------------------------------- failures
def test_a_failed_chunk_is_retried_and_loses_nothing(
    tiny_model: EngineModel, engines: list[Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The third chunk's prefill fails once: the request is retried alone (in chunks) and finishes as without
    the failure, and so does the request running beside it."""
    engine = start_engine(engines, tiny_model, chunked_prefill_size=CHUNK)
    prefill_packed = tiny_model.prefill_packed
    failures = {"left": 1}

    def flaky(sequences: Any, cache: Any, slots: Any, starts: Any = None, replay: Any = None) -> torch.Tensor:
        if starts is not None and list(starts) == [27] and failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("transient failure of a chunk")
        return prefill_packed(sequences, cache, slots, starts, replay)

    monkeypatch.setattr(tiny_model, "prefill_packed", flaky)
    got = generate_together(engine, [[1, 2, 3, 4, 5], LONG], max_new_tokens=[40, 8], num_prompt_logprobs=50)
    monkeypatch.undo()
    assert failures["left"] == 0
    assert all(r.finish_reason == {"type": "length", "length": len(r.output_ids)} for r in got)
    want = _reference(tiny_model, got)
    _assert_same(got, want)


# ---------------------------------------------------------------------------------------------- the server
async def test_the_server_takes_and_reports_the_flag(make_client: Any) -> None:
    """`--chunked-prefill-size` reaches the engine and `/server_info`; a long prompt's prompt logprobs over
    HTTP are those of an unchunked server's."""
    bodies: list[Any] = []
    for size in (CHUNK, -1):
        client: TestClient[Any, Any]
        client, server = await make_client(chunked_prefill_size=size)
        assert server.engine.chunked_prefill_size == (CHUNK if size > 0 else None)
        info = await (await client.get("/server_info")).json()
        assert info["chunked_prefill_size"] == size
        response = await client.post(
            "/generate",
            json={
                "input_ids": LONG,
                "return_logprob": True,
                "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True},
            },
        )
        assert response.status == 200
        bodies.append(await response.json())
    chunked, whole = bodies
    assert chunked["output_ids"] == whole["output_ids"]
    assert chunked["meta_info"]["prompt_tokens"] == len(LONG)
    got, want = chunked["meta_info"]["input_token_logprobs"], whole["meta_info"]["input_token_logprobs"]
    assert [item[1] for item in got] == LONG
    assert got[0][0] is None
    assert want[0][0] is None
    assert [item[0] for item in got[1:]] == pytest.approx([item[0] for item in want[1:]], abs=TOLERANCE)
