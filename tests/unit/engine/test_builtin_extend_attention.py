"""The packed prefill (`EngineModel.prefill_packed`) and its extend-attention kernel
(`builtin/extend_attention.py`): the kernel equals the per-sequence SDPA reference, and the packed prefill
equals the right-padded one it replaces (hidden states and the KV it writes), with and without cached
prefixes. On the CPU the Triton kernels run under Triton's interpreter; on CUDA (`gpu`) compiled, in float32
and bfloat16."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from engine_testing import generate_together, run_interpreted, start_engine

from asyncrl_core.errors import EngineControlError
from asyncrl_engine import extend_attention
from asyncrl_engine.__main__ import launch_arguments
from asyncrl_engine.engine import Engine
from asyncrl_engine.flags import parse_args
from asyncrl_engine.info import server_args
from asyncrl_engine.kv_cache import KVCache, PackedShape
from asyncrl_engine.model import EngineModel
from asyncrl_engine.model_config import ModelConfig
from asyncrl_sglang.launcher import builtin_command

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

KERNEL_CHECKS = """
import torch

from asyncrl_engine import extend_attention as ea

# Five sequences in slots out of order, cached prefixes of 0 to 130 positions, 1 to 130 new tokens (past a
# block of query tokens and of keys), 1, 3 and 4 query heads per KV head, head dims 64 and 24 (padded in the
# kernel), float32 and bfloat16: equal to the reference (bfloat16: both against the float32 reference of the
# same inputs, the kernel within a bfloat16 rounding of it).
slots, prefixes, lengths = [4, 0, 2, 5, 1], [0, 5, 70, 0, 130], [1, 70, 130, 64, 3]
generator = torch.Generator().manual_seed(0)
for heads, kv_heads, dim in ((4, 4, 64), (9, 3, 64), (8, 2, 24)):
    q = torch.randn(sum(lengths), heads, dim, generator=generator)
    keys = torch.randn(7, kv_heads, 300, dim, generator=generator)
    values = torch.randn(7, kv_heads, 300, dim, generator=generator)
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        args = [t.to(dtype) for t in (q, keys, values)]
        per_program = ea.tokens_per_program(heads, kv_heads)
        # The exact work list, and one padded as a CUDA graph's grid is (its extra programs do nothing).
        size = ea.max_work_items(sum(lengths), len(lengths), per_program) + 3
        for work in (
            ea.work_items(torch.tensor(lengths), per_program),
            ea.work_items(torch.tensor(lengths), per_program, size),
        ):
            got = ea.extend_attention(*args, torch.tensor(slots), torch.tensor(prefixes), offsets, *work)
            assert got.dtype == dtype
            want = ea.torch_extend_attention(*(t.float() for t in args), slots, prefixes, lengths)
            torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=tolerance)
    # q as the model passes it: a view of a q|k|v projection (rows wider than the heads).
    wide = torch.randn(sum(lengths), (heads + 2 * kv_heads) * dim, generator=generator)
    view = wide[:, : heads * dim].view(-1, heads, dim)
    work = ea.work_items(torch.tensor(lengths), ea.tokens_per_program(heads, kv_heads))
    got = ea.extend_attention(view, keys, values, torch.tensor(slots), torch.tensor(prefixes), offsets, *work)
    want = ea.torch_extend_attention(view, keys, values, slots, prefixes, lengths)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    ea.self_check(torch.device("cpu"), torch.float32)
    ea.self_check(torch.device("cpu"), torch.bfloat16)

# The model's packed prefill with the kernel (and the fused rotary + cache write) against the same prefill
# with the reference and against the padded prefill, fresh and over cached prefixes: hidden states and the
# whole cache to 1e-5 in float32.
from asyncrl_engine.model import EngineModel
from asyncrl_engine.kv_cache import KVCache, PackedShape
from asyncrl_engine.model_config import ModelConfig

