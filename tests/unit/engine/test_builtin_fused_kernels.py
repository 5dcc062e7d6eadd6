"""The fused kernels (`fused_kernels.py`: residual add + RMSNorm, rotary embedding + KV cache write,
SiLU * up) against the torch ops they replace. On the CPU the Triton kernels run under Triton's interpreter
(float32); on CUDA (`gpu`) they run compiled, in bfloat16 within bfloat16 ulps of torch, and through the
engine's decode graphs in float32.

Float32 equality: the rotary kernel and the residual sum are bit for bit torch's (the same products and sums,
each rounded once, no fused multiply-adds); the RMSNorm and SiLU differ from torch by float32 ulps (the order
of the norm's sum, the library behind rsqrt and exp), so they and the whole model are compared to 1e-5."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from engine_testing import generate_together, run_interpreted

from asyncrl_engine import fused_kernels
from asyncrl_engine.engine import Engine
from asyncrl_engine.model import EngineModel
from asyncrl_engine.model_config import ModelConfig
from asyncrl_engine.options import SamplingOptions
from asyncrl_engine.request import Request

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

INTERPRETED_CHECKS = """
import collections

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from asyncrl_engine import extend_attention
from asyncrl_engine import fused_kernels as fused
from asyncrl_engine._kernels import LazyKernels
from asyncrl_engine.model import EngineModel
from asyncrl_engine.kv_cache import KVCache
from asyncrl_engine.model_config import ModelConfig

generator = torch.Generator().manual_seed(0)


def randn(*shape):
    return torch.randn(shape, generator=generator)


# add_rms_norm / rms_norm: one row, odd rows, the SmolLM2 width; the sum exact, the norm to float32 ulps.
for shape in ((1, 72), (3, 7, 72), (5, 576)):
    x, residual, weight = randn(*shape), randn(*shape), randn(shape[-1])
    total, normed = fused.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(total, x + residual)
    want = fused.torch_rms_norm(x + residual, weight, 1e-5)
    torch.testing.assert_close(normed, want, atol=1e-6, rtol=1e-6)
    want = fused.torch_rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(fused.rms_norm(x, weight, 1e-5), want, atol=1e-6, rtol=1e-6)

