"""The built-in engine's model and scheduler in process: logits, KV cache, batching, sampling, pauses."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from engine_testing import WAIT_S, generate_together, start_engine

from asyncrl_engine.engine import Engine
from asyncrl_engine.kv_cache import KVCache
from asyncrl_engine.model import EngineModel
from asyncrl_engine.model_config import ModelLoadError
from asyncrl_engine.options import SamplingOptions
from asyncrl_engine.request import Request


def _hf_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids.unsqueeze(0)).logits[0].float()


@pytest.fixture(scope="module")
def smollm2_model(smollm2_path: Path) -> EngineModel:
    return EngineModel.from_pretrained(smollm2_path)


def _submit(engine: Engine, prompt: list[int], **options: object) -> tuple[Request, threading.Event]:
    done = threading.Event()
    return_logprob = bool(options.pop("return_logprob", False))
    top = int(options.pop("top_logprobs_num", 0))  # type: ignore[call-overload]
    request = Request(
        rid=f"r{time.monotonic_ns()}",
        prompt_ids=prompt,
        options=SamplingOptions(**options),  # type: ignore[arg-type]
        return_logprob=return_logprob,
        top_logprobs_num=top,
        on_update=lambda _r, finished: done.set() if finished else None,
    )
    engine.call(lambda: engine.add_request(request), timeout_s=WAIT_S)
    return request, done


def _generate(engine: Engine, prompt: list[int], **options: object) -> Request:
    request, done = _submit(engine, prompt, **options)
    assert done.wait(WAIT_S), "generation did not finish"
    return request


def _greedy_reference(
    model: EngineModel, prompt: list[int], num_tokens: int
) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs by full recompute (no cache) at every step."""
    tokens = list(prompt)
    logprobs: list[float] = []
    for _ in range(num_tokens):
        row = torch.log_softmax(model.forward_logits(torch.tensor(tokens))[-1], dim=-1)
        token = int(row.argmax())
        tokens.append(token)
        logprobs.append(float(row[token]))
    return tokens[len(prompt) :], logprobs


def _perturbed(model: EngineModel, seed: int) -> list[tuple[str, torch.Tensor]]:
    """New weights for every parameter: the old ones plus noise of the same scale (a 'training step')."""
    generator = torch.Generator().manual_seed(seed)
    out: list[tuple[str, torch.Tensor]] = []
    for name in sorted(model.required_names()):
        tensor = model.named[name].clone()
        out.append((name, tensor + tensor.std() * torch.randn(tensor.shape, generator=generator)))
    return out


