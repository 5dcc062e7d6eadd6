# The kernel's parameters are Triton's (pointers, strides, constexprs; Triton reads their annotations itself),
# so they carry no Python annotations:
# pyright: reportMissingParameterType=false, reportUnknownParameterType=false
"""Decode attention over each row's own length (a Triton kernel), for the CUDA decode step.

The decode step's SDPA call attends over a fixed length for every row (the KV capacity, so that one captured
CUDA graph serves every step) and masks what lies beyond each row: its cost is batch x capacity whatever the
rows' lengths, and under agentic load (contexts of 200-1,200 tokens in a cache of 1,264 positions) most of
what it reads is masked. This kernel reads each row's KV only up to its own length, which it takes from a
tensor at run time, so the captured graph stays one per batch size while the work follows the real lengths.

Layout: queries `[B, kv_heads, group, head_dim]` (the `group` query heads that share a KV head), keys and
values `[slots, kv_heads, capacity, head_dim]` (row b reads slot b), lengths `[B]` (row b attends to
positions `0..lengths[b]-1`). Each program handles one (row, KV head, split): the split's positions in blocks
of `BLOCK_N`, online softmax in float32. With few rows the positions are split over several programs
(flash-decoding) and the partial results are combined by their log-sum-exp.

Why a kernel of our own: no maintained paged/varlen decode kernel installs both on the CPU machines (CI)
and on the GPU machine (flash-attn and FlashInfer need a build for the exact torch and CUDA there, and
neither is installed there); torch's `flex_attention` needs `torch.compile` at every new shape. Triton ships
with torch's CUDA wheels. Without Triton (or on CPU) the engine keeps the masked SDPA.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from asyncrl_engine._kernels import KernelCheck, LazyKernels, dot_size

BLOCK_N = 64
"""Key positions per block of the kernel's loop."""
TARGET_PROGRAMS = 512
"""Splits are chosen so that rows x KV heads x splits reaches about this many programs (an H200 has 132
SMs): a small batch over long contexts still spreads over the GPU."""
MAX_SPLITS = 16


def _self_check(device: torch.device) -> None:
    _kernel()
    generator = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(3, 2, 3, 64, device=device, generator=generator)
    keys = torch.randn(3, 2, 100, 64, device=device, generator=generator)
    values = torch.randn(3, 2, 100, 64, device=device, generator=generator)
    lengths = torch.tensor([1, 64, 100], device=device)
    mask = (torch.arange(100, device=device) < lengths.unsqueeze(1)).view(3, 1, 1, 100)
    want = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    for splits in (1, 4):
        got = decode_attention(q, keys, values, lengths, splits)
        if not torch.allclose(got, want, atol=1e-4, rtol=1e-4):
            raise RuntimeError(f"differs from SDPA by {(got - want).abs().max().item():.3g}")


available = KernelCheck("the Triton decode kernel is", "decode uses SDPA", _self_check)
"""`available(device)`: whether the kernel runs on `device`: CUDA, Triton importable, and a first launch
there (compiled on the spot) equal to SDPA. Checked once per device; a failure is logged and the engine keeps
SDPA."""


