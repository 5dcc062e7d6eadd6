"""The built-in engine's overlap scheduler: a decode step is launched before the previous one is read, so a
request that finishes at step n has been decoded once more by step n + 1, whose token must be dropped.
Outputs equal the non-overlapped loop's (greedy and seeded sampling), aborts add nothing after them, and the
pause modes keep their promises with a step in flight."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_testing import WAIT_S, start_engine

from asyncrl_engine.engine import Engine
from asyncrl_engine.model import EngineModel
from asyncrl_engine.options import SamplingOptions
from asyncrl_engine.request import Request

PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15], [21, 22], [31, 32, 33, 34], [41, 42, 43, 44, 45, 46]]


@pytest.fixture(scope="module")
def decode_text(tiny_llama_path: Path) -> Callable[[list[int]], str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_path))

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=True))

    return decode


@dataclass
class Tracked:
    """A request and what its client heard: the output length at each token event and at each finish."""

    request: Request
    done: threading.Event = field(default_factory=threading.Event)
    token_events: list[int] = field(default_factory=lambda: list[int]())
    finish_events: list[int] = field(default_factory=lambda: list[int]())
    running_at_finish: list[int] = field(default_factory=lambda: list[int]())
    """`engine.snapshot.num_running` when the client heard of the finish."""


def _request(
    engine: Engine,
    prompt: list[int],
    options: SamplingOptions,
    then: Callable[[Request], None] | None = None,
    then_at: int = 0,
) -> Tracked:
    """A streamed request with logprobs; `then(request)` runs on the scheduler thread once it has `then_at`
    tokens."""
    request = Request(
        rid=f"r{time.monotonic_ns()}", prompt_ids=prompt, options=options, return_logprob=True, stream=True
    )
    request.top_logprobs_num = 2
    tracked = Tracked(request)

    def on_update(r: Request, finished: bool) -> None:
        if finished:
            tracked.finish_events.append(len(r.output_ids))
            tracked.running_at_finish.append(engine.snapshot.num_running)
            tracked.done.set()
            return
        tracked.token_events.append(len(r.output_ids))
        if then is not None and len(r.output_ids) == then_at:
            then(r)

    request.on_update = on_update
    return tracked


def _add(engine: Engine, *tracked: Tracked) -> None:
    engine.call(lambda: [engine.add_request(t.request) for t in tracked], timeout_s=WAIT_S)


def _wait(tracked: list[Tracked]) -> None:
    for t in tracked:
        assert t.done.wait(WAIT_S), f"request {t.request.rid} did not finish"


def _assert_heard_once(t: Tracked) -> None:
    """The client heard every token once, in order, and one finish at the final length: no token after it."""
    request = t.request
    count = len(request.output_ids)
    assert t.finish_events == [count]
    assert t.token_events == list(range(1, count + 1))[: len(t.token_events)]
    assert len(t.token_events) in (count, count - 1)  # the last token comes with the finish
    assert len(request.output_logprobs) == count
    assert len(request.output_top_logprobs) == count
    assert request.weight_versions()[-1]["end"] == count


def _recomputed(model: EngineModel, prompt: list[int], count: int) -> list[int]:
    """Greedy tokens by a full forward (no cache) at every step."""
    tokens = list(prompt)
    for _ in range(count):
        tokens.append(int(model.forward_logits(torch.tensor(tokens))[-1].argmax()))
    return tokens[len(prompt) :]


def _perturbed(model: EngineModel) -> list[tuple[str, torch.Tensor]]:
    """New weights for every parameter: the old ones plus noise of their scale (a training step)."""
    generator = torch.Generator().manual_seed(3)
    return [
        (
            name,
            model.named[name]
            + model.named[name].std() * torch.randn(model.named[name].shape, generator=generator),
        )
        for name in sorted(model.required_names())
    ]


def _generate(engine: Engine, prompt: list[int], options: SamplingOptions) -> list[int]:
    tracked = _request(engine, prompt, options)
    _add(engine, tracked)
    _wait([tracked])
    return tracked.request.output_ids


def _seeded(max_new_tokens: int | None, **options: Any) -> SamplingOptions:
    """Sampling from a request's own generator: the same tokens in any batch, overlapped or not (the tiny
    random model's greedy output repeats one token, too plain for stop ids and strings)."""
    return SamplingOptions(
        max_new_tokens=max_new_tokens, temperature=1.0, top_p=0.9, sampling_seed=17, **options
    )


def _greedy(max_new_tokens: int | None, **options: Any) -> SamplingOptions:
    return SamplingOptions(max_new_tokens=max_new_tokens, temperature=0.0, **options)