def _wait_tokens(request: Request, count: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while len(request.output_ids) < count:
        assert time.monotonic() < deadline, "request made no progress"
        time.sleep(0.001)


# ---------------------------------------------------------------------------------------------- the model
def test_logits_match_transformers_llama(tiny_llama_path: Path, tiny_model: EngineModel) -> None:
    ids = torch.randint(0, tiny_model.config.vocab_size, (37,), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(
        tiny_model.forward_logits(ids), _hf_logits(tiny_llama_path, ids), atol=1e-4, rtol=1e-4
    )


def test_logits_match_transformers_qwen2_untied_with_bias(tmp_path: Path) -> None:
    """Qwen2: q/k/v biases, untied LM head, a rope theta of its own."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=256,
        rope_theta=50000.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.q_proj.bias.normal_(0, 0.5)
            layer.self_attn.k_proj.bias.normal_(0, 0.5)
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    model = EngineModel.from_pretrained(tmp_path)
    assert model.config.attention_bias
    assert not model.config.tie_word_embeddings
    ids = torch.randint(0, 512, (29,), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(model.forward_logits(ids), _hf_logits(tmp_path, ids), atol=1e-4, rtol=1e-4)


def test_logits_match_transformers_llama3_rope_scaling(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(tmp_path), safe_serialization=True)
    model = EngineModel.from_pretrained(tmp_path)
    assert model.config.rope_scaling is not None
    ids = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(model.forward_logits(ids), _hf_logits(tmp_path, ids), atol=1e-4, rtol=1e-4)


def test_load_named_tensors_refuses_bad_names_and_shapes_changing_nothing(tiny_model: EngineModel) -> None:
    before = tiny_model.named["model.norm.weight"].clone()
    bad = [
        ("model.norm.weight", torch.full_like(before, 3.0)),
        ("model.layers.0.mlp.up_proj.weight", torch.zeros(3, 3)),
        ("model.layers.9.self_attn.q_proj.weight", torch.zeros(64, 64)),
    ]
    with pytest.raises(ModelLoadError) as caught:
        tiny_model.load_named_tensors(bad)
    assert len(caught.value.problems) == 2
    assert "model.layers.9.self_attn.q_proj.weight" in str(caught.value)
    assert "up_proj" in str(caught.value)
    torch.testing.assert_close(tiny_model.named["model.norm.weight"], before)


def test_partial_load_by_huggingface_names_reaches_fused_weights(tiny_llama_path: Path) -> None:
    model = EngineModel.from_pretrained(tiny_llama_path)
    ids = torch.arange(1, 12)
    before = model.forward_logits(ids)
    k_proj = model.named["model.layers.1.self_attn.k_proj.weight"]
    model.load_named_tensors([("model.layers.1.self_attn.k_proj.weight", k_proj * 5.0)])
    assert not torch.allclose(model.forward_logits(ids), before)
    # Tied: lm_head.weight is accepted and lands in the embedding.
    embed = model.named["model.embed_tokens.weight"].clone()
    model.load_named_tensors([("lm_head.weight", embed * 2.0)])
    torch.testing.assert_close(model.named["model.embed_tokens.weight"], embed * 2.0)


def test_kv_cached_decode_equals_full_recompute(smollm2_model: EngineModel) -> None:
    model = smollm2_model
    prompt = torch.tensor([1, 504, 3458, 282, 4649, 314, 253, 3100])
    cache = KVCache(model.config, 3, 64, model.device, model.dtype)
    hidden = model.prefill(prompt, cache, slot=2)
    cache.move_slot(2, 0, len(prompt))
    tokens = [int(model.logits(hidden[-1:]).argmax())]
    for step in range(6):
        position = len(prompt) + step
        out = model.decode(torch.tensor(tokens[-1:]), torch.tensor([position]), cache, position + 1)
        cached = torch.log_softmax(model.logits(out)[0], dim=-1)
        full = torch.log_softmax(model.forward_logits(torch.cat([prompt, torch.tensor(tokens)]))[-1], dim=-1)
        torch.testing.assert_close(cached, full, atol=2e-4, rtol=1e-4)
        tokens.append(int(cached.argmax()))


# ---------------------------------------------------------------------------------------------- the scheduler
def test_greedy_generation_matches_recompute_and_transformers(
    smollm2_path: Path, smollm2_model: EngineModel, engines: list[Engine]
) -> None:
    from transformers import AutoModelForCausalLM

    engine = start_engine(engines, smollm2_model)
    prompt = [1, 504, 3458, 282, 4649, 314, 253, 3100, 30]
    request = _generate(
        engine, prompt, max_new_tokens=16, temperature=0.0, ignore_eos=True, return_logprob=True
    )
    expected, expected_logprobs = _greedy_reference(smollm2_model, prompt, 16)
    assert request.output_ids == expected
    torch.testing.assert_close(
        torch.tensor(request.output_logprobs), torch.tensor(expected_logprobs), atol=1e-3, rtol=0
    )
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_path), dtype=torch.float32).eval()
    with torch.no_grad():
        generated = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, min_new_tokens=16)
    assert generated[0, len(prompt) :].tolist() == request.output_ids


def test_batching_does_not_change_greedy_tokens(smollm2_model: EngineModel, engines: list[Engine]) -> None:
    engine = start_engine(engines, smollm2_model, max_running_requests=4)
    prompts = [
        [1, 504, 3458, 282],
        [1, 19, 2132, 314, 1345, 28, 7, 5, 99, 23, 88],
        [2, 3],
        [1, 930, 12, 4, 81, 61],
    ]
    alone = [
        _generate(engine, p, max_new_tokens=10, temperature=0.0, ignore_eos=True).output_ids for p in prompts
    ]
    # Together, with staggered lengths so requests join and leave a running batch.
    submitted = [
        _submit(engine, p, max_new_tokens=4 + 2 * i, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(prompts)
    ]
    for _, done in submitted:
        assert done.wait(WAIT_S)
    for (request, _), reference in zip(submitted, alone, strict=True):
        assert request.output_ids == reference[: len(request.output_ids)]


def test_top_k_one_is_greedy_and_logprobs_are_the_tempered_distribution(
    tiny_model: EngineModel, engines: list[Engine]
) -> None:
    engine = start_engine(engines, tiny_model)
    prompt = [1, 2, 3, 4, 5]
    greedy = _generate(engine, prompt, max_new_tokens=8, temperature=0.0, ignore_eos=True)
    top1 = _generate(
        engine, prompt, max_new_tokens=8, temperature=0.7, top_k=1, ignore_eos=True, return_logprob=True
    )
    assert top1.output_ids == greedy.output_ids
    sampled = _generate(
        engine,
        prompt,
        max_new_tokens=8,
        temperature=0.7,
        ignore_eos=True,
        return_logprob=True,
        top_logprobs_num=3,
    )
    tokens = prompt + sampled.output_ids
    logits = tiny_model.forward_logits(torch.tensor(tokens))[len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits / 0.7, dim=-1)
    chosen = expected.gather(1, torch.tensor(sampled.output_ids).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(torch.tensor(sampled.output_logprobs), chosen, atol=1e-4, rtol=0)
    top_values, top_ids = expected.topk(3, dim=-1)
    assert [[t for _, t in row] for row in sampled.output_top_logprobs] == top_ids.tolist()
    torch.testing.assert_close(
        torch.tensor([[v for v, _ in row] for row in sampled.output_top_logprobs]),
        top_values,
        atol=1e-4,
        rtol=0,
    )


def test_sampling_seed_reproduces_tokens_across_batches(
    tiny_model: EngineModel, engines: list[Engine]
) -> None:
    engine = start_engine(engines, tiny_model)
    options = {"max_new_tokens": 12, "temperature": 1.0, "top_p": 0.9, "ignore_eos": True, "sampling_seed": 7}
    alone = _generate(engine, [5, 6, 7], **options).output_ids
    noise = [_submit(engine, [9, 9, 9, i], max_new_tokens=20, ignore_eos=True) for i in range(3)]
    again = _generate(engine, [5, 6, 7], **options).output_ids
    for _, done in noise:
        assert done.wait(WAIT_S)
    other_seed = _generate(engine, [5, 6, 7], **{**options, "sampling_seed": 8}).output_ids
    assert again == alone
    assert other_seed != alone


def test_top_k_and_top_p_restrict_the_support(tiny_model: EngineModel, engines: list[Engine]) -> None:
    engine = start_engine(engines, tiny_model)
    prompt = [3, 1, 4, 1, 5]
    request = _generate(engine, prompt, max_new_tokens=30, temperature=5.0, top_k=3, ignore_eos=True)
    tokens = prompt + request.output_ids
    logits = tiny_model.forward_logits(torch.tensor(tokens))[len(prompt) - 1 : -1]
    top3 = logits.topk(3, dim=-1).indices
    for step, token in enumerate(request.output_ids):
        assert token in top3[step].tolist()
    nucleus = _generate(engine, prompt, max_new_tokens=10, temperature=1.0, top_p=1e-6, ignore_eos=True)
    greedy = _generate(engine, prompt, max_new_tokens=10, temperature=0.0, ignore_eos=True)
    assert nucleus.output_ids == greedy.output_ids


def test_stop_token_ids_eos_and_lengths(tiny_model: EngineModel, engines: list[Engine]) -> None:
    engine = start_engine(engines, tiny_model, context_length=40)
    prompt = [7, 8, 9]
    greedy = _generate(engine, prompt, max_new_tokens=10, temperature=0.0, ignore_eos=True).output_ids
    stop_at = greedy[4]
    first = greedy.index(stop_at)
    stopped = _generate(
        engine, prompt, max_new_tokens=10, temperature=0.0, stop_token_ids=frozenset({stop_at})
    )
    assert stopped.output_ids == greedy[: first + 1]
    assert stopped.finish_reason == {"type": "stop", "matched": stop_at}
    # An EOS id (the engine's) stops unless ignore_eos.
    engine_eos = start_engine(engines, tiny_model, eos_token_ids=[stop_at])
    assert _generate(engine_eos, prompt, max_new_tokens=10, temperature=0.0).finish_reason == {
        "type": "stop",
        "matched": stop_at,
    }
    ignored = _generate(engine_eos, prompt, max_new_tokens=10, temperature=0.0, ignore_eos=True)
    assert ignored.finish_reason == {"type": "length", "length": 10}
    # min_new_tokens bans the EOS until the minimum.
    at_least = _generate(engine_eos, prompt, max_new_tokens=10, temperature=0.0, min_new_tokens=8)
    assert len(at_least.output_ids) >= 8
    # Unlimited max_new_tokens stops at the context length.
    unlimited = _generate(engine, prompt, max_new_tokens=None, temperature=0.0, ignore_eos=True)
    assert unlimited.finish_reason == {"type": "length", "length": 40 - len(prompt)}


def test_running_limit_and_fifo_queue(tiny_model: EngineModel, engines: list[Engine]) -> None:
    engine = start_engine(engines, tiny_model, max_running_requests=2)
    engine.call(lambda: engine.pause("in_place"))
    submitted = [_submit(engine, [1, 2, i + 3], max_new_tokens=200, ignore_eos=True) for i in range(5)]
    assert engine.call(lambda: (engine.num_running, engine.num_waiting)) == (0, 5)
    engine.call(engine.resume)
    _wait_tokens(submitted[0][0], 1)
    running, waiting = engine.call(lambda: (engine.num_running, engine.num_waiting))
    assert running == 2
    assert waiting == 3
    for _, done in submitted:
        assert done.wait(WAIT_S)
    assert engine.call(lambda: (engine.num_running, engine.num_waiting)) == (0, 0)
    assert all(len(r.output_ids) == 200 for r, _ in submitted)


# ---------------------------------------------------------------------------------------------- pause modes
def test_retract_recomputes_under_new_weights(tiny_llama_path: Path, engines: list[Engine]) -> None:
    model = EngineModel.from_pretrained(tiny_llama_path)
    engine = start_engine(engines, model)
    prompt = [11, 12, 13, 14]
    old_reference, _ = _greedy_reference(model, prompt, 30)
    request, done = _submit(engine, prompt, max_new_tokens=30, temperature=0.0, ignore_eos=True)
    _wait_tokens(request, 3)
    engine.call(lambda: engine.pause("retract"))
    kept = len(request.output_ids)
    assert engine.call(lambda: (engine.num_running, engine.num_waiting)) == (0, 1)
    assert not done.is_set()
    new_weights = _perturbed(model, seed=1)
    engine.call(lambda: engine.load_weights(new_weights, "v2"))
    engine.call(engine.resume)
    assert done.wait(WAIT_S)
    assert request.output_ids[:kept] == old_reference[:kept]
    # The continuation is what the new weights produce from the kept prefix (no stale KV).
    continuation, _ = _greedy_reference(model, prompt + request.output_ids[:kept], 30 - kept)
    assert request.output_ids[kept:] == continuation
    assert request.num_retractions == 1
    assert request.finish_reason == {"type": "length", "length": 30}
    assert request.weight_versions() == [
        {"version": "default", "start": 0, "end": kept},
        {"version": "v2", "start": kept, "end": 30},
    ]


def test_in_place_keeps_old_kv_and_uses_new_weights(tiny_llama_path: Path, engines: list[Engine]) -> None:
    model = EngineModel.from_pretrained(tiny_llama_path)
    engine = start_engine(engines, model)
    prompt = [21, 22, 23, 24, 25]
    request, done = _submit(engine, prompt, max_new_tokens=24, temperature=0.0, ignore_eos=True)
    _wait_tokens(request, 3)
    engine.call(lambda: engine.pause("in_place"))
    kept = len(request.output_ids)
    assert engine.call(lambda: (engine.num_running, engine.num_waiting)) == (1, 0)
    new_weights = _perturbed(model, seed=2)
    # The reference, computed explicitly: the KV of prompt + output[:-1] under the OLD weights...
    reference = EngineModel.from_pretrained(tiny_llama_path)
    cache = KVCache(reference.config, 1, 64, reference.device, reference.dtype)
    prefix = prompt + request.output_ids[: kept - 1]
    reference.prefill(torch.tensor(prefix), cache, 0)
    # ...then the new weights for every later token.
    reference.load_named_tensors(new_weights)
    tokens = list(request.output_ids[:kept])
    while len(tokens) < 24:
        position = len(prompt) + len(tokens) - 1
        hidden = reference.decode(torch.tensor(tokens[-1:]), torch.tensor([position]), cache, position + 1)
        tokens.append(int(reference.logits(hidden).argmax()))
    engine.call(lambda: engine.load_weights(new_weights, "v2"))
    engine.call(engine.resume)
    assert done.wait(WAIT_S)
    assert request.output_ids == tokens
    assert request.num_retractions == 0
    assert request.weight_versions() == [
        {"version": "default", "start": 0, "end": kept},
        {"version": "v2", "start": kept, "end": 24},
    ]
    # And the old KV really matters: the first step after the pause differs from a recompute under the new
    # weights (the decode below rewrites the same position with the same K/V).
    position = len(prompt) + kept - 1
    hidden = reference.decode(
        torch.tensor(tokens[kept - 1 : kept]), torch.tensor([position]), cache, position + 1
    )
    recomputed = reference.forward_logits(torch.tensor(prompt + tokens[:kept]))[-1]
    assert not torch.allclose(reference.logits(hidden)[0], recomputed, atol=1e-3)


def test_abort_pause_finishes_everything_with_partial_output(
    tiny_model: EngineModel, engines: list[Engine]
) -> None:
    engine = start_engine(engines, tiny_model, max_running_requests=1)
    running, running_done = _submit(engine, [1, 2, 3], max_new_tokens=1000, ignore_eos=True)
    waiting, waiting_done = _submit(engine, [4, 5, 6], max_new_tokens=10, ignore_eos=True)
    _wait_tokens(running, 2)
    engine.call(lambda: engine.pause("abort"))
    assert running_done.wait(WAIT_S)
    assert waiting_done.wait(WAIT_S)
    assert running.finish_reason is not None
    assert running.finish_reason["type"] == "abort"
    assert 0 < len(running.output_ids) < 1000
    assert waiting.output_ids == []
    assert waiting.weight_versions() == [{"version": "default", "start": 0, "end": 0}]
    assert engine.call(engine.is_idle)


def test_flush_and_release_need_an_idle_engine(tiny_model: EngineModel, engines: list[Engine]) -> None:
    from asyncrl_engine.request import EngineBusyError

    engine = start_engine(engines, tiny_model)
    request, done = _submit(engine, [1, 2, 3], max_new_tokens=1000, ignore_eos=True)
    _wait_tokens(request, 1)
    engine.call(lambda: engine.pause("in_place"))
    with pytest.raises(EngineBusyError):
        engine.call(engine.flush_cache)
    with pytest.raises(EngineBusyError):
        engine.call(lambda: engine.release_memory(["kv_cache", "weights"]))
    engine.call(lambda: engine.abort(request.rid))
    assert done.wait(WAIT_S)
    engine.call(engine.flush_cache)
    engine.call(lambda: engine.release_memory(["kv_cache", "weights"]))
    engine.call(lambda: engine.resume_memory(["kv_cache", "weights"]))
    engine.call(engine.resume)
    assert len(_generate(engine, [1, 2], max_new_tokens=3, ignore_eos=True).output_ids) == 3


@pytest.mark.parametrize("whole_context", [False, True])
def test_the_kv_cache_grows_on_demand_or_takes_the_whole_context_once(
    tiny_model: EngineModel, engines: list[Engine], whole_context: bool
) -> None:
    """On demand (the CPU's default) the cache grows in steps as requests lengthen; with `kv_whole_context`
    (CUDA's default where it fits) it is allocated at the context length at once and never grows, so no
    captured decode graph is dropped. Both give the same tokens."""
    engine = start_engine(engines, tiny_model, context_length=700, kv_whole_context=whole_context)
    assert engine.kv_whole_context is whole_context
    capacities: list[int] = []
    outputs: list[list[int]] = []
    for new_tokens in (8, 400):
        (request,) = generate_together(engine, [[3, 1, 4, 1, 5]], new_tokens)
        outputs.append(request.output_ids)
        capacities.append(engine.call(lambda: engine.runner.cache.capacity if engine.runner.cache else 0))
    assert capacities == ([700, 700] if whole_context else [256, 512])
    assert outputs[1][:8] == outputs[0]
