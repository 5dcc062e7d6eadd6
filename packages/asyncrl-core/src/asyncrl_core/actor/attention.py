"""The torch actor's attention: packed rows without crossing trajectories, and one explicit kernel per case.

The actor's HuggingFace model reaches it through transformers' attention interface (`AttentionInterface`,
under the name `PACKED_ATTENTION`): the model is loaded with `attn_implementation=PACKED_ATTENTION`, no
layer of it is replaced, and transformers builds no attention mask for a name it has no mask function for.
A forward pass of a packed row (`asyncrl_core.algorithms.PackedBatch`, packed layout) passes the row's
sequence offsets as keyword arguments of the model (`packed_attention_arguments`), which transformers hands
down to every attention call; a padded batch passes none.

Kernels, chosen once per process from the device and dtype (`attention_backend`) and logged once:

- packed rows on CUDA in bfloat16 or float16: variable-length flash attention (`torch.nn.attention.varlen`,
  FlashAttention-2 in torch): every trajectory attends causally to itself only, and no kernel plans per
  shape;
- packed rows elsewhere (a CPU, float32 on CUDA): scaled dot-product attention over each trajectory in turn,
  causal, without a mask: exact, and what the padded path computes for the same trajectory;
- padded rows: causal scaled dot-product attention over the batch. On CUDA the flash, memory-efficient and
  math kernels are allowed and cuDNN's is not: cuDNN plans again for every new (batch, width), which cost
  a 362 ms forward and backward against 95 ms at a width seen before (one 8-row micro-batch of the actor's
  shape on an H200), as the built-in engine found for prefill.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import logging
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

PACKED_ATTENTION = "asyncrl_packed"
"""The name of `packed_attention` in transformers' `AttentionInterface`."""

AttentionBackend = Literal["flash_varlen", "sdpa_per_sequence"]


def register_packed_attention() -> None:
    """Register `packed_attention` in transformers' attention interface (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention)


def packed_attention_arguments(
    sequence_offsets: torch.Tensor, max_sequence_len: int
) -> dict[str, torch.Tensor | int]:
    """The model keyword arguments that make `packed_attention` treat a row as the sequences between
    `sequence_offsets` (`[S + 1]`, int32, on the model's device) of at most `max_sequence_len` tokens.
    The names are transformers' own for variable-length attention (`FlashAttentionKwargs`)."""
    return {
        "cu_seq_lens_q": sequence_offsets,
        "cu_seq_lens_k": sequence_offsets,
        "max_length_q": max_sequence_len,
        "max_length_k": max_sequence_len,
    }


@functools.cache
def _varlen_kernel() -> tuple[Callable[..., Any], dict[str, Any], bool] | None:
    """torch's variable-length flash attention, with the keyword that makes it causal in this torch
    version (`window_size=(-1, 0)` from 2.11, `is_causal=True` in 2.10) and whether it takes fewer
    key/value heads than query heads; None when this torch has none, or one without a `scale` argument
    (a model may scale its scores otherwise than by `1 / sqrt(head_dim)`)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    parameters = inspect.signature(varlen_attn).parameters
    if "window_size" in parameters:
        causal: dict[str, Any] = {"window_size": (-1, 0)}
    elif "is_causal" in parameters:
        causal = {"is_causal": True}
    else:
        return None
    if "scale" not in parameters:
        return None
    return varlen_attn, causal, "enable_gqa" in parameters


def attention_backend(device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """The kernel that packed rows use on `device` in the compute `dtype` (the module docstring says why)."""
    flash_dtype = dtype in (torch.bfloat16, torch.float16)
    if device.type == "cuda" and flash_dtype and _varlen_kernel() is not None:
        return "flash_varlen"
    return "sdpa_per_sequence"


@functools.cache
def log_attention_backend(device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """`attention_backend`, logged the first time it is asked for (per device and dtype)."""
    backend = attention_backend(device, dtype)
    padded = "flash, memory-efficient or math SDPA (no cuDNN)" if device.type == "cuda" else "SDPA"
    logger.info(
        "torch actor attention on %s in %s: packed rows through %s, padded rows through causal %s",
        device,
        dtype,
        "variable-length flash attention" if backend == "flash_varlen" else "causal SDPA per trajectory",
        padded,
    )
    return backend


def _sdpa_kernels(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention for transformers' attention interface: `query` `[B, H, T, D]`, `key` and `value`
    `[B, H_kv, T, D]` -> `[B, T, H, D]` (and no weights).

    With `cu_seq_lens_q` (`packed_attention_arguments`; then `B == 1`) each sequence between two offsets
    attends to itself only; without, every row is one causal sequence. `attention_mask` must be None (the
    actor trains without masks: right padding is never attended by a real token, packed padding is a
    sequence of its own). Dropout must be 0: the actor trains with dropout off.
    """
    del module
    if attention_mask is not None:
        raise ValueError("packed attention takes no attention mask (right padding or packed sequences)")
    if dropout != 0.0:
        raise ValueError(f"packed attention runs without dropout, got {dropout}")
    offsets: torch.Tensor | None = kwargs.get("cu_seq_lens_q")
    if offsets is None:
        with _sdpa_kernels(query.device):
            output = F.scaled_dot_product_attention(
                query, key, value, is_causal=True, scale=scaling, enable_gqa=True
            )
        return output.transpose(1, 2), None
    if query.shape[0] != 1:
        raise ValueError(f"a packed batch is one row, got {query.shape[0]}")
    device_type = query.device.type
    # Under autocast the rotary embedding leaves float32 queries and keys (bfloat16 projections times
    # float32 tables); SDPA casts them itself, the variable-length kernel (a custom op) does not.
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else query.dtype
    if attention_backend(query.device, dtype) == "flash_varlen":
        query, key, value = (tensor.to(dtype) for tensor in (query, key, value))
        return _flash_varlen(query, key, value, offsets, int(kwargs["max_length_q"]), scaling), None
    bounds = offsets.tolist()
    with _sdpa_kernels(query.device):
        pieces = [
            F.scaled_dot_product_attention(
                query[:, :, start:end],
                key[:, :, start:end],
                value[:, :, start:end],
                is_causal=True,
                scale=scaling,
                enable_gqa=True,
            )
            for start, end in itertools.pairwise(bounds)
        ]
    output = torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0]
    return output.transpose(1, 2), None


def _flash_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    offsets: torch.Tensor,
    max_len: int,
    scaling: float | None,
) -> torch.Tensor:
    """torch's variable-length flash attention over one packed row; `[1, T, H, D]`."""
    kernel = _varlen_kernel()
    assert kernel is not None
    varlen_attn, causal, takes_gqa = kernel
    q, k, v = (tensor[0].transpose(0, 1) for tensor in (query, key, value))  # [T, heads, D]
    extra = dict(causal)
    if q.shape[1] != k.shape[1]:
        if takes_gqa:
            extra["enable_gqa"] = True
        else:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if scaling is not None:
        extra["scale"] = scaling
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # Flash explicitly: some torch versions prefer cuDNN's variable-length kernel where it is eligible.
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        output: torch.Tensor = varlen_attn(q, k, v, offsets, offsets, max_len, max_len, **extra)
    return output[None]