def _mixed_workload(engine: Engine, stop_token: int, stop_text: str) -> list[Tracked]:
    """Greedy and seeded requests of different lengths and finish causes (stop id, stop string, length,
    context), two of them (n = 2) joining when the first request has 3 tokens; returns every request once
    all have finished."""
    late = [_request(engine, PROMPTS[4], _seeded(7)) for _ in range(2)]

    def join(_request: Request) -> None:  # on the scheduler thread, while a step is in flight
        for t in late:
            engine.add_request(t.request)

    first = [
        _request(engine, PROMPTS[0], _greedy(12, ignore_eos=True), join, 3),
        _request(engine, PROMPTS[0], _seeded(12, stop_token_ids=frozenset({stop_token}), ignore_eos=True)),
        _request(engine, PROMPTS[0], _seeded(12, stop=(stop_text,), ignore_eos=True)),
        _request(engine, PROMPTS[1], _greedy(1)),
        _request(engine, PROMPTS[2], _greedy(None, ignore_eos=True)),
        _request(engine, PROMPTS[3], _seeded(9, ignore_eos=True)),
        _request(engine, PROMPTS[3], _seeded(5, min_new_tokens=3)),
    ]
    _add(engine, *first)
    everything = [*first, *late]
    _wait(everything)
    return everything


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
    ],
)
def test_overlap_gives_the_non_overlapped_loops_tokens_and_logprobs(
    device: str,
    tiny_llama_path: Path,
    tiny_model: EngineModel,
    decode_text: Callable[[list[int]], str],
    engines: list[Engine],
) -> None:
    """On CUDA through the captured decode graphs, whose input ids are copied from the previous step's draws
    on the device (the races of the overlap show only there)."""
    model = tiny_model if device == "cpu" else EngineModel.from_pretrained(tiny_llama_path, device)
    options: dict[str, Any] = {
        "max_running_requests": 4,
        "context_length": 40,
        "decode_text": decode_text,
        "use_cuda_graphs": device == "cuda",
    }
    reference = start_engine(engines, model, **options)
    sampled = _generate(reference, PROMPTS[0], _seeded(12, ignore_eos=True))
    stop_token = sampled[5]
    # A stop string inside a later token's text: its first match ends the request early.
    stop_text = next(text for t in sampled[6:] if len(text := decode_text([t]).strip()) >= 2)
    runs: list[list[Tracked]] = []
    for overlap in (False, True):
        engine = start_engine(engines, model, **options, overlap_schedule=overlap)
        runs.append(_mixed_workload(engine, stop_token, stop_text))
    plain, overlapped = runs
    for a, b in zip(plain, overlapped, strict=True):
        assert b.request.output_ids == a.request.output_ids
        assert b.request.finish_reason == a.request.finish_reason
        # Rows batch differently (a finished row is decoded once more before its slot is freed): float32
        # matmuls may round the last bits differently (more so on a GPU, whose kernels follow the shape).
        tolerance = 1e-5 if device == "cpu" else 1e-4
        torch.testing.assert_close(
            torch.tensor(b.request.output_logprobs),
            torch.tensor(a.request.output_logprobs),
            atol=tolerance,
            rtol=0,
        )
        torch.testing.assert_close(
            torch.tensor([[v for v, _ in top] for top in b.request.output_top_logprobs]),
            torch.tensor([[v for v, _ in top] for top in a.request.output_top_logprobs]),
            atol=tolerance,
            rtol=0,
        )
        _assert_heard_once(b)
    reasons = [t.request.finish_reason for t in overlapped]
    if device == "cpu":
        # Which stop fires follows the reference run, a request alone. On a GPU the same request in a batch
        # of four may draw other tokens (kernels round by batch shape, and the random model's near-uniform
        # distribution turns the last bit into another token under an inverse CDF), so there only the
        # equality of the two loops above holds, which is what this test is for.
        assert reasons[1] == {"type": "stop", "matched": stop_token}
        assert reasons[2] == {"type": "stop", "matched": stop_text}
    assert reasons[4] == {"type": "length", "length": 40 - len(PROMPTS[2])}  # the context length
    assert len(overlapped[0].request.output_ids) == 12
    assert len(overlapped[3].request.output_ids) == 1


