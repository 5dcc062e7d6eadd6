"""The run's rollout backend, found by `rollout.rollout_backend` in the entry-point group
`asyncrl.rollout_backends` (or as `module:attr`), and the weight group the runner gives it.

Core names no backend package: asyncrl-sglang declares `sglang` as an entry point like any third-party
backend would.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from asyncrl_core import plugins
from asyncrl_core.errors import PluginError
from asyncrl_core.protocols import WeightGroup

if TYPE_CHECKING:
    from collections.abc import Callable

    from asyncrl_core.config import AsyncRLConfig
    from asyncrl_core.protocols import RolloutBackend


def rollout_backend(config: AsyncRLConfig) -> RolloutBackend:
    """The backend `rollout.rollout_backend` names, built for `config` (its plugin's module is imported
    now, in the worker that needs it)."""
    factory = plugins.load("asyncrl.rollout_backends", config.rollout.rollout_backend)
    if not callable(factory):
        raise PluginError(
            f"`asyncrl.rollout_backends`: {config.rollout.rollout_backend!r} is not a factory of backends "
            f"(got {factory!r})"
        )
    return cast("Callable[[AsyncRLConfig], RolloutBackend]", factory)(config)


def weight_group(config: AsyncRLConfig) -> WeightGroup:
    """Where this process (actor rank 0) hosts a broadcast weight sync: its node's address, on a port the
    system gives the store when it binds (0), NCCL between separate GPUs and gloo on CPUs or where trainer and
    engines share a GPU (NCCL forms no group with two ranks on one device), bounded by
    `actor.train_timeout_s`."""
    from asyncrl_core.runner.placement import node_address

    cluster = config.cluster
    shared = set(cluster.devices_of("actor")) & set(cluster.devices_of("rollout"))
    nccl = cluster.device_type == "gpu" and not shared
    address = node_address()
    return WeightGroup(
        master_address=address,
        master_port=0,
        backend="nccl" if nccl else "gloo",
        device="cuda" if nccl else "cpu",
        timeout_s=config.actor.train_timeout_s,
    )
