"""The call sequence of a weight sync in each pause mode, across several engines, and what happens on failure.

The engines here are recording HTTP transports (the behaviour of a real engine is covered by the contract
tests); these tests pin the orchestration: which calls, in which order, with which flags.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load

from asyncrl_core.errors import EngineControlError, EngineUnavailableError
from asyncrl_core.types import SamplingParams
from asyncrl_sglang.client import RetryPolicy, SGLangClient, serialize_named_tensors
from asyncrl_sglang.pool import EnginePool
from asyncrl_sglang.weight_sync import SyncMode, TensorTransport, sync_weights

Call = tuple[int, str, Any]
Reply = Callable[[int, str, Any], httpx.Response | None]


def make_pool(num_engines: int, calls: list[Call], reply: Reply | None = None) -> EnginePool:
    def handler_for(index: int) -> Callable[[httpx.Request], httpx.Response]:
        def handler(request: httpx.Request) -> httpx.Response:
            body = json.loads(request.content) if request.content else None
            calls.append((index, request.url.path, body))
            custom = reply(index, request.url.path, body) if reply else None
            if custom is not None:
                return custom
            return httpx.Response(200, json={"success": True, "message": "ok", "status": "ok"})

        return handler

    return EnginePool(
        [
            SGLangClient(
                f"http://engine{index}",
                transport=httpx.MockTransport(handler_for(index)),
                retry=RetryPolicy(max_attempts=1),
            )
            for index in range(num_engines)
        ]
    )


BUCKETS = [[("a", torch.ones(2)), ("b", torch.zeros(3))], [("c", torch.full((4,), 2.0))]]


def per_engine(calls: list[Call], engine: int) -> list[tuple[str, Any]]:
    return [(path, body) for index, path, body in calls if index == engine]


def summary(path: str, body: Any) -> tuple[str, ...]:
    if path == "/pause_generation":
        return (path, body["mode"])
    if path == "/update_weights_from_tensor":
        names = sorted(load(base64.b64decode(body["serialized_named_tensors"][0])))
        return (path, ",".join(names), str(body["flush_cache"]), str(body.get("weight_version")))
    return (path,)


@pytest.mark.parametrize("mode", ["retract", "in_place"])
async def test_pausing_modes_update_without_flush_and_always_continue(mode: SyncMode) -> None:
    calls: list[Call] = []
    async with make_pool(2, calls) as pool:
        result = await sync_weights(pool, iter(BUCKETS), 5, mode=mode, transport=TensorTransport())
    for engine in (0, 1):
        assert [summary(path, body) for path, body in per_engine(calls, engine)] == [
            ("/pause_generation", mode),
            ("/metrics",),
            ("/begin_weight_update",),
            ("/update_weights_from_tensor", "a,b", "False", "None"),
            ("/update_weights_from_tensor", "c", "False", "5"),
            ("/end_weight_update",),
            ("/continue_generation",),
        ]
    assert result.num_buckets == 2
    assert result.num_bytes == 4 * (2 + 3 + 4)
    assert result.version == 5
    assert set(result.metrics()) == {"time/sync_weights", "rollout/sync_paused_requests"}


def _prometheus(running: int, queued: int) -> httpx.Response:
    label = '{model_name="m",engine_type="unified"}'
    text = (
        "# TYPE sglang:num_running_reqs gauge\n"
        f"sglang:num_running_reqs{label} {running}\n"
        "# TYPE sglang:num_queue_reqs gauge\n"
        f"sglang:num_queue_reqs{label} {queued}\n"
    )
    return httpx.Response(200, text=text, headers={"content-type": "text/plain; version=0.0.4"})


@pytest.mark.parametrize("mode", ["retract", "in_place"])
async def test_paused_requests_are_the_engines_own_count(mode: SyncMode) -> None:
    # The runner syncs through a pool of its own, with nothing in flight through it: the requests the sync
    # paused are those the engines hold once paused, running (frozen) or queued (retracted), of every client.
    held = {0: (3, 2), 1: (1, 0)}

    def reply(index: int, path: str, body: Any) -> httpx.Response | None:
        return _prometheus(*held[index]) if path == "/metrics" else None

    calls: list[Call] = []
    async with make_pool(2, calls, reply) as pool:
        assert pool.num_inflight == 0
        result = await sync_weights(pool, iter(BUCKETS), 2, mode=mode, transport=TensorTransport())
    assert result.num_paused_requests == 6
    assert result.metrics()["rollout/sync_paused_requests"] == 6.0


async def test_paused_requests_fall_back_to_the_pool_without_engine_metrics() -> None:
    def reply(index: int, path: str, body: Any) -> httpx.Response | None:
        return httpx.Response(404, json={"detail": "Not Found"}) if path == "/metrics" else None

    calls: list[Call] = []
    async with make_pool(1, calls, reply) as pool:
        result = await sync_weights(pool, iter(BUCKETS), 2, mode="retract", transport=TensorTransport())
    assert result.num_paused_requests == 0
    assert [path for _, path, _ in calls][-1] == "/continue_generation"


async def test_drain_closes_admission_and_flushes_with_the_last_bucket() -> None:
    calls: list[Call] = []
    admission_during_update: list[bool] = []
    pool_box: list[EnginePool] = []

    def reply(index: int, path: str, body: Any) -> httpx.Response | None:
        if path == "/update_weights_from_tensor":
            admission_during_update.append(pool_box[0].admission_open)
        return None

    async with make_pool(1, calls, reply) as pool:
        pool_box.append(pool)
        await sync_weights(pool, BUCKETS, 9, mode="drain", transport=TensorTransport())
        assert pool.admission_open
    assert [summary(path, body) for path, body in per_engine(calls, 0)] == [
        ("/begin_weight_update",),
        ("/update_weights_from_tensor", "a,b", "False", "None"),
        ("/update_weights_from_tensor", "c", "True", "9"),
        ("/end_weight_update",),
    ]
    assert admission_during_update == [False, False]


async def test_drain_waits_for_in_flight_requests_and_holds_new_ones() -> None:
    release = asyncio.Event()
    order: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/generate":
            body = json.loads(request.content)
            order.append(f"generate {body['rid']}")
            if body["rid"] == "first":
                await release.wait()
            return httpx.Response(200, json=generation_reply(body["rid"]))
        order.append(request.url.path)
        return httpx.Response(200, json={"success": True, "message": "ok"})

    async with EnginePool([SGLangClient("http://e", transport=httpx.MockTransport(handler))]) as pool:
        first = asyncio.create_task(pool.generate([1], SamplingParams(), rid="first"))
        await asyncio.sleep(0.01)
        sync = asyncio.create_task(sync_weights(pool, BUCKETS, 2, mode="drain", transport=TensorTransport()))
        await asyncio.sleep(0.01)
        held = asyncio.create_task(pool.generate([1], SamplingParams(), rid="held"))
        await asyncio.sleep(0.05)
        assert not sync.done()
        assert order == ["generate first"]
        release.set()
        result = await sync
        await asyncio.gather(first, held)
    assert result.num_paused_requests == 1
    assert order == [
        "generate first",
        "/begin_weight_update",
        "/update_weights_from_tensor",
        "/update_weights_from_tensor",
        "/end_weight_update",
        "generate held",
    ]


def generation_reply(rid: str) -> dict[str, Any]:
    return {
        "text": "",
        "output_ids": [3],
        "meta_info": {
            "id": rid,
            "finish_reason": {"type": "length", "length": 1},
            "weight_version": "1",
            "output_token_logprobs": [[-0.1, 3, None]],
        },
    }


async def test_drain_timeout_reopens_admission_and_updates_nothing() -> None:
    calls: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if request.url.path == "/generate":
            await asyncio.Event().wait()
        return httpx.Response(200, json={"success": True, "message": "ok"})

    async with EnginePool([SGLangClient("http://e", transport=httpx.MockTransport(handler))]) as pool:
        stuck = asyncio.create_task(pool.generate([1], SamplingParams()))
        await asyncio.sleep(0.01)
        with pytest.raises(EngineUnavailableError, match="1 requests were still in flight"):
            await sync_weights(
                pool, BUCKETS, 2, mode="drain", transport=TensorTransport(), drain_timeout_s=0.05
            )
        assert pool.admission_open
        stuck.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stuck
    assert "/update_weights_from_tensor" not in calls


async def test_an_engine_that_fails_a_bucket_is_left_paused_and_the_others_finish() -> None:
    # Engine 1 fails the first bucket: it holds weights of no version (a failed load may have applied
    # part), so it must not generate; the others take the second bucket with the version and go on.
    calls: list[Call] = []

    def reply(index: int, path: str, body: Any) -> httpx.Response | None:
        if index == 1 and path == "/update_weights_from_tensor" and body.get("weight_version") is None:
            return httpx.Response(400, json={"success": False, "message": "shape mismatch for a"})
        return None

    async with make_pool(3, calls, reply) as pool:
        with pytest.raises(EngineControlError) as failed:
            await sync_weights(pool, BUCKETS, 4, mode="retract", transport=TensorTransport())
    assert re.search(r"engine 1 \(http://engine1\).*shape mismatch for a", str(failed.value))
    assert re.search(r"Left paused.*: engine 1 \(http://engine1\); ", str(failed.value))
    for engine in (0, 2):
        assert [summary(path, body) for path, body in per_engine(calls, engine)] == [
            ("/pause_generation", "retract"),
            ("/metrics",),
            ("/begin_weight_update",),
            ("/update_weights_from_tensor", "a,b", "False", "None"),
            ("/update_weights_from_tensor", "c", "False", "4"),
            ("/end_weight_update",),
            ("/continue_generation",),
        ]
    assert [summary(path, body) for path, body in per_engine(calls, 1)] == [
        ("/pause_generation", "retract"),
        ("/metrics",),
        ("/begin_weight_update",),
        ("/update_weights_from_tensor", "a,b", "False", "None"),
        ("/end_weight_update",),
    ]


async def test_an_export_that_fails_midway_leaves_every_engine_paused() -> None:
    # Every engine took the first bucket and none the rest: none holds the weights its label names.
    calls: list[Call] = []

    def export() -> Iterator[list[tuple[str, torch.Tensor]]]:
        yield BUCKETS[0]
        yield BUCKETS[1]
        raise RuntimeError("the actor's export failed")

    async with make_pool(2, calls) as pool:
        with pytest.raises(RuntimeError, match="export failed") as failed:
            await sync_weights(pool, export(), 4, mode="in_place", transport=TensorTransport())
    assert "Left paused" in "\n".join(failed.value.__notes__)
    assert "/continue_generation" not in [path for _, path, _ in calls]
    assert [path for _, path, _ in calls].count("/end_weight_update") == 2


async def test_in_drain_mode_an_engine_that_fails_is_paused() -> None:
    calls: list[Call] = []

    def reply(index: int, path: str, body: Any) -> httpx.Response | None:
        if index == 0 and path == "/update_weights_from_tensor" and body.get("weight_version") == "4":
            return httpx.Response(400, json={"success": False, "message": "out of memory"})
        return None

    async with make_pool(2, calls, reply) as pool:
        with pytest.raises(EngineControlError, match="out of memory"):
            await sync_weights(pool, BUCKETS, 4, mode="drain", transport=TensorTransport())
        assert pool.admission_open
    assert [summary(path, body) for path, body in per_engine(calls, 0)][-2:] == [
        ("/end_weight_update",),
        ("/pause_generation", "retract"),
    ]
    assert "/pause_generation" not in [path for path, _ in per_engine(calls, 1)]


async def test_a_failed_pause_still_continues_every_engine() -> None:
    calls: list[Call] = []

    def reply(index: int, path: str, body: Any) -> httpx.Response | None:
        if index == 0 and path == "/pause_generation":
            return httpx.Response(400, json={"object": "error", "message": "bad mode"})
        return None

    async with make_pool(2, calls, reply) as pool:
        with pytest.raises(EngineControlError, match="pause"):
            await sync_weights(pool, BUCKETS, 4, mode="in_place", transport=TensorTransport())
    assert [path for _, path, _ in calls if path != "/pause_generation"] == ["/continue_generation"] * 2


async def test_servers_without_sessions_get_no_end_and_empty_exports_relabel() -> None:
    calls: list[Call] = []

    def reply(index: int, path: str, body: Any) -> httpx.Response | None:
        if path == "/begin_weight_update":
            return httpx.Response(404, json={"detail": "Not Found"})
        return None

    async with make_pool(1, calls, reply) as pool:
        result = await sync_weights(pool, [], 8, mode="retract", transport=TensorTransport())
    assert result.num_buckets == 0
    assert [(path, body) for _, path, body in calls] == [
        ("/pause_generation", {"mode": "retract"}),
        ("/metrics", None),
        ("/begin_weight_update", {}),
        ("/update_weight_version", {"new_version": "8", "abort_all_requests": False}),
        ("/continue_generation", {}),
    ]


def test_payloads_copy_shared_storage_and_refuse_duplicate_names() -> None:
    shared = torch.arange(6, dtype=torch.float32)
    payload = serialize_named_tensors([("embed", shared), ("lm_head", shared), ("view", shared[:3])])
    loaded = load(base64.b64decode(payload))
    assert torch.equal(loaded["lm_head"], shared)
    assert torch.equal(loaded["view"], shared[:3])
    with pytest.raises(EngineControlError, match="twice"):
        serialize_named_tensors([("a", torch.zeros(1)), ("a", torch.ones(1))])