def test_a_request_finished_at_step_n_gets_nothing_from_step_n_plus_1(
    tiny_model: EngineModel, engines: list[Engine]
) -> None:
    """Requests finish one by one (stop id, EOS, max_new_tokens) while the others decode on, overlapped: each
    keeps exactly the tokens the non-overlapped rules give it, heard once, and the engine counts only those;
    a client told of a finish never reads a snapshot that runs its request."""
    engine = start_engine(engines, tiny_model, max_running_requests=8)
    sampled = _generate(engine, PROMPTS[1], _seeded(16, ignore_eos=True))
    stop_at, eos_at = sampled[4], sampled[8]
    engine_eos = start_engine(engines, tiny_model, max_running_requests=8, eos_token_ids=[eos_at])
    options = [
        _seeded(16, stop_token_ids=frozenset({stop_at})),
        _seeded(16),
        _seeded(6, ignore_eos=True),
        _seeded(16, ignore_eos=True),
    ]
    tracked = [_request(engine_eos, PROMPTS[1], o) for o in options]
    before = engine_eos.snapshot.counters.generation_tokens_total
    _add(engine_eos, *tracked)
    _wait(tracked)
    lengths = [len(t.request.output_ids) for t in tracked]
    first_stop = next(i for i, token in enumerate(sampled) if token in (stop_at, eos_at))
    assert lengths == [first_stop + 1, sampled.index(eos_at) + 1, 6, 16]
    for t in tracked:
        assert t.request.output_ids == sampled[: len(t.request.output_ids)]
        _assert_heard_once(t)
    counters = engine_eos.call(lambda: engine_eos.counters)
    assert counters.generation_tokens_total - before == sum(lengths)
    # At each finish only requests not finished yet run: the longer ones, and those of the same length
    # whose tokens of that step were not read yet.
    for t in tracked:
        [running] = t.running_at_finish
        count = len(t.request.output_ids)
        assert sum(n > count for n in lengths) <= running <= sum(n >= count for n in lengths) - 1
    assert engine_eos.call(lambda: (engine_eos.num_running, engine_eos.num_waiting)) == (0, 0)


def test_an_abort_adds_no_token_after_it(tiny_model: EngineModel, engines: list[Engine]) -> None:
    """An abort from another request's callback (inside the step being read, with the next step in flight)
    and an abort through `call` both end their request with the tokens it had."""
    engine = start_engine(engines, tiny_model, max_running_requests=4)
    long = SamplingOptions(max_new_tokens=60, temperature=0.0, ignore_eos=True)
    at_abort: dict[str, int] = {}
    victim = _request(engine, PROMPTS[2], long)

    def abort_victim(_request: Request) -> None:
        at_abort["inline"] = len(victim.request.output_ids)
        engine.abort(victim.request.rid)

    killer = _request(engine, PROMPTS[3], long, abort_victim, 5)
    other = _request(engine, PROMPTS[1], long)
    _add(engine, victim, killer, other)
    assert victim.done.wait(WAIT_S)
    while len(other.request.output_ids) < 10:
        time.sleep(0.002)
    at_abort["call"] = engine.call(
        lambda: (engine.abort(other.request.rid), len(other.request.output_ids))[1]
    )
    _wait([victim, killer, other])
    assert len(victim.request.output_ids) == at_abort["inline"] > 0
    assert len(other.request.output_ids) == at_abort["call"] < 60
    for t in (victim, other):
        assert t.request.finish_reason is not None
        assert t.request.finish_reason["type"] == "abort"
        _assert_heard_once(t)
    assert len(killer.request.output_ids) == 60