# rotary: 9 query and 3 KV heads (padded to 16 and 4 in the kernel), B = 1, T = 1, odd T, positions past 0 as
# [B, T], [B] and [T], head dims 64 and 80 (half 40, padded to 64 in the kernel); q and k equal torch bit for
# bit, v untouched; the cache write at slots and positions.
heads, kv_heads = 9, 3
for dim in (64, 80):
    angles = torch.outer(torch.arange(300.0), torch.rand(dim // 2, generator=generator))
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos(), angles.sin()
    width = (heads + 2 * kv_heads) * dim
    cases = [
        (randn(1, 1, width), torch.tensor([[17]])),
        (randn(1, 5, width), torch.arange(5) + 40),
        (randn(3, 7, width), torch.arange(7) + torch.tensor([[0], [9], [250]])),
        (randn(4, width), torch.tensor([3, 0, 299, 64])),
    ]
    for qkv, positions in cases:
        tokens = qkv.view(qkv.shape[0], -1, heads + 2 * kv_heads, dim)
        shared = positions.dim() == 1 and qkv.dim() == 3  # [T], every row
        full = positions.expand(qkv.shape[0], -1) if shared else positions.view(qkv.shape[0], -1)
        want = tokens.clone()
        rope = cos[full].unsqueeze(2), sin[full].unsqueeze(2)
        want[:, :, : heads + kv_heads] = fused.torch_rotate(want[:, :, : heads + kv_heads], *rope)
        keys, values = torch.zeros(6, kv_heads, 300, dim), torch.zeros(6, kv_heads, 300, dim)
        slots = torch.tensor([4, 0, 5, 2][: qkv.shape[0]])
        written = (full + 1) % 300
        got = qkv.clone()
        fused.rotary(got, positions, cos, sin, heads, kv_heads, dim, (keys, values), slots, written)
        assert torch.equal(got.view_as(want), want)
        expected_keys, expected_values = torch.zeros_like(keys), torch.zeros_like(values)
        for row, slot in enumerate(slots.tolist()):
            expected_keys[slot][:, written[row]] = want[row, :, heads : heads + kv_heads].transpose(0, 1)
            expected_values[slot][:, written[row]] = want[row, :, heads + kv_heads :].transpose(0, 1)
        assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)
        # Without a cache: q and k rotated alone; without slots, row b writes slot b at `positions`.
        alone = qkv.clone()
        fused.rotary(alone, positions, cos, sin, heads, kv_heads, dim)
        assert torch.equal(alone, got)
        keys.zero_()
        fused.rotary(qkv.clone(), positions, cos, sin, heads, kv_heads, dim, (keys, values))
        for row in range(qkv.shape[0]):
            written_keys = want[row, :, heads : heads + kv_heads].transpose(0, 1)
            assert torch.equal(keys[row][:, full[row]], written_keys)

# silu_mul: one row, odd widths, a width over several programs (1536 = SmolLM2's FFN).
for shape in ((1, 2 * 100), (3, 5, 2 * 7), (4, 2 * 1536)):
    gate_up = randn(*shape) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(fused.silu_mul(gate_up), F.silu(gate) * up, atol=1e-6, rtol=1e-6)


# The whole model, fused against torch: a plain prefill (padded rows), a prefill over cached prefixes and a
# decode step (rows at different positions), Qwen2 (q/k/v biases) and Llama, 9 query / 3 KV heads.
def model_config(model_type, layers):
    return ModelConfig.from_dict(
        {
            "model_type": model_type, "vocab_size": 300, "hidden_size": 72, "intermediate_size": 100,
            "num_hidden_layers": layers, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 16,
            "max_position_embeddings": 512, "eos_token_id": 2,
        }
    )


def steps(model, cache):
    return [
        model.prefill_batch([[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18]], cache, [2, 0, 1]),
        model.prefill_batch([[20, 21, 22], [23]], cache, [2, 1], starts=[5, 7]),
        model.logits(model.decode(torch.tensor([3, 4, 5]), torch.tensor([8, 2, 8]), cache, 64)),
        model.forward_logits(torch.tensor([7, 8, 9, 10])),
    ]


for model_type in ("qwen2", "llama"):
    config = model_config(model_type, 2)
    model = EngineModel.random(config, "cpu", torch.float32, seed=1)
    for name in model.required_names():  # norms and biases away from 1 and 0
        if name.endswith((".bias", "norm.weight")):
            model.named[name].copy_(torch.randn(model.named[name].shape, generator=generator))
    results = []
    for use_fused in (False, True):
        model.fused_kernels = use_fused
        cache = KVCache(config, 4, 64, model.device, torch.float32)
        results.append((steps(model, cache), cache.kv[..., :63, :].clone()))
    (torch_out, torch_cache), (fused_out, fused_cache) = results
    for got, want in zip(fused_out, torch_out):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # The last position takes the extend's padding, written in either order.
    torch.testing.assert_close(fused_cache, torch_cache, atol=1e-5, rtol=1e-5)


# Operators per layer: every operator the dispatcher runs (each one kernel or more on CUDA; views and empty
# allocations are none) and every fused kernel launch, per layer (3 layers less 2).
class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        if self.paused or name in ("aten.empty", "aten.empty_like", "aten.new_empty", "aten.empty_strided"):
            return out
        if not func.is_view or (name == "aten.to" and out.data_ptr() != args[0].data_ptr()):
            self.ops[name] += 1
        return out


class CountedKernel:
    # The real kernel, launched with the counting paused (the interpreter's own tensors are not the model's).
    def __init__(self, name, kernel):
        self.name, self.kernel = name, kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            MODE.ops["fused." + self.name] += 1
            MODE.paused = True
            try:
                return launch(*args, **kwargs)
            finally:
                MODE.paused = False

        return run


kernels = fused._kernels()
for name, kernel in list(kernels.items()):
    kernels[name] = CountedKernel(name, kernel)
counted_extend = CountedKernel("extend_attention", extend_attention._kernel())
extend_attention._kernel = LazyKernels(lambda: counted_extend)


def count(layers, use_fused, dtype, step):
    global MODE
    config = model_config("llama", layers)
    model = EngineModel.random(config, "cpu", dtype, seed=1)
    model.fused_kernels = model.extend_kernel = use_fused
    cache = KVCache(config, 4, 64, model.device, dtype)
    with torch.inference_mode(), Count() as MODE:
        if step == "decode":
            model.decode(torch.tensor([3, 4, 5]), torch.tensor([8, 2, 8]), cache, 64)
        elif step == "prefill":
            model.prefill_batch([[1, 2, 3], [4, 5]], cache, [0, 1])
        elif step == "packed":
            model.prefill_packed([[1, 2, 3], [4, 5]], cache, [0, 1], starts=[3, 4])
        else:
            model.prefill_batch([[1, 2, 3], [4, 5]], cache, [0, 1], starts=[3, 4])
    return MODE.ops


per_layer = {}
for step in ("decode", "prefill", "extend", "packed"):
    for use_fused, dtype in ((False, torch.bfloat16), (False, torch.float32), (True, torch.float32)):
        ops = count(3, use_fused, dtype, step)
        ops.subtract(count(2, use_fused, dtype, step))
        ops = +ops
        per_layer[(step, use_fused, str(dtype))] = (sum(ops.values()), dict(ops))
for step, extra in (("decode", 0), ("prefill", 0), ("extend", 2)):  # extend: the gather of each slot's K, V
    torch_bf16 = per_layer[(step, False, "torch.bfloat16")]
    torch_f32 = per_layer[(step, False, "torch.float32")]
    fused_f32 = per_layer[(step, True, "torch.float32")]
    assert torch_bf16[0] == 43 + extra, torch_bf16
    assert torch_f32[0] == 33 + extra, torch_f32
    # 4 matmuls, attention, 2 add + norm, 1 rotary (with the cache write), 1 SiLU * up.
    assert fused_f32[0] == 9 + extra, fused_f32
    launched = {k: v for k, v in fused_f32[1].items() if k.startswith("fused.")}
    assert launched == {"fused.add_rms_norm": 2, "fused.rotary": 1, "fused.silu_mul": 1}, launched
# The engine's packed prefill over cached prefixes, with the extend-attention kernel: 9 as well, the
# attention one launch that reads the cache in place (no gather).
packed = per_layer[("packed", True, "torch.float32")]
assert packed[0] == 9, packed
launched = {k: v for k, v in packed[1].items() if k.startswith("fused.")}
assert launched == {
    "fused.add_rms_norm": 2, "fused.rotary": 1, "fused.silu_mul": 1, "fused.extend_attention": 1
}, launched
print("ok")
"""


def test_the_kernels_and_the_model_equal_torch_under_the_interpreter() -> None:
    """On the CPU, under Triton's interpreter (float32): each kernel against the torch ops it replaces
    (rotary and the residual sum bit for bit, the norm and SiLU to 1e-6), the model's prefill, prefill over
    cached prefixes, decode and logits with the kernels against torch (to 1e-5), and the operators per layer
    (43 in bfloat16 / 33 in float32 with torch, 9 fused; +2 for a padded prefill over cached prefixes, 9 for
    the packed one with the extend kernel), with every
    fused kernel launched when the model is set to use them. A process of its own: the interpreter must be
    chosen before Triton is first imported."""
    run_interpreted(INTERPRETED_CHECKS)


def test_not_available_on_the_cpu() -> None:
    assert not fused_kernels.available(torch.device("cpu"))
    model = EngineModel.random(_config(), "cpu", torch.float32)
    assert not model.fused_kernels


def _config() -> ModelConfig:
    return ModelConfig.from_dict(
        {
            "model_type": "qwen2",
            "vocab_size": 300,
            "hidden_size": 72,
            "intermediate_size": 100,
            "num_hidden_layers": 2,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "head_dim": 16,
            "max_position_embeddings": 512,
            "eos_token_id": 2,
        }
    )


def _within_ulps(got: torch.Tensor, want: torch.Tensor, ulps: int) -> bool:
    """Each element of `got` within `ulps` bfloat16 ulps of `want`'s (of its binade; zeros: 1e-30)."""
    want_f = want.float()
    exponent = torch.floor(torch.log2(want_f.abs().clamp_min(1e-30)))
    ulp = torch.exp2(exponent - 7)
    return bool(((got.float() - want_f).abs() <= ulps * ulp).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_kernels_in_bfloat16_are_within_bfloat16_ulps_of_torch_on_cuda() -> None:
    """Compiled on the GPU, bfloat16: the residual sum and the rotary embedding equal torch bit for bit; the
    normalised value (unit weights) and the SiLU (unit up) within one bfloat16 ulp of torch, and with the
    product by random weights (by a random up) within two: a value one ulp away can round the other way."""
    device = torch.device("cuda")
    assert fused_kernels.available(device), "Triton is importable, so the kernels run on CUDA"
    generator = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, device=device, generator=generator).to(torch.bfloat16)

    x, residual, weight = randn(64, 37, 576), randn(64, 37, 576), randn(576)
    total, normed = fused_kernels.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(total, x + residual)
    assert _within_ulps(normed, fused_kernels.torch_rms_norm(x + residual, weight, 1e-5), 2)
    ones = torch.ones_like(weight)
    unit = fused_kernels.add_rms_norm(x, residual, ones, 1e-5)[1]
    assert _within_ulps(unit, fused_kernels.torch_rms_norm(x + residual, ones, 1e-5), 1)

    heads, kv_heads, dim = 9, 3, 64
    angles = torch.outer(torch.arange(1000.0, device=device), torch.rand(dim // 2, device=device))
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos(), angles.sin()
    qkv = randn(256, (heads + 2 * kv_heads) * dim)
    positions = torch.randint(0, 1000, (256,), device=device, generator=generator)
    want = qkv.clone().view(256, heads + 2 * kv_heads, dim)
    rope = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    want[:, : heads + kv_heads] = fused_kernels.torch_rotate(want[:, : heads + kv_heads], *rope)
    fused_kernels.rotary(qkv, positions, cos, sin, heads, kv_heads, dim)
    assert torch.equal(qkv.view_as(want), want)

    gate_up = randn(64, 37, 2 * 1536) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    assert _within_ulps(fused_kernels.silu_mul(gate_up), torch.nn.functional.silu(gate) * up, 2)
    up.fill_(1.0)  # a view into gate_up
    assert _within_ulps(fused_kernels.silu_mul(gate_up), torch.nn.functional.silu(gate), 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_engine_with_the_fused_kernels_and_cuda_graphs_matches_torch_on_cuda() -> None:
    """Compiled on the GPU, through the engine's prefills (with prefix-cache hits: the prompts share a prefix)
    in captured prefill graphs and captured decode graphs (the batch shrinks through several buckets, with
    padding rows): greedy float32 tokens equal and logprobs within 1e-4 of the same engine with torch's
    elementwise ops. The model reports the fused path on by default and off when asked."""
    shared = [(5 * j) % 290 + 3 for j in range(40)]
    prompts = [shared + [(11 * i + 7 * j) % 290 + 3 for j in range(5 + 29 * i)] for i in range(7)]
    results: list[list[Request]] = []
    for fused in (True, False):
        model = EngineModel.random(_config(), "cuda", torch.float32, seed=5, fused_kernels=fused)
        assert model.fused_kernels is fused, "requested on CUDA with Triton: the fused path must be on"
        engine = Engine(model, max_running_requests=8, use_cuda_graphs=True, context_length=512)
        engine.start()
        try:
            results.append(generate_together(engine, prompts[:1], 8))  # fills the prefix cache
            results.append(generate_together(engine, prompts, [60 - 3 * i for i in range(len(prompts))]))
            # The fused path's prefills replay graphs; the torch path's run eagerly.
            assert bool(engine.cuda_graph_prefill_tokens) is fused
        finally:
            engine.stop()
    for got, want in zip(results[1], results[3], strict=True):
        assert got.output_ids == want.output_ids
        assert got.output_logprobs == pytest.approx(want.output_logprobs, abs=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_decode_graphs_draw_as_the_eager_sampler_on_cuda() -> None:
    """The sampling captured in the decode graphs (`sample_dense`), and the prefill graphs, against the same
    engine without graphs, from the same seed, float32: every row drawn at temperature 1 (one graph's draws),
    every row drawn at mixed temperatures (copied to the graph when they change), and a batch the graphs
    leave to the eager sampler (a greedy row beside drawn ones, top-k): the same tokens, logprobs within
    1e-4."""
    prompts = [[(13 * i + 3 * j) % 290 + 3 for j in range(9 + 17 * i)] for i in range(6)]
    batches = [
        [SamplingOptions(max_new_tokens=40 - 4 * i, temperature=1.0, ignore_eos=True) for i in range(6)],
        [SamplingOptions(max_new_tokens=30, temperature=0.5 + 0.2 * i, ignore_eos=True) for i in range(6)],
        [
            SamplingOptions(max_new_tokens=30, temperature=0.0 if i == 0 else 1.0, top_k=8 if i == 1 else -1)
            for i in range(6)
        ],
    ]
    model = EngineModel.random(_config(), "cuda", torch.float32, seed=5)
    results: list[list[list[Request]]] = []
    for graphs in (True, False):
        engine = Engine(model, max_running_requests=8, use_cuda_graphs=graphs, context_length=512, seed=11)
        engine.start()
        try:
            results.append([generate_together(engine, prompts, options=batch) for batch in batches])
            if graphs:
                assert engine.cuda_graph_batch_sizes == [1, 2, 4, 8]
                assert engine.cuda_graph_prefill_tokens, "the prefills replayed graphs"
        finally:
            engine.stop()
    for got_batch, want_batch in zip(*results, strict=True):
        for got, want in zip(got_batch, want_batch, strict=True):
            assert got.output_ids == want.output_ids
            assert got.output_logprobs == pytest.approx(want.output_logprobs, abs=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_prefill_graph_that_fails_to_capture_leaves_its_bucket_eager_on_cuda() -> None:
    """Every prefill capture fails (the model synchronises the device while the stream captures, which CUDA
    forbids): the prefills run eagerly and nothing else changes, the same tokens and logprobs (within 1e-4)
    as the engine without graphs from the same seed, no request aborted, the decode graphs in use."""
    prompts = [[(13 * i + 3 * j) % 290 + 3 for j in range(9 + 17 * i)] for i in range(6)]
    options = [SamplingOptions(max_new_tokens=30 - 3 * i, temperature=1.0, ignore_eos=True) for i in range(6)]
    model = EngineModel.random(_config(), "cuda", torch.float32, seed=5)
    forward_packed = model.forward_packed
    failed: list[int] = []

    def uncapturable(*args: Any, **kwargs: Any) -> Any:
        if torch.cuda.is_current_stream_capturing():
            failed.append(1)
            torch.cuda.synchronize()  # raises: not permitted while the stream captures
        return forward_packed(*args, **kwargs)

    results: list[list[Request]] = []
    for graphs in (True, False):
        engine = Engine(model, max_running_requests=8, use_cuda_graphs=graphs, context_length=512, seed=11)
        model.forward_packed = uncapturable if graphs else forward_packed  # pyright: ignore[reportAttributeAccessIssue]
        engine.start()
        try:
            results.append(generate_together(engine, prompts, options=options))
            if graphs:
                assert failed, "a prefill graph's capture was attempted"
                assert engine.cuda_graph_prefill_tokens == []
                assert engine.cuda_graph_batch_sizes == [1, 2, 4, 8]
            assert engine.counters.num_aborted_requests_total == 0
        finally:
            engine.stop()
    for got, want in zip(*results, strict=True):
        assert got.finish_reason is not None
        assert got.finish_reason["type"] == "length"
        assert got.output_ids == want.output_ids
        assert got.output_logprobs == pytest.approx(want.output_logprobs, abs=1e-4)
