"""The PyTorch actor (the embedded default training backend) and its data-parallel helpers.

Importing this package imports torch; only actor workers do.
"""

from asyncrl_core.actor.distributed import (
    ProcessGroupSettings,
    destroy_process_group,
    host_store,
    init_process_group,
)
from asyncrl_core.actor.torch_actor import TorchActor
from asyncrl_core.actor.warm_start import warm_start
from asyncrl_core.errors import ActorError

__all__ = [
    "ActorError",
    "ProcessGroupSettings",
    "TorchActor",
    "destroy_process_group",
    "host_store",
    "init_process_group",
    "warm_start",
]
