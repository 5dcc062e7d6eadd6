"""A Megatron-Core GPT model built from a HuggingFace Llama or Qwen2 `config.json`.

`Architecture` reads the fields that matter from the HuggingFace config; `build_gpt_model` turns it into a
`TransformerConfig` and a `GPTModel` with the local layer spec (TransformerEngine's spec when TE is
importable and a GPU is present). The model starts with Megatron's random initialisation: load weights with
`asyncrl_megatron.mapping.load_hf_weights`.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from asyncrl_core.errors import AsyncRLError
from asyncrl_core.models import read_hf_config

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


class ArchitectureError(AsyncRLError, ValueError):
    """A HuggingFace config this package cannot map onto a Megatron GPT model."""


@dataclass(frozen=True, slots=True)
class Architecture:
    """The shape of a Llama/Qwen2 decoder, as its HuggingFace `config.json` describes it."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    """Qwen2 (and Llama with `attention_bias`) has biases on q, k and v; no other linear has one."""

    @property
    def heads_per_group(self) -> int:
        """Query heads sharing one key/value head (GQA)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> Architecture:
        """Read a HuggingFace config dictionary; raises `ArchitectureError` naming what is unsupported."""
        model_type = str(config.get("model_type", ""))
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ArchitectureError(
                f"model_type {model_type!r} is not supported; the Megatron actor maps {SUPPORTED_MODEL_TYPES}"
            )
        activation = config.get("hidden_act", "silu")
        if activation != "silu":
            raise ArchitectureError(f"hidden_act {activation!r} is not supported (SwiGLU needs `silu`)")
        if config.get("mlp_bias", False):
            raise ArchitectureError("mlp_bias: true is not supported")
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ArchitectureError(f"rope_type {rope_type!r} is not supported (only unscaled RoPE)")
        rope_theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        hidden_size = int(config["hidden_size"])
        num_heads = int(config["num_attention_heads"])
        num_kv_heads = int(config.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise ArchitectureError(f"num_attention_heads {num_heads} is not a multiple of {num_kv_heads}")
        head_dim = int(config.get("head_dim") or hidden_size // num_heads)
        return cls(
            model_type=model_type,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Architecture:
        """Read `path/config.json`."""
        try:
            raw = read_hf_config(path)
        except AsyncRLError as error:
            raise ArchitectureError(str(error)) from None
        return cls.from_dict(dict(raw))


@contextlib.contextmanager
def megatron_warnings_ignored() -> Generator[None]:
    """Silence the warnings Megatron-Core raises from its own modules.

    Without Apex or TransformerEngine Megatron warns that it falls back to torch modules (the intended
    setup here), and some of its layers warn on every call about arguments that later versions will
    require. Warnings from any other module still surface.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="megatron")  # megatron.* and megatron_fsdp
        yield


def padded_vocab_size(vocab_size: int, tensor_parallel_size: int) -> int:
    """The vocabulary size Megatron is built with: the smallest multiple of the tensor-parallel size.

    Rows past `vocab_size` exist only so the vocabulary splits evenly; they are zero when loaded, their
    logits are excluded from every softmax, and export drops them.
    """
    return math.ceil(vocab_size / tensor_parallel_size) * tensor_parallel_size


def transformer_engine_available() -> bool:
    """Whether TransformerEngine can be imported (and a GPU exists to run it)."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401  # pyright: ignore[reportMissingImports, reportUnusedImport]
    except ImportError:
        return False
    return True


def transformer_config(
    arch: Architecture,
    *,
    tensor_parallel_size: int = 1,
    dtype: torch.dtype = torch.float32,
    gradient_checkpointing: bool = False,
) -> TransformerConfig:
    """The `TransformerConfig` of `arch`: RMSNorm, SwiGLU, RoPE, GQA, no dropout, no bias but Qwen2's qkv.

    Fused kernels that need TransformerEngine or Apex stay off; on a CPU every fusion is off.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    if arch.num_kv_heads % tensor_parallel_size:
        raise ArchitectureError(
            f"tensor_parallel_size {tensor_parallel_size} must divide num_key_value_heads {arch.num_kv_heads}"
        )
    if arch.intermediate_size % tensor_parallel_size:
        raise ArchitectureError(
            f"tensor_parallel_size {tensor_parallel_size} must divide "
            f"intermediate_size {arch.intermediate_size}"
        )
    on_gpu = torch.cuda.is_available()
    recompute: dict[str, Any] = {}
    if gradient_checkpointing:
        recompute = {
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": 1,
        }
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tensor_parallel_size,
        pipeline_model_parallel_size=1,
        sequence_parallel=False,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not on_gpu,
        # Megatron marks tensor-parallel weights (`tensor_model_parallel`, `partition_dim`) only while it
        # initialises them, and gradient-norm clipping needs the marks: initialise, then load over it.
        perform_initialization=True,
        # Every fused kernel needs TransformerEngine, Apex or Megatron's compiled extensions.
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        **recompute,
    )


def build_gpt_model(
    arch: Architecture,
    *,
    tensor_parallel_size: int = 1,
    dtype: torch.dtype = torch.float32,
    gradient_checkpointing: bool = False,
) -> GPTModel:
    """A `GPTModel` for `arch` on this rank (its tensor-parallel shard), on the GPU if there is one.

    Model parallelism must already be initialised (`asyncrl_megatron.parallel.initialize`).
    """
    with megatron_warnings_ignored():
        from megatron.core.models.gpt import GPTModel

        config = transformer_config(
            arch,
            tensor_parallel_size=tensor_parallel_size,
            dtype=dtype,
            gradient_checkpointing=gradient_checkpointing,
        )
        if transformer_engine_available():
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

            layer_spec = get_gpt_layer_with_transformer_engine_spec()
        else:
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

            layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm")
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec,
            vocab_size=padded_vocab_size(arch.vocab_size, tensor_parallel_size),
            max_sequence_length=arch.max_position_embeddings,
            pre_process=True,
            post_process=True,
            parallel_output=True,
            share_embeddings_and_output_weights=arch.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_percent=1.0,
            # Annotated `int` in Megatron, used as a float base: a non-integral theta must stay exact.
            rotary_base=cast(int, arch.rope_theta),
        )
    if torch.cuda.is_available():
        model = model.cuda(torch.cuda.current_device())
    # The local spec's norms are created in float32 whatever `params_dtype` says; like Megatron's
    # Float16Module, cast the whole model so norms run fused in the compute dtype.
    return model.to(dtype)
