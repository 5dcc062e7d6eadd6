"""Several engine instances behind one `GenerationClient`.

Routing: a request goes to the engine with the fewest outstanding requests from this pool (ties: the lowest
index). A caller may pass a `routing_key` (for example the trajectory id): every request with that key then
goes to the engine the first one went to, so the turns of a multi-turn trajectory hit that engine's prefix
cache. Sticky keys are forgotten least-recently-used beyond `max_sticky_keys`.

Pool-wide control (pause, continue, weight updates) runs on every engine at once and reports which engines
failed. The pool also owns the client-side admission gate the `drain` pause mode needs: while it is closed,
new `generate` calls wait at the gate (their time there counts against nothing but the caller's patience),
and `wait_idle` waits for the requests already sent to finish.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from asyncrl_core.errors import EngineControlError, EngineUnavailableError
from asyncrl_core.types import Generation, SamplingParams
from asyncrl_sglang.client import PauseMode, SGLangClient

T = TypeVar("T")


class EnginePool:
    """Clients of several engines, used as one `GenerationClient`; closes the clients on `aclose`."""

    def __init__(self, clients: Sequence[SGLangClient], *, max_sticky_keys: int = 100_000) -> None:
        if not clients:
            raise ValueError("an engine pool needs at least one engine client")
        self.clients: tuple[SGLangClient, ...] = tuple(clients)
        self._outstanding = [0] * len(self.clients)
        self._sticky: OrderedDict[str, int] = OrderedDict()
        self._max_sticky_keys = max_sticky_keys
        self._admission_open = asyncio.Event()
        self._admission_open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._num_inflight = 0

    def __repr__(self) -> str:
        return f"EnginePool({[client.base_url for client in self.clients]!r})"

    async def __aenter__(self) -> EnginePool:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close every client."""
        await asyncio.gather(*(client.aclose() for client in self.clients))

    @property
    def num_inflight(self) -> int:
        """`generate` calls sent to an engine that have not returned (calls waiting at the gate excluded)."""
        return self._num_inflight

    def outstanding(self) -> tuple[int, ...]:
        """In-flight requests per engine, in client order."""
        return tuple(self._outstanding)

    # ---------------------------------------------------------------------------------------------------
    # Generation

    def _pick(self, routing_key: str | None) -> int:
        if routing_key is not None and (index := self._sticky.get(routing_key)) is not None:
            self._sticky.move_to_end(routing_key)
            return index
        index = min(range(len(self.clients)), key=lambda i: (self._outstanding[i], i))
        if routing_key is not None:
            self._sticky[routing_key] = index
            if len(self._sticky) > self._max_sticky_keys:
                self._sticky.popitem(last=False)
        return index

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        rid: str | None = None,
        routing_key: str | None = None,
    ) -> Generation:
        """`GenerationClient.generate` on the least-loaded engine (or the one `routing_key` sticks to)."""
        while not self._admission_open.is_set():
            await self._admission_open.wait()
        index = self._pick(routing_key)
        self._outstanding[index] += 1
        self._num_inflight += 1
        self._idle.clear()
        try:
            return await self.clients[index].generate(input_ids, sampling, rid=rid)
        finally:
            self._outstanding[index] -= 1
            self._num_inflight -= 1
            if self._num_inflight == 0:
                self._idle.set()

    # ---------------------------------------------------------------------------------------------------
    # Admission gate (drain)

    @property
    def admission_open(self) -> bool:
        return self._admission_open.is_set()

    def close_admission(self) -> None:
        """Hold new `generate` calls at the gate until `open_admission`."""
        self._admission_open.clear()

    def open_admission(self) -> None:
        """Let held and new `generate` calls through."""
        self._admission_open.set()

    async def wait_idle(self, timeout_s: float) -> None:
        """Wait until no request sent through the pool is in flight; `EngineUnavailableError` naming the
        number still running after `timeout_s`."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError as exc:
            raise EngineUnavailableError(
                f"{self._num_inflight} requests were still in flight after waiting {timeout_s:.0f} s "
                f"for them to finish (per engine: {self.outstanding()})"
            ) from exc

    # ---------------------------------------------------------------------------------------------------
    # Pool-wide control

    async def each(
        self,
        action: Callable[[SGLangClient], Awaitable[T]],
        what: str,
        *,
        indices: Sequence[int] | None = None,
    ) -> list[T]:
        """Run `action` on every engine (or those in `indices`) at once; results in client order.

        Every engine's call runs to its end even when another fails; then one `EngineControlError` names
        each engine that failed and why.
        """
        chosen = list(range(len(self.clients))) if indices is None else list(indices)
        results = await asyncio.gather(
            *(action(self.clients[index]) for index in chosen), return_exceptions=True
        )
        failures = [
            f"engine {index} ({self.clients[index].base_url}): {type(result).__name__}: {result}"
            for index, result in zip(chosen, results, strict=True)
            if isinstance(result, BaseException)
        ]
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, Exception):
                raise result  # cancellation or interpreter exit is not an engine failure
        if failures:
            raise EngineControlError(f"{what} failed on {len(failures)} engine(s): " + "; ".join(failures))
        return [result for result in results if not isinstance(result, BaseException)]

    async def pause(self, mode: PauseMode) -> None:
        """Pause every engine in `mode`."""
        await self.each(lambda client: client.pause(mode), f"pause({mode})")

    async def continue_generation(self) -> None:
        """Continue every engine."""
        await self.each(lambda client: client.continue_generation(), "continue_generation")

    async def weight_versions(self) -> list[int]:
        """The weight version each engine holds, in client order."""
        return await self.each(lambda client: client.weight_version(), "weight_version")
