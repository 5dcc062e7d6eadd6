"""What our Triton kernels (`fused_kernels.py`, `decode_attention.py`, `extend_attention.py`) share: one lazy
builder, one check that a family runs on a device, and the block sizes of their launches.

Each family defines its kernels inside a `build` function that imports Triton, so that importing the engine
never imports Triton (absent on CPU-only installs) and nothing is compiled before a kernel is first launched.
Each has a torch reference the model keeps where the kernels cannot run: on CPU, without Triton, or where a
first launch on the device (compiled on the spot) differs from that reference.

Block sizes: a `tl.arange` range must be a power of two, and a `tl.dot` operand needs at least 16 along each
axis. A size padded up to one of these has its extra columns or rows masked in the kernel.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

logger = logging.getLogger(__name__)

K = TypeVar("K")


class LazyKernels(Generic[K]):
    """A family's kernels, built by `build` (which imports Triton and defines them with `@triton.jit`) at the
    first call and kept for the process: `kernels()` returns them. Triton compiles each kernel at its first
    launch for a given specialisation, not here."""

    def __init__(self, build: Callable[[], K]) -> None:
        self._build = build
        self._kernels: K | None = None

    def __call__(self) -> K:
        if self._kernels is None:
            self._kernels = self._build()
        return self._kernels


class KernelCheck:
    """`check(device)` runs the kernels once on `device` against their torch reference and raises where they
    differ (or where Triton cannot be imported or compiles nothing). Calling the `KernelCheck` answers whether
    the kernels run on a device: CUDA and a check that passed there. The check runs at the first call for each
    device; a failure is logged once, naming `kernels` and what the model does instead (`fallback`)."""

    def __init__(self, kernels: str, fallback: str, check: Callable[[torch.device], None]) -> None:
        self.kernels = kernels
        self.fallback = fallback
        self._check = check
        self._passed: dict[torch.device, bool] = {}

    def __call__(self, device: torch.device) -> bool:
        if device.type != "cuda":
            return False
        if device not in self._passed:
            try:
                self._check(device)
            except Exception as error:
                logger.warning("%s unavailable on %s (%s): %s", self.kernels, device, error, self.fallback)
                self._passed[device] = False
            else:
                self._passed[device] = True
        return self._passed[device]


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


def dot_size(n: int) -> int:
    """The smallest power of two >= n and >= 16: an axis of a `tl.dot` operand."""
    return max(16, next_power_of_2(n))
