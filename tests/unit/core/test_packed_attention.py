"""The torch actor's attention (`asyncrl_core.actor.attention`): a packed row's sequences attend to
themselves only, exactly as each would alone (values and gradients), the padding at its end included; on a
GPU, variable-length flash attention gives what the exact per-sequence path gives."""

from __future__ import annotations

import pytest
import torch

from asyncrl_core.actor.attention import (
    attention_backend,
    packed_attention,
    packed_attention_arguments,
)

LENGTHS = [37, 5, 64, 1, 19]
"""Sequences of a packed row: a trajectory of one token, and the row's padding (19) last."""


def packed_inputs(
    device: torch.device, dtype: torch.dtype, heads: int = 6, kv_heads: int = 2, dim: int = 64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    total = sum(LENGTHS)

    def tensor(num_heads: int) -> torch.Tensor:
        values = torch.randn(1, num_heads, total, dim, generator=generator).to(device, dtype)
        return values.requires_grad_(True)

    offsets = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return tensor(heads), tensor(kv_heads), tensor(kv_heads), offsets


def each_alone(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Every sequence through the padded path (one row, causal) on its own, the outputs concatenated."""
    pieces, start = [], 0
    for length in LENGTHS:
        end = start + length
        output, _ = packed_attention(
            torch.nn.Module(), query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], None
        )
        pieces.append(output)
        start = end
    return torch.cat(pieces, dim=1)


def test_packed_sequences_attend_within_themselves_exactly_as_alone() -> None:
    query, key, value, offsets = packed_inputs(torch.device("cpu"), torch.float32)
    packed, weights = packed_attention(
        torch.nn.Module(), query, key, value, None, **packed_attention_arguments(offsets, max(LENGTHS))
    )
    assert weights is None
    assert packed.shape == (1, sum(LENGTHS), query.shape[1], query.shape[3])
    alone = each_alone(query, key, value)
    torch.testing.assert_close(packed, alone, rtol=1e-6, atol=1e-6)
    upstream = torch.randn(packed.shape, generator=torch.Generator().manual_seed(1))
    packed_grads = torch.autograd.grad(packed, (query, key, value), upstream)
    alone_grads = torch.autograd.grad(alone, (query, key, value), upstream)
    for got, want in zip(packed_grads, alone_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # And the first sequence is not what attention over the whole row would give it past its first token.
    whole, _ = packed_attention(torch.nn.Module(), query, key, value, None)
    assert not torch.allclose(whole[:, LENGTHS[0] :], packed[:, LENGTHS[0] :])


def test_packed_attention_refuses_masks_and_dropout() -> None:
    query, key, value, _ = packed_inputs(torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="mask"):
        packed_attention(torch.nn.Module(), query, key, value, torch.ones(1, 1, 1, 1))
    with pytest.raises(ValueError, match="dropout"):
        packed_attention(torch.nn.Module(), query, key, value, None, dropout=0.1)


def test_a_cpu_takes_the_exact_per_sequence_path() -> None:
    assert attention_backend(torch.device("cpu"), torch.bfloat16) == "sdpa_per_sequence"
    assert attention_backend(torch.device("cpu"), torch.float32) == "sdpa_per_sequence"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flash_varlen_on_a_gpu_gives_the_per_sequence_attention() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    assert attention_backend(device, torch.bfloat16) == "flash_varlen"
    query, key, value, offsets = packed_inputs(device, torch.bfloat16)
    packed, _ = packed_attention(
        torch.nn.Module(), query, key, value, None, **packed_attention_arguments(offsets, max(LENGTHS))
    )
    reference = each_alone(*(tensor.float().detach().requires_grad_(True) for tensor in (query, key, value)))
    torch.testing.assert_close(packed.float(), reference.detach(), rtol=2e-2, atol=2e-2)
    # Under autocast, float32 queries (rotary embeddings leave them so) take the same bfloat16 kernel.
    with torch.autocast("cuda", dtype=torch.bfloat16):
        autocast, _ = packed_attention(
            torch.nn.Module(),
            *(tensor.detach().float() for tensor in (query, key, value)),
            None,
            **packed_attention_arguments(offsets, max(LENGTHS)),
        )
    assert autocast.dtype == torch.bfloat16
    torch.testing.assert_close(autocast, packed.detach())
    upstream = torch.randn(packed.shape, device=device)
    grads = torch.autograd.grad(packed, (query, key, value), upstream.to(packed.dtype))
    float_inputs = [tensor.detach().float().requires_grad_(True) for tensor in (query, key, value)]
    reference = each_alone(*float_inputs)
    reference_grads = torch.autograd.grad(reference, float_inputs, upstream)
    for got, want in zip(grads, reference_grads, strict=True):
        torch.testing.assert_close(got.float(), want, rtol=5e-2, atol=5e-2)