for kv_heads in (1, 3):
    config = ModelConfig.from_dict(
        {
            "model_type": "qwen2", "vocab_size": 300, "hidden_size": 72, "intermediate_size": 100,
            "num_hidden_layers": 2, "num_attention_heads": 9, "num_key_value_heads": kv_heads, "head_dim": 16,
            "max_position_embeddings": 512, "eos_token_id": 2,
        }
    )
    model = EngineModel.random(config, "cpu", torch.float32, seed=1)
    for name in model.required_names():  # biases away from 0
        if name.endswith(".bias"):
            model.named[name].copy_(torch.randn(model.named[name].shape, generator=generator))
    first = [[5, 6, 7, 8, 9], [10, 11], list(range(20, 90))]
    second = [[20, 21, 22], [23], list(range(100, 170))]
    results = []
    for path in ("padded", "reference", "kernel"):
        model.fused_kernels = model.extend_kernel = path == "kernel"
        cache = KVCache(config, 4, 160, model.device, torch.float32)
        prefill = model.prefill_batch if path == "padded" else model.prefill_packed
        hidden = [prefill(first, cache, [2, 0, 3]), prefill(second, cache, [2, 0, 3], starts=[5, 2, 70])]
        if path == "padded":  # rows without their padding, packed
            hidden = [
                torch.cat([h[row, : len(s)] for row, s in enumerate(batch)])
                for h, batch in zip(hidden, (first, second))
            ]
        results.append((hidden, cache))
    (want_hidden, want_cache), *others = results
    for hidden, cache in others:
        for got, want in zip(hidden, want_hidden):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for slot, used in ((2, 8), (0, 3), (3, 140)):
            torch.testing.assert_close(
                cache.kv[:, :, slot, :, :used], want_cache.kv[:, :, slot, :, :used], atol=1e-5, rtol=1e-5
            )

    # Padded as a CUDA graph runs it (`PackedPrefill.padded`: tokens of no sequence, a sequence of no tokens,
    # work items that do nothing): its first rows equal the unpadded prefill's, and so does the cache but
    # for the last position of slot 0, where the padding tokens write.
    model.fused_kernels = model.extend_kernel = True
    caches = [KVCache(config, 4, 160, model.device, torch.float32) for _ in range(2)]
    caches[0].kv.normal_(generator=generator)
    caches[1].kv.copy_(caches[0].kv)
    want = model.prefill_packed(second, caches[0], [2, 0, 3], starts=[5, 2, 70])
    batch = model.pack_prefill(second, caches[1], [2, 0, 3], [5, 2, 70])
    shape = PackedShape(batch.total + 29, 4, batch.columns[-1].numel() + 5)
    got = model.forward_packed(shape.columns(batch.padded(shape, 160)), caches[1], None)
    torch.testing.assert_close(got[: batch.total], want, atol=1e-5, rtol=1e-5)
    assert not torch.equal(caches[1].kv[:, :, 0, :, 159], caches[0].kv[:, :, 0, :, 159])
    caches[1].kv[:, :, 0, :, 159] = caches[0].kv[:, :, 0, :, 159]
    torch.testing.assert_close(caches[1].kv, caches[0].kv, atol=1e-5, rtol=1e-5)
print("ok")
"""


@needs_triton
def test_the_kernel_and_the_packed_prefill_equal_the_references_under_the_interpreter() -> None:
    """On the CPU, under Triton's interpreter: the kernel alone against `torch_extend_attention`, and the
    model's packed prefill with it against the reference path and the padded prefill. A process of its own:
    the interpreter must be chosen before Triton is first imported."""
    run_interpreted(KERNEL_CHECKS)


def test_not_available_on_the_cpu() -> None:
    assert not extend_attention.available(torch.device("cpu"))


def _config(model_type: str, heads: int, kv_heads: int) -> ModelConfig:
    return ModelConfig.from_dict(
        {
            "model_type": model_type,
            "vocab_size": 300,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "max_position_embeddings": 512,
            "eos_token_id": 2,
        }
    )


@pytest.mark.parametrize(
    ("model_type", "heads", "kv_heads"), [("llama", 4, 4), ("qwen2", 4, 2), ("llama", 4, 1)]
)
def test_the_packed_prefill_equals_the_padded_one(model_type: str, heads: int, kv_heads: int) -> None:
    """Fresh prompts, then later turns over their cached prefixes beside a fresh prompt, in slots out of
    order: the packed prefill's hidden states equal the padded prefill's valid rows, and it writes the same
    K/V at each sequence's positions and nothing anywhere else (float32, to 1e-5)."""
    config = _config(model_type, heads, kv_heads)
    model = EngineModel.random(config, "cpu", torch.float32, seed=2)
    generator = torch.Generator().manual_seed(3)
    turns = [
        ([[5, 6, 7, 8, 9], [10, 11], [3], list(range(20, 60))], [3, 0, 4, 1], [0, 0, 0, 0]),
        ([[20, 21, 22], [23], list(range(100, 140)), [7, 8]], [3, 0, 1, 2], [5, 2, 40, 0]),
    ]
    filled = torch.randn(KVCache(config, 5, 128, model.device, torch.float32).kv.shape, generator=generator)
    padded_cache = KVCache(config, 5, 128, model.device, torch.float32)
    packed_cache = KVCache(config, 5, 128, model.device, torch.float32)
    padded_cache.kv.copy_(filled)
    packed_cache.kv.copy_(filled)
    used = torch.zeros(5, dtype=torch.long)  # positions written per slot
    for sequences, slots, starts in turns:
        padded = model.prefill_batch(sequences, padded_cache, slots, starts)
        packed = model.prefill_packed(sequences, packed_cache, slots, starts)
        assert packed.shape == (sum(len(s) for s in sequences), config.hidden_size)
        rows = torch.cat([padded[row, : len(s)] for row, s in enumerate(sequences)])
        torch.testing.assert_close(packed, rows, atol=1e-5, rtol=1e-5)
        for slot, start, sequence in zip(slots, starts, sequences, strict=True):
            used[slot] = start + len(sequence)
    for slot in range(5):
        end = int(used[slot])
        torch.testing.assert_close(
            packed_cache.kv[:, :, slot, :, :end], padded_cache.kv[:, :, slot, :, :end], atol=1e-5, rtol=1e-5
        )
        assert torch.equal(packed_cache.kv[:, :, slot, :, end:], filled[:, :, slot, :, end:])


