"""Data parallelism for the torch actor: one process per device, joined by `torch.distributed`.

Every rank builds the same `TorchActor` and is given its share of the step's rows (or the step's groups,
which it cuts the same way: `asyncrl_core.shares`), and DDP averages the gradients (gloo on CPU, NCCL on
GPU). Whoever starts the ranks (the actor group, or a test) calls `init_process_group` in each of them first
and `destroy_process_group` at the end.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from asyncrl_core.errors import AsyncRLError
from asyncrl_core.server_process import free_port as free_port  # re-exported

DeviceType = Literal["cpu", "cuda"]


@dataclass(frozen=True, slots=True)
class ProcessGroupSettings:
    """Where the ranks of one actor meet: a TCP store on `address:port`, served by rank 0."""

    rank: int
    world_size: int
    port: int
    address: str = "127.0.0.1"
    timeout_s: float = 300.0
    """Longest wait for all ranks to join, and for any collective operation afterwards."""


def backend_for(device_type: DeviceType) -> str:
    """The collective backend for a device type: `nccl` for CUDA, `gloo` for CPU."""
    return "nccl" if device_type == "cuda" else "gloo"


def init_process_group(settings: ProcessGroupSettings, device_type: DeviceType) -> None:
    """Join this process to the actor's process group (blocks until all ranks joined or the timeout).

    On CUDA, call it after `torch.cuda.set_device` so NCCL binds this rank's device.
    """
    if dist.is_initialized():
        raise AsyncRLError("torch.distributed is already initialised in this process")
    if not 0 <= settings.rank < settings.world_size:
        raise AsyncRLError(f"rank {settings.rank} is outside a world of {settings.world_size}")
    dist.init_process_group(
        backend=backend_for(device_type),
        init_method=f"tcp://{settings.address}:{settings.port}",
        rank=settings.rank,
        world_size=settings.world_size,
        timeout=datetime.timedelta(seconds=settings.timeout_s),
    )


def settings_from_environment(timeout_s: float) -> ProcessGroupSettings | None:
    """The group a launcher (the runner's actor group, torchrun) put this process in through `RANK`,
    `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT`; None when `WORLD_SIZE` is absent or 1."""
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
