"""`AgentLoopWorker`: runs a task's trajectories against the engines through the agent loop
`agentloop.agent_loop` names, and the run's task (`build_task`) and step metrics of its groups."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from asyncrl_core import metrics, plugins, prompts
from asyncrl_core.errors import AsyncRLError, PluginError
from asyncrl_core.runner.rollout_backend import rollout_backend
from asyncrl_core.runner.workers.buffer import BufferPort
from asyncrl_core.runner.workers.common import PERMANENT_ERRORS, RunnerError, pin_to_cores
from asyncrl_core.runner.workers.rollout import EngineEndpoint
from asyncrl_core.tasks import load_task
from asyncrl_core.types import Group, SamplingParams, ToolHealth

if TYPE_CHECKING:
    from asyncrl_core.config import AsyncRLConfig
    from asyncrl_core.protocols import AgentLoop, AgentLoopFactory, EngineClient, Task

logger = logging.getLogger(__name__)


def build_task(config: AsyncRLConfig, task_services: Mapping[str, str]) -> Task:
    """The run's task, with `agentloop.task_args` and the services its `serve()` yielded (a URL, say)."""
    task_name = config.agentloop.task_name
    if task_name is None:
        raise RunnerError("agentloop.task_name is not set")
    return load_task(task_name, {**config.agentloop.task_args, **task_services})


def agent_loop_factory(config: AsyncRLConfig) -> AgentLoopFactory:
    """The agent loop `agentloop.agent_loop` names (its plugin's module is imported now, in the worker that
    runs it)."""
    factory = plugins.load("asyncrl.agent_loops", config.agentloop.agent_loop)
    if not callable(factory):
        raise PluginError(
            f"`asyncrl.agent_loops`: {config.agentloop.agent_loop!r} is not a factory of agent loops "
            f"(got {factory!r})"
        )
    return cast("AgentLoopFactory", factory)


