"""The engine's prefix cache: same tokens and logprobs as a full prefill, weight versions, flush, eviction,
and the agentic workload of `benchmarks/system/engine.py` in CI size."""

from __future__ import annotations

import importlib.util
import itertools
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_testing import WAIT_S, generate_together, start_engine

from asyncrl_engine.engine import Engine
from asyncrl_engine.gate import AdmissionGate
from asyncrl_engine.info import Load
from asyncrl_engine.kv_cache import KVCache
from asyncrl_engine.model import EngineModel
from asyncrl_engine.options import SamplingOptions
from asyncrl_engine.request import Request
from asyncrl_engine.step_runner import KV_CAPACITY_STEP

BLOCK = 4


def _assert_same(cached: list[Request], reference: list[Request]) -> None:
    for got, want in zip(cached, reference, strict=True):
        assert got.output_ids == want.output_ids
        assert got.output_logprobs == pytest.approx(want.output_logprobs, abs=1e-5)


def test_cached_prefixes_give_the_tokens_and_logprobs_of_a_full_prefill(
    tiny_model: EngineModel, engines: list[Engine]
) -> None:
    cached_engine = start_engine(engines, tiny_model, kv_block_size=BLOCK)
    plain_engine = start_engine(engines, tiny_model, kv_block_size=BLOCK, prefix_cache=False)
    first_turns = [list(range(10, 31)), list(range(40, 53)), [7, 8, 9]]
    turn1 = generate_together(cached_engine, first_turns)
    _assert_same(turn1, generate_together(plain_engine, first_turns))
    assert [r.cached_tokens for r in turn1] == [0, 0, 0]
    # Second turns of different lengths in one prefill batch, beside a prompt the cache has never seen and
    # one that shares only part of an earlier prompt.
    second_turns = [
        first_turns[0] + turn1[0].output_ids + [60, 61, 62, 63, 64],
        first_turns[1] + turn1[1].output_ids + [70],
        [100, 101, 102, 103, 104, 105],
        [*range(10, 19), 99, 98],
    ]
    turn2 = generate_together(cached_engine, second_turns)
    _assert_same(turn2, generate_together(plain_engine, second_turns))
    # All but the last token of a finished turn are cached, in whole blocks of 4.
    held = [len(first_turns[0]) + 8 - 1, len(first_turns[1]) + 8 - 1]
    assert [r.cached_tokens for r in turn2] == [held[0] // BLOCK * BLOCK, held[1] // BLOCK * BLOCK, 0, 8]
    assert plain_engine.counters.cached_tokens_total == 0
    assert cached_engine.counters.cached_tokens_total == sum(r.cached_tokens for r in turn2)
    # /v1/loads' cache_hit_rate: the share of the latest prefill batch (the second turns) from the cache.
    rate = sum(r.cached_tokens for r in turn2) / sum(len(s) for s in second_turns)
    assert cached_engine.snapshot.counters.cache_hit_rate == pytest.approx(rate)
    assert Load.read(cached_engine, AdmissionGate()).sglang_json(["core"])["cache_hit_rate"] == round(rate, 4)
    assert Load.read(plain_engine, AdmissionGate()).sglang_json(["core"])["cache_hit_rate"] == 0


def test_a_retract_update_drops_the_cache_and_in_place_keeps_it(
    tiny_llama_path: Path, engines: list[Engine]
) -> None:
    model = EngineModel.from_pretrained(tiny_llama_path)
    engine = start_engine(engines, model, kv_block_size=BLOCK)
    prompt = list(range(20, 37))
    (first,) = generate_together(engine, [prompt])
    follow_up = prompt + first.output_ids + [5, 6, 7]
    generator = torch.Generator().manual_seed(3)
    new_weights = [
        (name, model.named[name] + 0.02 * torch.randn(model.named[name].shape, generator=generator))
        for name in sorted(model.required_names())
    ]
    old_weights = [(name, model.named[name].clone()) for name in sorted(model.required_names())]

    engine.call(lambda: engine.pause("retract"))
    engine.call(lambda: engine.load_weights(new_weights, "v2"))
    engine.call(engine.resume)
    assert engine.prefix_cache is not None
    assert engine.prefix_cache.num_cached_tokens == 0
    (after_retract,) = generate_together(engine, [follow_up])
    assert after_retract.cached_tokens == 0
    reference_engine = start_engine(
        engines, EngineModel.from_pretrained(tiny_llama_path), kv_block_size=BLOCK, prefix_cache=False
    )
    reference_engine.call(lambda: reference_engine.model.load_named_tensors(new_weights))
    _assert_same([after_retract], generate_together(reference_engine, [follow_up]))

    # in_place: the cache (now holding the follow-up's KV, computed under v2) survives an update to v3 (the
    # old weights), and the same prompt decodes over that v2 KV with the v3 weights.
    engine.call(lambda: engine.pause("in_place"))
    engine.call(lambda: engine.load_weights(old_weights, "v3"))
    engine.call(engine.resume)
    assert engine.prefix_cache.num_cached_tokens > 0
    (after_in_place,) = generate_together(engine, [follow_up], max_new_tokens=4)
    cached_length = (len(follow_up) - 1) // BLOCK * BLOCK
    assert after_in_place.cached_tokens == cached_length
    # Reference without the engine's code paths: v2 KV for the cached part, then v3 weights token by token.
    reference = EngineModel.from_pretrained(tiny_llama_path)
    reference.load_named_tensors(new_weights)
    cache = KVCache(reference.config, 1, 128, reference.device, reference.dtype)
    reference.prefill(torch.tensor(follow_up[:cached_length]), cache, 0)
    reference.load_named_tensors(old_weights)
    tokens = list(follow_up)
    logprobs: list[float] = []
    for position in range(cached_length, len(follow_up) + 3):
        hidden = reference.decode(
            torch.tensor(tokens[position : position + 1]), torch.tensor([position]), cache, position + 1
        )
        if position >= len(follow_up) - 1:
            row = torch.log_softmax(reference.logits(hidden)[0], dim=-1)
            tokens.append(int(row.argmax()))
            logprobs.append(float(row.max()))
    assert after_in_place.output_ids == tokens[len(follow_up) :]
    assert after_in_place.output_logprobs == pytest.approx(logprobs, abs=1e-5)


def test_flush_empties_the_cache(tiny_model: EngineModel, engines: list[Engine]) -> None:
    engine = start_engine(engines, tiny_model, kv_block_size=BLOCK)
    prompt = list(range(30, 45))
    (first,) = generate_together(engine, [prompt])
    assert engine.prefix_cache is not None
    assert engine.prefix_cache.num_cached_tokens > 0
    held = engine.call(lambda: engine.kv_cache_bytes)
    engine.call(engine.flush_cache)
    assert engine.prefix_cache.num_cached_tokens == 0
    # Its memory and the KV cache stay allocated for the next requests (as SGLang's pool does).
    assert engine.call(lambda: engine.kv_cache_bytes) == held > 0
    (again,) = generate_together(engine, [prompt + first.output_ids])
    assert again.cached_tokens == 0


def test_a_full_pool_evicts_and_keeps_its_accounting(tiny_model: EngineModel, engines: list[Engine]) -> None:
    engine = start_engine(engines, tiny_model, kv_block_size=BLOCK, prefix_cache_tokens=6 * BLOCK)
    prefix_cache = engine.prefix_cache
    assert prefix_cache is not None
    prompts = [[base + i for i in range(13)] for base in (10, 40, 70, 100)]
    for prompt in prompts:
        generate_together(engine, [prompt], max_new_tokens=4)
        assert prefix_cache.pool.num_blocks <= 6
        assert prefix_cache.tree.num_blocks == prefix_cache.pool.allocator.num_allocated
    assert prefix_cache.evicted_blocks_total > 0
    # The most recent prompt is still cached; the oldest was evicted first.
    (last,) = generate_together(engine, [prompts[-1]], max_new_tokens=1)
    assert last.cached_tokens == 12
    (oldest,) = generate_together(engine, [prompts[0]], max_new_tokens=1)
    assert oldest.cached_tokens == 0


def _benchmark_module() -> Any:
    path = Path(__file__).parents[3] / "benchmarks" / "system" / "engine.py"
    spec = importlib.util.spec_from_file_location("engine_benchmark", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_agentic_workload_in_ci_size(tiny_model: EngineModel, engines: list[Engine]) -> None:
    """The benchmark's agentic workload, small: every turn's prompt extends the last, later turns prefill only
    what the cache lacks, and every token comes with a finite logprob."""
    bench = _benchmark_module()
    vocab = tiny_model.config.vocab_size
    engine = start_engine(
        engines,
        tiny_model,
        kv_block_size=BLOCK,
        max_running_requests=4,
        decode_text=bench.synthetic_decoder(vocab),
    )
    result = bench.run_agentic(
        engine, 6, 3, 12, vocab, seed=1, new_tokens=(3, 9), observation_tokens=(2, 6), timeout_s=WAIT_S
    )
    assert len(result.turns) == 6
    for turns in result.turns:
        assert [r.rid.rsplit("-", 1)[1] for r in turns] == ["0", "1", "2"]
        for earlier, later in itertools.pairwise(turns):
            assert later.prompt_ids[: earlier.num_tokens] == earlier.prompt_ids + earlier.output_ids
            assert later.cached_tokens >= (earlier.num_tokens - 1) // BLOCK * BLOCK
        for request in turns:
            assert request.finish_reason is not None
            assert request.finish_reason["type"] in ("length", "stop")
            assert len(request.output_logprobs) == len(request.output_ids) > 0
            assert all(lp <= 0.0 and lp > -1e9 for lp in request.output_logprobs)
    assert result.generated_tokens == sum(len(r.output_ids) for t in result.turns for r in t)
    assert result.cached_tokens > 0
    assert result.prefill_tokens + result.cached_tokens == sum(
        r.num_tokens - len(r.output_ids) for t in result.turns for r in t
    )


def test_waiting_requests_join_at_the_prefill_interval(tiny_model: EngineModel) -> None:
    """With others running, a waiting request is admitted at the interval's step, or at once when the batch
    is empty or a quarter of the slots' worth waits (the scheduler's steps run here by hand, no thread)."""
    engine = Engine(tiny_model, max_running_requests=8, prefill_interval=3)
    options = SamplingOptions(max_new_tokens=50, temperature=0.0, ignore_eos=True)

    def request(name: str) -> Request:
        return Request(rid=name, prompt_ids=[5, 6, 7], options=options)

    engine.add_request(request("first"))
    engine.batch.step()
    assert (engine.num_running, engine.num_waiting) == (1, 0)  # an empty batch admits at once
    engine.add_request(request("second"))
    waiting: list[int] = []
    for _ in range(3):
        engine.batch.step()
        waiting.append(engine.num_waiting)
    assert waiting == [1, 1, 0]
    engine.add_request(request("third"))
    engine.add_request(request("fourth"))
    engine.batch.step()
    assert engine.num_waiting == 0  # 2 waiting = a quarter of 8 slots
    assert Engine(tiny_model).scheduler.prefill_interval == 1  # on CPU every step admits


def test_an_admission_cut_short_by_its_prefill_budget_goes_on_at_the_next_step(
    tiny_model: EngineModel,
) -> None:
    """Requests that a free slot but not the prefill budget could take are admitted at the next step, not at
    the interval's: one left over (fewer than a quarter of the slots) would otherwise join 100 steps after
    the others, and a batch submitted at once would end in a tail of few rows."""
    engine = Engine(tiny_model, max_running_requests=20, prefill_interval=100, chunked_prefill_size=20)
    options = SamplingOptions(max_new_tokens=50, temperature=0.0, ignore_eos=True)
    for i in range(16):  # 4 tokens each, distinct: 5 fit the budget of 20
        engine.add_request(Request(rid=f"r{i}", prompt_ids=[3 + i, 4, 5, 6], options=options))
    waiting: list[int] = []
    for _ in range(4):
        engine.batch.step()
        waiting.append(engine.num_waiting)
    assert waiting == [11, 6, 1, 0]
    engine.add_request(Request(rid="late", prompt_ids=[40, 4, 5, 6], options=options))
    engine.batch.step()
    assert engine.num_waiting == 1  # one arriving later, with slots free, still waits for the interval


def test_an_admission_put_back_for_a_cache_growth_still_goes_on_at_the_next_step(
    tiny_model: EngineModel,
) -> None:
    """The last prompt left by a cut-short admission is taken beside the step in flight, put back because the
    KV cache must grow first, and then admitted by the same step's sync path: putting it back restores that
    an admission is due (taking it had cleared it, the queue being empty for a moment)."""
    length = KV_CAPACITY_STEP - 4  # the fourth step's decode positions need the cache to grow
    engine = Engine(
        tiny_model,
        max_running_requests=20,
        prefill_interval=100,
        chunked_prefill_size=5 * length,
        context_length=4 * KV_CAPACITY_STEP,
    )
    options = SamplingOptions(max_new_tokens=50, temperature=0.0, ignore_eos=True)
    for i in range(16):
        engine.add_request(Request(rid=f"r{i}", prompt_ids=[3 + i] + [4] * (length - 1), options=options))
    waiting: list[int] = []
    for _ in range(4):
        engine.batch.step()
        waiting.append(engine.num_waiting)
    assert waiting == [11, 6, 1, 0]
    cache = engine.runner.cache
    assert cache is not None
    assert cache.capacity > KV_CAPACITY_STEP  # the path that puts the prompt back was taken


def test_the_cpu_pool_defaults_to_a_gibibyte(tiny_model: EngineModel) -> None:
    engine = Engine(tiny_model, max_running_requests=1024, context_length=4096, kv_block_size=BLOCK)
    assert engine.prefix_cache is not None
    assert 0 < engine.prefix_cache.pool.max_blocks * BLOCK * _token_bytes(tiny_model) <= 1 << 30
    assert Engine(tiny_model, prefix_cache_tokens=64).prefix_cache.pool.max_blocks == 64 // 16  # type: ignore[union-attr]


def _token_bytes(model: EngineModel) -> int:
    c = model.config
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4


def test_a_retract_on_top_of_an_in_place_update_recomputes_the_kept_kv(
    tiny_llama_path: Path, engines: list[Engine]
) -> None:
    model = EngineModel.from_pretrained(tiny_llama_path)
    engine = start_engine(engines, model, kv_block_size=BLOCK)
    started, done = threading.Event(), threading.Event()

    def on_update(request: Request, finished: bool) -> None:
        if len(request.output_ids) >= 3:
            started.set()
        if finished:
            done.set()

    options = SamplingOptions(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    request = Request(
        rid="kept", prompt_ids=list(range(50, 70)), options=options, on_update=on_update, stream=True
    )
    engine.call(lambda: engine.add_request(request), timeout_s=WAIT_S)
    assert started.wait(WAIT_S)
    engine.call(lambda: engine.pause("in_place"))
    noise = torch.Generator().manual_seed(5)
    engine.call(
        lambda: engine.load_weights(
            [
                (n, model.named[n] + 0.02 * torch.randn(model.named[n].shape, generator=noise))
                for n in sorted(model.required_names())
            ],
            "v2",
        )
    )
    engine.call(lambda: engine.pause("retract"))
    engine.call(engine.resume)
    assert done.wait(WAIT_S)
    assert request.num_retractions == 1
    assert request.cached_tokens == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cached_prefixes_match_a_full_prefill_on_cuda(engines: list[Engine]) -> None:
    """The CUDA kernels of a packed prefill over cached prefixes (the extend-attention kernel reading them in
    place) against prefills from position 0 (the same kernel without a prefix), float32, greedy, several
    turns in one batch."""
    from asyncrl_engine.model_config import ModelConfig

    config = ModelConfig.from_dict(
        {
            "model_type": "llama",
            "vocab_size": 512,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 1024,
            "eos_token_id": 2,
        }
    )
    model = EngineModel.random(config, "cuda", torch.float32, seed=3)
    cached_engine = start_engine(engines, model, kv_block_size=BLOCK)
    plain_engine = start_engine(engines, model, kv_block_size=BLOCK, prefix_cache=False)
    prompts = [[(7 * i + j) % 500 + 3 for j in range(17 + 5 * i)] for i in range(6)]
    turn1 = generate_together(cached_engine, prompts)
    _assert_same(turn1, generate_together(plain_engine, prompts))
    second = [p + r.output_ids + [9, 10, 11] for p, r in zip(prompts, turn1, strict=True)]
    turn2 = generate_together(cached_engine, second)
    assert all(r.cached_tokens > 0 for r in turn2)
    reference = generate_together(plain_engine, second)
    for got, want in zip(turn2, reference, strict=True):
        assert got.output_ids == want.output_ids
        assert got.output_logprobs == pytest.approx(want.output_logprobs, abs=1e-4)
