"""Fault injection into short async runs (CPU, Ray, tiny Llama).

One run (the `search-probe` task: every trajectory searches on its first turn, through the real search tool
and a retrieval server this module starts) takes five faults in turn, each once the previous one has
recovered and a step has passed: its engine process is killed (SIGKILL), its agent-loop worker is killed,
its rollout worker (the Ray actor that owns the engine) is killed, its (restarted) engine is frozen
(SIGSTOP, so it stops answering), and its retriever is killed, kept down until a step has trained on failed
searches, then started again at its address. A second run (the arith task) has its actor killed while the
driver waits for data, a third its buffer worker (then it is resumed from its last checkpoint). From the
runs' own records: each failure is named within 30 s of the fault (`faults.jsonl`), the first run recovers
from each and trains every step once, the retriever's outage shows in the steps' tool metrics and ends when
it is back, the second and third runs stop with an error naming the part (the third's telling how to
resume), the resumed run trains every step once, every prompt is accounted for (the ledger's audit,
`summary.json`), and no process of any run is left.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from faults_testing import (
    Injected,
    Injector,
    engine_pids,
    fault_events,
    first_event,
    leftovers,
    wait_until,
    worker_pids,
)
from runner_testing import read_metrics, read_summary, run_config

from asyncrl_agents.retrieval import RetrievalServer
from asyncrl_agents.tasks.searchr1 import SearchR1MiniTask
from asyncrl_core import metrics
from asyncrl_core.runner import run
from asyncrl_core.runner.ledger import audit_run
from asyncrl_core.runner.workers import RunnerError
from asyncrl_sglang.launcher import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

NAMED_WITHIN_S = 30.0
"""The issue's bound: a failure is recovered from, or the run stops naming it, within this of the fault."""
NUM_STEPS = 20


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> Iterator[None]:
    ray = pytest.importorskip("ray")

    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


def _faulted_config(
    tmp_path: Path,
    model_path: Path,
    num_steps: int,
    save_every_steps: int | None,
    *,
    agentloop: dict[str, object],
    resume: bool = False,
    **sections: dict[str, object],
) -> object:
    return run_config(
        tmp_path,
        model_path,
        runner={"num_steps": num_steps},
        rollout={
            "engine_unresponsive_s": 10,
            "max_engine_restarts": 2,
            "max_worker_restarts": 1,
            # A port of its own: a restarted engine must get its address back, where other runs' engines
            # on the default port could be.
            "sglang": {"launch": "builtin", "base_port": free_port()},
        },
        agentloop={"max_worker_restarts": 1, **agentloop},
        checkpoint={
            "save_at_end": False,
            "save_every_steps": save_every_steps,
            "resume_from": "latest" if resume else None,
        },
        **sections,
    )


@pytest.fixture(scope="module")
def recovered_run(tmp_path_factory: pytest.TempPathFactory, tiny_llama_path: Path) -> tuple[Path, Injector]:
    tmp_path = tmp_path_factory.mktemp("faults")
    corpus = SearchR1MiniTask().corpus_file()
    retriever = RetrievalServer(corpus, topk=1)
    url = retriever.start()
    search_probe = {
        "task_name": "search-probe",
        "task_args": {"retriever_url": url, "topk": 1, "max_turns": 1, "search_timeout_s": 20.0},
    }
    config = _faulted_config(
        tmp_path,
        tiny_llama_path,
        NUM_STEPS,
        None,
        agentloop=search_probe,
        data={"max_prompt_len": 512, "max_response_len": 160},
    )
    run_dir = tmp_path / "run"

    def plan(injector: Injector) -> None:
        nonlocal retriever
        injector.after_steps(1)
        (engine,) = engine_pids(tiny_llama_path)
        injector.signal(engine, signal.SIGKILL, "engine 0")
        injector.until_recovered("engine 0")
        injector.after_steps(len(read_metrics(run_dir)) + 1)
        (agent_loop,) = worker_pids("AgentLoopWorker")
        injector.signal(agent_loop, signal.SIGKILL, "agent-loop worker 0")
        injector.until_recovered("agent-loop worker 0")
        injector.after_steps(len(read_metrics(run_dir)) + 1)
        (rollout_worker,) = worker_pids("RolloutWorker")
        injector.signal(rollout_worker, signal.SIGKILL, "rollout worker 0")
        injector.until_recovered("rollout worker 0")
        injector.after_steps(len(read_metrics(run_dir)) + 1)
        (restarted,) = engine_pids(tiny_llama_path)
        assert restarted != engine
        injector.signal(restarted, signal.SIGSTOP, "engine 0")
        injector.until_recovered("engine 0")
        injector.after_steps(len(read_metrics(run_dir)) + 1)
        injector.signal(retriever.pid, signal.SIGKILL, "tool search")
        injector.until_event("tool search", "failed")
        injector.until_step(lambda step: step[metrics.TOOL_ERRORS] > 0, "a step trained on failed searches")
        retriever.stop()  # reaps the killed process
        retriever = RetrievalServer(corpus, topk=1, port=int(url.rsplit(":", 1)[1]))
        assert retriever.start() == url  # back at its address
        injector.until_recovered("tool search")
        injector.after_steps(len(read_metrics(run_dir)) + 3)  # what was generated while down is trained
        wait_until(lambda: (run_dir / "summary.json").is_file(), 300, "the end of the run")

    injector = Injector(run_dir, plan)
    injector.start()
    try:
        run(config)  # type: ignore[arg-type]
    finally:
        injector.join(timeout=300)
        retriever.stop()
    if injector.error is not None:
        raise injector.error
    return run_dir, injector


