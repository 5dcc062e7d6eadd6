"""Placement without Ray: device ids numbered over the nodes by address, the address an engine binds to and
the one its URL carries, and the errors of a worker whose devices are not where it can run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from asyncrl_core.config import load_config
from asyncrl_core.runner.placement import (
    LOOPBACK,
    Placement,
    advertised_host,
    engine_bind_host,
    node_address,
    number_devices,
)
from asyncrl_core.runner.workers import RunnerError, weight_transport

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def _node(node_id: str, address: str, *, gpus: int = 8, cpus: int = 64, head: bool = False) -> dict[str, Any]:
    resources: dict[str, float] = {"GPU": gpus, "CPU": cpus}
    if head:
        resources["node:__internal_head__"] = 1.0
    return {"NodeID": node_id, "NodeManagerAddress": address, "Alive": True, "Resources": resources}


def test_ids_follow_the_node_addresses_not_the_head_or_the_random_node_ids() -> None:
    nodes = [
        _node("ff", "10.0.0.10", head=True),
        _node("00", "10.0.0.2", gpus=4),
        {**_node("aa", "10.0.0.1"), "Alive": False},
        _node("11", "10.0.0.9", gpus=0),
    ]
    numbered = number_devices(nodes, "gpu")
    assert [(node.address, node.first_id, node.num_devices) for node in numbered] == [
        ("10.0.0.2", 0, 4),
        ("10.0.0.9", 4, 0),
        ("10.0.0.10", 4, 8),
    ]
    # Restarted, the same hosts get new node ids and keep their device ids.
    renamed = [{**node, "NodeID": node["NodeID"][::-1] + "x"} for node in nodes]
    assert [node.first_id for node in number_devices(renamed, "gpu")] == [0, 4, 4]
    assert [node.num_devices for node in number_devices(nodes, "cpu")] == [64, 64, 64]


def test_nodes_sharing_an_address_put_the_head_first() -> None:
    nodes = [_node("00", "127.0.0.1"), _node("ff", "127.0.0.1", head=True)]
    assert [node.node_id for node in number_devices(nodes, "gpu")] == ["ff", "00"]


def test_engines_bind_to_loopback_alone_and_to_their_node_in_a_cluster() -> None:
    assert engine_bind_host(None, "10.0.0.2", num_nodes=1) == LOOPBACK
    assert engine_bind_host(None, "10.0.0.2", num_nodes=2) == "10.0.0.2"
    assert engine_bind_host("0.0.0.0", "10.0.0.2", num_nodes=2) == "0.0.0.0"
    assert advertised_host("0.0.0.0", "10.0.0.2") == "10.0.0.2"
    assert advertised_host("::", "10.0.0.2") == "10.0.0.2"
    assert advertised_host("10.0.0.2", "10.0.0.7") == "10.0.0.2"


def _two_hosts() -> Placement:
    config = load_config(
        EXAMPLES / "searchr1-gpu.yaml",
        ["cluster.num_devices=16", "cluster.component_placement={actor: 0-7, rollout: 8-15}"],
    )
    return Placement(config, number_devices([_node("b", "10.0.0.2"), _node("a", "10.0.0.1")], "gpu"))


def test_a_worker_with_devices_on_two_nodes_is_refused_naming_them() -> None:
    placement = _two_hosts()
    assert placement.layout() == "10.0.0.1: ids 0-7, 10.0.0.2: ids 8-15"
    with pytest.raises(RunnerError, match=r"engine 0 are not all on one node \(the nodes hold 10\.0\.0\.1"):
        placement.slot([7, 8], "engine 0")
    with pytest.raises(RunnerError, match="device 16 of the actor rank 3 is not in the cluster"):
        placement.slot([16], "actor rank 3")


def test_outside_ray_the_weight_update_group_meets_on_loopback() -> None:
    assert node_address() == LOOPBACK
    config = load_config(EXAMPLES / "searchr1-mini.yaml", ["rollout.sglang.weight_transport=distributed"])
    assert weight_transport(config).master_address == LOOPBACK
