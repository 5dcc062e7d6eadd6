"""Several engine instances behind one `GenerationClient`.

Routing: a request goes to the engine with the fewest outstanding requests from this pool (ties: the lowest
index), among those not marked down; an engine is marked down when it cannot be reached and no longer
answers `/health` (its client's `health`: over gRPC, its gRPC service must be reachable too), and its
requests go again to another engine (or wait, up to `recovery_timeout_s`, for one to answer again: a
restarted engine). While other engines are up, a down engine's `/health` is probed again
in the background at most every `reprobe_interval_s`, and it rejoins routing once it answers (the runner
restarts a dead engine on its address). A caller may pass a `routing_key` (for example the trajectory id):
every request with that key then goes to the engine the first one went to, so the turns of a multi-turn
trajectory hit that engine's prefix cache. A key whose engine went down moves to another engine and stays
there when its first engine rejoins (that is where its prefix now is); new keys fill the rejoined one.
Sticky keys are forgotten least-recently-used beyond `max_sticky_keys`.

Pool-wide control (pause, continue, weight updates) runs on every engine at once and reports which engines
failed. The pool also owns the client-side admission gate the `drain` pause mode needs: while it is closed,
new `generate` calls wait at the gate (their time there counts against nothing but the caller's patience),
and `wait_idle` waits for the requests already sent to finish.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar, cast

from asyncrl_core.errors import EngineControlError, EngineUnavailableError
from asyncrl_core.types import Generation, SamplingParams
from asyncrl_sglang.client import PauseMode, SGLangClient

T = TypeVar("T")

RECOVERY_POLL_S = 0.5
"""Seconds between `/health` probes of engines that went down, while a request waits for one."""

REPROBE_INTERVAL_S = 5.0
"""Least seconds between background `/health` probes of an engine that went down, while others are up."""


class EnginePool:
    """Clients of several engines, used as one `GenerationClient`; closes the clients on `aclose`."""

    def __init__(
        self,
        clients: Sequence[SGLangClient],
        *,
        max_sticky_keys: int = 100_000,
        recovery_timeout_s: float = 0.0,
        reprobe_interval_s: float = REPROBE_INTERVAL_S,
    ) -> None:
        """`recovery_timeout_s`: how long a request whose engine went down waits for an engine to answer
        `/health` again before it fails (0: it fails at once). `reprobe_interval_s`: least seconds between
        background `/health` probes of a down engine while other engines are up."""
        if not clients:
            raise ValueError("an engine pool needs at least one engine client")
        if reprobe_interval_s < 0:
            raise ValueError(f"reprobe_interval_s must be >= 0, got {reprobe_interval_s}")
        self.clients: tuple[SGLangClient, ...] = tuple(clients)
        self.recovery_timeout_s = recovery_timeout_s
        self._down: set[int] = set()
        """Engines that failed a request and have not answered `/health` since: routed around."""
        self.reprobe_interval_s = reprobe_interval_s
        self._reprobe_at = [0.0] * len(self.clients)
        """When (`time.monotonic`) each down engine may next be probed in the background."""
        self._probes: dict[int, asyncio.Task[None]] = {}
        """Background `/health` probes running, by engine."""
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
        """Stop the background probes and close every client."""
        for probe in self._probes.values():
            probe.cancel()
        await asyncio.gather(*self._probes.values(), return_exceptions=True)
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
        if (
            routing_key is not None
            and (index := self._sticky.get(routing_key)) is not None
            and index not in self._down
        ):
            self._sticky.move_to_end(routing_key)
            return index
        index = min(range(len(self.clients)), key=lambda i: (i in self._down, self._outstanding[i], i))
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
        """`GenerationClient.generate` on the least-loaded engine (or the one `routing_key` sticks to).

        An engine that cannot be reached (`EngineUnavailableError` and no answer to `/health`: it died or
        stopped answering) is routed around until it answers again, and the request is sent again under
        the same `rid` to another engine, or to the first that answers within `recovery_timeout_s` (a
        restarted one). The lost engine never finished the request, so it is generated once. An engine that
        answers `/health` but not the request (it timed out) fails the call.
        """
        rid = rid or uuid.uuid4().hex
        while True:
            while not self._admission_open.is_set():
                await self._admission_open.wait()
            self._reprobe_due()
            index = self._pick(routing_key)
            self._outstanding[index] += 1
            self._num_inflight += 1
            self._idle.clear()
            try:
                return await self.clients[index].generate(input_ids, sampling, rid=rid)
            except EngineUnavailableError as error:
                if await self.clients[index].health():
                    raise
                self._mark_down(index)
                lost = error
            finally:
                self._outstanding[index] -= 1
                self._num_inflight -= 1
                if self._num_inflight == 0:
                    self._idle.set()
            await self._wait_available(lost)

    def _mark_down(self, index: int) -> None:
        self._down.add(index)
        self._reprobe_at[index] = time.monotonic() + self.reprobe_interval_s

    def _reprobe_due(self) -> None:
        """Start a background `/health` probe of each down engine whose interval has passed, while some
        engine is up (when none is, `_wait_available` probes them); one that answers rejoins routing."""
        if not self._down or len(self._down) == len(self.clients):
            return
        now = time.monotonic()
        for index in self._down:
            if index not in self._probes and now >= self._reprobe_at[index]:
                self._reprobe_at[index] = now + self.reprobe_interval_s
                self._probes[index] = asyncio.create_task(self._reprobe(index))

    async def _reprobe(self, index: int) -> None:
        try:
            if await self.clients[index].health():
                self._down.discard(index)
        finally:
            del self._probes[index]

    async def _wait_available(self, lost: EngineUnavailableError) -> None:
        """Return once some engine is not marked down (probing the down ones' `/health`); `lost` again
        after `recovery_timeout_s` without one."""
        deadline = time.monotonic() + self.recovery_timeout_s
        while len(self._down) == len(self.clients):
            for index in sorted(self._down):
                if await self.clients[index].health():
                    self._down.discard(index)
            if len(self._down) < len(self.clients):
                return
            if time.monotonic() >= deadline:
                raise lost
            await asyncio.sleep(RECOVERY_POLL_S)

    @property
    def down(self) -> frozenset[int]:
        """Engines routed around: they failed a request and have not answered `/health` since."""
        return frozenset(self._down)

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
        outcomes = await self.settle(action, indices=indices)
        failures = [
            self.describe_failure(index, outcome)
            for index, outcome in outcomes.items()
            if isinstance(outcome, Exception)
        ]
        if failures:
            raise EngineControlError(f"{what} failed on {len(failures)} engine(s): " + "; ".join(failures))
        return [outcome for outcome in outcomes.values() if not isinstance(outcome, Exception)]

    async def settle(
        self, action: Callable[[SGLangClient], Awaitable[T]], *, indices: Sequence[int] | None = None
    ) -> dict[int, T | Exception]:
        """Run `action` on every engine (or those in `indices`) at once, each to its end; the result or the
        error of each, by engine index, in the order given. Cancellation is raised, not returned."""
        chosen = list(range(len(self.clients))) if indices is None else list(indices)
        results = await asyncio.gather(
            *(action(self.clients[index]) for index in chosen), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, Exception):
                raise result  # cancellation or interpreter exit is not an engine failure
        return {index: cast("T | Exception", result) for index, result in zip(chosen, results, strict=True)}

    def describe_failure(self, index: int, error: Exception) -> str:
        """`engine <index> (<url>): <error type>: <error>`, how the pool names an engine's failure."""
        return f"engine {index} ({self.clients[index].base_url}): {type(error).__name__}: {error}"

    async def pause(self, mode: PauseMode) -> None:
        """Pause every engine in `mode`."""
        await self.each(lambda client: client.pause(mode), f"pause({mode})")

    async def continue_generation(self) -> None:
        """Continue every engine."""
        await self.each(lambda client: client.continue_generation(), "continue_generation")

    async def weight_versions(self) -> list[int]:
        """The weight version each engine holds, in client order."""
        return await self.each(lambda client: client.weight_version(), "weight_version")