def test_each_failure_is_named_within_30_s_and_recovered(recovered_run: tuple[Path, Injector]) -> None:
    run_dir, injector = recovered_run
    assert [fault.what for fault in injector.injected] == ["SIGKILL"] * 3 + ["SIGSTOP", "SIGKILL"]
    for fault in injector.injected:
        failed = first_event(run_dir, fault, "failed")
        recovered = first_event(run_dir, fault, "recovered")
        named_s, recovered_s = failed["time"] - fault.at, recovered["time"] - fault.at
        print(f"{fault.part} {fault.what}: named after {named_s:.1f} s, recovered after {recovered_s:.1f} s")
        assert named_s <= NAMED_WITHIN_S, failed
        assert recovered["time"] >= failed["time"]
    frozen = first_event(run_dir, injector.injected[3], "failed")
    assert "stopped answering /health" in frozen["message"]
    outage = first_event(run_dir, injector.injected[4], "failed")
    assert re.search(r"retrieval server http://127\.0\.0\.1:\d+/retrieve did not answer", outage["message"])
    assert not [event for event in fault_events(run_dir) if event["event"] == "fatal"]


def test_a_retriever_outage_shows_in_the_step_metrics_until_it_is_back(
    recovered_run: tuple[Path, Injector],
) -> None:
    run_dir, injector = recovered_run
    outage: Injected = injector.injected[4]
    records = [record for record in read_metrics(run_dir) if metrics.TIME_STEP in record]
    before, after = records[: outage.step], records[outage.step :]
    assert sum(record[metrics.TOOL_CALLS] for record in before) > 0  # the trajectories search
    assert all(record[metrics.TOOL_ERRORS] == 0 for record in before)
    assert any(record[metrics.TOOL_ERRORS] > 0 for record in after)
    # Groups generated while it was down may still be trained after it is back; the last steps' are not.
    assert after[-1][metrics.TOOL_CALLS] > 0
    assert after[-1][metrics.TOOL_ERRORS] == 0


def test_the_run_trains_every_step_once_and_counts_the_restarts(recovered_run: tuple[Path, Injector]) -> None:
    run_dir, _ = recovered_run
    records = [record for record in read_metrics(run_dir) if metrics.TIME_STEP in record]
    assert [record["step"] for record in records] == list(range(1, NUM_STEPS + 1))
    assert sum(record[metrics.ENGINE_RESTARTS] for record in records) == 2
    assert sum(record[metrics.AGENT_LOOP_RESTARTS] for record in records) == 1
    assert sum(record[metrics.ROLLOUT_WORKER_RESTARTS] for record in records) == 1
    assert all(metrics.FAILED_GROUPS_RETRIED in record for record in records)
    assert read_summary(run_dir)["version"] == NUM_STEPS


def test_every_prompt_is_accounted_for(recovered_run: tuple[Path, Injector]) -> None:
    run_dir, _ = recovered_run
    sound, lines = audit_run(run_dir)
    assert sound, lines
    prompts = read_summary(run_dir)["prompts"]
    parts = ("trained", "handed_back", "dropped", "inflight", "buffered")
    assert prompts["issued"] == sum(prompts[part] for part in parts)
    assert prompts["trained"] == 2 * NUM_STEPS
    assert prompts["inflight"] == 0
    records = [record for record in read_metrics(run_dir) if metrics.TIME_STEP in record]
    assert prompts["handed_back"] == sum(record[metrics.FAILED_GROUPS_RETRIED] for record in records)
    assert prompts["dropped"] == sum(record[metrics.FAILED_GROUPS_DROPPED] for record in records) == 0


def test_no_process_of_the_recovered_run_is_left(
    recovered_run: tuple[Path, Injector], tiny_llama_path: Path
) -> None:
    wait_until(lambda: not leftovers(tiny_llama_path), 60, "the end of every process of the run")


