"""Whether a family of our Triton kernels runs on a device, checked once per device.

The model's Triton kernels (`fused_kernels.py`, `decode_attention.py`, `extend_attention.py`) each have a
torch reference the model keeps where they cannot run: on CPU, without Triton, or where a first launch on the
device (compiled on the spot) differs from that reference. `KernelCheck` holds that rule once for all of them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


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
