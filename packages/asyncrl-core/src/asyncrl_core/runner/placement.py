"""Where each worker of a run runs: Ray placement groups over the devices `cluster.component_placement` names,
and the addresses the workers reach each other at.

**Device ids.** Ids are global over the Ray cluster's alive nodes, taken in the order of the nodes' addresses
(numerically: `10.0.0.2` before `10.0.0.10`; nodes that share an address, as on a test machine, head first
and then by node id). Node `k` holds the next `n` ids, `n` being its GPU count (`device_type: gpu`) or its CPU
count, so the ids of a cluster stay the same when it restarts (Ray's node ids do not).

**Reservation.** The run reserves the devices it uses with one placement group per node, `STRICT_PACK`, a
bundle per device (`{"GPU": 1}`, or `{"CPU": 1}` for CPU cores), each bundle pinned to its node by the node-id
label, so no other Ray job is given them while the run lasts. Every worker runs in the bundle of its first
device, asking Ray for no resources of its own, and uses its ids itself: GPU ids become
`CUDA_VISIBLE_DEVICES` (Ray is told not to set it), CPU ids the process's core affinity. One worker's devices
(an engine's tensor-parallel devices, one actor rank's) must be on one node; a component may span nodes.

**Addresses.** Whatever other workers connect to is addressed by the node it runs on, never by a constant:
- an engine binds to `rollout.sglang.host` when it is set; unset, to loopback (`127.0.0.1`) when the cluster
  has one node, and to its node's address when the cluster has several, so the actor and the agent loops
  on other nodes reach it. Its URL carries the address it bound, or its node's address when it binds every
  interface (`0.0.0.0`). Its port is picked on its node by the launcher;
- the actor ranks (when there are several) meet at a store on rank 0's node (`MASTER_ADDR`), which a worker
  of its own hosts there for the run, on a port the system gave it when it bound (`rendezvous`);
- the weight-update group of the `distributed` transport meets at actor rank 0, which hosts its store on
  its node's address and a port it picks there itself.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asyncrl_core.runner.workers import RunnerError

if TYPE_CHECKING:
    from asyncrl_core.config import AsyncRLConfig

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
WILDCARDS = ("0.0.0.0", "::")
"""Bind addresses meaning every interface: a URL then names the node's own address."""
NODE_ID_LABEL = "ray.io/node-id"
"""The label every Ray node carries with its id; a bundle selecting it is placed on that node."""
RESERVE_POLL_S = 10.0
"""How often the wait for the placement groups says what it still waits for."""


@dataclass(frozen=True, slots=True)
class NodeDevices:
    """One Ray node: its id, its address, and the global ids of its devices."""

    node_id: str
    address: str
    first_id: int
    num_devices: int
    is_head: bool = False

    def holds(self, device: int) -> bool:
        return self.first_id <= device < self.first_id + self.num_devices

    @property
    def ids_text(self) -> str:
        if self.num_devices == 0:
            return f"{self.address}: no devices"
        return f"{self.address}: ids {self.first_id}-{self.first_id + self.num_devices - 1}"


def _address_key(address: str) -> tuple[int, int, str]:
    """Numeric order of IPv4 before IPv6 addresses; host names after both, by text."""
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return (2, 0, address)
    return (parsed.version // 6, int(parsed), address)


def number_devices(nodes: Sequence[Mapping[str, Any]], device_type: str) -> list[NodeDevices]:
    """The alive nodes of `ray.nodes()` in address order with the global device ids each holds."""
    resource = "GPU" if device_type == "gpu" else "CPU"
    alive = [node for node in nodes if node.get("Alive")]

    def order(node: Mapping[str, Any]) -> tuple[tuple[int, int, str], bool, str]:
        head = bool(node.get("Resources", {}).get("node:__internal_head__"))
        return (_address_key(str(node["NodeManagerAddress"])), not head, str(node["NodeID"]))

    found: list[NodeDevices] = []
    first = 0
    for node in sorted(alive, key=order):
        resources = node.get("Resources", {})
        count = int(resources.get(resource, 0))
        head = bool(resources.get("node:__internal_head__"))
        found.append(NodeDevices(str(node["NodeID"]), str(node["NodeManagerAddress"]), first, count, head))
        first += count
    return found


def cluster_devices(device_type: str) -> list[NodeDevices]:
    """The cluster's alive nodes with their global device ids (`number_devices` over `ray.nodes()`)."""
    import ray

    return number_devices(ray.nodes(), device_type)


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one worker runs: its node, its devices' ids on that node, and the bundle it runs in (none for a
    worker without devices)."""

    node: NodeDevices
    local_devices: tuple[int, ...]
    bundle: tuple[Any, int] | None = None
    """`(placement group, bundle index)`."""


def engine_bind_host(configured: str | None, node_address: str, num_nodes: int) -> str:
    """The address an engine binds to: `rollout.sglang.host` when set, else loopback on a one-node cluster
    and the engine's node address on a cluster of several nodes."""
    if configured is not None:
        return configured
    return LOOPBACK if num_nodes == 1 else node_address


