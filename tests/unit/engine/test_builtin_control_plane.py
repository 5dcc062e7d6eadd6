"""The built-in engine's control plane cannot be wedged (HTTP, and gRPC where the service has the call; served
in process on loopback over a tiny Llama): pause and continue are serialised, so the admission gate and the
scheduler always change together, and `/health` and `/ready` say whether the scheduler can serve; every
request is bounded before it is queued (body size, the top logprobs its response would hold, stop strings,
the weight version), each refusal a 400 naming the field; tokenisation and stop-pattern compilation run off
the event loop; a request that can draw no token is refused."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import AsyncIterable, Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from aiohttp.test_utils import TestClient
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from asyncrl_engine import options as options_module
from asyncrl_engine.calls import MAX_TOP_LOGPROB_ENTRIES
from asyncrl_engine.options import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from asyncrl_engine.server import BuiltinServer
from asyncrl_engine.weights import MAX_WEIGHT_VERSION_CHARS

WAIT_S = 60.0
SERVED_S = 10.0
"""How long a one-token `/generate` may take on an engine that can serve (the tiny model needs well under
a second); a wedged engine never answers."""

Factory = Callable[..., Any]


async def _refused(client: TestClient[Any, Any], field: str, **body: Any) -> None:
    """`/generate` with `body` is a 400 whose message names `field` (in either of SGLang's envelopes)."""
    async with asyncio.timeout(WAIT_S):
        status, answer = await _generate(client, **body)
    assert status == 400, answer
    assert field in answer.get("error", answer)["message"]


async def _grpc_refused(
    stub: pb_grpc.SglangSchedulerStub,
    field: str,
    code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT,
    **fields: Any,
) -> None:
    request = pb.GenerateRequest(
        request_id=fields.pop("request_id", "g"),
        tokenized=pb.TokenizedInput(input_ids=fields.pop("input_ids", [1, 2])),
        **fields,
    )
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        async for _ in stub.Generate(request, timeout=WAIT_S):
            pass
    assert refused.value.code() == code
    assert field in (refused.value.details() or "")


async def _generate(client: TestClient[Any, Any], **body: Any) -> tuple[int, Any]:
    response = await client.post("/generate", json=body)
    return response.status, json.loads(await response.text())


async def _served(client: TestClient[Any, Any]) -> None:
    async with asyncio.timeout(SERVED_S):
        status, body = await _generate(client, input_ids=[1, 2], sampling_params={"max_new_tokens": 1})
    assert status == 200, body
    assert len(body["output_ids"]) == 1


# ------------------------------------------------------------------------------------------------ pause
async def test_pause_and_continue_at_the_same_moment_never_wedge_the_engine(make_client: Factory) -> None:
    client, server = await make_client()
    assert isinstance(server, BuiltinServer)
    modes = ("in_place", "retract", "abort")
    for round_index in range(60):
        mode = modes[round_index % len(modes)]
        pause = client.post("/pause_generation", json={"mode": mode})
        resume = client.post("/continue_generation", json={})
        # Both orders of arrival, alternately.
        first, second = (pause, resume) if round_index % 2 == 0 else (resume, pause)
        async with asyncio.timeout(WAIT_S):
            answers = await asyncio.gather(first, second)
        assert [a.status for a in answers] == [200, 200]
        # The gate and the scheduler agree: both paused or both running.
        gate_paused = server.gate.paused is not None
        scheduler_paused = await asyncio.to_thread(
            server.engine.call, lambda: server.engine.paused is not None
        )
        assert gate_paused == scheduler_paused, f"round {round_index}: gate paused {gate_paused}"
        assert (await client.get("/health")).status == 200
        ready = (await client.get("/ready")).status
        assert ready == (503 if gate_paused else 200)
        if ready == 200:
            await _served(client)
    assert (await client.post("/continue_generation", json={})).status == 200
    await _served(client)


async def test_health_and_ready_refuse_a_scheduler_paused_under_an_open_gate(make_client: Factory) -> None:
    client, server = await make_client()
    assert (await client.get("/health")).status == 200
    assert (await client.get("/ready")).status == 200
    # The state a pause and a continue used to leave when they crossed: the gate open, the scheduler paused.
    await asyncio.to_thread(server.engine.call, lambda: server.engine.pause("in_place"))
    assert server.gate.paused is None
    assert (await client.get("/health")).status == 503
    assert (await client.get("/ready")).status == 503
    assert (await client.post("/continue_generation", json={})).status == 200
    assert (await client.get("/health")).status == 200
    assert (await client.get("/ready")).status == 200
    await _served(client)


# ---------------------------------------------------------------------------------------------- bounds
async def test_a_body_above_the_configured_maximum_is_refused_before_it_is_read(
    make_served: Callable[..., Any],
) -> None:
    served = await make_served(max_request_body_bytes=4096)
    client, stub = served.client, served.stub
    await _refused(
        client, "--max-request-body-bytes", text="a " * 4096, sampling_params={"max_new_tokens": 1}
    )

    async def chunks() -> AsyncIterable[bytes]:  # no Content-Length: refused once the chunks pass the bound
        yield b'{"text": "'
        for _ in range(8):
            yield b"a " * 512
        yield b'"}'

    response = await client.post("/generate", data=chunks(), headers={"Content-Type": "application/json"})
    assert response.status == 400
    assert "--max-request-body-bytes" in json.loads(await response.text())["message"]
    # The weight update route carries whole buckets of tensors: the bound does not apply to it.
    response = await client.post(
        "/update_weights_from_tensor", json={"serialized_named_tensors": ["x" * 8192]}
    )
    assert "--max-request-body-bytes" not in await response.text()
    await _grpc_refused(stub, "", grpc.StatusCode.RESOURCE_EXHAUSTED, input_ids=[1] * 4096)
    await _served(client)


async def test_top_logprobs_over_the_prompt_are_bounded_by_the_response_they_imply(
    make_served: Callable[..., Any],
) -> None:
    served = await make_served()
    client, server, stub = served.client, served.server, served.stub
    vocab = server.engine.model.config.vocab_size
    prompt = [1] * (MAX_TOP_LOGPROB_ENTRIES // vocab + 1)
    request: dict[str, Any] = {"return_logprob": True, "top_logprobs_num": vocab, "logprob_start_len": 0}
    await _refused(
        client, "top_logprobs_num", input_ids=prompt, sampling_params={"max_new_tokens": 1}, **request
    )
    await _grpc_refused(
        stub,
        "top_logprobs_num",
        input_ids=prompt,
        sampling_params=pb.SamplingParams(max_new_tokens=1),
        **request,
    )
    # The same from the last prompt position fits.
    status, body = await _generate(
        client,
        input_ids=prompt,
        sampling_params={"max_new_tokens": 1},
        **(request | {"logprob_start_len": -1}),
    )
    assert status == 200
    assert len(body["meta_info"]["output_top_logprobs"][0]) == vocab


async def test_stop_strings_are_bounded_in_count_and_length(make_served: Callable[..., Any]) -> None:
    served = await make_served()
    client, stub = served.client, served.stub
    many = [f"stop{i}" for i in range(MAX_STOP_STRINGS + 1)]
    long = ["s" * (MAX_STOP_STRING_CHARS + 1)]
    for stop in (many, long):
        await _refused(client, "sampling_params.stop", input_ids=[1, 2], sampling_params={"stop": stop})
        await _grpc_refused(stub, "sampling_params.stop", sampling_params=pb.SamplingParams(stop=stop))
    status, _ = await _generate(
        client,
        input_ids=[1, 2],
        sampling_params={
            "max_new_tokens": 1,
            "stop": [*many[: MAX_STOP_STRINGS - 1], "s" * MAX_STOP_STRING_CHARS],
        },
    )
    assert status == 200


async def test_the_weight_version_is_bounded(make_client: Factory) -> None:
    client, _ = await make_client()
    response = await client.post(
        "/update_weight_version", json={"new_version": "v" * (MAX_WEIGHT_VERSION_CHARS + 1)}
    )
    assert response.status == 400
    body = json.loads(await response.text())
    assert body["success"] is False
    assert "new_version" in body["message"]
    assert json.loads(await (await client.get("/model_info")).text())["weight_version"] == "default"
    response = await client.post(
        "/update_weight_version", json={"new_version": "v" * MAX_WEIGHT_VERSION_CHARS}
    )
    assert response.status == 200
    status, body = await _generate(client, input_ids=[1, 2], sampling_params={"max_new_tokens": 1})
    assert status == 200
    assert body["meta_info"]["weight_version"] == "v" * MAX_WEIGHT_VERSION_CHARS


# ------------------------------------------------------------------------------------------ no valid token
async def test_a_request_that_can_draw_no_token_is_refused(make_served: Callable[..., Any]) -> None:
    served = await make_served()
    client, server, stub = served.client, served.server, served.stub
    every_id = list(range(server.engine.model.config.vocab_size))
    params: dict[str, Any] = {"stop_token_ids": every_id, "min_new_tokens": 4, "max_new_tokens": 8}
    await _refused(client, "stop_token_ids", input_ids=[1, 2], return_logprob=True, sampling_params=params)
    await _grpc_refused(
        stub, "stop_token_ids", return_logprob=True, sampling_params=pb.SamplingParams(**params)
    )
    # Without min_new_tokens the first token stops the request: a valid request.
    status, body = await _generate(client, input_ids=[1, 2], sampling_params=params | {"min_new_tokens": 0})
    assert status == 200
    assert body["meta_info"]["finish_reason"]["type"] == "stop"


# ---------------------------------------------------------------------------------------------- off the loop
class _Blocker:
    """Holds a worker in `block` until released (or `HOLD_S` passed), recording when it entered and left."""

    HOLD_S = 5.0

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.left = threading.Event()

    def block(self) -> None:
        self.entered.set()
        self.release.wait(self.HOLD_S)
        self.left.set()


class _SlowTokenizer:
    def __init__(self, tokenizer: Any, blocker: _Blocker) -> None:
        self.tokenizer, self.blocker = tokenizer, blocker

    def encode(self, text: str) -> list[int]:
        self.blocker.block()
        return list(self.tokenizer.encode(text))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens))