def test_a_sequence_that_does_not_fit_is_refused_changing_nothing() -> None:
    config = _config("llama", 4, 2)
    model = EngineModel.random(config, "cpu", torch.float32, seed=2)
    cache = KVCache(config, 2, 16, model.device, torch.float32)
    for sequences, slots, starts, named in (
        ([[1, 2], [3]], [0, 2], [0, 0], "sequence 1: 1 tokens from position 0 in slot 2"),
        ([[1, 2], list(range(10))], [0, 1], [0, 8], "sequence 1: 10 tokens from position 8"),
        ([[1, 2], []], [0, 1], [0, 0], "sequence 1: 0 tokens"),
        ([[1, 2]], [0, 1], [0], "1 sequences but 2 slots"),
        ([], [], [], "0 sequences"),
    ):
        with pytest.raises(ValueError, match=named):
            model.prefill_packed(sequences, cache, slots, starts)
    assert not cache.kv.any()


def test_attention_backend_torch_native_reaches_the_model_and_server_info(tiny_llama_path: Path) -> None:
    """SGLang's `--attention-backend` (also `rollout.sglang.extra_args: {attention_backend: torch_native}`):
    `torch_native` builds the model without the attention kernels, a choice a move of its weights keeps, and
    `/server_info` reports it; a backend the engine lacks is refused before any engine starts."""
    command = builtin_command(
        model_path="m",
        host="127.0.0.1",
        port=5,
        max_running_requests=2,
        extra_args={"attention_backend": "torch_native"},
    )
    args = parse_args(list(command.argv[3:]))
    assert args.attention_backend == "torch_native"
    reported = launch_arguments(
        args,
        model_path=tiny_llama_path,
        tokenizer_path=None,
        context_length=64,
        device="cpu",
        dtype="float32",
        command="",
    )
    assert server_args(reported)["attention_backend"] == "torch_native"
    assert parse_args(["--model-path", "m"]).attention_backend == "triton"
    with pytest.raises(EngineControlError, match="attention-backend"):
        builtin_command(
            model_path="m",
            host="127.0.0.1",
            port=5,
            max_running_requests=2,
            extra_args={"attention_backend": "fa3"},
        )
    model = EngineModel.from_pretrained(tiny_llama_path, attention_kernels=False)
    assert model._attention_requested is False
    model.move_weights(torch.device("meta"))
    assert model._attention_requested is False
    assert not model.decode_kernel
    assert not model.extend_kernel