def num_splits(batch: int, kv_heads: int) -> int:
    """Splits of each row's positions for a batch of `batch` rows (1 when the rows fill the GPU)."""
    return max(1, min(MAX_SPLITS, TARGET_PROGRAMS // max(1, batch * kv_heads)))


def decode_attention(
    q: Tensor, keys: Tensor, values: Tensor, lengths: Tensor, splits: int | None = None
) -> Tensor:
    """Attention of one query token per row over its own first `lengths[b]` positions.

    q [B, kv_heads, group, D]; keys, values [slots >= B, kv_heads, capacity, D] (last dim contiguous);
    lengths [B] int (each in 1..capacity). Returns [B, kv_heads, group, D] in q's dtype. Shapes and the
    launch depend only on B and the capacity (lengths are read on the GPU), so a CUDA graph replays it."""
    kernel = _kernel()
    batch, kv_heads, group, head_dim = q.shape
    if splits is None:
        splits = num_splits(batch, kv_heads)
    group_pad = dot_size(group)
    out = None
    if splits == 1:
        # One program per row and head: it divides by the softmax's denominator and writes the output in q's
        # dtype itself (no partials to combine, two launches fewer).
        out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
        partial = out.view(batch, kv_heads, 1, group, head_dim)
        max_logit = denominator = out[..., 0]
    else:
        partial = torch.empty(
            (batch, kv_heads, splits, group, head_dim), device=q.device, dtype=torch.float32
        )
        max_logit = torch.empty((batch, kv_heads, splits, group), device=q.device, dtype=torch.float32)
        denominator = torch.empty_like(max_logit)
    kernel[(batch, kv_heads, splits)](
        q,
        keys,
        values,
        lengths,
        partial,
        max_logit,
        denominator,
        *q.stride()[:3],
        *keys.stride()[:3],
        *values.stride()[:3],
        *partial.stride()[:4],
        *max_logit.stride()[:3],
        1.0 / math.sqrt(head_dim),
        splits,
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        # The columns past the head dim are masked.
        DIM_PAD=dot_size(head_dim),
        BLOCK_N=BLOCK_N,
        # float32 in IEEE precision (Triton's default for float32 dots is TF32), so float32 runs match SDPA.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FINAL=splits == 1,
    )
    if out is not None:
        return out
    # Combine the splits by their log-sum-exp (a split past its row's length has max -inf and weight 0).
    overall = max_logit.amax(dim=2, keepdim=True)
    weights = torch.exp(max_logit - overall)  # [B, H, S, G]
    total = (denominator * weights).sum(dim=2)  # [B, H, G]
    out = (partial * weights.unsqueeze(-1)).sum(dim=2) / total.unsqueeze(-1)
    return out.to(q.dtype)


def _build() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(  # pragma: no cover - runs on the GPU (or under TRITON_INTERPRET in the tests)
        q_ptr,
        k_ptr,
        v_ptr,
        lengths_ptr,
        out_ptr,
        max_ptr,
        den_ptr,
        stride_qb,
        stride_qh,
        stride_qg,
        stride_kb,
        stride_kh,
        stride_kt,
        stride_vb,
        stride_vh,
        stride_vt,
        stride_ob,
        stride_oh,
        stride_os,
        stride_og,
        stride_mb,
        stride_mh,
        stride_ms,
        scale,
        splits,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        DIM_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
        FINAL: tl.constexpr,
    ):
        row = tl.program_id(0)
        head = tl.program_id(1)
        split = tl.program_id(2)
        length = tl.load(lengths_ptr + row)
        # Each split covers a whole number of blocks.
        per_split = tl.cdiv(tl.cdiv(length, BLOCK_N), splits) * BLOCK_N
        start = split * per_split
        end = tl.minimum(start + per_split, length)

        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, DIM_PAD)
        n = tl.arange(0, BLOCK_N)
        columns = d[None, :] < HEAD_DIM
        rows = (g[:, None] < GROUP) & columns
        q = tl.load(
            q_ptr + row * stride_qb + head * stride_qh + g[:, None] * stride_qg + d[None, :],
            mask=rows,
            other=0.0,
        )
        k_base = k_ptr + row * stride_kb + head * stride_kh
        v_base = v_ptr + row * stride_vb + head * stride_vh
        m_i = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((GROUP_PAD,), dtype=tl.float32)
        acc = tl.zeros((GROUP_PAD, DIM_PAD), dtype=tl.float32)
        for block_start in range(start, end, BLOCK_N):
            positions = block_start + n
            valid = positions < end
            cells = valid[:, None] & columns
            k = tl.load(k_base + positions[:, None] * stride_kt + d[None, :], mask=cells, other=0.0)
            v = tl.load(v_base + positions[:, None] * stride_vt + d[None, :], mask=cells, other=0.0)
            # [GROUP_PAD, BLOCK_N], float32
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out_base = out_ptr + row * stride_ob + head * stride_oh + split * stride_os
        if FINAL:
            # The whole row in one split: the output itself, divided as torch divides (IEEE rounding) and
            # stored in out's dtype. Padded group rows (l_i = 0) are not stored.
            normalised = tl.math.div_rn(acc, tl.where(g < GROUP, l_i, 1.0)[:, None])
            tl.store(out_base + g[:, None] * stride_og + d[None, :], normalised, mask=rows)
        else:
            tl.store(out_base + g[:, None] * stride_og + d[None, :], acc, mask=rows)
            stat = row * stride_mb + head * stride_mh + split * stride_ms + g
            tl.store(max_ptr + stat, m_i, mask=g < GROUP)
            tl.store(den_ptr + stat, l_i, mask=g < GROUP)

    return kernel


_kernel = LazyKernels(_build)