async def _health_answers_during(
    client: TestClient[Any, Any], blocker: _Blocker, call: Awaitable[Any]
) -> None:
    """`/health` answers 200 while `call` is held in `blocker` (the event loop is free), then `call` ends."""
    task = asyncio.ensure_future(call)
    async with asyncio.timeout(WAIT_S):
        while not blocker.entered.is_set():  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    async with asyncio.timeout(WAIT_S):
        status = (await client.get("/health")).status
    answered_while_held = not blocker.left.is_set()
    blocker.release.set()
    await asyncio.wait_for(task, WAIT_S)
    assert status == 200
    assert answered_while_held, "/health waited for the held work: it ran on the event loop"


async def test_tokenisation_runs_off_the_event_loop(make_client: Factory) -> None:
    client, server = await make_client()
    blocker = _Blocker()
    server.generation.tokenizer = _SlowTokenizer(server.generation.tokenizer, blocker)

    async def call() -> None:
        status, body = await _generate(client, text="hello", sampling_params={"max_new_tokens": 1})
        assert status == 200, body

    await _health_answers_during(client, blocker, call())


async def test_stop_patterns_compile_off_the_event_loop(
    make_served: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    served = await make_served()
    client, stub = served.client, served.stub
    blockers: list[_Blocker] = []

    def compile_slowly(pattern: str) -> re.Pattern[str]:
        if "held" in pattern and blockers:
            blockers[-1].block()
        return re.compile(pattern)

    monkeypatch.setattr(options_module, "re", SimpleNamespace(compile=compile_slowly, escape=re.escape))

    async def http_call() -> None:
        status, body = await _generate(
            client, input_ids=[1, 2], sampling_params={"max_new_tokens": 1, "stop": ["held"]}
        )
        assert status == 200, body

    async def grpc_call() -> None:
        request = pb.GenerateRequest(
            request_id="held",
            tokenized=pb.TokenizedInput(input_ids=[1, 2]),
            sampling_params=pb.SamplingParams(max_new_tokens=1, stop=["held"]),
        )
        async for _ in stub.Generate(request, timeout=WAIT_S):
            pass

    for call in (http_call, grpc_call):
        blockers.append(_Blocker())
        await _health_answers_during(client, blockers[-1], call())
