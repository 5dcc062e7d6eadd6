# The kernel's parameters are Triton's (pointers, strides, constexprs; Triton reads their annotations itself),
# so they carry no Python annotations:
# pyright: reportMissingParameterType=false, reportUnknownParameterType=false
"""Prefill attention over packed sequences that reads the slot KV cache in place (a Triton kernel), for CUDA.

A prefill after a prefix-cache hit (an agentic turn: ~100 new tokens on a context of ~1,000) attends each new
token over the sequence's cached KV and the new tokens before it. Padded to the longest row, that attention
gathers every row's KV up to the longest context for each layer (a copy of batch x context), repeats it for
grouped-query attention and masks it: memory-bound copies that dominate the prefill. This kernel reads each
sequence's keys and values where they lie, in its slot of the cache, up to its own length.

Layout: queries packed `[N, q_heads, head_dim]`, sequence b's tokens at rows
`cu_seqlens[b]..cu_seqlens[b+1]-1` (no padding); keys and values `[slots, kv_heads, capacity, head_dim]`;
sequence b lives in slot `slots[b]` with `prefix_lengths[b]` positions already there, and its token i sits at
position `prefix_lengths[b] + i`, whose own K/V the caller has already written. Query i attends to positions
`0..prefix_lengths[b] + i`. Each program takes one (sequence, block of query tokens, KV head), read from a
work list built on the host (`work_items`): the `group`
query heads sharing that KV head and the block's tokens as the rows of one tile (`ROWS` rows), the keys in
blocks of `BLOCK_N`, online softmax in float32 (the dots take float32 operands, also from a bfloat16 cache:
the attention reads more than it computes, and Triton's interpreter, which the CPU tests run, multiplies
bfloat16 wrongly), the output written packed like q. Every length is read from a tensor on the GPU; the launch
depends on the length of the work list only, which a CUDA graph of a padded batch fixes (its extra programs
do nothing).

Why a kernel of our own: no maintained varlen kernel over a slot (or paged) KV cache installs both on the CPU
machines (CI) and on the GPU machine (flash-attn and FlashInfer need a build for the exact torch and CUDA
there), and torch's `flex_attention` compiles anew for each new shape, which nearly every prefill under
continuous batching is. Triton ships with torch's CUDA wheels. On CPU, without Triton, or where a first
launch does not match (`available`), the model runs `torch_extend_attention`, the reference.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from asyncrl_engine._kernels import KernelCheck, LazyKernels, dot_size

ROWS = 64
"""Query rows (tokens x the query heads of one KV head) per program."""
BLOCK_N = 64
"""Key positions per block of the kernel's loop."""


def torch_extend_attention(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    slots: Sequence[int],
    prefix_lengths: Sequence[int],
    lengths: Sequence[int],
) -> Tensor:
    """The reference (and the path on CPU): one SDPA per sequence over its own slot's first
    `prefix_lengths[b] + lengths[b]` positions, causal with the offset of its cached prefix.

    q [N = sum(lengths), q_heads, D] packed; keys, values [slots, kv_heads, capacity, D]. Returns [N, q_heads,
    D] in q's dtype."""
    out = torch.empty_like(q)
    begin = 0
    for slot, prefix, length in zip(slots, prefix_lengths, lengths, strict=True):
        end, total = begin + length, prefix + length
        query = q[begin:end].transpose(0, 1).unsqueeze(0)  # [1, heads, T, D]
        k, v = keys[slot, :, :total].unsqueeze(0), values[slot, :, :total].unsqueeze(0)
        if prefix == 0:
            attention = F.scaled_dot_product_attention(query, k, v, is_causal=True, enable_gqa=True)
        else:
            # Query i, at position prefix + i, sees positions 0..prefix + i.
            mask = (
                torch.arange(total, device=q.device)
                <= prefix + torch.arange(length, device=q.device)[:, None]
            )
            attention = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, enable_gqa=True)
        out[begin:end] = attention[0].transpose(0, 1)
        begin = end
    return out


def tokens_per_program(num_heads: int, kv_heads: int) -> int:
    """Query tokens one program of the kernel takes: the tile's `ROWS` rows hold that many tokens' `group`
    query heads."""
    return ROWS // (num_heads // kv_heads)


NO_WORK = 1 << 30
"""The first token of a padding program (`work_items(..., size=...)`): past every sequence, so it does
nothing."""


