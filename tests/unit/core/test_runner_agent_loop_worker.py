"""The runner's agent-loop worker in one process, over a real `BufferWorker`: admission never exceeds the
worker's concurrency, a failed group is handed back or dropped by the kind of its error, and sync mode
replaces failed groups until its batch is complete.

The engine is a stand-in `GenerationClient` that answers every turn with `<answer> 1 </answer>` (or fails as
a test asks); the arith task, the tokenizer, the agent loop and the buffer are the real ones.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from asyncrl_core import metrics
from asyncrl_core.config import AsyncRLConfig, load_config
from asyncrl_core.errors import EngineUnavailableError, GenerationError
from asyncrl_core.runner.workers import (
    AgentLoopWorker,
    BufferWorker,
    EngineEndpoint,
    LocalBufferPort,
    RunnerError,
)
from asyncrl_core.types import Generation, SamplingParams, VersionSpan

pytestmark = pytest.mark.timeout(120)


def _config(tmp_path: Path, model_path: Path, **overrides: object) -> AsyncRLConfig:
    pairs = {
        "runner.run_dir": str(tmp_path / "run"),
        "actor.model_path": str(model_path),
        "data.rollout_batch_size": 2,
        "data.shuffle": False,
        "algorithm.group_size": 1,
        "actor.micro_batch_size": 2,
        "agentloop.task_name": "arith",
        "agentloop.task_args": '{"num_train": 16, "num_test": 2}',
        "agentloop.max_concurrent_groups": 2,
        "rollout_buffer.max_inflight_groups": 20,
        "rollout_buffer.max_buffered_groups": 40,
        **overrides,
    }
    return load_config(None, [f"{key}={value}" for key, value in pairs.items()])


class AnsweringEngine:
    """Answers `<answer> 1 </answer>` once `gate` is open; `fail(call_number)` may raise instead."""

    def __init__(self, tokenizer: object, fail: Callable[[int], None] = lambda _: None) -> None:
        self.ids: list[int] = tokenizer.encode("<answer> 1 </answer>", add_special_tokens=False)  # type: ignore[attr-defined]
        self.fail = fail
        self.gate = asyncio.Event()
        self.gate.set()
        self.num_calls = 0
        self.arrived = asyncio.Condition()

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        rid: str | None = None,
        routing_key: str | None = None,
    ) -> Generation:
        self.num_calls += 1
        number = self.num_calls
        async with self.arrived:
            self.arrived.notify_all()
        await self.gate.wait()
        self.fail(number)
        ids = self.ids[: sampling.max_new_tokens]
        return Generation(
            output_ids=ids,
            logprobs=[-0.5] * len(ids),
            text="<answer> 1 </answer>",
            finish_reason="stop",
            version_spans=(VersionSpan(0, 0, len(ids)),),
            matched_stop="</answer>",
        )


def _worker(config: AsyncRLConfig, model_path: Path) -> AgentLoopWorker:
    # No engine listens at the endpoint: the worker's loop generates through the stand-in instead.
    return AgentLoopWorker(
        config, model_path=str(model_path), endpoints=[EngineEndpoint("http://127.0.0.1:9")], task_services={}
    )


class RecordingPort(LocalBufferPort):
    """The real local port, noting the most groups in flight after each admission."""

    max_inflight = 0

    async def admit(self, max_groups: int, timeout_s: float, worker_index: int = 0) -> list[tuple[int, int]]:
        admitted = await super().admit(max_groups, timeout_s, worker_index)
        self.max_inflight = max(self.max_inflight, self.worker.buffer.num_inflight)
        return admitted


async def test_continuous_admission_stays_within_the_workers_concurrency(
    tmp_path: Path, tiny_llama_path: Path
) -> None:
    config = _config(tmp_path, tiny_llama_path)
    worker = _worker(config, tiny_llama_path)
    engine = AnsweringEngine(worker.loop.tokenizer)
    worker.loop.client = engine
    engine.gate.clear()
    buffer = BufferWorker(config, dataset_size=16)
    port = RecordingPort(buffer)
    serving = asyncio.create_task(worker.serve(port))
    async with engine.arrived:
        await asyncio.wait_for(engine.arrived.wait_for(lambda: engine.num_calls >= 2), 30)
    engine.gate.set()
    async with engine.arrived:
        await asyncio.wait_for(engine.arrived.wait_for(lambda: engine.num_calls >= 8), 30)
    await worker.stop()
    await asyncio.wait_for(serving, 30)
    await worker.aclose()
    # max_concurrent_groups is 2 while the buffer would admit 20: never more than 2 in flight.
    assert port.max_inflight <= 2
    assert buffer.counts()["inflight"] == 0


async def test_sync_rollout_replaces_failed_groups_by_the_kind_of_their_error(
    tmp_path: Path, tiny_llama_path: Path
) -> None:
    def fail(number: int) -> None:
        if number == 1:
            raise EngineUnavailableError("engine http://127.0.0.1:9 did not answer")
        if number == 2:
            raise GenerationError("http://127.0.0.1:9/generate refused request r (400): too long")

    config = _config(tmp_path, tiny_llama_path, **{"agentloop.max_concurrent_groups": 1})
    worker = _worker(config, tiny_llama_path)
    worker.loop.client = AnsweringEngine(worker.loop.tokenizer, fail)
    buffer = BufferWorker(config, dataset_size=16)
    assert await worker.run_groups(LocalBufferPort(buffer), 2, timeout_s=60) == 2
    await worker.aclose()
    counts = buffer.counts()
    assert (counts["issued"], counts["handed_back"], counts["dropped"], counts["buffered"]) == (4, 1, 1, 2)
    assert list(buffer.failure_reasons.values()) == [
        "GenerationError: http://127.0.0.1:9/generate refused request r (400): too long"
    ]
    assert buffer.take_batch(2, actor_version=0, timeout_s=0.0) is not None
    step = buffer.end_step()
    assert (step[metrics.FAILED_GROUPS_RETRIED], step[metrics.FAILED_GROUPS_DROPPED]) == (1.0, 1.0)


COUNTING_LOOP = '''
from asyncrl_agents.loop import MultiTurnAgentLoop


class CountingLoop(MultiTurnAgentLoop):
    """The multi-turn loop, counting the groups it runs."""

    built = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.groups_run = 0
        CountingLoop.built.append(self)

    async def run_group(self, prompt_index, sample=None, *, group_id=None, split="train"):
        self.groups_run += 1
        return await super().run_group(prompt_index, sample, group_id=group_id, split=split)
'''


async def test_the_worker_runs_the_agent_loop_the_configuration_names(
    tmp_path: Path, tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A distribution declaring an agent loop, as a third-party package would.
    module = f"counting_loop_{tmp_path.name.replace('-', '_')}"
    site = tmp_path / "site"
    info = site / "counting_loop-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: counting-loop\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[asyncrl.agent_loops]\ncounting = {module}:CountingLoop\n")
    (site / f"{module}.py").write_text(COUNTING_LOOP)
    monkeypatch.syspath_prepend(str(site))
    config = _config(
        tmp_path, tiny_llama_path, **{"agentloop.agent_loop": "counting", "algorithm.group_size": 2}
    )
    worker = _worker(config, tiny_llama_path)
    answering = AnsweringEngine(worker.loop.tokenizer)
    engines, worker._client = worker.client, answering  # type: ignore[assignment]
    worker.loop.client = answering
    buffer = BufferWorker(config, dataset_size=16)
    assert await worker.run_groups(LocalBufferPort(buffer), 2, timeout_s=60) == 2
    assert metrics.EVAL_REWARD_MEAN in await worker.evaluate("test")
    worker._client = engines
    await worker.aclose()
    built = sys.modules[module].CountingLoop.built
    assert built[0] is worker.loop
    assert [loop.group_size for loop in built] == [2, 1]  # training, then evaluation
    assert [loop.groups_run for loop in built] == [2, 2]  # 2 groups, then the test split's 2 prompts


async def test_a_worker_starts_before_the_engines_and_connects_once(
    tmp_path: Path, tiny_llama_path: Path
) -> None:
    """A run starts its agent loops beside the engines: the task and the tokenizer are ready before any
    engine answers, generation waits for `connect`, and a retried `connect` changes nothing."""
    config = _config(tmp_path, tiny_llama_path)
    worker = AgentLoopWorker(config, model_path=str(tiny_llama_path), task_services={})
    assert worker.dataset_size() == 16
    assert worker.tokenizer.encode("1", add_special_tokens=False)
    with pytest.raises(RunnerError, match="agent-loop worker 0 is not connected to the engines yet"):
        worker.loop  # noqa: B018
    buffer = BufferWorker(config, dataset_size=16)
    with pytest.raises(RunnerError, match="not connected to the engines yet"):
        await worker.run_groups(LocalBufferPort(buffer), 1, timeout_s=10)
    assert buffer.buffer.num_inflight == 0  # nothing was admitted for a worker that cannot run it

    endpoints = [EngineEndpoint("http://127.0.0.1:9")]
    worker.connect(endpoints)
    loop = worker.loop
    worker.connect(list(endpoints))  # a retried call
    assert worker.loop is loop
    with pytest.raises(RunnerError, match="is connected to"):
        worker.connect([EngineEndpoint("http://127.0.0.1:10")])
    assert worker.loop is loop
    worker.loop.client = AnsweringEngine(worker.loop.tokenizer)
    assert await worker.run_groups(LocalBufferPort(buffer), 1, timeout_s=60) == 1
    await worker.aclose()
