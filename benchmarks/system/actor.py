"""Training throughput of the actors, side by side in one run.

Measures, on the same random Llama and the same token counts:

  (a) a bare Megatron-Core GPT training step: local layer spec, plain next-token cross-entropy (the labels
      path of `GPTModel`), Megatron's DDP and optimizer on a GPU (torch AdamW on a CPU);
  (b) `MegatronActor.train_step`: packing, group-relative advantages, per-token logprobs and entropy, the PPO
      loss, backward, optimizer step;
  (c) `TorchActor.train_step` on the same groups;

and prints tokens per second of each and the ratio (b)/(a). On a GPU the model is shaped like SmolLM2-135M
(hidden 576, 30 layers, 9 heads, 3 KV heads, FFN 1536, vocab 49152, tied) and the batch is 32 x 1024 in
bfloat16; on a CPU a smaller model and batch in float32. Random weights, nothing downloaded.

    python benchmarks/system/actor.py [--rows 32 --seq-len 1024 --micro-batch-size 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from asyncrl_core.metrics import TRAIN_LOSS

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SMOLLM2_SHAPE = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
                 "num_key_value_heads": 3, "intermediate_size": 1536}  # fmt: skip
CPU_SHAPE = {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 384}  # fmt: skip
VOCAB_SIZE = 49152


def write_random_llama(folder: Path, shape: dict[str, int], seed: int = 0) -> Path:
    """A HuggingFace Llama folder (config.json + model.safetensors) with random weights, tied embeddings."""
    from safetensors.torch import save_file

    hidden, layers = shape["hidden_size"], shape["num_hidden_layers"]
    heads, kv_heads, ffn = (
        shape["num_attention_heads"],
        shape["num_key_value_heads"],
        shape["intermediate_size"],
    )
    head_dim = hidden // heads
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB_SIZE,
        "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192,
        "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False, "bos_token_id": 1,
        "eos_token_id": 2, "pad_token_id": 2, "torch_dtype": "float32",
    }  # fmt: skip
    generator = torch.Generator().manual_seed(seed)

    def normal(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator) * 0.02

    tensors = {
        "model.embed_tokens.weight": normal(VOCAB_SIZE, hidden),
        "model.norm.weight": torch.ones(hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
            p + "self_attn.q_proj.weight": normal(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": normal(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": normal(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": normal(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": normal(ffn, hidden),
            p + "mlp.up_proj.weight": normal(ffn, hidden),
            p + "mlp.down_proj.weight": normal(hidden, ffn),
        }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def make_groups(rows: int, seq_len: int, group_size: int, seed: int = 0) -> list[Any]:
    """`rows` trajectories of exactly `seq_len` tokens (a quarter prompt), in groups of `group_size`."""
    from asyncrl_core.types import Group, Trajectory

    rng = random.Random(seed)
    prompt_len = seq_len // 4
    groups = []
    for group_index in range(rows // group_size):
        trajectories = []
        for _ in range(group_size):
            response_len = seq_len - prompt_len
            trajectories.append(
                Trajectory(
                    token_ids=[rng.randrange(3, VOCAB_SIZE) for _ in range(seq_len)],
                    prompt_len=prompt_len,
                    loss_mask=[1] * response_len,
                    rollout_logprobs=[-10.8 + rng.uniform(-0.1, 0.1) for _ in range(response_len)],
                    versions=[0] * response_len,
                    reward=float(rng.random() < 0.5),
                )
            )
        groups.append(Group(group_id=group_index, prompt_index=group_index, trajectories=trajectories))
    return groups


def timed(step: Callable[[], object], warmup: int, steps: int) -> list[float]:
    """Wall seconds of each of `steps` calls after `warmup` untimed ones (device work included)."""
    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        step()
    durations = []
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        durations.append(time.perf_counter() - start)
    return durations


def bare_megatron_step(
    model_dir: Path, dtype: torch.dtype, rows: int, seq_len: int, micro: int
) -> Callable[[], float]:
    """(a): GPTModel with the labels path (vocab-parallel cross-entropy), DDP buffers, an optimizer step."""
    from asyncrl_megatron.mapping import SafetensorsReader, load_hf_weights
    from asyncrl_megatron.model import Architecture, build_gpt_model, megatron_warnings_ignored

    with megatron_warnings_ignored():
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        arch = Architecture.from_pretrained(model_dir)
        module = build_gpt_model(arch, dtype=dtype)
        load_hf_weights(module, SafetensorsReader(model_dir), arch)
        model = DistributedDataParallel(
            config=module.config,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False),
            module=module,
        )
        if torch.cuda.is_available():
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

            optimizer: Any = get_megatron_optimizer(
                OptimizerConfig(
                    optimizer="adam", lr=1e-6, bf16=dtype == torch.bfloat16, params_dtype=dtype, clip_grad=1.0
                ),
                [model],
            )
        else:
            optimizer = None
            torch_optimizer = torch.optim.AdamW(module.parameters(), lr=1e-6)
    device = next(module.parameters()).device
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, VOCAB_SIZE, (rows, seq_len + 1), generator=generator).to(device)
    positions = torch.arange(seq_len, device=device).expand(micro, seq_len)

    def step() -> float:
        with megatron_warnings_ignored():
            model.zero_grad_buffer()
            total = 0.0
            for start in range(0, rows, micro):
                chunk = tokens[start : start + micro]
                losses = model(chunk[:, :-1], positions[: chunk.shape[0]], None, labels=chunk[:, 1:])
                loss = losses.float().sum() / (rows * seq_len)
                loss.backward()
                total += float(loss.detach())
            model.finish_grad_sync()
            if optimizer is not None:
                optimizer.step()
            else:
                for parameter in module.parameters():
                    parameter.grad = parameter.main_grad  # pyright: ignore[reportAttributeAccessIssue]
                torch.nn.utils.clip_grad_norm_(list(module.parameters()), 1.0)
                torch_optimizer.step()
                torch_optimizer.zero_grad(set_to_none=True)
        return total

    return step


def engine_round_trip(actor: Any, model_dir: Path) -> float | None:
    """Load the actor's exported weights into the built-in engine and compare logits on a few tokens."""
    try:
        from asyncrl_engine.model import EngineModel
    except ImportError:
        print("built-in engine not importable: round trip skipped")
        return None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = EngineModel.from_pretrained(model_dir, device, actor.dtype)
    for bucket in actor.export_weights(64 << 20):
        engine.load_named_tensors(bucket)
    tokens = torch.randint(3, VOCAB_SIZE, (64,), generator=torch.Generator().manual_seed(1))
    ours, theirs = actor.forward_logits(tokens), engine.forward_logits(tokens)
    difference = float((ours - theirs).abs().max())
    agree = float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())
    print(f"engine round trip ({actor.dtype}): max |logits difference| {difference:.4g}, ", end="")
    print(f"argmax agreement {agree:.3f}")
    return difference