def work_items(lengths: Tensor, per_program: int, size: int | None = None) -> Tensor:
    """The kernel's programs for sequences of `lengths` ([B] int64, on the host): [2, I] int64, per program
    the sequence it takes and its first query token (`per_program` tokens each, `tokens_per_program`).
    `size`: padded to that many programs with ones that do nothing (a CUDA graph's fixed grid; at least
    `max_work_items(...)`)."""
    blocks = (lengths + per_program - 1) // per_program
    count = int(blocks.sum())
    sequence = torch.repeat_interleave(torch.arange(lengths.shape[0]), blocks)
    starts = torch.cumsum(blocks, 0) - blocks
    first = (torch.arange(count) - starts[sequence]) * per_program
    work = torch.stack([sequence, first])
    if size is not None:
        if size < count:
            raise ValueError(f"{count} programs do not fit a grid of {size}")
        padding = torch.tensor([[0], [NO_WORK]]).expand(2, size - count)
        work = torch.cat([work, padding], dim=1)
    return work


def max_work_items(total_tokens: int, num_sequences: int, per_program: int) -> int:
    """The most programs sequences of `total_tokens` in all, `num_sequences` of them, can take."""
    return -(-total_tokens // per_program) + num_sequences


def extend_attention(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    slots: Tensor,
    prefix_lengths: Tensor,
    cu_seqlens: Tensor,
    work_sequence: Tensor,
    work_first: Tensor,
) -> Tensor:
    """`torch_extend_attention` as one kernel launch, reading K/V in place.

    q [N, q_heads, D] (last dim contiguous; a view of the q|k|v projection does); keys, values [slots,
    kv_heads, capacity, D] (last dim contiguous); slots, prefix_lengths [B] int; cu_seqlens [B + 1] int
    (sequence b's queries are rows cu_seqlens[b]..cu_seqlens[b+1]-1 of q); `work_sequence`, `work_first` [I]
    int64 (the rows of `work_items`, on q's device): the grid, which depends on nothing else, so a CUDA graph
    of a padded batch replays it whatever its sequences. Returns [N, q_heads, D] in q's dtype."""
    kernel = _kernel()
    tokens, num_heads, head_dim = q.shape
    kv_heads = keys.shape[1]
    if num_heads % kv_heads or q.stride(-1) != 1 or keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError(
            f"q {list(q.shape)} over keys {list(keys.shape)}: the query heads must be a multiple of the KV "
            "heads and the last dimensions contiguous"
        )
    group = num_heads // kv_heads
    if group > ROWS:
        raise ValueError(f"{group} query heads per KV head exceed the kernel's {ROWS} rows")
    out = torch.empty((tokens, num_heads, head_dim), device=q.device, dtype=q.dtype)
    dim_pad = dot_size(head_dim)
    kernel[(work_sequence.shape[0], kv_heads)](
        q,
        keys,
        values,
        out,
        slots,
        prefix_lengths,
        cu_seqlens,
        work_sequence,
        work_first,
        *q.stride()[:2],
        *keys.stride()[:3],
        *values.stride()[:3],
        *out.stride()[:2],
        1.0 / math.sqrt(head_dim),
        GROUP=group,
        TOKENS=ROWS // group,
        ROWS=ROWS,
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad,
        BLOCK_N=BLOCK_N,
        # The dots take float32 operands: in IEEE precision for a float32 model (Triton's default for float32
        # dots is TF32), so it matches SDPA; TF32 for bfloat16 (exact on bfloat16 inputs, and finer than
        # bfloat16 for the softmax weights).
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        # Five float32 tiles of ROWS (or BLOCK_N) x DIM_PAD live at once: 8 warps past a head dim of 64.
        num_warps=4 if dim_pad <= 64 else 8,
    )
    return out


def self_check(device: torch.device, dtype: torch.dtype) -> None:
    """Run the kernel once on random inputs (3 sequences in slots out of order, prefixes 0, 5 and 70, lengths
    1 to past a block, 6 query heads over 2 KV heads) and raise `AssertionError` where it differs from
    `torch_extend_attention` beyond 1e-4 (float32) or 2e-2 (bfloat16)."""
    generator = torch.Generator(device=device).manual_seed(0)
    slots, prefixes, lengths = [2, 0, 3], [0, 5, 70], [70, 1, 30]
    q = torch.randn(sum(lengths), 6, 64, device=device, generator=generator).to(dtype)
    keys = torch.randn(4, 2, 128, 64, device=device, generator=generator).to(dtype)
    values = torch.randn(4, 2, 128, 64, device=device, generator=generator).to(dtype)
    cu_seqlens = torch.tensor([0, 70, 71, 101], device=device)
    # Padded with programs that do nothing, as a CUDA graph's grid is.
    work = work_items(torch.tensor(lengths), tokens_per_program(6, 2), size=20).to(device)
    got = extend_attention(
        q,
        keys,
        values,
        torch.tensor(slots, device=device),
        torch.tensor(prefixes, device=device),
        cu_seqlens,
        *work,
    )
    want = torch_extend_attention(q, keys, values, slots, prefixes, lengths)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)


