"""A run over two Ray nodes at distinct addresses, started with `ray start` as on two hosts: the actor on the
head (127.0.0.3), the engine on the other node (127.0.0.2), bound to that node's address only. An engine URL,
a weight push or an agent loop aimed at any other address finds nothing listening there, so the run trains,
syncs its weights (by both transports) and evaluates only if every address was taken from where its part
runs. Device ids count over the nodes by address: 127.0.0.2 holds ids 0-1, the head 2-3.

Loopback addresses on one machine cannot tell a store bound to every interface (the weight-update group's,
a torch TCP store) from one bound to the right node; where the group meets is checked in the engine's log
instead. The actor is a single rank, so no store of actor ranks is started
(`test_runner_data_parallel` checks where two ranks meet).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from ray_nodes import RayNodes, ray_nodes
from runner_testing import read_metrics, read_summary, run_config

from asyncrl_core import metrics
from asyncrl_core.runner import run
from asyncrl_sglang.launcher import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

ACTOR_NODE = "127.0.0.3"
ENGINE_NODE = "127.0.0.2"


@pytest.fixture(scope="module")
def two_hosts() -> Iterator[RayNodes]:
    pytest.importorskip("ray")
    with ray_nodes(
        [ACTOR_NODE, ENGINE_NODE],
        num_cpus=2,
        resources=[{"asyncrl_test_actor_node": 1}, {"asyncrl_test_engine_node": 1}],
    ) as nodes:
        yield nodes


def _run_on_two_hosts(tmp_path: Path, model_path: Path, nodes: RayNodes, weight_transport: str) -> Path:
    config = run_config(
        tmp_path,
        model_path,
        runner={
            "ray_address": nodes.address,
            "async_mode": True,
            "num_steps": 2,
            "seed": 3,
            "run_dir": str(tmp_path / "run"),
            "eval_every_steps": 2,
        },
        # 127.0.0.2 holds ids 0-1 (its cores 0-1), the head 127.0.0.3 ids 2-3.
        cluster={"num_devices": 4, "component_placement": {"actor": 2, "rollout": 1}},
        rollout={
            "max_running_requests": 8,
            "request_timeout_s": 240,
            "sglang": {
                "launch": "builtin",
                "weight_transport": weight_transport,
                "base_port": free_port(ENGINE_NODE),
            },
            "sampling": {"max_new_tokens": 16},
        },
    )
    return run(config)


def _check_run(run_dir: Path) -> str:
    """The checks both transports share; returns the engine's log."""
    records = read_metrics(run_dir)
    steps = [record for record in records if metrics.TIME_STEP in record]
    assert len(steps) == 2
    assert all(metrics.TIME_SYNC_WEIGHTS in record for record in steps)
    assert any(metrics.EVAL_REWARD_MEAN in record for record in records)
    summary = read_summary(run_dir)
    assert summary["version"] == 2
    nodes = summary["nodes"]
    assert nodes["actor"] == [ACTOR_NODE]
    assert nodes["rollout"] == [ENGINE_NODE]
    assert "actor_master" not in nodes  # a single actor rank meets nobody
    assert len(nodes["engines"]) == 1
    assert nodes["engines"][0].startswith(f"http://{ENGINE_NODE}:")
    log = (run_dir / "rollout-0" / "engines" / "engine-0.log").read_text(encoding="utf-8")
    # Bound to its node's address, not to every interface nor to loopback's usual 127.0.0.1.
    assert f"listening on {nodes['engines'][0]}" in log
    return log


def test_tensor_transport_across_hosts(tmp_path: Path, tiny_llama_path: Path, two_hosts: RayNodes) -> None:
    log = _check_run(_run_on_two_hosts(tmp_path, tiny_llama_path, two_hosts, "tensor"))
    assert "joined the weight update group" not in log


def test_distributed_transport_across_hosts(
    tmp_path: Path, tiny_llama_path: Path, two_hosts: RayNodes
) -> None:
    log = _check_run(_run_on_two_hosts(tmp_path, tiny_llama_path, two_hosts, "distributed"))
    # The engine met the trainer at the actor's node.
    joined = re.findall(r"joined the weight update group '[^']+' at ([^:\s]+):\d+ as rank 1 of 2", log)
    assert joined == [ACTOR_NODE]