def main() -> int:
    on_gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=32 if on_gpu else 8)
    parser.add_argument("--seq-len", type=int, default=1024 if on_gpu else 128)
    parser.add_argument("--micro-batch-size", type=int, default=8 if on_gpu else 4)
    parser.add_argument("--group-size", type=int, default=8 if on_gpu else 4)
    parser.add_argument("--steps", type=int, default=5 if on_gpu else 3)
    parser.add_argument("--warmup", type=int, default=2 if on_gpu else 1)
    parser.add_argument("--skip-torch", action="store_true", help="do not measure the torch actor")
    parser.add_argument(
        "--no-distributed-optimizer",
        action="store_true",
        help="Megatron's plain optimizer instead of the sharded one",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    from asyncrl_core.algorithms import LossSettings
    from asyncrl_megatron.actor import MegatronActor, MegatronActorSettings

    dtype_name = "bfloat16" if on_gpu else "float32"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    shape = SMOLLM2_SHAPE if on_gpu else CPU_SHAPE
    num_tokens = args.rows * args.seq_len
    device = torch.cuda.get_device_name() if on_gpu else f"CPU ({os.cpu_count()} cores)"
    print(f"device: {device}; torch {torch.__version__}; model {shape}, vocab {VOCAB_SIZE}; {dtype_name}")
    print(f"batch: {args.rows} x {args.seq_len} tokens, micro-batches of {args.micro_batch_size}; "
          f"{args.warmup} warm-up + {args.steps} timed steps each")  # fmt: skip
    results: dict[str, Any] = {
        "device": device, "dtype": dtype_name, "shape": shape, "rows": args.rows, "seq_len": args.seq_len,
        "micro_batch_size": args.micro_batch_size,
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-") as scratch:
        model_dir = write_random_llama(Path(scratch) / "model", shape)
        groups = make_groups(args.rows, args.seq_len, args.group_size)
        settings = MegatronActorSettings(
            model_path=str(model_dir),
            temperature=1.0,
            dtype=dtype_name,
            micro_batch_size=args.micro_batch_size,
            lr=1e-6,
            use_distributed_optimizer=not args.no_distributed_optimizer,
        )
        actor = MegatronActor(settings, LossSettings())
        bare = bare_megatron_step(model_dir, dtype, args.rows, args.seq_len, args.micro_batch_size)

        runs: dict[str, list[float]] = {}
        losses: list[float] = []

        def actor_step() -> None:
            losses.append(actor.train_step(groups)[TRAIN_LOSS])

        # Interleave (a) and (b) so drift in clocks or load hits both alike.
        runs["megatron_bare"] = timed(bare, args.warmup, args.steps)
        runs["megatron_actor"] = timed(actor_step, args.warmup, args.steps)
        runs["megatron_bare"] += timed(bare, 0, args.steps)
        print(f"megatron actor: losses {[round(value, 5) for value in losses]}, version {actor.version}")
        exported = sum(t.numel() for bucket in actor.export_weights(256 << 20) for _, t in bucket)
        print(f"megatron actor: exported {exported / 1e6:.1f}M parameters under HuggingFace names")
        results["engine_logits_max_abs_diff"] = engine_round_trip(actor, model_dir)
        if not args.skip_torch:
            from types import SimpleNamespace

            from asyncrl_core.actor import TorchActor

            shared = ("model_path", "dtype", "micro_batch_size", "lr", "weight_decay", "adam_beta1",
                      "adam_beta2", "adam_eps", "grad_clip", "tensor_parallel_size", "pipeline_parallel_size",
                      "gradient_checkpointing", "temperature", "ppo_mini_batch_size",
                      "ppo_epochs")  # fmt: skip
            torch_settings = SimpleNamespace(**{k: getattr(settings, k) for k in shared}, optimizer="adamw")
            # TorchActor reads its settings as attributes; plain values keep pydantic off the GPU machine.
            algorithm = SimpleNamespace(**{k: getattr(LossSettings(), k) for k in LossSettings.__slots__})
            torch_actor = TorchActor(torch_settings, algorithm)  # pyright: ignore[reportArgumentType]
            runs["torch_actor"] = timed(lambda: torch_actor.train_step(groups), args.warmup, args.steps)

    print(f"\n{'step':<16} {'median s':>10} {'tokens/s':>12}")
    for name, durations in runs.items():
        median = statistics.median(durations)
        results[name] = {"seconds": durations, "tokens_per_s": num_tokens / median}
        print(f"{name:<16} {median:>10.4f} {num_tokens / median:>12.0f}")
    ratio = results["megatron_actor"]["tokens_per_s"] / results["megatron_bare"]["tokens_per_s"]
    results["actor_over_bare"] = ratio
    print(f"\nMegatron actor / bare Megatron step: {ratio:.3f}")
    if "torch_actor" in results:
        torch_ratio = results["torch_actor"]["tokens_per_s"] / results["megatron_actor"]["tokens_per_s"]
        results["torch_over_megatron_actor"] = torch_ratio
        print(f"torch actor / Megatron actor: {torch_ratio:.3f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