class AgentLoopWorker:
    """Runs groups of a task's trajectories against the engines at `endpoints`.

    `task_services` are the keyword arguments the task's `serve()` yielded in the driver (e.g. the
    retriever's URL); they are added to `agentloop.task_args`. On a machine without GPUs, `cores` are the
    rollout's: tokenising, parsing and tool calls then take time from the engines, never from the actor.

    Its start (the task, the tokenizer and the libraries they import) needs no engine, so a run starts the
    workers while the engines start, and `connect`s them once the engines answer; given `endpoints`, it
    connects at once.
    """

    def __init__(
        self,
        config: AsyncRLConfig,
        *,
        model_path: str,
        task_services: Mapping[str, str],
        endpoints: Sequence[EngineEndpoint] | None = None,
        worker_index: int = 0,
        cores: Sequence[int] = (),
    ) -> None:
        self.config = config
        self.worker_index = worker_index
        self._tool_health: list[ToolHealth] = []
        self._tool_health_told = asyncio.Event()
        self._closed = False
        self.task = build_task(config, task_services)
        self.model_path = model_path
        self.tokenizer = prompts.load_tokenizer(model_path)
        self._client: EngineClient | None = None
        self._loop: AgentLoop | None = None
        self._endpoints: list[EngineEndpoint] | None = None
        self._stop = asyncio.Event()
        self._eval_loop: AgentLoop | None = None
        self.num_running = 0
        self.num_groups = 0
        self.num_failed = 0
        # Pinned once started: the start may use any free core, the run only the rollout's.
        pin_to_cores(cores)
        if endpoints is not None:
            self.connect(endpoints)

    def connect(self, endpoints: Sequence[EngineEndpoint]) -> None:
        """Generate on the engines at `endpoints` from now on. Called once, when they have started; a
        repeated call with the same endpoints (a retried call) changes nothing, other ones are refused."""
        endpoints = list(endpoints)
        if self._endpoints is not None:
            if endpoints != self._endpoints:
                raise RunnerError(
                    f"agent-loop worker {self.worker_index} is connected to {self._endpoints} already"
                )
            return
        client = _connect_engines(self.config, endpoints)
        loop = self._make_loop(client, group_size=self.config.algorithm.group_size)
        self._client, self._loop, self._endpoints = client, loop, endpoints

    @property
    def client(self) -> EngineClient:
        self._check_connected()
        assert self._client is not None
        return self._client

    @property
    def loop(self) -> AgentLoop:
        self._check_connected()
        assert self._loop is not None
        return self._loop

    def _check_connected(self) -> None:
        """Refuse to admit work before `connect`: an admitted group would only fail and be issued again."""
        if self._client is None:
            raise RunnerError(f"agent-loop worker {self.worker_index} is not connected to the engines yet")

    def _make_loop(self, client: EngineClient, *, group_size: int) -> AgentLoop:
        config = self.config
        sampling = config.rollout.sampling
        assert sampling.max_new_tokens is not None  # derived
        max_concurrent = config.agentloop.max_concurrent_groups
        assert max_concurrent is not None  # derived
        return agent_loop_factory(config)(
            self.task,
            client,
            self.tokenizer,
            group_size=group_size,
            sampling=SamplingParams(
                max_new_tokens=sampling.max_new_tokens,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
            ),
            max_prompt_len=config.data.max_prompt_len,
            max_response_len=config.data.max_response_len,
            context_len=config.rollout.context_length,
            max_turns=config.agentloop.max_turns,
            max_concurrent_groups=max_concurrent,
            on_tool_health=self._tell_tool_health,
        )

    def _tell_tool_health(self, event: ToolHealth) -> None:
        self._tool_health.append(event)
        self._tool_health_told.set()

    async def watch_tools(self) -> list[ToolHealth]:
        """Wait until a tool starts failing or answers again (`ToolHealth`, oldest first); empty once the
        worker closes. The driver keeps one call pending beside the data (`runner.liveness`)."""
        while not self._tool_health and not self._closed:
            self._tool_health_told.clear()
            await self._tool_health_told.wait()
        events, self._tool_health = self._tool_health, []
        return events

    def dataset_size(self, split: str = "train") -> int:
        return len(self.task.dataset(split))

    def dataset_fingerprint(self, split: str = "train") -> str:
        """A hash of the split's samples (ids, messages, answers), so a checkpoint names its dataset."""
        from asyncrl_core.runner.checkpoint import dataset_fingerprint

        return dataset_fingerprint(self.task.dataset(split))

    def _start(
        self,
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
        buffer: BufferPort,
        admitted: tuple[int, int],
    ) -> asyncio.Task[None]:
        """Run an admitted group as a task; it counts as running from now on, so the capacity read next
        already sees it (a task starts only at the loop's next turn)."""
        self.num_running += 1
        return spawn(self._run_one(buffer, *admitted))

    async def _run_one(self, buffer: BufferPort, group_id: int, prompt_index: int) -> None:
        """One admitted group (counted in `num_running` by `_start`): completed, or abandoned with the
        failure's kind: a permanent error drops the prompt with its reason, any other `AsyncRLError`
        (an engine lost, a request timed out) hands it back to be issued again."""
        try:
            group = await self.loop.run_group(prompt_index, group_id=group_id)
        except asyncio.CancelledError:
            await buffer.abandon(group_id)
            raise
        except PERMANENT_ERRORS as error:
            reason = f"{type(error).__name__}: {error}"
            logger.warning("group %d (prompt %d) dropped for good: %s", group_id, prompt_index, reason)
            self.num_failed += 1
            await buffer.abandon(group_id, reason)
            return
        except AsyncRLError as error:
            logger.warning("group %d (prompt %d) failed, issued again: %s", group_id, prompt_index, error)
            self.num_failed += 1
            await buffer.abandon(group_id)
            return
        finally:
            self.num_running -= 1
        await buffer.complete(group)
        self.num_groups += 1

    async def run_groups(self, buffer: BufferPort, num_groups: int, timeout_s: float) -> int:
        """Run groups until `num_groups` have finished (sync mode); returns how many finished. A group that
        fails is replaced by a new admission, until the buffer's failure guard stops the run. Admission
        waits for the limits like in async mode, so a batch larger than the in-flight limit runs in
        waves. `RunnerError` when `timeout_s` passes first."""
        self._check_connected()
        deadline = time.monotonic() + timeout_s
        finished_before = self.num_groups
        running: set[asyncio.Task[None]] = set()
        try:
            while (finished := self.num_groups - finished_before) < num_groups:
                remaining_s = deadline - time.monotonic()
                if remaining_s <= 0:
                    raise RunnerError(
                        f"{finished} of {num_groups} groups finished within {timeout_s:.0f} s "
                        f"({self.num_failed} failed on this worker so far)"
                    )
                wanted = num_groups - finished - len(running)
                if wanted > 0:
                    for admitted in await buffer.admit(wanted, min(remaining_s, 1.0), self.worker_index):
                        running.add(self._start(asyncio.create_task, buffer, admitted))
                if running:
                    more_wanted = num_groups - finished - len(running) > 0
                    done, running = await asyncio.wait(
                        running,
                        timeout=0 if more_wanted else min(remaining_s, 1.0),
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                    for task in done:
                        task.result()  # an error of the loop itself (not a group's failure) ends the call
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
        return self.num_groups - finished_before

    async def serve(self, buffer: BufferPort) -> None:
        """Async mode: keep admitting prompts and running their groups until `stop`; then wait for the
        groups already running. A failed group's prompt is handed back or dropped; an error of the loop
        itself stops it."""
        self._check_connected()
        self._stop.clear()
        async with asyncio.TaskGroup() as tasks:
            while not self._stop.is_set():
                max_groups = self.loop_capacity()
                if max_groups == 0:
                    await asyncio.sleep(0.01)
                    continue
                for admitted in await buffer.admit(max_groups, 0.2, self.worker_index):
                    self._start(tasks.create_task, buffer, admitted)

    def loop_capacity(self) -> int:
        """Groups this worker can start now without queueing them behind its own concurrency limit."""
        max_concurrent = self.config.agentloop.max_concurrent_groups or 1
        return max(0, max_concurrent - self.num_running)

    async def stop(self) -> None:
        """End `serve`: no new prompt is admitted; the running groups finish and are buffered."""
        self._stop.set()

    async def evaluate(self, split: str = "test", max_prompts: int | None = None) -> dict[str, float]:
        """Mean reward of one trajectory per prompt of `split` (the engines' current weights; runs beside
        training groups), with the weight versions the evaluation saw."""
        started = time.perf_counter()
        if self._eval_loop is None:
            self._eval_loop = self._make_loop(self.client, group_size=1)
        dataset = self._eval_loop.dataset(split)
        count = len(dataset) if max_prompts is None else min(max_prompts, len(dataset))
        groups: list[Group] = await asyncio.gather(
            *(self._eval_loop.run_group(index, split=split) for index in range(count))
        )
        rewards = [t.reward for group in groups for t in group.trajectories]
        versions = [r for group in groups for t in group.trajectories if (r := t.version_range()) is not None]
        result = {
            metrics.EVAL_REWARD_MEAN: sum(rewards) / max(1, len(rewards)),
            metrics.TIME_EVAL: time.perf_counter() - started,
        }
        if versions:
            result[metrics.EVAL_WEIGHT_VERSION_MIN] = float(min(v[0] for v in versions))
            result[metrics.EVAL_WEIGHT_VERSION_MAX] = float(max(v[1] for v in versions))
        return result

    async def drain(self, timeout_s: float) -> None:
        """Hold new requests at the client and wait for those in flight (the `drain` pause mode)."""
        self.client.close_admission()
        await self.client.wait_idle(timeout_s)

    async def reopen(self) -> None:
        """Let the requests held by `drain` through."""
        self.client.open_admission()

    async def aclose(self) -> None:
        self._closed = True
        self._tool_health_told.set()
        if self._loop is None:  # never connected: the task is closed here
            await self.task.aclose()
            return
        await self._loop.aclose()  # closes the task, which the evaluation loop shares
        await self.client.aclose()


def _connect_engines(config: AsyncRLConfig, endpoints: Sequence[EngineEndpoint]) -> EngineClient:
    """One client over every engine, through the rollout backend."""
    return rollout_backend(config).connect(
        [endpoint.url for endpoint in endpoints], [endpoint.grpc_target for endpoint in endpoints]
    )
