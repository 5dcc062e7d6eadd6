"""The weight-update process group, joined the same way by the trainer (rank 0) and by the built-in engine.

SGLang's engines build this group with torch's `_new_process_group_helper` over a TCP store namespaced by the
group name (a `PrefixStore`); both ends must agree on that store layout, so both use the same helper. The
trainer hosts the store. The group is its own communicator: it neither needs nor touches the process's
default group. The helper is private, but every RL trainer speaking to SGLang uses it; its option argument
was renamed across torch releases (`pg_options`, then `backend_options`), so it is passed by position, which
has not changed.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    import torch.distributed as dist


def join_weight_update_group(
    *,
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str,
    backend: str,
    timeout_s: float,
) -> dist.ProcessGroup:
    """Join the group as `rank` (0 hosts the store); returns once every member has joined."""
    from torch._C._distributed_c10d import PrefixStore, TCPStore
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    is_master = rank == 0
    store = TCPStore(
        master_address, master_port, world_size, is_master=is_master, timeout=timeout, multi_tenant=is_master
    )
    prefixed = PrefixStore(group_name, store)
    helper = cast(
        Callable[..., tuple[object, object]],
        c10d._new_process_group_helper,  # pyright: ignore[reportPrivateUsage]
    )
    # (group_size, group_rank, global_ranks_in_group, backend, store, group_name, options, timeout)
    group, _ = helper(world_size, rank, [], c10d.Backend(backend), prefixed, group_name, None, timeout)
    if not isinstance(group, c10d.ProcessGroup):
        raise RuntimeError(f"torch did not create the process group {group_name!r} (got {group!r})")
    c10d._world.pg_group_ranks[group] = {r: r for r in range(world_size)}  # pyright: ignore[reportPrivateUsage]
    return group
