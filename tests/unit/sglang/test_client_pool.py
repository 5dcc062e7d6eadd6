"""The engine pool: least-outstanding routing, sticky routing keys, pool-wide calls naming failed engines."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import httpx
import pytest

from asyncrl_core.errors import EngineControlError, EngineUnavailableError
from asyncrl_core.protocols import GenerationClient
from asyncrl_core.types import SamplingParams
from asyncrl_sglang.client import RetryPolicy, SGLangClient
from asyncrl_sglang.pool import EnginePool

GENERATION = {
    "output_ids": [1],
    "meta_info": {
        "id": "r",
        "finish_reason": {"type": "length", "length": 1},
        "weight_version": "0",
        "output_token_logprobs": [[-1.0, 1, None]],
    },
}
"""A `/generate` answer of one token."""


class Engines:
    """Recording engines whose `/generate` answers only when released."""

    def __init__(self, count: int) -> None:
        self.release = asyncio.Event()
        self.served: list[tuple[int, str]] = []
        self.pool = EnginePool(
            [
                SGLangClient(f"http://engine{index}", transport=httpx.MockTransport(self._handler(index)))
                for index in range(count)
            ]
        )

    def _handler(self, index: int) -> Callable[[httpx.Request], Awaitable[httpx.Response]]:
        async def handler(request: httpx.Request) -> httpx.Response:
            body = json.loads(request.content)
            self.served.append((index, body["rid"]))
            await self.release.wait()
            return httpx.Response(200, json=GENERATION)

        return handler

    def engine_of(self, rid: str) -> int:
        return next(index for index, served in self.served if served == rid)


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_the_pool_is_a_generation_client() -> None:
    engines = Engines(1)
    assert isinstance(engines.pool, GenerationClient)
    await engines.pool.aclose()


async def test_requests_go_to_the_least_loaded_engine() -> None:
    engines = Engines(3)
    async with engines.pool as pool:
        tasks = [asyncio.create_task(pool.generate([1], SamplingParams(), rid=f"r{i}")) for i in range(7)]
        await settle()
        assert sorted(pool.outstanding()) == [2, 2, 3]
        assert pool.num_inflight == 7
        engines.release.set()
        await asyncio.gather(*tasks)
        assert pool.outstanding() == (0, 0, 0)
        assert pool.num_inflight == 0


async def test_a_routing_key_sticks_to_its_engine() -> None:
    engines = Engines(2)
    async with engines.pool as pool:
        first = asyncio.create_task(
            pool.generate([1], SamplingParams(), rid="t-1", routing_key="trajectory-7")
        )
        await settle()
        # The sticky engine is now the busier one; the key still goes there, other requests do not.
        second = asyncio.create_task(
            pool.generate([1], SamplingParams(), rid="t-2", routing_key="trajectory-7")
        )
        other = asyncio.create_task(pool.generate([1], SamplingParams(), rid="o"))
        await settle()
        assert engines.engine_of("t-1") == engines.engine_of("t-2")
        assert engines.engine_of("o") != engines.engine_of("t-1")
        engines.release.set()
        await asyncio.gather(first, second, other)


async def test_sticky_keys_are_forgotten_least_recently_used() -> None:
    engines = Engines(2)
    engines.release.set()
    async with EnginePool(engines.pool.clients, max_sticky_keys=2) as pool:
        for key in ("a", "b", "c"):
            await pool.generate([1], SamplingParams(), routing_key=key)
        assert list(pool._sticky) == ["b", "c"]  # pyright: ignore[reportPrivateUsage]


async def test_pool_wide_calls_name_every_failed_engine() -> None:
    def handler_for(index: int) -> Callable[[httpx.Request], httpx.Response]:
        def handler(request: httpx.Request) -> httpx.Response:
            if index == 1:
                return httpx.Response(400, json={"object": "error", "message": "bad mode"})
            return httpx.Response(200, json={"status": "ok"})

        return handler

    clients = [
        SGLangClient(f"http://e{i}", transport=httpx.MockTransport(handler_for(i)), retry=RetryPolicy(1))
        for i in range(3)
    ]
    async with EnginePool(clients) as pool:
        with pytest.raises(EngineControlError, match=r"on 1 engine\(s\): engine 1 \(http://e1\).*bad mode"):
            await pool.pause("retract")


def test_an_empty_pool_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one"):
        EnginePool([])


class Outage:
    """Engines that refuse connections while `down` holds their index (as a dead process's port does)."""

    def __init__(
        self, count: int, down: set[int], recovery_timeout_s: float, reprobe_interval_s: float = 5.0
    ) -> None:
        self.down = down
        self.generated: list[tuple[int, str]] = []
        self.health_probes = 0
        self.probed = asyncio.Event()
        no_wait = RetryPolicy(max_attempts=2, initial_backoff_s=0.0, max_backoff_s=0.0)
        self.pool = EnginePool(
            [
                SGLangClient(
                    f"http://engine{index}",
                    transport=httpx.MockTransport(self._handler(index)),
                    retry=no_wait,
                )
                for index in range(count)
            ],
            recovery_timeout_s=recovery_timeout_s,
            reprobe_interval_s=reprobe_interval_s,
        )

    def _handler(self, index: int) -> Callable[[httpx.Request], Awaitable[httpx.Response]]:
        async def handler(request: httpx.Request) -> httpx.Response:
            if request.url.path == "/health":
                self.health_probes += 1
                self.probed.set()
            if index in self.down:
                raise httpx.ConnectError("connection refused", request=request)
            if request.url.path == "/health":
                return httpx.Response(200)
            self.generated.append((index, json.loads(request.content)["rid"]))
            return httpx.Response(200, json=GENERATION)

        return handler


async def test_a_dead_engines_request_goes_to_another_engine_under_its_rid() -> None:
    outage = Outage(2, down={0}, recovery_timeout_s=0.0)
    async with outage.pool as pool:
        generation = await pool.generate([1, 2], SamplingParams(), rid="r0")
        assert generation.output_ids == [1]
        assert outage.generated == [(1, "r0")]
        assert pool.down == {0}
        await pool.generate([1, 2], SamplingParams(), rid="r1")  # routed around engine 0 at once
        assert outage.generated == [(1, "r0"), (1, "r1")]


async def test_a_request_waits_for_a_restarted_engine() -> None:
    outage = Outage(1, down={0}, recovery_timeout_s=60.0)
    async with outage.pool as pool:
        request = asyncio.create_task(pool.generate([1, 2], SamplingParams(), rid="r0"))
        await asyncio.wait_for(outage.probed.wait(), 10)
        assert not request.done()
        outage.down.clear()  # the engine is back on its port
        generation = await asyncio.wait_for(request, 10)
        assert generation.output_ids == [1]
        assert outage.generated == [(0, "r0")]
        assert pool.down == frozenset()


async def test_a_request_fails_when_no_engine_comes_back_in_time() -> None:
    outage = Outage(1, down={0}, recovery_timeout_s=0.0)
    async with outage.pool as pool:
        with pytest.raises(EngineUnavailableError, match="engine0"):
            await pool.generate([1, 2], SamplingParams(), rid="r0")
        assert outage.generated == []


async def test_an_engine_back_on_its_port_rejoins_routing_while_others_are_up() -> None:
    outage = Outage(2, down={0}, recovery_timeout_s=0.0, reprobe_interval_s=0.0)
    async with outage.pool as pool:
        await pool.generate([1, 2], SamplingParams(), rid="r0", routing_key="moved")
        assert outage.generated == [(1, "r0")]
        assert pool.down == {0}
        outage.down.clear()  # the engine is back on its port
        await pool.generate([1, 2], SamplingParams(), rid="r1")  # starts a probe of engine 0
        probes = list(pool._probes.values())  # pyright: ignore[reportPrivateUsage]
        assert len(probes) == 1
        await asyncio.wait_for(asyncio.gather(*probes), 10)
        assert pool.down == frozenset()
        await pool.generate([1, 2], SamplingParams(), rid="new")
        await pool.generate([1, 2], SamplingParams(), rid="r2", routing_key="moved")
        # New work fills the engine that came back; the key moved while it was down stays where it went.
        assert outage.generated[-2:] == [(0, "new"), (1, "r2")]


async def test_a_down_engine_is_probed_no_more_often_than_the_interval() -> None:
    outage = Outage(2, down={0}, recovery_timeout_s=0.0, reprobe_interval_s=3600.0)
    async with outage.pool as pool:
        await pool.generate([1, 2], SamplingParams(), rid="r0")
        assert outage.health_probes == 1  # the probe that found it down
        for i in range(5):
            await pool.generate([1, 2], SamplingParams(), rid=f"r{i + 1}")
        await settle()
        assert outage.health_probes == 1
        assert pool.down == {0}


def test_a_negative_reprobe_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="reprobe_interval_s must be >= 0, got -1"):
        EnginePool([SGLangClient("http://e0")], reprobe_interval_s=-1.0)
