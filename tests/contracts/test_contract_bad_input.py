"""Bad input gets a 400 with a message; the engine keeps serving and loses nothing in flight.

Each case runs while a long request is in flight on the engine: that request must still finish normally
(`length`, every token), and a fresh request must work afterwards.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import torch
from safetensors.torch import load_file
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from asyncrl_core.errors import EngineControlError, GenerationError
from asyncrl_core.types import Generation, SamplingParams
from asyncrl_sglang.client import SGLangClient, serialize_named_tensors
from asyncrl_sglang.grpc_client import GrpcSGLangClient
from asyncrl_sglang.pool import EnginePool
from asyncrl_sglang.weight_sync import TensorTransport, sync_weights

pytestmark = pytest.mark.integration

IN_FLIGHT = SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True)


async def wait_running(client: SGLangClient, count: int = 1) -> None:
    async with asyncio.timeout(60):
        while True:
            if (await client.metrics()).num_running_requests >= count:
                return
            await asyncio.sleep(0.01)


async def wait_idle(client: SGLangClient) -> None:
    async with asyncio.timeout(60):
        while True:
            if (await client.metrics()).num_running_requests == 0:
                return
            await asyncio.sleep(0.01)


@pytest.fixture
async def in_flight(client: SGLangClient) -> AsyncGenerator[asyncio.Task[Generation]]:
    """A long request running while the test sends bad input; it must finish with all its tokens."""
    task = asyncio.create_task(client.generate([11, 12, 13], IN_FLIGHT))
    await wait_running(client)
    yield task
    generation = await asyncio.wait_for(task, 120)
    assert generation.finish_reason == "length"
    assert len(generation.output_ids) == IN_FLIGHT.max_new_tokens
    after = await client.generate([1, 2], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert len(after.output_ids) == 3


def assert_schema_error(reply: httpx.Response) -> None:
    assert reply.status_code == 400
    body = reply.json()
    assert body["object"] == "error"
    assert body["code"] == 400
    assert body["message"]


@pytest.mark.usefixtures("in_flight")
@pytest.mark.parametrize(
    "path", ["/generate", "/update_weights_from_tensor", "/pause_generation", "/update_weight_version"]
)
async def test_malformed_json_is_400(http: httpx.AsyncClient, path: str) -> None:
    reply = await http.post(
        path, content=b'{"input_ids": [1, 2', headers={"content-type": "application/json"}
    )
    assert_schema_error(reply)


@pytest.mark.usefixtures("in_flight")
@pytest.mark.parametrize(
    "body",
    [
        {"input_ids": [1, 2], "sampling_params": {"max_new_token": 3}},
        {"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}},
        {"input_ids": [1, 2], "sampling_params": {"top_p": 0}},
        {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}},
        {"input_ids": []},
        {"input_ids": [1, 10**9]},
        {"input_ids": [1, -5]},
        {"input_ids": [1, 2], "return_logprob": True, "top_logprobs_num": 10**6},
        {"input_ids": [1, 2], "sampling_params": {"n": 10**6}},
        {"input_ids": [1, 2], "sampling_params": {"sampling_seed": 2**64}},
        {"input_ids": [[1, 2]] * 300, "sampling_params": {"n": 256}},
    ],
)
async def test_bad_generate_requests_are_400_with_a_message(
    http: httpx.AsyncClient, body: dict[str, Any]
) -> None:
    reply = await http.post("/generate", json=body)
    assert reply.status_code == 400, reply.text
    payload = reply.json()
    message = payload.get("message") or payload["error"]["message"]
    assert isinstance(message, str)
    assert message


@pytest.mark.usefixtures("in_flight")
async def test_unknown_sampling_key_is_named(client: SGLangClient, http: httpx.AsyncClient) -> None:
    reply = await http.post("/generate", json={"input_ids": [1], "sampling_params": {"max_new_token": 3}})
    assert "max_new_token" in reply.text
    # Unknown top-level keys are ignored, as SGLang's GenerateReqInput parser does.
    tolerated = await http.post(
        "/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 1}, "future_field": 1}
    )
    assert tolerated.status_code == 200


@pytest.mark.usefixtures("in_flight")
async def test_prompt_longer_than_the_context_is_refused(connect: Callable[[], SGLangClient]) -> None:
    async with connect() as client:
        info = await client.server_info()
        context_length = info["context_length"]
        assert isinstance(context_length, int)
        with pytest.raises(GenerationError, match="context"):
            await client.generate([1] * (context_length + 1), SamplingParams(max_new_tokens=1))
        with pytest.raises(GenerationError, match="context"):
            await client.generate([1] * 8, SamplingParams(max_new_tokens=context_length))
        with pytest.raises(GenerationError, match="top_p"):
            await client.generate([1, 2], SamplingParams(max_new_tokens=1, top_p=0.0))
        with pytest.raises(GenerationError, match="empty"):
            await client.generate([], SamplingParams(max_new_tokens=1))


@pytest.mark.usefixtures("in_flight")
@pytest.mark.parametrize(
    ("request_fields", "named"),
    [
        ({"tokenized": pb.TokenizedInput(input_ids=[])}, "input_ids"),
        ({"tokenized": pb.TokenizedInput(input_ids=[1, 10**9])}, "vocabulary"),
        # (top_p 0 and top_k 0 are proto3's unset: read as 1.0 and -1, as SGLang's servicer reads them.)
        ({"sampling_params": pb.SamplingParams(top_p=1.5, temperature=1.0)}, "top_p"),
        ({"sampling_params": pb.SamplingParams(top_p=1.0, top_k=-2)}, "top_k"),
        (
            {"sampling_params": pb.SamplingParams(top_p=1.0, top_k=-1, frequency_penalty=0.5)},
            "frequency_penalty",
        ),
        ({"sampling_params": pb.SamplingParams(top_p=1.0, top_k=-1, regex="a+")}, "regex"),
        ({"lora_id": "adapter"}, "lora_id"),
        ({"return_logprob": True, "top_logprobs_num": 10**6}, "top_logprobs_num"),
        ({"sampling_params": pb.SamplingParams(top_p=1.0, top_k=-1, max_new_tokens=1, n=10**6)}, "--max-n"),
    ],
)
async def test_bad_grpc_requests_are_invalid_argument_with_a_message(
    engine_grpc_target: str, request_fields: dict[str, Any], named: str
) -> None:
    fields: dict[str, Any] = {
        "request_id": "bad",
        "tokenized": pb.TokenizedInput(input_ids=[1, 2]),
        "sampling_params": pb.SamplingParams(top_p=1.0, top_k=-1, max_new_tokens=1),
        **request_fields,
    }
    async with grpc.aio.insecure_channel(engine_grpc_target) as channel:
        call = pb_grpc.SglangSchedulerStub(channel).Generate(pb.GenerateRequest(**fields), timeout=60)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in call:
                pass
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in (refused.value.details() or "")


@pytest.mark.usefixtures("in_flight")
async def test_a_duplicate_rid_is_refused_over_grpc(engine_url: str, engine_grpc_target: str) -> None:
    async with GrpcSGLangClient(engine_url, engine_grpc_target) as client:
        first = asyncio.create_task(client.generate([1, 2], IN_FLIGHT, rid="twice"))
        await wait_running(client, 2)
        with pytest.raises(GenerationError, match="Duplicate request ID"):
            await client.generate([1], SamplingParams(max_new_tokens=1), rid="twice")
        await client.abort("twice")
        assert (await first).finish_reason == "abort"


async def test_a_rid_in_flight_over_one_transport_is_refused_over_the_other(
    engine_url: str, engine_grpc_target: str, client: SGLangClient, http: httpx.AsyncClient
) -> None:
    async with GrpcSGLangClient(engine_url, engine_grpc_target) as grpc_client:
        over_grpc = asyncio.create_task(grpc_client.generate([1, 2], IN_FLIGHT, rid="both"))
        await wait_running(client)
        refused = await http.post(
            "/generate", json={"input_ids": [1], "rid": "both", "sampling_params": {"max_new_tokens": 1}}
        )
        assert refused.status_code == 400
        assert "Duplicate request ID detected: both" in refused.json()["error"]["message"]
        await grpc_client.abort("both")
        assert (await over_grpc).finish_reason == "abort"
        await wait_idle(client)
        over_http = asyncio.create_task(client.generate([1, 2], IN_FLIGHT, rid="again"))
        await wait_running(client)
        with pytest.raises(GenerationError, match="Duplicate request ID detected: again"):
            await grpc_client.generate([1], SamplingParams(max_new_tokens=1), rid="again")
        await client.abort("again")
        assert (await over_http).finish_reason == "abort"


@pytest.mark.usefixtures("in_flight")
@pytest.mark.parametrize(
    "named",
    [
        [("model.layers.0.self_attn.q_proj.weight", torch.zeros(3, 3))],  # wrong shape
        [("model.layers.0.self_attn.not_a_weight", torch.zeros(64))],  # unknown name
        [("model.norm.weight", torch.zeros(64, dtype=torch.int64))],  # not a float tensor
    ],
)
async def test_bad_weight_updates_are_400_and_change_nothing(
    client: SGLangClient, http: httpx.AsyncClient, named: list[tuple[str, torch.Tensor]]
) -> None:
    version = await client.weight_version()
    probe = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    before = await client.generate([3, 1, 4], probe)
    reply = await http.post(
        "/update_weights_from_tensor",
        json={
            "serialized_named_tensors": [serialize_named_tensors(named)],
            "load_format": "safetensors",
            "flush_cache": False,
            "weight_version": str(version + 100),
        },
    )
    assert reply.status_code == 400
    assert reply.json()["success"] is False
    assert named[0][0] in reply.json()["message"]
    assert await client.weight_version() == version
    assert (await client.generate([3, 1, 4], probe)).output_ids == before.output_ids


@pytest.mark.usefixtures("in_flight")
async def test_undecodable_payload_is_400(http: httpx.AsyncClient) -> None:
    for payload in ("not base64 at all!", "aGVsbG8="):
        reply = await http.post(
            "/update_weights_from_tensor",
            json={"serialized_named_tensors": [payload], "load_format": "safetensors"},
        )
        assert reply.status_code == 400
        assert reply.json()["success"] is False


async def test_a_failed_sync_leaves_the_engine_paused_and_names_it_until_a_whole_sync(
    engine_url: str, tiny_llama_path: Path
) -> None:
    """A bucket the engine refuses, mid-sync in retract mode, after it took the first: the error names the
    engine and the engine stays paused (it holds part of the new weights under the old label), the version is
    unchanged; a whole sync afterwards continues it, and the paused request finishes under the new version."""
    weights = load_file(str(tiny_llama_path / "model.safetensors"))
    good = [(name, tensor) for name, tensor in sorted(weights.items()) if name != "model.embed_tokens.weight"]
    bad = [("model.norm.weight", torch.zeros(5))]
    async with EnginePool([SGLangClient(engine_url)]) as pool:
        client = pool.clients[0]
        version = await client.weight_version()
        task = asyncio.create_task(pool.generate([11, 12, 13], IN_FLIGHT))
        await wait_running(client)
        with pytest.raises(EngineControlError, match=engine_url) as failure:
            await sync_weights(pool, [good, bad], version + 1, mode="retract", transport=TensorTransport())
        assert "model.norm.weight" in str(failure.value)
        assert await client.weight_version() == version
        assert not task.done()  # paused: the request waits for the engine to be continued
        await sync_weights(pool, [good], version + 1, mode="retract", transport=TensorTransport())
        generation = await asyncio.wait_for(task, 120)
        assert generation.finish_reason == "length"
        assert len(generation.output_ids) == IN_FLIGHT.max_new_tokens
        assert await client.weight_version() == version + 1
        assert (await client.generate([1], SamplingParams(max_new_tokens=2, ignore_eos=True))).output_ids