def advertised_host(bind_host: str, node_address: str) -> str:
    """The host of an engine's URL: the address it binds, or its node's address when it binds every
    interface."""
    return node_address if bind_host in WILDCARDS else bind_host


class Placement:
    """The run's placement groups and the node of every worker.

    `reserve` creates them (and waits until Ray has reserved every bundle); `slot` says where a worker with
    given devices runs; `remove` gives the devices back.
    """

    def __init__(self, config: AsyncRLConfig, nodes: Sequence[NodeDevices]) -> None:
        self.config = config
        self.nodes = list(nodes)
        self.gpu = config.cluster.device_type == "gpu"
        self._groups: dict[str, Any] = {}
        """Node id -> its placement group."""
        self._bundle_of: dict[int, tuple[str, int]] = {}
        """Global device id -> (node id, bundle index)."""
        heads = [node for node in self.nodes if node.is_head] or self.nodes
        self._head = heads[0] if heads else None

    @classmethod
    def reserve(cls, config: AsyncRLConfig, timeout_s: float) -> Placement:
        """Number the cluster's devices and reserve those the placement uses, one `STRICT_PACK` placement
        group per node; raises `RunnerError` naming the devices when Ray cannot reserve them in
        `timeout_s`."""
        placement = cls(config, cluster_devices(config.cluster.device_type))
        try:
            placement._reserve(timeout_s)
        except BaseException:
            placement.remove()
            raise
        return placement

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    def node_of(self, device: int, what: str) -> NodeDevices:
        for node in self.nodes:
            if node.holds(device):
                return node
        raise RunnerError(
            f"cluster.component_placement: device {device} of the {what} is not in the cluster; the nodes "
            f"hold {self.layout()}"
        )

    def layout(self) -> str:
        """The nodes and their ids, for messages: `10.0.0.1: ids 0-7, 10.0.0.2: ids 8-15`."""
        return ", ".join(node.ids_text for node in self.nodes) or "no nodes"

    def _used_devices(self) -> list[int]:
        cluster = self.config.cluster
        used = set(cluster.devices_of("actor"))
        if self.config.rollout.sglang.launch != "external":
            used |= set(cluster.devices_of("rollout"))
        return sorted(used)

    def _reserve(self, timeout_s: float) -> None:
        import ray
        from ray.util.placement_group import placement_group

        per_node: dict[str, list[int]] = {}
        for device in self._used_devices():
            per_node.setdefault(self.node_of(device, "run").node_id, []).append(device)
        resource = "GPU" if self.gpu else "CPU"
        for node_id, devices in per_node.items():
            self._groups[node_id] = placement_group(
                [{resource: 1.0} for _ in devices],
                strategy="STRICT_PACK",
                name=f"asyncrl-{self.config.runner.name}-{node_id[:8]}",
                bundle_label_selector=[{NODE_ID_LABEL: node_id} for _ in devices],
            )
            for index, device in enumerate(devices):
                self._bundle_of[device] = (node_id, index)
        deadline = time.monotonic() + timeout_s
        for node_id, group in self._groups.items():
            node = next(node for node in self.nodes if node.node_id == node_id)
            devices = [device for device, (owner, _) in self._bundle_of.items() if owner == node_id]
            while True:
                remaining_s = deadline - time.monotonic()
                ready, _ = ray.wait([group.ready()], timeout=max(0.0, min(RESERVE_POLL_S, remaining_s)))
                if ready:
                    break
                what = f"{len(devices)} {resource} of node {node.address} (ids {devices})"
                if remaining_s <= RESERVE_POLL_S:
                    raise RunnerError(
                        f"Ray did not reserve {what} within {timeout_s:.0f} s (runner.startup_timeout_s): "
                        "other Ray jobs hold them, or the node has fewer; free them or change "
                        "cluster.component_placement"
                    )
                logger.warning("waiting for Ray to reserve %s for the run", what)

    def slot(self, devices: Sequence[int], what: str) -> Slot:
        """Where the worker of `devices` (`what`, for messages: `engine 1`, `actor rank 0`) runs; every one of
        its devices must be on one node."""
        if not devices:
            raise RunnerError(f"the {what} has no devices")
        node = self.node_of(devices[0], what)
        elsewhere = [device for device in devices if not node.holds(device)]
        if elsewhere:
            raise RunnerError(
                f"cluster.component_placement: the devices {list(devices)} of the {what} are not all on one "
                f"node (the nodes hold {self.layout()}); place each engine's and each actor rank's devices "
                "on one node"
            )
        node_id, index = self._bundle_of[devices[0]]
        local = tuple(device - node.first_id for device in devices)
        return Slot(node, local, (self._groups[node_id], index))

    def head_slot(self) -> Slot:
        """A slot without devices on the head node (the buffer worker)."""
        if self._head is None:
            raise RunnerError("the Ray cluster has no alive node")
        return Slot(self._head, ())

    def options(self, slot: Slot, devices: Sequence[int] | None = None) -> dict[str, Any]:
        """Ray options that run an actor in `slot` with `devices` (default: the slot's) as its GPUs, or
        nothing to set on a CPU, where the worker pins itself to its cores."""
        from ray.util.scheduling_strategies import (
            NodeAffinitySchedulingStrategy,
            PlacementGroupSchedulingStrategy,
        )

        local = slot.local_devices if devices is None else devices
        env = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1", "TOKENIZERS_PARALLELISM": "false"}
        if self.gpu and local:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(device) for device in local)
        strategy: Any
        if slot.bundle is not None:
            group, index = slot.bundle
            strategy = PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=index, placement_group_capture_child_tasks=False
            )
        else:
            strategy = NodeAffinitySchedulingStrategy(slot.node.node_id, soft=False)
        return {
            "num_cpus": 0,
            "num_gpus": 0,
            "scheduling_strategy": strategy,
            "runtime_env": {"env_vars": env},
        }

    def engine_host(self, slot: Slot) -> str:
        """The address the engine in `slot` binds to (`engine_bind_host`)."""
        return engine_bind_host(self.config.rollout.sglang.host, slot.node.address, self.num_nodes)

    def rendezvous(self, slot: Slot, timeout_s: float) -> tuple[Any, str, int]:
        """Start the store the actor ranks meet at on the node of `slot` (rank 0's): the handle of the worker
        hosting it, which the caller keeps while the ranks live and kills at the end, the address of its
        node as Ray knows it, and the port it bound. A worker of its own, since every rank blocks in its
        constructor until all have joined: none can host a store the others must know of first."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        store = ray.remote(RendezvousStore).options(**self.options(slot, ()))  # pyright: ignore[reportFunctionMemberAccess]
        host: Any = store.remote(timeout_s)
        try:
            address, port = ray.get(host.where.remote(), timeout=timeout_s)
        except (GetTimeoutError, RayActorError) as error:
            ray.kill(host)
            raise RunnerError(
                f"no store for the actor ranks on node {slot.node.address} within {timeout_s:.0f} s "
                f"(runner.startup_timeout_s): {error}"
            ) from error
        return host, str(address), int(port)

    def remove(self) -> None:
        """Give every reserved device back to Ray (idempotent)."""
        if not self._groups:
            return
        from ray.util.placement_group import remove_placement_group

        groups, self._groups = self._groups, {}
        for group in groups.values():
            try:
                remove_placement_group(group)
            except Exception as error:  # a cluster that went away took the groups with it
                logger.warning("could not remove a placement group: %s", error)


def node_address() -> str:
    """The address of the Ray node this process runs on; loopback outside Ray (a worker built in a test)."""
    import sys

    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return LOOPBACK
    return str(ray.util.get_node_ip_address())


class RendezvousStore:
    """Hosts the TCP store where the actor ranks meet, on the address of the node it runs on and a port the
    system gives it when it binds, for as long as it lives (`asyncrl_core.actor.distributed.host_store`)."""

    def __init__(self, timeout_s: float) -> None:
        from asyncrl_core.actor.distributed import host_store

        self.address = node_address()
        self.store = host_store(self.address, timeout_s)

    def where(self) -> tuple[str, int]:
        """`(address, port)` of the store."""
        return self.address, int(self.store.port)
