"""Megatron-Core on a machine without a GPU: the few CUDA-only calls it makes, redirected to the CPU.

Megatron-Core assumes CUDA in a handful of places that a CPU run with the gloo backend reaches. Everything
else (layers, tensor-parallel mappings, vocab-parallel cross-entropy, the optimizer) is device-agnostic once
these are redirected. `enable()` patches exactly the following, and only when `torch.cuda.is_available()` is
false; on a GPU it does nothing, so GPU runs execute Megatron unmodified.

- `torch.cuda.current_device()` returns `torch.device("cpu")` instead of raising. Megatron uses it as the
  device for new tensors (rotary frequencies, gradient buffers, the optimizer's scalars).
- `megatron.core.fusions.fused_softmax.get_default_causal_mask` builds its mask with `device="cuda"`; the
  replacement builds the same upper-triangular mask on the CPU.
- The RNG tracker (`tensor_parallel.random`) stores and swaps CUDA generator states so that dropout in
  tensor-parallel regions differs across ranks. On the CPU the tracked states are CPU generator states:
  `_get_cuda_rng_state` / `_set_cuda_rng_state` read and write the CPU default generator, and
  `CudaRNGStatesTracker.add` seeds a CPU generator, so `model_parallel_cuda_manual_seed` works unchanged.
- `torch.cuda.synchronize()` does nothing instead of raising: `dist_checkpointing`'s save strategy calls it
  before it copies the shards to host memory, where there is nothing to wait for.

The patches are process-wide and irreversible by design: they are applied in worker processes that own
Megatron, before the model is built.
"""

from __future__ import annotations

import torch

_enabled = False


def needed() -> bool:
    """True when Megatron must run on the CPU (no usable CUDA device in this process)."""
    return not torch.cuda.is_available()


def enable() -> bool:
    """Apply the CPU redirections if no GPU exists; returns whether they are active. Idempotent."""
    global _enabled
    if _enabled or not needed():
        return _enabled
    import megatron.core.fusions.fused_softmax as fused_softmax
    from megatron.core.tensor_parallel import random as megatron_random

    def current_device() -> torch.device:
        return torch.device("cpu")

    def default_causal_mask(sq: int) -> torch.Tensor:
        # True above the diagonal: the positions a query may not attend to.
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    def get_rng_state(
        device: int | str | torch.device = "cuda", clone: bool = False, graph_safe: bool = False
    ) -> torch.Tensor:
        del device, graph_safe
        state = torch.get_rng_state()
        return state.clone() if clone else state

    def set_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        del device, graph_safe
        torch.set_rng_state(new_state)

    def add(self: megatron_random.CudaRNGStatesTracker, name: str, seed: int) -> None:
        # Same bookkeeping and errors as the CUDA version, with a CPU generator state.
        self._is_initialized = True  # pyright: ignore[reportAttributeAccessIssue, reportPrivateUsage]
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} is already tracked")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} is already tracked")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    def synchronize(device: object = None) -> None:
        del device

    torch.cuda.current_device = current_device
    torch.cuda.synchronize = synchronize
    fused_softmax.get_default_causal_mask = default_causal_mask
    megatron_random._get_cuda_rng_state = get_rng_state  # pyright: ignore[reportPrivateUsage]
    megatron_random._set_cuda_rng_state = set_rng_state  # pyright: ignore[reportPrivateUsage]
    megatron_random.CudaRNGStatesTracker.add = add
    _enabled = True
    return True
