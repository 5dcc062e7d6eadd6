"""HuggingFace -> Megatron -> HuggingFace weight round trips, and the fused layouts, on CPU (gloo)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncrl_megatron.mapping import fuse_qkv, split_qkv
from asyncrl_megatron.model import Architecture, ArchitectureError, padded_vocab_size
from asyncrl_megatron.parallel import spawn

SPAWN_TIMEOUT_S = 480.0


def _random_hf_model(folder: Path, *, model_type: str, vocab_size: int, tie: bool) -> Path:
    """A small random Llama/Qwen2 checkpoint written directly as safetensors (no transformers needed)."""
    hidden, heads, kv_heads, head_dim, ffn, layers = 32, 4, 2, 8, 48, 2
    config = {
        "model_type": model_type, "vocab_size": vocab_size, "hidden_size": hidden,
        "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": 64, "tie_word_embeddings": tie,
        "hidden_act": "silu",
    }  # fmt: skip
    generator = torch.Generator().manual_seed(1)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    tensors = {"model.embed_tokens.weight": rand(vocab_size, hidden), "model.norm.weight": rand(hidden)}
    if not tie:
        tensors["lm_head.weight"] = rand(vocab_size, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": rand(hidden),
            p + "post_attention_layernorm.weight": rand(hidden),
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": rand(ffn, hidden),
            p + "mlp.up_proj.weight": rand(ffn, hidden),
            p + "mlp.down_proj.weight": rand(hidden, ffn),
        }
        if model_type == "qwen2":
            tensors |= {
                p + "self_attn.q_proj.bias": rand(heads * head_dim),
                p + "self_attn.k_proj.bias": rand(kv_heads * head_dim),
                p + "self_attn.v_proj.bias": rand(kv_heads * head_dim),
            }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    import json

    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _round_trip(
    model_dirs: list[str], tensor_parallel_size: int, bucket_bytes: int
) -> list[dict[str, object]]:
    """In each rank: load each HF checkpoint into Megatron, export it back, and report what came out."""
    from asyncrl_megatron import parallel
    from asyncrl_megatron.mapping import SafetensorsReader, export_hf_weights, load_hf_weights
    from asyncrl_megatron.model import Architecture, build_gpt_model

    parallel.initialize(tensor_parallel_size)
    reports: list[dict[str, object]] = []
    try:
        for model_dir in model_dirs:
            arch = Architecture.from_pretrained(model_dir)
            model = build_gpt_model(arch, tensor_parallel_size=tensor_parallel_size)
            load_hf_weights(model, SafetensorsReader(model_dir), arch)
            exported: dict[str, torch.Tensor] = {}
            bucket_sizes: list[int] = []
            for bucket in export_hf_weights(model, arch, bucket_bytes):
                bucket_sizes.append(sum(t.numel() * t.element_size() for _, t in bucket))
                for name, tensor in bucket:
                    assert name not in exported, f"{name} exported twice"
                    exported[name] = tensor.clone()
            shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
            reports.append({"exported": exported, "bucket_sizes": bucket_sizes, "shapes": shapes})
    finally:
        parallel.destroy()
    return reports


CASES = [("llama", 96, True), ("qwen2", 97, False)]  # 97: padded to 98 for TP=2, sliced back on export


def _check_report(report: dict[str, object], model_dir: Path, case: tuple[str, int, bool], tp: int) -> None:
    _, vocab_size, tie = case
    original = load_file(str(model_dir / "model.safetensors"))
    exported = report["exported"]
    assert isinstance(exported, dict)
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    sizes = report["bucket_sizes"]
    assert isinstance(sizes, list)
    assert len(sizes) > 1
    largest_tensor = max(t.numel() * t.element_size() for t in original.values())
    assert all(size <= max(BUCKET_BYTES, largest_tensor) for size in sizes)
    shapes = report["shapes"]
    assert isinstance(shapes, dict)
    padded = padded_vocab_size(vocab_size, tp)
    assert shapes["embedding.word_embeddings.weight"] == (padded // tp, 32)
    assert ("output_layer.weight" in shapes) == (not tie)


BUCKET_BYTES = 16 * 1024


def _write_cases(tmp_path: Path) -> list[Path]:
    return [
        _random_hf_model(
            tmp_path / f"{model_type}-{vocab_size}", model_type=model_type, vocab_size=vocab_size, tie=tie
        )
        for model_type, vocab_size, tie in CASES
    ]


def test_hf_megatron_hf_round_trip_is_exact_tp1(tmp_path: Path) -> None:
    model_dirs = _write_cases(tmp_path)
    reports = _round_trip([str(d) for d in model_dirs], 1, BUCKET_BYTES)
    for report, model_dir, case in zip(reports, model_dirs, CASES, strict=True):
        _check_report(report, model_dir, case, 1)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hf_megatron_hf_round_trip_is_exact_tp2(tmp_path: Path) -> None:
    model_dirs = _write_cases(tmp_path)
    results = spawn(
        _round_trip, 2, ([str(d) for d in model_dirs], 2, BUCKET_BYTES), timeout_s=SPAWN_TIMEOUT_S
    )
    for rank_reports in results:
        for report, model_dir, case in zip(rank_reports, model_dirs, CASES, strict=True):
            _check_report(report, model_dir, case, 2)


def test_qkv_fusion_interleaves_query_groups() -> None:
    arch = Architecture.from_dict(
        {"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
         "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 1}
    )  # fmt: skip
    q = torch.tensor([[10.0], [11.0], [12.0], [13.0]])  # heads 0,1 -> group 0; heads 2,3 -> group 1
    k = torch.tensor([[20.0], [21.0]])
    v = torch.tensor([[30.0], [31.0]])
    fused = fuse_qkv(q, k, v, arch)
    assert fused.flatten().tolist() == [10.0, 11.0, 20.0, 30.0, 12.0, 13.0, 21.0, 31.0]
    assert fuse_qkv(q, k, v, arch, rank=1, size=2).flatten().tolist() == [12.0, 13.0, 21.0, 31.0]
    back = split_qkv(fused, arch)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v), strict=True))


def test_architecture_rejects_what_it_cannot_map() -> None:
    base = {"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 4}  # fmt: skip
    assert Architecture.from_dict(base).num_kv_heads == 4
    with pytest.raises(ArchitectureError, match="model_type 'gpt2'"):
        Architecture.from_dict(base | {"model_type": "gpt2"})
    with pytest.raises(ArchitectureError, match="rope_type 'llama3'"):
        Architecture.from_dict(base | {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(ArchitectureError, match="hidden_act"):
        Architecture.from_dict(base | {"hidden_act": "gelu"})


def test_architecture_reads_smollm2_style_config(tmp_path: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model_dir = _random_hf_model(tmp_path, model_type="llama", vocab_size=16, tie=True)
    arch = Architecture.from_pretrained(model_dir)
    assert (arch.heads_per_group, arch.head_dim, arch.tie_word_embeddings, arch.qkv_bias) == (
        2,
        8,
        True,
        False,
    )
    with pytest.raises(ArchitectureError, match="not a HuggingFace model folder"):
        Architecture.from_pretrained(tmp_path / "missing")
