# The kernels' parameters are Triton's (pointers, strides, constexprs; Triton reads their annotations itself),
# so they carry no Python annotations:
# pyright: reportMissingParameterType=false, reportUnknownParameterType=false
"""The decoder's small elementwise steps, in torch (every device) and as fused Triton kernels (CUDA).

A decoder as small as SmolLM2-135M is bound on the GPU by kernel launches, not arithmetic: in torch, one
layer launches ~45 kernels (an RMSNorm is eight: float, pow, mean, add, rsqrt, mul, to, mul; a rotary
embedding eight for q and eight for k), nearly all of them tiny. Three kernels here replace them:

- `add_rms_norm`: the residual add before a norm and the norm, one kernel returning both the new residual
  stream and the normed input (`rms_norm` is the same kernel without the add);
- `rotary`: the rotary embedding of q and k in place in the fused q|k|v projection, reading each token's
  position from a tensor, and optionally the write of the rotated K and of V into the KV cache at (slot,
  position) (the index_put the model would otherwise launch for each);
- `silu_mul`: SiLU(gate) * up from the fused gate|up projection.

Each kernel rounds where torch does (float32 arithmetic, cast to the model's dtype at the same points, no
fused multiply-adds), so in float32 a kernel differs from torch only by the order of the RMSNorm's sum (a
float32 ulp or two) and by the library behind `exp`/`rsqrt`. In bfloat16 the normalised value and the SiLU
are within one bfloat16 ulp of torch's, and after the product by the weight (by up) within two (the product
of a value one ulp away can round the other way).
The kernels take no host synchronisation and their launches depend only on the shapes, so a captured CUDA
graph replays them.

Why kernels of our own: no maintained fused-op package installs both on the CPU machines (CI) and on the GPU
machine (flash-attn's and FlashInfer's fused norms and rotary need a build for the exact torch and CUDA
there; Liger and Apex are not installed there), and `torch.compile` would recompile at every new prefill
shape. Triton ships with torch's CUDA wheels. On CPU, without Triton, or where a first launch does not match
torch (`available`), the model keeps the torch functions below, which are its reference.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from asyncrl_engine._kernels import KernelCheck, LazyKernels, next_power_of_2

SILU_BLOCK = 1024
"""Most columns of `silu_mul` per program."""


# ------------------------------------------------------------------------------------------ torch (reference)
def torch_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm as HuggingFace's Llama computes it: normalise in float32, cast back, then scale."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def torch_rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE with the half-split (HuggingFace) layout; x [..., head_dim], cos/sin float32 broadcastable."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


# ---------------------------------------------------------------------------------------------------- kernels
def self_check(device: torch.device, dtype: torch.dtype) -> None:
    """Run each kernel once on random inputs (odd sizes, 9 query and 3 KV heads, positions past 0, a KV cache
    write) and raise `AssertionError` where it differs from torch beyond a few float32 ulps (two bfloat16 ulps
    in bfloat16)."""
    generator = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int) -> Tensor:
        return torch.randn(shape, device=device, generator=generator).to(dtype)

    tolerance = 1e-5 if dtype == torch.float32 else 2**-6  # bfloat16: two ulps (2**-7 relative each)
    x, residual, weight = randn(3, 5, 72), randn(3, 5, 72), randn(72)
    total, normed = add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(total, x + residual, atol=0, rtol=0)
    torch.testing.assert_close(
        normed, torch_rms_norm(x + residual, weight, 1e-5), atol=tolerance, rtol=tolerance
    )
    torch.testing.assert_close(
        rms_norm(x, weight, 1e-5), torch_rms_norm(x, weight, 1e-5), atol=tolerance, rtol=tolerance
    )

    heads, kv_heads, dim, length = 9, 3, 64, 7
    angles = torch.arange(40.0, device=device).outer(torch.rand(dim // 2, device=device, generator=generator))
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos(), angles.sin()
    qkv = randn(2, length, (heads + 2 * kv_heads) * dim)
    positions = torch.arange(length, device=device) + torch.tensor([[3], [30]], device=device)
    want = qkv.clone().view(2, length, heads + 2 * kv_heads, dim)
    rotated = want[:, :, : heads + kv_heads]
    rotated.copy_(torch_rotate(rotated, cos[positions].unsqueeze(2), sin[positions].unsqueeze(2)))
    keys = torch.zeros(4, kv_heads, 40, dim, device=device, dtype=dtype)
    values = torch.zeros_like(keys)
    slots = torch.tensor([3, 1], device=device)
    rotary(qkv, positions, cos, sin, heads, kv_heads, dim, (keys, values), slots)
    torch.testing.assert_close(qkv, want.view_as(qkv), atol=tolerance, rtol=tolerance)
    for row, slot in enumerate(slots.tolist()):
        cached = want[row, :, heads:].transpose(0, 1)  # [2 kv_heads, T, D]
        taken = positions[row]
        torch.testing.assert_close(keys[slot][:, taken], cached[:kv_heads], atol=tolerance, rtol=tolerance)
        torch.testing.assert_close(values[slot][:, taken], cached[kv_heads:], atol=0, rtol=0)

    gate_up = randn(3, 5, 2 * 100)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(
        silu_mul(gate_up), torch.nn.functional.silu(gate) * up, atol=tolerance, rtol=tolerance
    )


def _self_check(device: torch.device) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        self_check(device, dtype)


available = KernelCheck("the fused Triton kernels are", "the model uses torch", _self_check)
"""`available(device)`: whether the fused kernels run on `device`: CUDA, Triton importable, and a first launch
of each there (compiled on the spot) equal to the torch functions, in float32 and bfloat16. Checked once per
device; a failure is logged and the model keeps torch."""


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`torch_rms_norm(x, weight, eps)` in one kernel: x [..., hidden] with contiguous rows."""
    return _norm(x, None, weight, eps)[1]


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """`x + residual` (rounded to x's dtype, as torch adds) and its RMSNorm, in one kernel: returns (the sum,
    its norm). x and residual [..., hidden], of one shape and dtype."""
    return _norm(x, residual, weight, eps)


