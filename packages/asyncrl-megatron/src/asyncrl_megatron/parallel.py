"""Process groups for the Megatron actor: torch.distributed (NCCL on GPUs, gloo on CPUs) and Megatron's
tensor / data parallel groups.

A worker launched by a launcher (the runner's actor group, `spawn`) finds `RANK`, `WORLD_SIZE`, `MASTER_ADDR`
and `MASTER_PORT` in its environment, where the launcher hosts the store its world meets at
(`asyncrl_core.actor.distributed`); a single process without them becomes a world of one on a store of its
own, in memory.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import HashStore  # pyright: ignore[reportPrivateImportUsage] (documented, no __all__)

from asyncrl_core.actor.distributed import (
    backend_for,
    host_store,
    init_process_group,
    settings_from_environment,
)
from asyncrl_megatron import _cpu
from asyncrl_megatron.model import megatron_warnings_ignored

DEFAULT_TIMEOUT_S = 600.0


def initialize(tensor_parallel_size: int = 1, *, seed: int = 0, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Start torch.distributed if needed, then Megatron's model-parallel groups and RNG tracker.

    On a machine without a GPU the CPU adaptation (`asyncrl_megatron._cpu`) is applied first. Re-entering
    with the same `tensor_parallel_size` is a no-op; a different one is an error.
    """
    with megatron_warnings_ignored():
        _cpu.enable()
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        settings = settings_from_environment(timeout_s)
        if settings is not None:
            init_process_group(settings, device_type)
        else:
            dist.init_process_group(
                backend=backend_for(device_type),
                store=HashStore(),
                rank=0,
                world_size=1,
                timeout=timedelta(seconds=timeout_s),
            )
    world_size = dist.get_world_size()
    if world_size % tensor_parallel_size:
        raise ValueError(
            f"tensor_parallel_size {tensor_parallel_size} must divide the world size {world_size}"
        )
    if parallel_state.model_parallel_is_initialized():
        current = parallel_state.get_tensor_model_parallel_world_size()
        if current != tensor_parallel_size:
            raise ValueError(
                f"model parallelism is already initialised with tensor_parallel_size {current}, "
                f"not {tensor_parallel_size}"
            )
        return
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel_size, pipeline_model_parallel_size=1
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def process_group(group: object) -> dist.ProcessGroup:
    """A group Megatron returned, checked to be a real group this rank belongs to."""
    if not isinstance(group, dist.ProcessGroup):
        raise RuntimeError(f"this rank is not a member of the expected process group (got {group!r})")
    return group


def destroy() -> None:
    """Tear down Megatron's groups and torch.distributed (for tests that build several worlds in turn)."""
    with megatron_warnings_ignored():
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _spawned_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: Sequence[Any],
    results: Any,
    collected: Any,
) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    try:
        value = fn(*args)
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        raise SystemExit(1) from None
    results.put((rank, True, value))
    # Tensors travel as shared-memory handles owned by this process: stay alive until the parent has them.
    collected.wait(timeout=600)


def spawn(
    fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (), *, timeout_s: float
) -> list[Any]:
    """Run `fn(*args)` in `world_size` fresh processes forming one torch.distributed world on loopback.

    Each process gets `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT`, where this
    process hosts the world's store while they run, so `initialize()` inside `fn` joins the world. Returns
    the ranks' return values (which must be picklable), in rank order. If a rank raises, or the whole run
    exceeds `timeout_s`, every process still alive is killed and a `RuntimeError` carries the failing rank's
    traceback.
    """
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    collected = context.Event()
    store = host_store("127.0.0.1", timeout_s)  # kept until the ranks are gone
    port = store.port
    # Not daemonic: Megatron's checkpoint writer starts processes of its own, which a daemon may not. Every
    # process is killed in the `finally` below whatever happens.
    processes = [
        context.Process(target=_spawned_main, args=(fn, rank, world_size, port, args, results, collected))
        for rank in range(world_size)
    ]
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        for process in processes:
            process.start()
        while len(values) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(f"spawned world of {world_size} did not finish within {timeout_s} s")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(
                        f"a spawned rank exited with code {dead[0]} without a result"
                    ) from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            values[rank] = value
        collected.set()
        for process in processes:
            process.join(timeout=max(deadline - time.monotonic(), 1.0))
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=10)
        results.close()
    return [values[rank] for rank in range(world_size)]