def _self_check(device: torch.device) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        self_check(device, dtype)


available = KernelCheck(
    "the Triton extend-attention kernel is", "prefill uses SDPA per sequence", _self_check
)
"""`available(device)`: whether the kernel runs on `device`: CUDA, Triton importable, and a first launch there
(compiled on the spot) equal to `torch_extend_attention` in float32 and bfloat16. Checked once per device; a
failure is logged and the model keeps the reference."""


def _build() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(  # pragma: no cover - runs on the GPU (or under TRITON_INTERPRET in the tests)
        q_ptr,
        k_ptr,
        v_ptr,
        out_ptr,
        slots_ptr,
        prefix_ptr,
        cu_ptr,
        work_sequence_ptr,
        work_first_ptr,
        stride_qt,
        stride_qh,
        stride_ks,
        stride_kh,
        stride_kt,
        stride_vs,
        stride_vh,
        stride_vt,
        stride_ot,
        stride_oh,
        scale,
        GROUP: tl.constexpr,
        TOKENS: tl.constexpr,
        ROWS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        DIM_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        sequence = tl.load(work_sequence_ptr + tl.program_id(0))
        first = tl.load(work_first_ptr + tl.program_id(0))
        head = tl.program_id(1)
        begin = tl.load(cu_ptr + sequence)
        length = tl.load(cu_ptr + sequence + 1) - begin
        if first < length:
            prefix = tl.load(prefix_ptr + sequence)
            slot = tl.load(slots_ptr + sequence)
            # Row r of the tile: token first + r // GROUP, query head head * GROUP + r % GROUP.
            r = tl.arange(0, ROWS)
            token = first + r // GROUP
            row_valid = (r < TOKENS * GROUP) & (token < length)
            d = tl.arange(0, DIM_PAD)
            d_valid = d < HEAD_DIM
            q = tl.load(
                q_ptr
                + (begin + token)[:, None] * stride_qt
                + (head * GROUP + r % GROUP)[:, None] * stride_qh
                + d[None, :],
                mask=row_valid[:, None] & d_valid[None, :],
                other=0.0,
            ).to(tl.float32)
            query_position = prefix + token
            # The block's last token sees positions up to prefix + its index; each row masks what follows
            # its own position. Every row sees position 0, so no row's maximum stays -inf.
            end = prefix + tl.minimum(first + TOKENS, length)
            n = tl.arange(0, BLOCK_N)
            k_base = k_ptr + slot * stride_ks + head * stride_kh
            v_base = v_ptr + slot * stride_vs + head * stride_vh
            m_i = tl.full((ROWS,), float("-inf"), dtype=tl.float32)
            l_i = tl.zeros((ROWS,), dtype=tl.float32)
            acc = tl.zeros((ROWS, DIM_PAD), dtype=tl.float32)
            for block_start in range(0, end, BLOCK_N):
                positions = block_start + n
                inside = (positions < end)[:, None] & d_valid[None, :]
                k = tl.load(k_base + positions[:, None] * stride_kt + d[None, :], mask=inside, other=0.0)
                v = tl.load(v_base + positions[:, None] * stride_vt + d[None, :], mask=inside, other=0.0)
                k, v = k.to(tl.float32), v.to(tl.float32)
                # [ROWS, BLOCK_N], float32
                scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
                scores = tl.where(positions[None, :] <= query_position[:, None], scores, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(scores, axis=1))
                p = tl.exp(scores - m_new[:, None])
                alpha = tl.exp(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, axis=1)
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
                m_i = m_new
            # Divided as torch divides (IEEE rounding), stored in out's dtype.
            normalised = tl.math.div_rn(acc, l_i[:, None])
            tl.store(
                out_ptr
                + (begin + token)[:, None] * stride_ot
                + (head * GROUP + r % GROUP)[:, None] * stride_oh
                + d[None, :],
                normalised,
                mask=row_valid[:, None] & d_valid[None, :],
            )

    return kernel


_kernel = LazyKernels(_build)
