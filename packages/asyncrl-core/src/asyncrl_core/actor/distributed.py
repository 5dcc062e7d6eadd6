"""Data parallelism for the torch actor: one process per device, joined by `torch.distributed`.

Every rank builds the same `TorchActor` and is given its share of the step's rows (or the step's groups,
which it cuts the same way: `asyncrl_core.shares`), and DDP averages the gradients (gloo on CPU, NCCL on
GPU). Whoever starts the ranks (the actor group, `asyncrl_megatron.parallel.spawn`, a test) hosts the store
they meet at (`host_store`) and keeps it while they live; each rank calls `init_process_group` first and
`destroy_process_group` at the end.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # pyright: ignore[reportPrivateImportUsage] (documented, no __all__)

from asyncrl_core.errors import AsyncRLError

DeviceType = Literal["cpu", "cuda"]


@dataclass(frozen=True, slots=True)
class ProcessGroupSettings:
    """Where the ranks of one actor meet: the TCP store on `address:port` that whoever started them hosts
    (`host_store`)."""

    rank: int
    world_size: int
    port: int
    address: str = "127.0.0.1"
    timeout_s: float = 300.0
    """Longest wait for all ranks to join, and for any collective operation afterwards."""


def backend_for(device_type: DeviceType) -> str:
    """The collective backend for a device type: `nccl` for CUDA, `gloo` for CPU."""
    return "nccl" if device_type == "cuda" else "gloo"


def host_store(address: str, timeout_s: float) -> TCPStore:
    """Serve the TCP store a world of ranks meets at, on `address` and a port the system gives when it binds
    (the store's `port`): no other process can take that port first, as one can take a port probed free
    and bound later. The server lives as long as the returned store: keep it while the ranks do.

    Multi-tenant, so that this process can also join the world as rank 0 through torch's own rendezvous on
    that port (`tcp://`, `env://`, the weight-update group), sharing the server instead of binding again.
    """
    return TCPStore(
        address,
        0,
        is_master=True,
        wait_for_workers=False,
        multi_tenant=True,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def init_process_group(settings: ProcessGroupSettings, device_type: DeviceType) -> None:
    """Join this process to the actor's process group (blocks until all ranks joined or the timeout).

    Every rank, rank 0 too, joins as a client of the store whoever started the ranks hosts (`host_store`).
    On CUDA, call it after `torch.cuda.set_device` so NCCL binds this rank's device.
    """
    if dist.is_initialized():
        raise AsyncRLError("torch.distributed is already initialised in this process")
    if not 0 <= settings.rank < settings.world_size:
        raise AsyncRLError(f"rank {settings.rank} is outside a world of {settings.world_size}")
    timeout = datetime.timedelta(seconds=settings.timeout_s)
    try:
        store = TCPStore(settings.address, settings.port, is_master=False, timeout=timeout)
    except RuntimeError as error:  # torch.distributed.DistNetworkError, DistStoreError
        raise AsyncRLError(
            f"rank {settings.rank} could not reach the store of its world at "
            f"{settings.address}:{settings.port} within {settings.timeout_s:.0f} s: {error}"
        ) from error
    dist.init_process_group(
        backend=backend_for(device_type),
        store=store,
        rank=settings.rank,
        world_size=settings.world_size,
        timeout=timeout,
    )


def settings_from_environment(timeout_s: float) -> ProcessGroupSettings | None:
    """The group a launcher (the runner's actor group, `asyncrl_megatron.parallel.spawn`) put this process in
    through `RANK`, `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT`, the launcher hosting the store there; None
    when `WORLD_SIZE` is absent or 1."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return None
    try:
        return ProcessGroupSettings(
            rank=int(os.environ["RANK"]),
            world_size=world_size,
            port=int(os.environ["MASTER_PORT"]),
            address=os.environ.get("MASTER_ADDR", "127.0.0.1"),
            timeout_s=timeout_s,
        )
    except (KeyError, ValueError) as error:
        raise AsyncRLError(
            f"WORLD_SIZE is {world_size} but RANK and MASTER_PORT are not both set to integers: {error}"
        ) from None


def destroy_process_group() -> None:
    """Leave the process group, if this process is in one."""
    if dist.is_initialized():
        dist.destroy_process_group()


def world() -> tuple[int, int]:
    """`(rank, world_size)` of this process: `(0, 1)` outside a process group."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """The element-wise sum of `values` over all ranks (in place; a no-op with one rank)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def barrier() -> None:
    """Wait until every rank got here (a no-op with one rank)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def ranks_disagree(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The names whose tensor differs on some rank from rank 0's (empty with one rank). A collective: every
    rank calls it with the same names in the same order.

    Data-parallel ranks apply the same averaged gradient to the same weights, so their weights and optimiser
    state stay equal bit for bit; a difference is a bug that a checkpoint (rank 0's copy) would hide. Each
    tensor is compared by its sum and sum of squares in float64, computed where it lives (equal tensors give
    equal sums; different ones almost surely do not), so only two numbers per tensor cross the network.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return []
    names: list[str] = []
    rows: list[torch.Tensor] = []
    for name, tensor in named:
        values = tensor.detach().to(torch.float64)
        names.append(name)
        rows.append(torch.stack([values.sum(), values.square().sum()]).cpu())
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    fingerprint = (torch.stack(rows) if rows else torch.zeros(0, 2, dtype=torch.float64)).to(device)
    gathered = [torch.empty_like(fingerprint) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, fingerprint)
    agree = torch.stack([torch.eq(other, gathered[0]).all(dim=1) for other in gathered]).all(dim=0)
    return [name for name, same in zip(names, agree.tolist(), strict=True) if not same]