def test_a_dead_actor_stops_the_run_naming_its_rank(tmp_path: Path, tiny_llama_path: Path) -> None:
    # The actor dies while the driver waits for a batch that cannot come (the agent-loop worker is frozen,
    # so no group finishes): the death must be named from that wait, not after it.
    arith = {"task_name": "arith", "task_args": {"num_train": 64, "num_test": 4}}
    config = _faulted_config(tmp_path, tiny_llama_path, 30, 1, agentloop=arith)
    run_dir = tmp_path / "run"

    def plan(injector: Injector) -> None:
        injector.after_steps(2)  # the checkpoint of step 1, with its ledger, is written
        (agent_loop,) = worker_pids("AgentLoopWorker")
        injector.signal(agent_loop, signal.SIGSTOP, "agent-loop worker 0")
        injector.until_driver_waits_in("wait_batch", for_s=3.0)
        (actor,) = worker_pids("ActorWorker")
        injector.signal(actor, signal.SIGKILL, "actor rank 0")
        injector.until_event("actor rank 0", "fatal")
        os.kill(agent_loop, signal.SIGCONT)  # so that it stops with the run, without waiting to be killed

    injector = Injector(run_dir, plan)
    injector.start()
    with pytest.raises(RunnerError, match="actor rank 0 died during the wait for data"):
        run(config)  # type: ignore[arg-type]
    injector.join(timeout=60)
    if injector.error is not None:
        raise injector.error
    _, fault = injector.injected
    fatal = first_event(run_dir, fault, "fatal")
    assert fatal["time"] - fault.at <= NAMED_WITHIN_S
    assert read_metrics(run_dir)  # it trained before the fault
    # The last checkpoint's ledger accounts for every prompt issued up to it: the run resumes from there.
    assert list((run_dir / "checkpoints").iterdir())
    sound, lines = audit_run(run_dir)
    assert sound, lines
    wait_until(lambda: not leftovers(tiny_llama_path), 60, "the end of every process of the run")


def test_a_dead_rollout_worker_is_restarted_with_its_engine(recovered_run: tuple[Path, Injector]) -> None:
    run_dir, injector = recovered_run
    fault = injector.injected[2]
    assert fault.part == "rollout worker 0"
    failed, recovered = first_event(run_dir, fault, "failed"), first_event(run_dir, fault, "recovered")
    assert "its process died" in failed["message"]
    assert "the current weights" in recovered["message"]
    # The plan found one engine after it (the dead worker's engine did not outlive it) and the run went on.
    assert recovered["time"] <= first_event(run_dir, injector.injected[3], "failed")["time"]


def test_a_dead_buffer_worker_stops_the_run_and_it_resumes_from_its_checkpoint(
    tmp_path: Path, tiny_llama_path: Path
) -> None:
    # The buffer worker holds the prompts issued and the groups finished since the last checkpoint, which
    # exist nowhere else: the run stops, naming it and how to resume, and the resumed run loses and repeats
    # no prompt.
    num_steps = 5
    arith = {"task_name": "arith", "task_args": {"num_train": 64, "num_test": 4}}
    config = _faulted_config(tmp_path, tiny_llama_path, num_steps, 1, agentloop=arith)
    run_dir = tmp_path / "run"

    def plan(injector: Injector) -> None:
        injector.after_steps(2)
        (buffer,) = worker_pids("BufferWorker")
        injector.signal(buffer, signal.SIGKILL, "buffer worker")

    injector = Injector(run_dir, plan)
    injector.start()
    with pytest.raises(RunnerError, match="buffer worker died") as stopped:
        run(config)  # type: ignore[arg-type]
    injector.join(timeout=60)
    if injector.error is not None:
        raise injector.error
    (fault,) = injector.injected
    fatal = first_event(run_dir, fault, "fatal")
    print(f"buffer worker SIGKILL (async): the run stopped naming it after {fatal['time'] - fault.at:.1f} s")
    assert fatal["time"] - fault.at <= NAMED_WITHIN_S
    assert "checkpoint.resume_from=latest" in str(stopped.value)
    assert [event["part"] for event in fault_events(run_dir)] == ["buffer worker"]  # no other part blamed
    wait_until(lambda: not leftovers(tiny_llama_path), 60, "the end of every process of the run")

    resumed = _faulted_config(tmp_path, tiny_llama_path, num_steps, 1, agentloop=arith, resume=True)
    run(resumed)  # type: ignore[arg-type]
    records = [record for record in read_metrics(run_dir) if metrics.TIME_STEP in record]
    assert [record["step"] for record in records] == list(range(1, num_steps + 1))
    sound, lines = audit_run(run_dir)
    assert sound, lines
    prompts = read_summary(run_dir)["prompts"]
    assert prompts["trained"] == 2 * num_steps
    parts = ("trained", "handed_back", "dropped", "inflight", "buffered")
    assert prompts["issued"] == sum(prompts[part] for part in parts)
    wait_until(lambda: not leftovers(tiny_llama_path), 60, "the end of every process of the run")
