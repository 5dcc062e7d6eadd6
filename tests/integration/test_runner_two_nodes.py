"""A run on a two-node local Ray cluster (`ray.cluster_utils.Cluster`): the actor on one node, the rollout
on the other, joined through `runner.ray_address` as a user joins a cluster started with `ray start`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from runner_testing import read_metrics, read_summary, run_config

from asyncrl_core import metrics
from asyncrl_core.runner import run

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[Any]:
    pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    yield cluster
    import ray

    ray.shutdown()
    cluster.shutdown()


def test_actor_and_rollout_on_different_nodes(tmp_path: Path, tiny_llama_path: Path, two_nodes: Any) -> None:
    import ray

    config = run_config(
        tmp_path,
        tiny_llama_path,
        runner={"ray_address": two_nodes.address},
        cluster={"num_devices": 2, "component_placement": {"actor": 0, "rollout": 1}},
    )
    run_dir = run(config)
    steps = [record for record in read_metrics(run_dir) if metrics.TIME_STEP in record]
    assert len(steps) == 2
    summary = read_summary(run_dir)
    assert summary["version"] == 2
    assert summary["nodes"]["actor"] != summary["nodes"]["rollout"]
    # The cluster outlives the run that joined it.
    assert len([node for node in ray.nodes() if node["Alive"]]) == 2