def test_engine_turns_over_cached_prefixes_match_a_full_recompute(
    tiny_model: EngineModel, engines: list[Engine]
) -> None:
    """The engine's packed prefills over prefix-cache hits (second turns of different lengths in one batch,
    beside a fresh prompt): every output and prompt logprob equals the model's full forward of the whole
    sequence without a cache, and greedy tokens are its argmax."""
    model = tiny_model
    engine = start_engine(engines, model, kv_block_size=4)
    first = [list(range(10, 31)), list(range(40, 53))]
    turn1 = generate_together(engine, first, 6, num_prompt_logprobs=3)
    second = [
        first[0] + turn1[0].output_ids + [60, 61, 62],
        first[1] + turn1[1].output_ids + [70],
        [100, 101, 102, 103, 104],
    ]
    turn2 = generate_together(engine, second, 6, num_prompt_logprobs=3)
    assert [request.cached_tokens > 0 for request in turn2] == [True, True, False]
    for request in turn1 + turn2:
        tokens = request.prompt_ids + request.output_ids
        logprobs = torch.log_softmax(model.forward_logits(torch.tensor(tokens)), dim=-1)
        prompt_length = len(request.prompt_ids)
        want_output = logprobs[prompt_length - 1 : -1].gather(1, torch.tensor(request.output_ids)[:, None])
        assert request.output_ids == logprobs[prompt_length - 1 : -1].argmax(-1).tolist()
        assert request.output_logprobs == pytest.approx(want_output.squeeze(1).tolist(), abs=1e-5)
        start = prompt_length - 3
        want_input = logprobs[start - 1 : prompt_length - 1].gather(
            1, torch.tensor(request.prompt_ids[start:])[:, None]
        )
        assert request.input_logprobs == pytest.approx(want_input.squeeze(1).tolist(), abs=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_and_the_packed_prefill_on_cuda(dtype: torch.dtype) -> None:
    """Compiled on the GPU: the self-check passes (so the model takes the kernel), the kernel on agentic-like
    shapes (32 sequences of up to 130 new tokens over up to 1,200 cached positions, 9 query / 3 KV heads)
    equals the reference, and the model's packed prefill with it equals the padded prefill (a head dim of 10,
    no power of two: the fused rotary kernel and the attention kernels pad it)."""
    device = torch.device("cuda")
    assert extend_attention.available(device), "Triton is importable, so the kernel runs on CUDA"
    generator = torch.Generator(device=device).manual_seed(0)
    lengths = [1 + (37 * b) % 130 for b in range(32)]
    prefixes = [(211 * b) % 1200 for b in range(32)]
    slots = list(range(31, -1, -1))
    q = torch.randn(sum(lengths), 9, 64, device=device, generator=generator).to(dtype)
    keys = torch.randn(32, 3, 1400, 64, device=device, generator=generator).to(dtype)
    values = torch.randn(32, 3, 1400, 64, device=device, generator=generator).to(dtype)
    offsets = torch.tensor([0, *lengths], device=device).cumsum(0)
    got = extend_attention.extend_attention(
        q,
        keys,
        values,
        torch.tensor(slots, device=device),
        torch.tensor(prefixes, device=device),
        offsets,
        *extend_attention.work_items(torch.tensor(lengths), extend_attention.tokens_per_program(9, 3)).to(
            device
        ),
    )
    want = extend_attention.torch_extend_attention(
        q.float(), keys.float(), values.float(), slots, prefixes, lengths
    )
    tolerance = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=tolerance)

    config = _config("qwen2", 6, 2)
    model = EngineModel.random(config, device, torch.float32, seed=2)
    assert model.extend_kernel
    sequences = [[(7 * b + j) % 290 + 3 for j in range(1 + 23 * b)] for b in range(6)]
    caches = [KVCache(config, 6, 512, device, torch.float32) for _ in range(2)]
    starts = [0, 3, 0, 40, 100, 7]
    for cache in caches:
        cache.kv.normal_(generator=generator)
    caches[1].kv.copy_(caches[0].kv)
    padded = model.prefill_batch(sequences, caches[0], [5, 0, 4, 1, 3, 2], starts)
    packed = model.prefill_packed(sequences, caches[1], [5, 0, 4, 1, 3, 2], starts)
    rows = torch.cat([padded[row, : len(s)] for row, s in enumerate(sequences)])
    torch.testing.assert_close(packed, rows, atol=1e-4, rtol=1e-4)


def test_a_padded_prefill_that_does_not_fit_its_shape_is_refused() -> None:
    """A CUDA graph's shape too small for a batch (tokens, sequences or kernel programs) is an error naming
    both, and so is the padded forward on a path that needs the batch's host side (the torch path)."""
    config = _config("llama", 4, 2)
    model = EngineModel.random(config, "cpu", torch.float32, seed=2)
    cache = KVCache(config, 4, 64, model.device, torch.float32)
    batch = model.pack_prefill([[1, 2, 3], [4, 5]], cache, [0, 1])
    for shape in (PackedShape(4, 2, 8), PackedShape(8, 1, 8)):
        with pytest.raises(ValueError, match=r"a packed prefill of 5 tokens does not fit PackedShape"):
            batch.padded(shape, cache.capacity)
    with pytest.raises(ValueError, match="programs do not fit a grid of 1"):
        extend_attention.work_items(torch.tensor([3, 2]), 2, size=1)
    shape = PackedShape(8, 2, 0)
    columns = shape.columns(batch.padded(shape, cache.capacity))
    with pytest.raises(ValueError, match="without its host side needs the extend and fused kernels"):
        model.forward_packed(columns, cache, None)