def _norm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    kernel = _kernels()["add_rms_norm"]
    hidden = x.shape[-1]
    rows_x = _rows(x)
    rows_r = rows_x if residual is None else _rows(residual)
    total = torch.empty_like(rows_x) if residual is not None else rows_x
    normed = torch.empty_like(rows_x)
    kernel[(rows_x.shape[0],)](
        rows_x,
        rows_r,
        weight,
        total,
        normed,
        rows_x.stride(0),
        rows_r.stride(0),
        total.stride(0),
        normed.stride(0),
        hidden,
        1.0 / hidden,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=next_power_of_2(hidden),
        enable_fp_fusion=False,
    )
    return total.view(x.shape), normed.view(x.shape)


def rotary(
    qkv: Tensor,
    positions: Tensor,
    cos: Tensor,
    sin: Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    cache: tuple[Tensor, Tensor] | None = None,
    slots: Tensor | None = None,
    write_positions: Tensor | None = None,
) -> None:
    """Rotate q and k in place in `qkv` [B, T, (heads + 2 kv_heads) * head_dim] (q|k|v per token, last dim
    contiguous), token (b, t) at `positions[b, t]` (positions [B, T], or [B] when T is 1, or [T] shared by
    every row) with the tables `cos`, `sin` [>= max position + 1, head_dim] (float32, halves equal).

    With `cache` (keys, values: [slots, kv_heads, capacity, head_dim], last dim contiguous), also writes the
    rotated K and V of token (b, t) at slot `slots[b]` (default: b) and position `write_positions[b, t]`
    (default: `positions`)."""
    kernel = _kernels()["rotary"]
    if qkv.dim() == 2:
        qkv = qkv.unsqueeze(1)
    batch, length, width = qkv.shape
    if width != (num_heads + 2 * num_kv_heads) * head_dim or qkv.stride(-1) != 1:
        raise ValueError(
            f"qkv {list(qkv.shape)} (strides {qkv.stride()}) is not q|k|v with a contiguous last dim"
        )
    pos_b, pos_t = _token_strides(positions, batch, length)
    keys, values = cache if cache is not None else (qkv, qkv)
    written = positions if write_positions is None else write_positions
    write_b, write_t = _token_strides(written, batch, length)
    # One program per token, on the grid's first axis (its second holds at most 65,535).
    kernel[(batch * length,)](
        qkv,
        positions,
        cos,
        sin,
        keys,
        values,
        slots if slots is not None else positions,
        written,
        qkv.stride(0),
        qkv.stride(1),
        pos_b,
        pos_t,
        cos.stride(0),
        sin.stride(0),
        min(cos.shape[0], sin.shape[0]) - 1,
        *keys.stride()[:3],
        *values.stride()[:3],
        write_b,
        write_t,
        length,
        HEADS=num_heads,
        KV_HEADS=num_kv_heads,
        HEADS_PAD=next_power_of_2(num_heads),
        KV_HEADS_PAD=next_power_of_2(num_kv_heads),
        HALF=head_dim // 2,
        HALF_PAD=next_power_of_2(head_dim // 2),
        WRITE_CACHE=cache is not None,
        HAS_SLOTS=slots is not None,
        enable_fp_fusion=False,
    )


def _token_strides(positions: Tensor, batch: int, length: int) -> tuple[int, int]:
    """Strides (per row, per token) of a positions tensor of shape [B, T], [B] (T = 1) or [T] (shared)."""
    if positions.dim() == 2:
        if tuple(positions.shape) != (batch, length):
            raise ValueError(f"positions {list(positions.shape)} for {batch} rows of {length} tokens")
        return positions.stride(0), positions.stride(1)
    if length == 1 and positions.shape[0] == batch:
        return positions.stride(0), 0
    if positions.shape[0] == length:
        return 0, positions.stride(0)
    raise ValueError(f"positions {list(positions.shape)} for {batch} rows of {length} tokens")


def silu_mul(gate_up: Tensor) -> Tensor:
    """`F.silu(gate) * up` for `gate, up = gate_up.chunk(2, -1)` in one kernel; gate_up [..., 2 F] with
    contiguous rows. Returns [..., F] in gate_up's dtype (SiLU rounded to it before the product, as torch)."""
    kernel = _kernels()["silu_mul"]
    width = gate_up.shape[-1] // 2
    rows = _rows(gate_up)
    out = torch.empty((rows.shape[0], width), device=gate_up.device, dtype=gate_up.dtype)
    block = min(SILU_BLOCK, next_power_of_2(width))
    kernel[(rows.shape[0], -(-width // block))](
        rows, out, rows.stride(0), out.stride(0), width, BLOCK=block, enable_fp_fusion=False
    )
    return out.view(*gate_up.shape[:-1], width)


def _rows(x: Tensor) -> Tensor:
    """x [..., n] as rows [N, n] with a contiguous last dimension (a view where it can be one)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _build() -> dict[str, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def add_rms_norm_kernel(  # pragma: no cover - runs on the GPU (or under TRITON_INTERPRET in the tests)
        x_ptr,
        residual_ptr,
        weight_ptr,
        total_ptr,
        normed_ptr,
        stride_x,
        stride_r,
        stride_total,
        stride_normed,
        hidden,
        inverse_hidden,
        eps,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        inside = cols < hidden
        x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0)
        if HAS_RESIDUAL:
            residual = tl.load(residual_ptr + row * stride_r + cols, mask=inside, other=0.0)
            x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
            tl.store(total_ptr + row * stride_total + cols, x, mask=inside)
        xf = x.to(tl.float32)
        # torch's mean on CUDA: the sum times 1/hidden.
        variance = tl.sum(xf * xf, axis=0) * inverse_hidden
        normalised = (xf * tl.math.rsqrt(variance + eps)).to(x.dtype)
        weight = tl.load(weight_ptr + cols, mask=inside, other=0.0)
        normed = (weight.to(tl.float32) * normalised.to(tl.float32)).to(x.dtype)
        tl.store(normed_ptr + row * stride_normed + cols, normed, mask=inside)

    @triton.jit
    def rotary_kernel(  # pragma: no cover - runs on the GPU (or under TRITON_INTERPRET in the tests)
        qkv_ptr,
        positions_ptr,
        cos_ptr,
        sin_ptr,
        keys_ptr,
        values_ptr,
        slots_ptr,
        write_ptr,
        stride_b,
        stride_t,
        stride_pos_b,
        stride_pos_t,
        stride_cos,
        stride_sin,
        max_position,
        stride_ks,
        stride_kh,
        stride_kt,
        stride_vs,
        stride_vh,
        stride_vt,
        stride_write_b,
        stride_write_t,
        length,
        HEADS: tl.constexpr,
        KV_HEADS: tl.constexpr,
        HEADS_PAD: tl.constexpr,
        KV_HEADS_PAD: tl.constexpr,
        HALF: tl.constexpr,
        HALF_PAD: tl.constexpr,
        WRITE_CACHE: tl.constexpr,
        HAS_SLOTS: tl.constexpr,
    ):
        row = tl.program_id(0) // length
        token = tl.program_id(0) % length
        # Clamped to the tables: only padding tokens (whose results nothing reads) can lie beyond them.
        position = tl.minimum(
            tl.load(positions_ptr + row * stride_pos_b + token * stride_pos_t), max_position
        )
        # A half of a head dim that is no power of two (80, 96) is padded; its columns past HALF are masked.
        i = tl.arange(0, HALF_PAD)
        half = i < HALF
        cos = tl.load(cos_ptr + position * stride_cos + i, mask=half, other=0.0)[None, :]
        sin = tl.load(sin_ptr + position * stride_sin + i, mask=half, other=0.0)[None, :]
        base = qkv_ptr + row * stride_b + token * stride_t

        # q: heads 0..HEADS-1. out[:half] = x1 cos - x2 sin, out[half:] = x2 cos + x1 sin (torch's products
        # and sum, each rounded in float32).
        heads = tl.arange(0, HEADS_PAD)[:, None]
        first = base + heads * (2 * HALF) + i[None, :]
        inside = (heads < HEADS) & half[None, :]
        x1 = tl.load(first, mask=inside, other=0.0)
        x2 = tl.load(first + HALF, mask=inside, other=0.0)
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        tl.store(first, (x1f * cos - x2f * sin).to(x1.dtype), mask=inside)
        tl.store(first + HALF, (x2f * cos + x1f * sin).to(x1.dtype), mask=inside)

        # k: the KV_HEADS heads after q's; v after k's.
        kv = tl.arange(0, KV_HEADS_PAD)[:, None]
        first = base + (HEADS + kv) * (2 * HALF) + i[None, :]
        inside = (kv < KV_HEADS) & half[None, :]
        x1 = tl.load(first, mask=inside, other=0.0)
        x2 = tl.load(first + HALF, mask=inside, other=0.0)
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        k1 = (x1f * cos - x2f * sin).to(x1.dtype)
        k2 = (x2f * cos + x1f * sin).to(x1.dtype)
        tl.store(first, k1, mask=inside)
        tl.store(first + HALF, k2, mask=inside)
        if WRITE_CACHE:
            slot = tl.load(slots_ptr + row) if HAS_SLOTS else row
            at = tl.load(write_ptr + row * stride_write_b + token * stride_write_t)
            key = keys_ptr + slot * stride_ks + kv * stride_kh + at * stride_kt + i[None, :]
            tl.store(key, k1, mask=inside)
            tl.store(key + HALF, k2, mask=inside)
            value_in = base + (HEADS + KV_HEADS + kv) * (2 * HALF) + i[None, :]
            value = values_ptr + slot * stride_vs + kv * stride_vh + at * stride_vt + i[None, :]
            v1 = tl.load(value_in, mask=inside, other=0.0)
            v2 = tl.load(value_in + HALF, mask=inside, other=0.0)
            tl.store(value, v1, mask=inside)
            tl.store(value + HALF, v2, mask=inside)

    @triton.jit
    def silu_mul_kernel(  # pragma: no cover - runs on the GPU (or under TRITON_INTERPRET in the tests)
        gate_up_ptr,
        out_ptr,
        stride_in,
        stride_out,
        width,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < width
        gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=inside, other=0.0)
        up = tl.load(gate_up_ptr + row * stride_in + width + cols, mask=inside, other=0.0)
        g = gate.to(tl.float32)
        silu = tl.math.div_rn(g, 1.0 + tl.exp(-g)).to(gate.dtype)
        out = (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
        tl.store(out_ptr + row * stride_out + cols, out, mask=inside)

    return {"add_rms_norm": add_rms_norm_kernel, "rotary": rotary_kernel, "silu_mul": silu_mul_kernel}


_kernels = LazyKernels(_build)
"""The kernels by name (`add_rms_norm`, `rotary`, `silu_mul`), defined at their first use."""