def test_pauses_and_weight_updates_under_load_keep_their_promises(
    tiny_llama_path: Path, engines: list[Engine]
) -> None:
    """Under load, with short requests finishing around the pause: a retract keeps exactly the tokens the
    clients heard and recomputes the rest under the new weights; an abort pause ends everyone with what they
    heard; requests that finished before keep their lengths."""
    model = EngineModel.from_pretrained(tiny_llama_path)
    engine = start_engine(engines, model, max_running_requests=4)
    references = {i: _recomputed(model, PROMPTS[i], 40) for i in range(4)}
    lengths = [40, 40, 3, 5]
    tracked = [
        _request(engine, PROMPTS[i], SamplingOptions(max_new_tokens=n, temperature=0.0, ignore_eos=True))
        for i, n in enumerate(lengths)
    ]
    _add(engine, *tracked)
    while len(tracked[0].request.output_ids) < 8:
        time.sleep(0.002)
    engine.call(lambda: engine.pause("retract"))
    kept = [len(t.request.output_ids) for t in tracked]
    heard = [max([0, *t.token_events, *t.finish_events]) for t in tracked]
    assert kept == heard
    new_weights = _perturbed(model)
    engine.call(lambda: engine.load_weights(new_weights, "v2"))
    engine.call(engine.resume)
    _wait(tracked)
    for i, t in enumerate(tracked):
        output = t.request.output_ids
        assert len(output) == lengths[i]
        assert output[: kept[i]] == references[i][: kept[i]]
        _assert_heard_once(t)
        if kept[i] < lengths[i]:
            assert t.request.num_retractions == 1
            continuation = _recomputed(model, PROMPTS[i] + output[: kept[i]], lengths[i] - kept[i])
            assert output[kept[i] :] == continuation
            assert t.request.weight_versions() == [
                {"version": "default", "start": 0, "end": kept[i]},
                {"version": "v2", "start": kept[i], "end": lengths[i]},
            ]
    # An abort pause under load: every request ends with what it had when the pause ran.
    tracked = [
        _request(engine, PROMPTS[i], SamplingOptions(max_new_tokens=n, temperature=0.0, ignore_eos=True))
        for i, n in enumerate(lengths)
    ]
    _add(engine, *tracked)
    while len(tracked[0].request.output_ids) < 6:
        time.sleep(0.002)
    at_pause = engine.call(lambda: (engine.pause("abort"), [len(t.request.output_ids) for t in tracked])[1])
    _wait(tracked)
    assert [len(t.request.output_ids) for t in tracked] == at_pause
    for t in tracked:
        _assert_heard_once(t)
    assert engine.call(engine.is_idle)


