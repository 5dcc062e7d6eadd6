"""The decode kernel (`builtin/decode_attention.py`): each row attends over its own length, equal to the
masked SDPA it replaces. On the CPU the Triton kernel runs under Triton's interpreter (float32); on CUDA
(`gpu`) it runs compiled, through the engine's decode step and its CUDA graphs."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from engine_testing import generate_together, run_interpreted

from asyncrl_engine import decode_attention
from asyncrl_engine.engine import Engine
from asyncrl_engine.model import EngineModel
from asyncrl_engine.model_config import ModelConfig
from asyncrl_engine.request import Request

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


INTERPRETED_CHECKS = """
import torch
import torch.nn.functional as F

from asyncrl_engine import decode_attention
from asyncrl_engine.model import EngineModel

# Lengths at block edges (1, 64, 65) and beyond, rows reading the first of more slots, every split count (a
from asyncrl_engine.kv_cache import KVCache
from asyncrl_engine.model_config import ModelConfig
# split past a row's length included), head dims of a power of two and not (80 and 10, padded to 128 and 16 in
# the kernel): equal to SDPA under a length mask.
generator = torch.Generator().manual_seed(0)
for dim in (64, 80, 10):
    batch, heads, group, capacity = 5, 3, 3, 300
    q = torch.randn(batch, heads, group, dim, generator=generator)
    keys = torch.randn(7, heads, capacity, dim, generator=generator)
    values = torch.randn(7, heads, capacity, dim, generator=generator)
    lengths = torch.tensor([1, 64, 65, 200, 300])
    mask = (torch.arange(capacity) < lengths.unsqueeze(1)).view(batch, 1, 1, capacity)
    reference = F.scaled_dot_product_attention(q, keys[:batch], values[:batch], attn_mask=mask)
    for splits in (1, 3, 16):
        got = decode_attention.decode_attention(q, keys, values, lengths, splits=splits)
        torch.testing.assert_close(got, reference, atol=1e-5, rtol=1e-5)

# The model's decode step over a KV cache's views (its strides), rows of different lengths, 4 query heads over
# 1, 2 or 4 KV heads: the kernel's hidden states and cache equal SDPA's.
for kv_heads in (1, 2, 4):
    config = ModelConfig.from_dict(
        {
            "model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": kv_heads,
            "max_position_embeddings": 512, "eos_token_id": 2,
        }
    )
    model = EngineModel.random(config, "cpu", torch.float32, seed=1)
    caches = [KVCache(config, 6, 160, model.device, torch.float32) for _ in range(2)]
    filled = torch.randn(caches[0].kv.shape, generator=torch.Generator().manual_seed(2))
    input_ids = torch.tensor([5, 17, 250, 3])
    positions = torch.tensor([0, 63, 100, 158])
    hidden = []
    for kernel, cache in zip((False, True), caches):
        cache.kv.copy_(filled)
        model.decode_kernel = kernel
        hidden.append(model.decode(input_ids, positions, cache, 160))
    torch.testing.assert_close(hidden[1], hidden[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(caches[1].kv, caches[0].kv)
print("ok")
"""


def test_the_kernel_equals_the_masked_sdpa_under_the_interpreter() -> None:
    """On the CPU, under Triton's interpreter (float32, to 1e-5): the kernel alone against SDPA under a
    length mask, and the model's decode step with it against the step with SDPA. A process of its own: the
    interpreter must be chosen before Triton is first imported."""
    run_interpreted(INTERPRETED_CHECKS)


def test_splits_spread_a_small_batch_and_not_a_full_one() -> None:
    assert decode_attention.num_splits(256, 3) == 1
    assert decode_attention.num_splits(8, 3) == decode_attention.MAX_SPLITS
    assert decode_attention.num_splits(64, 3) == 2


def test_not_available_on_the_cpu() -> None:
    assert not decode_attention.available(torch.device("cpu"))


def _config(kv_heads: int) -> ModelConfig:
    return ModelConfig.from_dict(
        {
            "model_type": "llama",
            "vocab_size": 300,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": kv_heads,
            "max_position_embeddings": 512,
            "eos_token_id": 2,
        }
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_engine_with_the_kernel_and_cuda_graphs_matches_the_masked_sdpa_on_cuda() -> None:
    """Compiled on the GPU, through the engine's captured decode graphs (the batch shrinks through several
    buckets, with padding rows; contexts past 256 positions, so the cache grows): greedy float32 tokens equal
    and logprobs within 1e-4 of the same engine with the masked SDPA."""
    prompts = [[(11 * i + 7 * j) % 290 + 3 for j in range(20 + 37 * i)] for i in range(7)]
    results: list[list[Request]] = []
    for kernel in (True, False):
        model = EngineModel.random(_config(2), "cuda", torch.float32, seed=5)
        assert model.decode_kernel, "Triton is importable, so the kernel is on by default on CUDA"
        model.decode_kernel = kernel
        engine = Engine(model, max_running_requests=8, use_cuda_graphs=True, context_length=512)
        engine.start()
        try:
            results.append(generate_together(engine, prompts, [60 - 3 * i for i in range(len(prompts))]))
        finally:
            engine.stop()
    for got, want in zip(*results, strict=True):
        assert got.output_ids == want.output_ids
        assert got.output_logprobs == pytest.approx(want.output_logprobs, abs=1e-4)
