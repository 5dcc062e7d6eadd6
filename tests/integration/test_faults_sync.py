"""Fault injection into short sync runs (CPU, Ray, tiny Llama, the arith task).

One run has its agent-loop worker killed (SIGKILL) while the driver waits for the rollout of a batch, then,
once that is recovered, its rollout worker (the Ray actor that owns the engine). From the run's own records:
each death is named within 30 s (`faults.jsonl`), the worker is restarted and the batch completed, every step
is trained once on fresh data, every prompt is accounted for, and no process of the run is left. Another run
has its buffer worker killed during a rollout: it stops naming it and how to resume, and the resumed run
trains every step once and loses and repeats no prompt.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from faults_testing import Injector, fault_events, first_event, leftovers, wait_until, worker_pids
from runner_testing import read_metrics, read_summary, run_config

from asyncrl_core import metrics
from asyncrl_core.config import AsyncRLConfig
from asyncrl_core.runner import run
from asyncrl_core.runner.ledger import audit_run
from asyncrl_core.runner.workers import RunnerError
from asyncrl_sglang.launcher import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

NAMED_WITHIN_S = 30.0
"""The issue's bound: a failure is recovered from, or the run stops naming it, within this of the fault."""
NUM_STEPS = 6
BATCH = 4


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> Iterator[None]:
    ray = pytest.importorskip("ray")

    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


def _sync_config(
    tmp_path: Path, model_path: Path, checkpoint: dict[str, object], base_port: int | None = None
) -> AsyncRLConfig:
    return run_config(
        tmp_path,
        model_path,
        runner={"async_mode": False, "num_steps": NUM_STEPS},
        data={"rollout_batch_size": BATCH},
        rollout={
            "max_worker_restarts": 1,
            "sglang": {"launch": "builtin", "base_port": base_port or free_port()},
        },
        agentloop={"max_worker_restarts": 1, "task_args": {"num_train": 64, "num_test": 4}},
        checkpoint={"save_at_end": False, **checkpoint},
    )


def test_dead_agent_loop_and_rollout_workers_are_restarted_in_sync_mode(
    tmp_path: Path, tiny_llama_path: Path
) -> None:
    config = _sync_config(tmp_path, tiny_llama_path, {})
    run_dir = tmp_path / "run"

    def plan(injector: Injector) -> None:
        injector.after_steps(1)
        injector.until_driver_waits_in("run_groups", for_s=0.0)  # the rollout of a batch is under way
        (agent_loop,) = worker_pids("AgentLoopWorker")
        injector.signal(agent_loop, signal.SIGKILL, "agent-loop worker 0")
        injector.until_recovered("agent-loop worker 0")
        injector.after_steps(len(read_metrics(run_dir)) + 1)
        injector.until_driver_waits_in("run_groups", for_s=0.0)
        (rollout_worker,) = worker_pids("RolloutWorker")
        injector.signal(rollout_worker, signal.SIGKILL, "rollout worker 0")

    injector = Injector(run_dir, plan)
    injector.start()
    try:
        run(config)
    finally:
        injector.join(timeout=300)
    if injector.error is not None:
        raise injector.error

    for fault in injector.injected:
        failed, recovered = first_event(run_dir, fault, "failed"), first_event(run_dir, fault, "recovered")
        print(
            f"{fault.part} SIGKILL (sync): named after {failed['time'] - fault.at:.1f} s, "
            f"recovered after {recovered['time'] - fault.at:.1f} s"
        )
        assert failed["time"] - fault.at <= NAMED_WITHIN_S
    assert not [event for event in fault_events(run_dir) if event["event"] == "fatal"]
    records = [record for record in read_metrics(run_dir) if metrics.TIME_STEP in record]
    assert [record["step"] for record in records] == list(range(1, NUM_STEPS + 1))
    assert sum(record[metrics.AGENT_LOOP_RESTARTS] for record in records) == 1
    assert sum(record[metrics.ROLLOUT_WORKER_RESTARTS] for record in records) == 1
    # Fresh data in every step, the one of the engine's restart too: the requests that waited for the new
    # engine reach it only once it holds the actor's current weights.
    assert [record[metrics.DATA_STALENESS_MAX] for record in records] == [0.0] * NUM_STEPS
    sound, lines = audit_run(run_dir)
    assert sound, lines
    prompts = read_summary(run_dir)["prompts"]
    assert prompts["trained"] == BATCH * NUM_STEPS
    assert prompts["inflight"] == 0
    parts = ("trained", "handed_back", "dropped", "inflight", "buffered")
    assert prompts["issued"] == sum(prompts[part] for part in parts)
    wait_until(lambda: not leftovers(tiny_llama_path), 60, "the end of every process of the run")


def test_a_dead_buffer_worker_stops_the_sync_run_and_it_resumes_from_its_checkpoint(
    tmp_path: Path, tiny_llama_path: Path
) -> None:
    port = free_port()
    config = _sync_config(tmp_path, tiny_llama_path, {"save_every_steps": 1}, port)
    run_dir = tmp_path / "run"

    def plan(injector: Injector) -> None:
        injector.after_steps(2)
        injector.until_driver_waits_in("run_groups", for_s=0.0)  # the agent loop calls the buffer
        (buffer,) = worker_pids("BufferWorker")
        injector.signal(buffer, signal.SIGKILL, "buffer worker")

    injector = Injector(run_dir, plan)
    injector.start()
    with pytest.raises(RunnerError, match="buffer worker died during") as stopped:
        run(config)
    injector.join(timeout=60)
    if injector.error is not None:
        raise injector.error
    (fault,) = injector.injected
    fatal = first_event(run_dir, fault, "fatal")
    print(f"buffer worker SIGKILL (sync): the run stopped naming it after {fatal['time'] - fault.at:.1f} s")
    assert fatal["time"] - fault.at <= NAMED_WITHIN_S
    assert "checkpoint.resume_from=latest" in str(stopped.value)
    assert [event["part"] for event in fault_events(run_dir)] == ["buffer worker"]  # no other part blamed
    wait_until(lambda: not leftovers(tiny_llama_path), 60, "the end of every process of the run")

    run(_sync_config(tmp_path, tiny_llama_path, {"save_every_steps": 1, "resume_from": "latest"}, port))
    records = [record for record in read_metrics(run_dir) if metrics.TIME_STEP in record]
    assert [record["step"] for record in records] == list(range(1, NUM_STEPS + 1))
    sound, lines = audit_run(run_dir)
    assert sound, lines
    prompts = read_summary(run_dir)["prompts"]
    assert prompts["trained"] == BATCH * NUM_STEPS
    parts = ("trained", "handed_back", "dropped", "inflight", "buffered")
    assert prompts["issued"] == sum(prompts[part] for part in parts)
    wait_until(lambda: not leftovers(tiny_llama_path), 60, "the end of every process of the run")
