"""No request can harm the others, over both fronts of the built-in engine (HTTP and gRPC, served in process
on loopback over a tiny Llama): bounds checked before admission, disconnects noticed, loads read from the
scheduler's snapshot, a server shutting down answers unavailable. For each bad input, requests started
before it finish normally and the engine answers a later request."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from aiohttp import ClientTimeout
from engine_testing import Served
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from asyncrl_core.errors import EngineUnavailableError, GenerationError
from asyncrl_core.types import SamplingParams
from asyncrl_engine.engine import Engine
from asyncrl_engine.model import EngineModel
from asyncrl_engine.options import SamplingOptions
from asyncrl_engine.request import EngineStoppedError, Request, shutdown_reason
from asyncrl_sglang._schema import AbortStatusError, parse_generation
from asyncrl_sglang.client import RetryPolicy, SGLangClient
from asyncrl_sglang.grpc_client import GrpcSGLangClient

WAIT_S = 60.0
LONG = {"max_new_tokens": 60, "ignore_eos": True, "temperature": 0.0}


async def _post(served: Served, **body: Any) -> tuple[int, Any]:
    response = await served.client.post("/generate", json=body)
    return response.status, json.loads(await response.text())


async def _last_event(served: Served, **body: Any) -> str:
    """The last ordinary `data:` event (before `[DONE]`) of a streamed `/generate` with output logprobs."""
    response = await served.client.post("/generate", json={**body, "stream": True, "return_logprob": True})
    assert response.status == 200
    chunks = [c for c in (await response.text()).split("\n\n") if c]
    assert chunks[-1] == "data: [DONE]"
    return chunks[-2].removeprefix("data: ")


async def _until(predicate: Callable[[], bool]) -> None:
    # The engine lives on its own thread: poll its published snapshot (no event to await).
    async with asyncio.timeout(WAIT_S):
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.005)


async def _started_before(served: Served, count: int = 2) -> list[asyncio.Task[tuple[int, Any]]]:
    """`count` long requests, running before the bad input arrives."""
    tasks = [
        asyncio.create_task(_post(served, input_ids=[5, 6, 7 + i], sampling_params=LONG))
        for i in range(count)
    ]
    await _until(lambda: served.engine.snapshot.num_running >= count)
    return tasks


async def _finish_normally(served: Served, tasks: list[asyncio.Task[tuple[int, Any]]]) -> None:
    for task in tasks:
        status, body = await asyncio.wait_for(task, WAIT_S)
        assert status == 200, body
        assert body["meta_info"]["finish_reason"] == {"type": "length", "length": LONG["max_new_tokens"]}
        assert len(body["output_ids"]) == LONG["max_new_tokens"]
    async with asyncio.timeout(WAIT_S):
        status, body = await _post(served, input_ids=[1, 2], sampling_params={"max_new_tokens": 2})
    assert status == 200
    assert len(body["output_ids"]) == 2


async def _grpc_refusal(served: Served, request: pb.GenerateRequest) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        async for _ in served.stub.Generate(request, timeout=WAIT_S):
            pass
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return refused.value


def _grpc_request(**fields: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=fields.pop("request_id", "g"),
        tokenized=pb.TokenizedInput(input_ids=fields.pop("input_ids", [1, 2])),
        sampling_params=fields.pop("sampling_params", pb.SamplingParams(max_new_tokens=2, temperature=1.0)),
        **fields,
    )


# ---------------------------------------------------------------------------------------------- top logprobs
async def test_top_logprobs_above_the_vocabulary_is_refused_before_admission(
    make_served: Callable[..., Any],
) -> None:
    served: Served = await make_served()
    vocab = served.engine.model.config.vocab_size
    others = await _started_before(served)
    status, body = await _post(
        served,
        input_ids=[1, 2],
        return_logprob=True,
        top_logprobs_num=vocab + 1,
        sampling_params={"max_new_tokens": 2},
    )
    assert status == 400
    assert "top_logprobs_num" in body["error"]["message"]
    refused = await _grpc_refusal(served, _grpc_request(return_logprob=True, top_logprobs_num=vocab + 1))
    assert "top_logprobs_num" in (refused.details() or "")
    await _finish_normally(served, others)
    # The whole vocabulary is a valid number of top logprobs.
    status, body = await _post(
        served,
        input_ids=[1, 2],
        return_logprob=True,
        top_logprobs_num=vocab,
        sampling_params={"max_new_tokens": 1},
    )
    assert status == 200
    assert len(body["meta_info"]["output_top_logprobs"][0]) == vocab


# ---------------------------------------------------------------------------------------------- n and batches
async def test_n_above_the_configured_maximum_is_refused(make_served: Callable[..., Any]) -> None:
    served: Served = await make_served(max_n=16)
    others = await _started_before(served)
    status, body = await _post(served, input_ids=[1, 2], sampling_params={"max_new_tokens": 1, "n": 10**6})
    assert status == 400
    assert "--max-n" in body["error"]["message"]
    sampling = pb.SamplingParams(max_new_tokens=1, temperature=1.0, n=17)
    refused = await _grpc_refusal(served, _grpc_request(sampling_params=sampling))
    assert "--max-n" in (refused.details() or "")
    await _finish_normally(served, others)
    status, body = await _post(served, input_ids=[1, 2], sampling_params={"max_new_tokens": 1, "n": 16})
    assert status == 200
    assert len(body) == 16


async def test_a_batch_larger_than_the_queue_can_take_is_refused(make_served: Callable[..., Any]) -> None:
    served: Served = await make_served(max_queued_requests=20)
    others = await _started_before(served)
    status, body = await _post(served, input_ids=[[1, 2]] * 8, sampling_params={"max_new_tokens": 1, "n": 4})
    assert status == 400
    assert "32 requests" in body["error"]["message"]
    assert served.engine.snapshot.counters.num_requests_total == 2  # nothing of the batch was queued
    sampling = pb.SamplingParams(max_new_tokens=1, temperature=1.0, n=21)
    await _grpc_refusal(served, _grpc_request(sampling_params=sampling))
    await _finish_normally(served, others)


async def test_a_full_queue_answers_503(make_served: Callable[..., Any]) -> None:
    served: Served = await make_served(max_queued_requests=4, max_running_requests=2)
    others = await _started_before(served)
    queued = [
        asyncio.create_task(_post(served, input_ids=[3, 4], sampling_params={"max_new_tokens": 1}))
        for _ in range(4)
    ]
    await _until(lambda: served.engine.snapshot.num_waiting >= 4)
    status, body = await _post(served, input_ids=[1, 2], sampling_params={"max_new_tokens": 1})
    assert (status, body["code"], body["message"]) == (503, 503, "The request queue is full.")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        async for _ in served.stub.Generate(_grpc_request(), timeout=WAIT_S):
            pass
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    for task in queued:
        assert (await asyncio.wait_for(task, WAIT_S))[0] == 200
    await _finish_normally(served, others)


async def test_a_server_shutting_down_answers_generate_as_unavailable(
    make_served: Callable[..., Any],
) -> None:
    # The engine stops before the server does: a request that arrives meanwhile (over a connection kept
    # alive) may go to another engine or to this one restarted (503, UNAVAILABLE), and is not refused for
    # good (500, UNKNOWN: its group would be dropped).
    served: Served = await make_served()
    served.server.ready = False
    await asyncio.to_thread(served.engine.stop)
    status, body = await _post(served, input_ids=[1, 2], sampling_params={"max_new_tokens": 1})
    assert (status, body["code"], body["message"]) == (503, 503, "The server is shutting down.")
    url = str(served.client.make_url("")).rstrip("/")
    async with SGLangClient(url, retry=RetryPolicy(max_attempts=1)) as client:
        with pytest.raises(EngineUnavailableError, match="shutting down"):
            await client.generate([1, 2], SamplingParams(max_new_tokens=1))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        async for _ in served.stub.Generate(_grpc_request(), timeout=WAIT_S):
            pass
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_requests_the_engine_stops_under_answer_unavailable_not_a_partial_output(
    make_served: Callable[..., Any],
) -> None:
    # A request cut off by the engine stopping was not ended by the model: answered with its partial output
    # and finish reason abort (200), it would be trained as if the model had ended there. SGLang answers an
    # abort that carries status 503 as a 503: the client sends the request again (another engine, or this
    # one restarted). An HTTP call and a gRPC call, both running when the engine stops.
    served: Served = await make_served()
    endless = {"max_new_tokens": 2000, "ignore_eos": True}
    http = asyncio.create_task(_post(served, input_ids=[5, 6, 7], sampling_params=endless))

    async def grpc_call() -> grpc.StatusCode:
        request = _grpc_request(
            request_id="cut", sampling_params=pb.SamplingParams(max_new_tokens=2000, ignore_eos=True)
        )
        try:
            async for _ in served.stub.Generate(request, timeout=WAIT_S):
                pass
        except grpc.aio.AioRpcError as error:
            return error.code()
        return grpc.StatusCode.OK

    rpc = asyncio.create_task(grpc_call())
    # A stream has the abort, status 503 included, as its last event (HTTP 200): the client's reading of a
    # result takes it for a 503, not for an output.
    stream = asyncio.create_task(_last_event(served, input_ids=[8, 9], sampling_params=endless))
    await _until(lambda: served.engine.snapshot.num_running == 3)
    served.server.ready = False
    await asyncio.to_thread(served.engine.stop)
    status, body = await asyncio.wait_for(http, WAIT_S)
    assert (status, body["code"], body["message"]) == (503, 503, "The server is shutting down.")
    assert await asyncio.wait_for(rpc, WAIT_S) == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(AbortStatusError) as cut:
        parse_generation(await asyncio.wait_for(stream, WAIT_S), 2)
    assert (cut.value.status, cut.value.message) == (503, "The server is shutting down.")


async def test_a_request_that_fails_alone_answers_an_internal_error_not_a_partial_output(
    make_served: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A request that fails on its own in the engine (here: a cached block of its prompt cannot be read) was
    # finished as a user abort (200, its partial output), which an agent loop ends its episode on and the
    # run may train. SGLang marks an internal error with status 500 and answers it as an error: HTTP 500 and
    # its ErrorResponse, in a stream the abort with its status as the last event, gRPC INTERNAL. The clients
    # take it as a failed request and do not send it again (it fails alone: it would fail again).
    served: Served = await make_served()
    cache = served.engine.prefix_cache
    assert cache is not None
    load = cache.load
    poisoned = [99] * 40

    def load_unless_poisoned(tokens: Any, *args: Any) -> int:
        if list(tokens[:40]) == poisoned:
            raise RuntimeError("a cached block of this prefix is unreadable")
        return load(tokens, *args)

    monkeypatch.setattr(cache, "load", load_unless_poisoned)
    others = await _started_before(served)
    prompt = [*poisoned, 1]
    status, body = await _post(served, input_ids=prompt, sampling_params={"max_new_tokens": 4})
    assert status == 500
    assert body["message"].startswith("Internal engine error:")
    assert "unreadable" in body["message"]
    assert body == {"object": "error", "message": body["message"], "type": "500", "param": None, "code": 500}

    last = await _last_event(served, input_ids=prompt, sampling_params={"max_new_tokens": 4})
    assert json.loads(last)["meta_info"]["finish_reason"]["type"] == "abort"
    with pytest.raises(AbortStatusError) as failed_in_stream:
        parse_generation(last, len(prompt))
    assert failed_in_stream.value.status == 500
    assert "unreadable" in failed_in_stream.value.message

    with pytest.raises(grpc.aio.AioRpcError) as failed:
        async for _ in served.stub.Generate(_grpc_request(input_ids=prompt), timeout=WAIT_S):
            pass
    assert failed.value.code() == grpc.StatusCode.INTERNAL
    assert "unreadable" in (failed.value.details() or "")

    url = str(served.client.make_url("")).rstrip("/")
    for client in (SGLangClient(url), GrpcSGLangClient(url, served.grpc_target)):
        before = served.engine.snapshot.counters.num_requests_total
        async with client:
            with pytest.raises(GenerationError, match="Internal engine error"):
                await client.generate(prompt, SamplingParams(max_new_tokens=4))
        assert served.engine.snapshot.counters.num_requests_total == before + 1  # not sent again
    await _finish_normally(served, others)


async def test_a_user_abort_still_answers_the_partial_output(make_served: Callable[..., Any]) -> None:
    # `abort_request` (and a pause in abort mode) keeps its documented answer: 200, partial output, abort.
    served: Served = await make_served()
    http = asyncio.create_task(
        _post(served, input_ids=[5, 6, 7], rid="mine", sampling_params={"max_new_tokens": 2000})
    )
    await _until(lambda: served.engine.snapshot.num_running == 1)
    response = await served.client.post("/abort_request", json={"abort_all": True})
    assert response.status == 200
    status, body = await asyncio.wait_for(http, WAIT_S)
    assert status == 200
    assert body["meta_info"]["finish_reason"]["type"] == "abort"
    assert body["meta_info"]["finish_reason"]["status_code"] is None


def test_a_request_queued_while_the_engine_stops_is_answered(
    tiny_model: EngineModel, engines: list[Engine]
) -> None:
    # A request queued after the engine's last abort of what it holds, before its scheduler ends (here by
    # the update callback of a request that the stop finishes), was left unanswered until the process
    # exited. Every call that reaches a stopping engine is answered: refused, or finished as cut off.
    engine = Engine(tiny_model)
    engine.start()
    engines.append(engine)
    late = Request(rid="late", prompt_ids=[1, 2, 3], options=SamplingOptions(max_new_tokens=500))
    queued: list[concurrent.futures.Future[None]] = []

    def queue_late(_request: Request, finished: bool) -> None:
        if finished:
            queued.append(engine.call_async(lambda: engine.add_request(late)))

    first = Request(
        rid="first",
        prompt_ids=[1, 2],
        options=SamplingOptions(max_new_tokens=2000, ignore_eos=True),
        on_update=queue_late,
    )
    engine.call(lambda: engine.add_request(first), timeout_s=WAIT_S)
    deadline = time.monotonic() + WAIT_S
    while engine.snapshot.num_running < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    engine.stop()
    assert first.finish_reason == shutdown_reason()
    assert len(queued) == 1
    try:
        queued[0].result(timeout=WAIT_S)
    except EngineStoppedError:
        return  # refused: the caller answers 503
    assert late.finish_reason == shutdown_reason()


async def test_calls_held_at_the_pause_gate_are_answered_when_the_server_stops(
    make_served: Callable[..., Any],
) -> None:
    # Requests held by a pause wait for a continue; a server that stops instead answers them (503), as it
    # answers every call that reaches it then.
    served: Served = await make_served()
    response = await served.client.post("/pause_generation", json={"mode": "retract"})
    assert response.status == 200
    held = asyncio.create_task(_post(served, input_ids=[1, 2], sampling_params={"max_new_tokens": 2}))
    await _until(lambda: served.server.gate.num_waiting == 1)
    await served.server.stop()
    status, body = await asyncio.wait_for(held, WAIT_S)
    assert (status, body["code"], body["message"]) == (503, 503, "The server is shutting down.")
    status, body = await _post(served, input_ids=[1, 2], sampling_params={"max_new_tokens": 2})
    assert (status, body["message"]) == (503, "The server is shutting down.")


# ---------------------------------------------------------------------------------------------- disconnects
async def test_a_non_streaming_client_that_leaves_is_aborted_while_its_samples_finish(
    make_served: Callable[..., Any],
) -> None:
    """n samples that finish one after another keep the call busy; the client leaving must still abort the
    unfinished ones at once (not only after a quiet spell)."""
    # One sample at a time, 8 tokens each: an update every 8 steps, far more often than the 0.5 s poll.
    served: Served = await make_served(max_running_requests=1)
    body = {"input_ids": [9, 8, 7], "sampling_params": {"max_new_tokens": 8, "n": 64, "ignore_eos": True}}
    response_task = asyncio.create_task(
        served.client.post("/generate", json=body, timeout=ClientTimeout(total=WAIT_S))
    )
    await _until(lambda: served.engine.snapshot.counters.generation_tokens_total >= 16)
    generated = served.engine.snapshot.counters.generation_tokens_total
    response_task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await response_task
    await _until(lambda: served.engine.snapshot.num_running + served.engine.snapshot.num_waiting == 0)
    snapshot = served.engine.snapshot
    assert snapshot.counters.num_aborted_requests_total > 0
    assert snapshot.counters.generation_tokens_total - generated < 64 * 8 // 2


# ------------------------------------------------------------------------------------------- loads
async def test_loads_and_metrics_never_fail_under_a_long_queue(make_served: Callable[..., Any]) -> None:
    # One running request: the scheduler pops from the queue at every step while the routes read.
    served: Served = await make_served(enable_metrics=True, max_running_requests=1)
    engine = served.engine
    queued = [
        Request(rid=f"q{i}", prompt_ids=[1, 2], options=SamplingOptions(max_new_tokens=1, ignore_eos=True))
        for i in range(100_000)
    ]
    await asyncio.wrap_future(engine.call_async(lambda: [engine.add_request(r) for r in queued]))
    for _ in range(40):
        for path in ("/metrics", "/v1/loads", "/server_info"):
            response = await served.client.get(path)
            assert response.status == 200, await response.text()
        reply = await served.stub.GetLoads(pb.GetLoadsRequest(), timeout=WAIT_S)
        assert 0 < reply.loads[0].num_waiting_reqs <= 100_000
    await served.client.post("/abort_request", json={"abort_all": True})
    await _until(lambda: engine.snapshot.num_waiting == 0)
    await _finish_normally(served, [])


# ---------------------------------------------------------------------------------------------- gRPC zeros
async def test_grpc_sampling_zeros_read_as_sglangs_servicer_reads_them(
    make_served: Callable[..., Any],
) -> None:
    """proto3 cannot tell an unset top_p, top_k, repetition_penalty or n from its zero: they mean the neutral
    value (SGLang 0.5.23's servicer); temperature 0 is greedy, as it is literally."""
    served: Served = await make_served()
    params = pb.SamplingParams(max_new_tokens=4, ignore_eos=True)  # everything else at its zero
    completes = [
        response.complete
        async for response in served.stub.Generate(_grpc_request(sampling_params=params), timeout=WAIT_S)
        if response.HasField("complete")
    ]
    assert len(completes) == 1
    assert len(completes[0].output_ids) == 4
    status, body = await _post(
        served,
        input_ids=[1, 2],
        sampling_params={"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True},
    )
    assert status == 200
    assert list(completes[0].output_ids) == body["output_ids"]
