"""Block sizes our Triton kernels (`fused_kernels.py`, `decode_attention.py`, `extend_attention.py`) share:
a `tl.arange` range must be a power of two, and a `tl.dot` operand needs at least 16 along each axis. A size
padded up to one of these has its extra columns or rows masked in the kernel."""

from __future__ import annotations


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


def dot_size(n: int) -> int:
    """The smallest power of two >= n and >= 16: an axis of a `tl.dot` operand."""
    return max(16, next_power_of_2(n))
