"""The client against the built-in engine, route by route: every example of section 10 of the SGLang contract
(`sglang-contract.md`) and what sections 1-9 imply. Raw HTTP checks the shapes; the client checks that it
reads them."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file

from asyncrl_core.errors import EngineControlError, GenerationError
from asyncrl_core.types import SamplingParams
from asyncrl_sglang.client import SGLangClient, serialize_named_tensors
from asyncrl_sglang.grpc_client import GrpcSGLangClient
from asyncrl_sglang.launcher import builtin_command, pick_ports, start_engines

pytestmark = pytest.mark.integration

LONG = {"max_new_tokens": 1500, "ignore_eos": True, "temperature": 0.0}


async def eventually(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 60.0) -> None:
    """Poll `check` until it is true; fail naming `what` after `timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        if await check():
            return
        await asyncio.sleep(0.01)
    pytest.fail(f"not {what} after {timeout_s:.0f} s")


async def generated_tokens(client: SGLangClient) -> float:
    return (await client.metrics()).values.get("sglang:generation_tokens_total", 0.0)


async def wait_running(client: SGLangClient, count: int) -> None:
    async def running() -> bool:
        return (await client.metrics()).num_running_requests >= count

    await eventually(running, f"{count} requests running")


def model_weights(model_path: Path) -> list[tuple[str, torch.Tensor]]:
    return sorted(load_file(str(model_path / "model.safetensors")).items())


# ---------------------------------------------------------------------------------------------- 1. readiness


async def test_1_readiness_and_model_info(engine_url: str, plain_engine_url: str) -> None:
    async with httpx.AsyncClient(base_url=engine_url, trust_env=False) as http:
        health = await http.get("/health")
        assert health.status_code == 200
        assert health.content == b""
        info = (await http.get("/model_info")).json()
        assert info["is_generation"] is True
        assert isinstance(info["weight_version"], str)
        alias = await http.get("/get_model_info")
        assert alias.status_code == 200
        assert alias.json()["is_generation"] is True
    async with SGLangClient(plain_engine_url) as plain:
        # SGLang's launch label reads as asyncrl's initial version.
        assert (await plain.model_info())["weight_version"] == "default"
        assert await plain.weight_version() == 0
        assert await plain.health()
        assert await plain.health_generate()


# ---------------------------------------------------------------------------------------------- 2-3. generate


async def test_2_basic_generate(http: httpx.AsyncClient) -> None:
    reply = await http.post(
        "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}
    )
    assert reply.status_code == 200
    body = reply.json()
    meta = body["meta_info"]
    assert isinstance(body["text"], str)
    assert len(body["output_ids"]) == 5
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["completion_tokens"] == 5
    assert isinstance(meta["prompt_tokens"], int)
    assert meta["prompt_tokens"] > 0
    assert isinstance(meta["id"], str)
    assert isinstance(meta["weight_version"], str)
    assert isinstance(meta["cached_tokens"], int)
    put = await http.put("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})
    assert put.status_code == 200


async def test_3_logprobs(http: httpx.AsyncClient, client: SGLangClient) -> None:
    request: dict[str, Any] = {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": 5, "ignore_eos": True},
        "return_logprob": True,
        "top_logprobs_num": 2,
    }
    body = (await http.post("/generate", json=request)).json()
    meta = body["meta_info"]
    assert len(meta["output_token_logprobs"]) == 5
    for item, token_id in zip(meta["output_token_logprobs"], body["output_ids"], strict=True):
        assert isinstance(item[0], float)
        assert item[1] == token_id
        assert item[2] is None
    assert len(meta["output_top_logprobs"]) == 5
    assert all(len(position) == 2 for position in meta["output_top_logprobs"])
    with_text = (await http.post("/generate", json={**request, "return_text_in_logprobs": True})).json()
    assert all(isinstance(item[2], str) for item in with_text["meta_info"]["output_token_logprobs"])
    # The client reads the same request into a Generation whose logprobs match the server's, token by token.
    generation = await client.generate(
        [1, 2, 3], SamplingParams(max_new_tokens=5, ignore_eos=True, temperature=0)
    )
    greedy = (
        await http.post(
            "/generate",
            json={**request, "sampling_params": {"max_new_tokens": 5, "ignore_eos": True, "temperature": 0}},
        )
    ).json()
    assert generation.output_ids == greedy["output_ids"]
    assert generation.logprobs == pytest.approx(
        [item[0] for item in greedy["meta_info"]["output_token_logprobs"]]
    )
    assert generation.finish_reason == "length"
    assert generation.prompt_tokens == 3
    assert len(generation.version_spans) == 1


# ---------------------------------------------------------------------------------------------- 4-6


async def test_4_rid_echo_and_duplicate(http: httpx.AsyncClient, client: SGLangClient) -> None:
    echoed = await http.post(
        "/generate", json={"input_ids": [1], "rid": "r1", "sampling_params": {"max_new_tokens": 1}}
    )
    assert echoed.json()["meta_info"]["id"] == "r1"
    first = asyncio.create_task(
        http.post("/generate", json={"input_ids": [1, 2], "rid": "r1", "sampling_params": LONG})
    )
    await wait_running(client, 1)
    duplicate = await http.post("/generate", json={"input_ids": [1], "rid": "r1"})
    assert duplicate.status_code == 400
    assert "Duplicate request ID" in duplicate.json()["error"]["message"]
    with pytest.raises(GenerationError, match="Duplicate request ID"):
        await client.generate([1], SamplingParams(max_new_tokens=1), rid="r1")
    await client.abort("r1")
    assert (await first).json()["meta_info"]["finish_reason"]["type"] == "abort"


async def test_5_batch_and_n(http: httpx.AsyncClient) -> None:
    batch = (
        await http.post("/generate", json={"text": ["a", "b"], "sampling_params": {"max_new_tokens": 2}})
    ).json()
    assert isinstance(batch, list)
    assert len(batch) == 2
    single_a = (
        await http.post(
            "/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        )
    ).json()
    greedy_batch = (
        await http.post(
            "/generate", json={"text": ["a", "b"], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        )
    ).json()
    assert greedy_batch[0]["output_ids"] == single_a["output_ids"]  # input order is kept
    samples = (
        await http.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 2, "n": 3}})
    ).json()
    assert isinstance(samples, list)
    assert len(samples) == 3
    assert len({sample["meta_info"]["id"] for sample in samples}) == 3


async def test_6_stop_strings_and_stop_tokens(client: SGLangClient, tiny_llama_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_path))
    greedy = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    free = await client.generate([1, 2, 3, 4], greedy)
    # A stop string the greedy continuation is known to produce: the text of one of its tokens.
    pieces = [tokenizer.decode([token_id]) for token_id in free.output_ids[8:]]
    stop_text = next(piece.strip() for piece in pieces if piece.strip())
    trimmed = await client.generate(
        [1, 2, 3, 4], SamplingParams(max_new_tokens=24, temperature=0.0, stop=(stop_text,))
    )
    assert trimmed.finish_reason == "stop"
    assert trimmed.matched_stop == stop_text
    assert not trimmed.text.endswith(stop_text)
    kept = await client.generate(
        [1, 2, 3, 4], SamplingParams(max_new_tokens=24, temperature=0.0, stop=(stop_text,), no_stop_trim=True)
    )
    assert kept.text.endswith(stop_text)
    assert kept.output_ids == trimmed.output_ids
    stop_id = free.output_ids[5]
    by_token = await client.generate(
        [1, 2, 3, 4], SamplingParams(max_new_tokens=24, temperature=0.0, stop_token_ids=(stop_id,))
    )
    assert by_token.finish_reason == "stop"
    assert by_token.matched_stop == stop_id
    assert isinstance(by_token.matched_stop, int)
    assert by_token.output_ids == free.output_ids[: free.output_ids.index(stop_id) + 1]


# ---------------------------------------------------------------------------------------------- 7-9


def sse_events(text: str) -> list[str]:
    assert text.endswith("data: [DONE]\n\n")
    events = [chunk for chunk in text.split("\n\n") if chunk]
    assert all(event.startswith("data: ") for event in events)
    return [event.removeprefix("data: ") for event in events]


async def test_7_streaming_shape(http: httpx.AsyncClient) -> None:
    reply = await http.post(
        "/generate",
        json={
            "input_ids": [1, 2],
            "stream": True,
            # Enough tokens that the stream has several chunks however the server's writes coalesce on a
            # loaded machine (6 came as one chunk once).
            "sampling_params": {"max_new_tokens": 48, "ignore_eos": True},
        },
    )
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/event-stream")
    events = sse_events(reply.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert len(chunks) >= 2
    for earlier, later in itertools.pairwise(chunks):
        assert later["output_ids"][: len(earlier["output_ids"])] == earlier["output_ids"]
    for chunk in chunks[:-1]:
        assert chunk["meta_info"]["finish_reason"] is None
        assert "weight_versions" not in chunk["meta_info"]
    last = chunks[-1]["meta_info"]
    assert last["finish_reason"] == {"type": "length", "length": 48}
    assert "e2e_latency" in last
    assert "weight_versions" in last


async def test_8_validation_is_400_never_422(http: httpx.AsyncClient) -> None:
    for content in (b"{not json", json.dumps({"input_ids": "abc"}).encode()):
        reply = await http.post("/generate", content=content, headers={"content-type": "application/json"})
        assert reply.status_code == 400
        body = reply.json()
        assert body["object"] == "error"
        assert body["code"] == 400
        assert body["type"] == "Bad Request"
        assert isinstance(body["message"], str)
        assert body["param"] is None


async def test_9_semantic_errors(http: httpx.AsyncClient, client: SGLangClient) -> None:
    empty = await http.post("/generate", json={})
    assert empty.status_code == 400
    assert empty.json() == {
        "error": {"message": "Either text, input_ids or input_embeds should be provided."}
    }
    too_long = {"input_ids": [1] * 100, "sampling_params": {"max_new_tokens": 4000}}
    reply = await http.post("/generate", json=too_long)
    assert reply.status_code == 400
    assert "context length" in reply.json()["error"]["message"]
    streamed = await http.post("/generate", json={**too_long, "stream": True})
    assert streamed.status_code == 200
    events = sse_events(streamed.text)
    assert len(events) == 2
    assert "error" in json.loads(events[0])
    with pytest.raises(GenerationError, match="context length"):
        await client.generate([1] * 100, SamplingParams(max_new_tokens=4000))


# ---------------------------------------------------------------------------------------------- 10, 14


async def test_10_abort_by_rid(http: httpx.AsyncClient, client: SGLangClient) -> None:
    task = asyncio.create_task(client.generate([5, 6, 7], SamplingParams(**LONG), rid="a1"))
    await wait_running(client, 1)
    reply = await http.post("/abort_request", json={"rid": "a1"})
    assert reply.status_code == 200
    assert reply.content == b""
    aborted = await task
    assert aborted.finish_reason == "abort"
    assert len(aborted.output_ids) < LONG["max_new_tokens"]
    assert len(aborted.logprobs) == len(aborted.output_ids)
    nope = await http.post("/abort_request", json={"rid": "nope"})
    assert nope.status_code == 200
    assert (await client.generate([1], SamplingParams(max_new_tokens=2))).finish_reason == "length"


async def test_10_abort_by_rid_over_each_transport(connect: Callable[[], SGLangClient]) -> None:
    async with connect() as client:
        task = asyncio.create_task(client.generate([5, 6, 7], SamplingParams(**LONG), rid="a2"))
        await wait_running(client, 1)
        await client.abort("a2")
        aborted = await task
        assert aborted.finish_reason == "abort"
        assert 0 < len(aborted.output_ids) < LONG["max_new_tokens"]
        assert len(aborted.logprobs) == len(aborted.output_ids)
        assert aborted.versions_verified
        assert aborted.version_spans[-1].end == len(aborted.output_ids)
        await client.abort("nope")
        assert (await client.generate([1], SamplingParams(max_new_tokens=2))).finish_reason == "length"


async def test_10_abort_all(connect: Callable[[], SGLangClient]) -> None:
    async with connect() as client:
        tasks = [asyncio.create_task(client.generate([i + 1], SamplingParams(**LONG))) for i in range(3)]
        await wait_running(client, 2)
        await client.abort_all()
        results = await asyncio.gather(*tasks)
    assert {result.finish_reason for result in results} == {"abort"}
    # The one that never left the waiting queue has no prompt_tokens on the wire: the prompt length is used.
    assert [result.prompt_tokens for result in results] == [1, 1, 1]


async def test_a_cancelled_call_aborts_its_request(connect: Callable[[], SGLangClient]) -> None:
    async with connect() as client:
        task = asyncio.create_task(client.generate([8, 9], SamplingParams(**LONG)))
        await wait_running(client, 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

        async def idle() -> bool:
            return (await client.metrics()).num_running_requests == 0

        await eventually(idle, "the cancelled request aborted on the engine", timeout_s=30.0)


async def test_14_pause_body_rules(http: httpx.AsyncClient, client: SGLangClient) -> None:
    bogus = await http.post("/pause_generation", json={"mode": "bogus"})
    assert bogus.status_code == 400
    no_body = await http.post("/pause_generation")
    assert no_body.status_code == 400
    for _ in range(2):
        await client.pause("abort")
    for _ in range(2):
        await client.continue_generation()
    assert (await client.generate([1], SamplingParams(max_new_tokens=1))).output_ids


async def test_pause_abort_returns_partials_and_holds_new_requests(
    connect: Callable[[], SGLangClient], transport: str
) -> None:
    async with connect() as client:
        running = asyncio.create_task(client.generate([3, 4], SamplingParams(**LONG)))
        await wait_running(client, 1)
        await client.pause("abort")  # returns once the in-flight request has answered
        if transport == "http":
            assert running.done()
        # Over gRPC the answer and the pause's reply come on two connections: it is sent, not yet read.
        partial = await asyncio.wait_for(running, 10)
        assert partial.finish_reason == "abort"
        await _holds_new_requests(client)


async def _holds_new_requests(client: SGLangClient) -> None:
    held = asyncio.create_task(client.generate([3, 4], SamplingParams(max_new_tokens=3, ignore_eos=True)))

    async def gated() -> bool:
        return (await client.metrics()).values.get("sglang:num_paused_reqs", 0.0) >= 1

    await eventually(gated, "the new request held at the pause gate")
    assert not held.done()
    await client.continue_generation()
    assert len((await held).output_ids) == 3


# ---------------------------------------------------------------------------------------------- 19-21


async def test_19_tensor_update_while_paused(
    engine_url: str, tiny_llama_path: Path, http: httpx.AsyncClient, client: SGLangClient
) -> None:
    # Every tensor but the 12.6 MB embedding (the whole model in one body is the next test).
    weights = [
        (name, tensor) for name, tensor in model_weights(tiny_llama_path) if "embed_tokens" not in name
    ]
    await client.pause("abort")
    try:
        session = await client.begin_weight_update()
        message = await client.update_weights_from_tensor(
            serialize_named_tensors(weights), weight_version=5, flush_cache=True
        )
        assert message.endswith("Weight version updated to 5.")
        if session:
            await client.end_weight_update()
        assert (await client.model_info())["weight_version"] == "5"
        assert await client.weight_version() == 5
        # /server_info keeps the launch value.
        assert (await client.server_info())["weight_version"] == "0"
        forced = await http.post(
            "/update_weights_from_tensor",
            json={
                "serialized_named_tensors": [
                    serialize_named_tensors([("model.no_such.weight", torch.zeros(2))])
                ],
                "load_format": "safetensors",
                "weight_version": "6",
            },
        )
        assert forced.status_code == 400
        assert forced.json()["success"] is False
        assert isinstance(forced.json()["message"], str)
        assert await client.weight_version() == 5
    finally:
        await client.continue_generation()


async def test_19_a_whole_model_fits_in_one_tensor_update(
    tiny_llama_path: Path, client: SGLangClient
) -> None:
    """A whole model in one bucket (about 13 MB of safetensors for the tiny Llama, 17 MB as base64): SGLang
    takes request bodies of any size on this route; a server that caps them cannot take a real model."""
    weights = model_weights(tiny_llama_path)
    version = await client.weight_version() + 1
    await client.pause("abort")
    try:
        message = await client.update_weights_from_tensor(
            serialize_named_tensors(weights), weight_version=version, flush_cache=True
        )
    finally:
        await client.continue_generation()
    assert message.endswith(f"Weight version updated to {version}.")


async def test_update_weight_version_relabels_without_aborting(client: SGLangClient) -> None:
    task = asyncio.create_task(
        client.generate([9, 9], SamplingParams(max_new_tokens=300, ignore_eos=True, temperature=0))
    )
    await wait_running(client, 1)
    current = await client.weight_version()
    await client.update_weight_version(current + 1)
    generation = await task
    assert generation.finish_reason == "length"
    assert generation.versions_verified
    assert generation.version_spans[-1].version == current + 1
    assert await client.weight_version() == current + 1


async def test_20_distributed_update_without_names_is_400(http: httpx.AsyncClient) -> None:
    missing = await http.post(
        "/update_weights_from_distributed", json={"dtypes": ["float32"], "shapes": [[2]]}
    )
    assert missing.status_code == 400
    assert missing.json()["object"] == "error"


async def test_20_distributed_group_lifecycle(
    engine_url: str, tiny_llama_path: Path, client: SGLangClient
) -> None:
    """The trainer joins as rank 0 the way SGLang's engines and every SGLang trainer do: a `tcp://`
    rendezvous store namespaced by the group name (`PrefixStore(group_name)`), a separate communicator. An
    engine that joins through `init_process_group`'s default-group store layout (`default_pg/...`) never
    meets such a trainer: both sides wait for keys the other never writes."""
    from asyncrl_sglang.pool import EnginePool
    from asyncrl_sglang.weight_sync import DistributedTransport

    weights = model_weights(tiny_llama_path)
    pool = EnginePool([SGLangClient(engine_url)])
    transport = DistributedTransport(master_address="127.0.0.1", backend="gloo", device="cpu", timeout_s=60.0)
    try:
        await transport.connect(pool)
        await client.pause("abort")
        try:
            assert await transport.push(pool, weights, weight_version=11, flush_cache=True) == {}
        finally:
            await client.continue_generation()
        assert await client.weight_version() == 11
        await transport.close(pool)
    finally:
        await pool.aclose()


async def test_21_deprecated_version_route(engine_url: str, plain_engine_url: str) -> None:
    async with httpx.AsyncClient(trust_env=False) as http:
        new = await http.get(f"{engine_url}/get_weight_version")
        assert new.status_code == 404
        assert "/model_info" in new.json()["message"]
        old = await http.get(f"{plain_engine_url}/get_weight_version")
        assert old.status_code == 200
        assert old.json() == {"weight_version": "default"}
    for url in (engine_url, plain_engine_url):
        async with SGLangClient(url) as client:
            assert isinstance(await client.weight_version(), int)


# ---------------------------------------------------------------------------------------------- 22-24


async def test_22_flush(client: SGLangClient, http: httpx.AsyncClient) -> None:
    idle = await http.post("/flush_cache")
    assert idle.status_code == 200
    assert idle.text.startswith("Cache flushed.")
    await client.flush_cache()
    task = asyncio.create_task(client.generate([2, 3], SamplingParams(**LONG)))
    await wait_running(client, 1)
    await client.pause("in_place")
    try:
        held = await http.post("/flush_cache")
        assert held.status_code == 400
        with pytest.raises(EngineControlError, match="400"):
            await client.flush_cache()
    finally:
        await client.continue_generation()
    await client.abort_all()
    assert (await task).finish_reason == "abort"


async def test_23_memory_release_and_resume(http: httpx.AsyncClient, client: SGLangClient) -> None:
    released = await http.post("/release_memory_occupation", json={})
    assert released.status_code == 200
    assert released.json() is None
    resumed = await http.post("/resume_memory_occupation", json={})
    assert resumed.status_code == 200
    assert resumed.json() is None
    await client.release_memory_occupation(["kv_cache"])
    await client.resume_memory_occupation(["kv_cache"])
    assert (
        len((await client.generate([1, 2], SamplingParams(max_new_tokens=3, ignore_eos=True))).output_ids)
        == 3
    )


async def test_24_metrics(
    engine_url: str, plain_engine_url: str, client: SGLangClient, http: httpx.AsyncClient
) -> None:
    text = (await http.get("/metrics")).text
    assert 'sglang:num_running_reqs{model_name="' in text
    assert 'sglang:num_queue_reqs{model_name="' in text
    tasks = [asyncio.create_task(client.generate([i + 1, 2], SamplingParams(**LONG))) for i in range(5)]

    async def saturated() -> bool:
        metrics = await client.metrics()
        return metrics.num_running_requests == 2 and metrics.num_queued_requests == 3

    try:
        await eventually(saturated, "2 running and 3 queued with --max-running-requests 2")
        loads = await client.loads()
        assert isinstance(loads, dict)
        assert loads["loads"][0]["num_running_reqs"] == 2
    finally:
        await client.abort_all()
        await asyncio.gather(*tasks)
    async with SGLangClient(plain_engine_url) as plain:
        with pytest.raises(EngineControlError, match="--enable-metrics"):
            await plain.metrics()


async def test_unknown_route_is_404(http: httpx.AsyncClient) -> None:
    reply = await http.get("/no_such_route")
    assert reply.status_code == 404
    assert reply.json() == {"detail": "Not Found"}


async def test_grpc_needs_the_api_key_in_call_metadata(tiny_llama_path: Path, tmp_path: Path) -> None:
    """With `--api-key`, every call but `HealthCheck` needs `authorization: Bearer KEY` (UNAUTHENTICATED
    otherwise), as every HTTP route but `/health` does; the launcher's health wait needs no key."""
    http_port, grpc_port = pick_ports("127.0.0.1", 2, None)
    command = builtin_command(
        model_path=str(tiny_llama_path),
        host="127.0.0.1",
        port=http_port,
        grpc_port=grpc_port,
        max_running_requests=2,
        api_key="sesame",
        enable_metrics=False,
        extra_args={"num_threads": 1},
    )
    with start_engines([command], log_dir=tmp_path, health_timeout_s=240.0, api_key="sesame") as launched:
        target = launched.grpc_targets[0]
        assert target is not None
        async with GrpcSGLangClient(launched.urls[0], target) as anonymous:
            with pytest.raises(GenerationError, match="UNAUTHENTICATED"):
                await anonymous.generate([1, 2], SamplingParams(max_new_tokens=1))
        async with GrpcSGLangClient(launched.urls[0], target, api_key="wrong") as wrong:
            with pytest.raises(GenerationError, match="UNAUTHENTICATED"):
                await wrong.generate([1, 2], SamplingParams(max_new_tokens=1))
        (client,) = launched.clients()
        async with client:
            assert isinstance(client, GrpcSGLangClient)
            generation = await client.generate([1, 2], SamplingParams(max_new_tokens=2, ignore_eos=True))
            assert len(generation.output_ids) == 2
            info = await client.grpc_model_info()
            assert info.weight_version == "0"
            assert info.max_context_length == info.max_req_input_len + 1
            server = await client.grpc_server_info()
            assert server.server_type == "grpc"
            assert not server.is_paused
            assert "api_key" not in server.server_args
            loads = await client.grpc_loads()
            assert loads.loads[0].max_running_requests == 2
            assert loads.loads[0].num_running_reqs == 0