async def test_over_http_a_finished_request_reports_only_its_own_tokens(
    tiny_model: EngineModel, tiny_llama_path: Path
) -> None:
    """Streamed over `/generate` beside longer requests (overlapped steps): the request stopped by a stop id
    at step n reports `completion_tokens`, `output_ids` and logprobs of exactly n tokens, in every event."""
    import asyncio
    import json

    from aiohttp.test_utils import TestClient, TestServer

    from asyncrl_engine.server import BuiltinServer, ServerArgs

    engine = Engine(tiny_model, max_running_requests=4)
    engine.start()
    args = ServerArgs(model_path=str(tiny_llama_path), served_model_name="tiny", tokenizer_path=None)
    server = BuiltinServer(engine, None, args)
    server.ready = True
    client: TestClient[Any, Any] = TestClient(TestServer(server.app, host="127.0.0.1"))
    await client.start_server()
    try:
        seeded = {"temperature": 1.0, "top_p": 0.9, "sampling_seed": 17, "max_new_tokens": 16}

        async def stream(params: dict[str, Any]) -> list[dict[str, Any]]:
            body = {
                "input_ids": PROMPTS[1],
                "stream": True,
                "return_logprob": True,
                "sampling_params": params,
            }
            response = await client.post("/generate", json=body)
            chunks = [c for c in (await response.text()).split("\n\n") if c]
            assert chunks[-1] == "data: [DONE]"
            return [json.loads(c.removeprefix("data: ")) for c in chunks[:-1]]

        reference = (await stream({**seeded, "ignore_eos": True}))[-1]["output_ids"]
        stop_at = reference[6]
        expected = reference[: reference.index(stop_at) + 1]
        long = {**seeded, "max_new_tokens": 40, "ignore_eos": True}
        stopped, *_ = await asyncio.gather(
            stream({**seeded, "ignore_eos": True, "stop_token_ids": [stop_at]}), stream(long), stream(long)
        )
    finally:
        await client.close()
        await asyncio.to_thread(engine.stop)
    final = stopped[-1]
    assert final["output_ids"] == expected
    assert final["meta_info"]["completion_tokens"] == len(expected)
    assert len(final["meta_info"]["output_token_logprobs"]) == len(expected)
    assert final["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}
    assert [e["meta_info"]["finish_reason"] for e in stopped[:-1]] == [None] * (len(stopped) - 1)
    for event in stopped:
        count = len(event["output_ids"])
        assert event["output_ids"] == expected[:count]
        assert event["meta_info"]["completion_tokens"] == count
        assert len(event["meta_info"]["output_token_logprobs"]) == count


@pytest.mark.parametrize("overlap", [True, False])
def test_an_abort_of_a_later_row_inside_the_step_adds_no_token_to_it(
    overlap: bool, tiny_model: EngineModel, engines: list[Engine]
) -> None:
    """A callback aborts a request whose row comes after its own in the step being recorded: the victim keeps
    the tokens it had (the step's token for its row is dropped), heard once, one finish."""
    engine = start_engine(engines, tiny_model, max_running_requests=4, overlap_schedule=overlap)
    long = SamplingOptions(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    at_abort: dict[str, int] = {}
    victim = _request(engine, PROMPTS[2], long)

    def abort_victim(_request: Request) -> None:
        at_abort["inline"] = len(victim.request.output_ids)
        engine.abort(victim.request.rid)

    killer = _request(engine, PROMPTS[3], long, abort_victim, 5)
    _add(engine, killer, victim)  # the killer's row comes first
    _wait([victim, killer])
    assert len(victim.request.output_ids) == at_abort["inline"] > 0
    assert victim.request.finish_reason is not None
    assert victim.request.finish_reason["type"] == "abort"
    _assert_heard_once(victim)
    assert len(killer.request.output_ids) == 30


def _staggered_workload(engine: Engine) -> list[Tracked]:
    """Greedy requests joining while others decode (queued from callbacks, so a step is in flight): two when
    the first has 3 tokens, one of them asking for prompt logprobs (whose prefill reads the host at once),
    and one more when the first has 8; every request's output once all have finished."""
    joining = [
        _request(engine, PROMPTS[1], _greedy(9, ignore_eos=True)),
        _request(engine, PROMPTS[2], _greedy(4, ignore_eos=True)),
        _request(engine, PROMPTS[3], _greedy(11, ignore_eos=True)),
    ]
    joining[1].request.logprob_start_len = 0

    def join(tracked: list[Tracked]) -> Callable[[Request], None]:
        def add(_request: Request) -> None:  # on the scheduler thread, while a step is in flight
            for t in tracked:
                engine.add_request(t.request)

        return add

    late = _request(engine, PROMPTS[4], _greedy(6, ignore_eos=True))
    first = _request(engine, PROMPTS[0], _greedy(20, ignore_eos=True), join(joining[:2]), 3)
    second = _request(engine, PROMPTS[0], _greedy(14, ignore_eos=True), join([joining[2], late]), 8)
    _add(engine, first, second)
    everything = [first, second, *joining, late]
    _wait(everything)
    return everything


@pytest.mark.parametrize("slots", [4, 6])
def test_admission_beside_the_step_in_flight_gives_the_non_overlapped_loops_tokens(
    slots: int, tiny_model: EngineModel, engines: list[Engine]
) -> None:
    """Requests admitted while a decode step is in flight (prefilled into the slots of finished rows or into
    fresh ones, the next step launched from the step in flight's ids and their first tokens on the device)
    get the tokens and logprobs of the non-overlapped loop, greedy, float32, on the CPU. With 4 slots the
    batch is full when the last two join, so they take over finished rows' slots; with 6, fresh ones too."""
    plain = _staggered_workload(
        start_engine(engines, tiny_model, max_running_requests=slots, overlap_schedule=False)
    )
    engine = start_engine(engines, tiny_model, max_running_requests=slots)
    beside: list[bool] = []
    taken_over: list[int] = []
    appended: list[int] = []
    admit = engine.batch.admit_beside
    prefill = engine.batch.prefill

    def spy_admit(step: Any) -> bool:
        beside.append(admit(step))
        return beside[-1]

    def spy_prefill(requests: list[Request], read: bool = True, slots: list[int] | None = None) -> Any:
        if not read:  # beside a step in flight
            assert slots is not None
            taken_over.extend(s for s in slots if s < len(engine.running))
            appended.extend(s for s in slots if s >= len(engine.running))
        return prefill(requests, read, slots)

    engine.batch.admit_beside = spy_admit
    engine.batch.prefill = spy_prefill
    overlapped = _staggered_workload(engine)
    assert any(beside)
    assert taken_over if slots == 4 else appended
    for a, b in zip(plain, overlapped, strict=True):
        assert b.request.output_ids == a.request.output_ids
        assert b.request.finish_reason == a.request.finish_reason
        torch.testing.assert_close(
            torch.tensor(b.request.output_logprobs),
            torch.tensor(a.request.output_logprobs),
            atol=1e-5,
            rtol=0,
        )
        _assert_heard_once(b)
    # The request with prompt logprobs was admitted through a sync point, with the same values.
    expected, got = plain[3].request.input_logprobs, overlapped[3].request.input_logprobs
    assert got[0] is None
    assert len(got) == len(PROMPTS[2])
    torch.testing.assert_close(torch.tensor(got[1:]), torch.tensor(expected[1:]), atol=1e-5, rtol=0)
    assert engine.call(lambda: (engine.num_running, engine.num_waiting)) == (0, 0)
