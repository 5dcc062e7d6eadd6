"""The decoder's parameters (`EngineParameters`): plain tensors (no autograd) in fused layouts, each
HuggingFace name a view into them, with their loading, checks and moves.

The engine keeps the projections fused (`q|k|v` in one matrix, `gate|up` in another) because one matmul beats
three on every device; each HuggingFace name is a *view* into a fused tensor, so `load_named_tensors` copies a
tensor sent under its HuggingFace name straight into place. Tied embeddings share one tensor, so
`lm_head.weight` is accepted for a tied model and lands in the embedding. `EngineModel` (`model.py`) adds
the forwards.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Self

import torch
from torch import Tensor

from asyncrl_core.errors import AsyncRLError
from asyncrl_core.models import read_hf_config
from asyncrl_engine.model_config import ModelConfig, ModelLoadError


class EngineParameters:
    """The parameters of one decoder in fused layouts, by HuggingFace name in `named`. `fused_kernels` and
    `attention_kernels` are what the model was asked for (kept so that a move rebuilds the same model)."""

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        fused_kernels: bool = True,
        attention_kernels: bool = True,
    ) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        c = config
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

        def empty(*shape: int) -> Tensor:
            return torch.zeros(shape, device=device, dtype=dtype)

        self.embed = empty(c.vocab_size, c.hidden_size)
        self.lm_head = self.embed if c.tie_word_embeddings else empty(c.vocab_size, c.hidden_size)
        self.final_norm = empty(c.hidden_size)
        self.qkv: list[Tensor] = []
        self.qkv_bias: list[Tensor | None] = []
        self.o_proj: list[Tensor] = []
        self.gate_up: list[Tensor] = []
        self.down: list[Tensor] = []
        self.attn_norm: list[Tensor] = []
        self.mlp_norm: list[Tensor] = []
        # HuggingFace name -> the view it is loaded into.
        self.named: dict[str, Tensor] = {
            "model.embed_tokens.weight": self.embed,
            "model.norm.weight": self.final_norm,
        }
        self.named["lm_head.weight"] = self.lm_head
        for i in range(c.num_layers):
            qkv = empty(q_size + 2 * kv_size, c.hidden_size)
            bias = empty(q_size + 2 * kv_size) if c.attention_bias else None
            gate_up = empty(2 * c.intermediate_size, c.hidden_size)
            layer = (
                qkv,
                empty(c.hidden_size, q_size),
                gate_up,
                empty(c.hidden_size, c.intermediate_size),
                empty(c.hidden_size),
                empty(c.hidden_size),
            )
            self.qkv.append(layer[0])
            self.qkv_bias.append(bias)
            self.o_proj.append(layer[1])
            self.gate_up.append(layer[2])
            self.down.append(layer[3])
            self.attn_norm.append(layer[4])
            self.mlp_norm.append(layer[5])
            prefix = f"model.layers.{i}."
            splits = {
                "q": (0, q_size),
                "k": (q_size, q_size + kv_size),
                "v": (q_size + kv_size, q_size + 2 * kv_size),
            }
            for letter, (start, end) in splits.items():
                self.named[f"{prefix}self_attn.{letter}_proj.weight"] = qkv[start:end]
                if bias is not None:
                    self.named[f"{prefix}self_attn.{letter}_proj.bias"] = bias[start:end]
            self.named[f"{prefix}self_attn.o_proj.weight"] = layer[1]
            self.named[f"{prefix}mlp.gate_proj.weight"] = gate_up[: c.intermediate_size]
            self.named[f"{prefix}mlp.up_proj.weight"] = gate_up[c.intermediate_size :]
            self.named[f"{prefix}mlp.down_proj.weight"] = layer[3]
            self.named[f"{prefix}input_layernorm.weight"] = layer[4]
            self.named[f"{prefix}post_attention_layernorm.weight"] = layer[5]
        self._fused_requested = fused_kernels
        self._attention_requested = attention_kernels

    # ---------------------------------------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        fused_kernels: bool = True,
        attention_kernels: bool = True,
    ) -> Self:
        """Build from a HuggingFace folder (`config.json` + `*.safetensors`); all parameters must be there.
        `fused_kernels=False` keeps torch's elementwise ops where the fused kernels would run;
        `attention_kernels=False` keeps SDPA where the decode and extend attention kernels would run."""
        folder = Path(path)
        try:
            raw = read_hf_config(folder)
        except AsyncRLError as error:
            raise ModelLoadError(str(error)) from None
        config = ModelConfig.from_dict(raw)
        model = cls(config, torch.device(device), dtype, fused_kernels, attention_kernels)
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"no *.safetensors file in {folder}")
        from safetensors.torch import load_file

        loaded: set[str] = set()
        for file in files:
            tensors = list(load_file(str(file)).items())
            model.load_named_tensors(tensors)
            loaded.update(name for name, _ in tensors)
        missing = sorted(model.required_names() - loaded)
        if missing:
            raise ModelLoadError(f"checkpoint {folder} lacks {len(missing)} parameters", missing[:20])
        return model

    @classmethod
    def random(
        cls,
        config: ModelConfig,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        fused_kernels: bool = True,
        attention_kernels: bool = True,
    ) -> Self:
        """A model with random weights (normal, std 0.02; norms at 1), for benchmarks."""
        model = cls(config, torch.device(device), dtype, fused_kernels, attention_kernels)
        generator = torch.Generator().manual_seed(seed)
        for name in sorted(model.required_names()):
            view = model.named[name]
            if name.endswith("norm.weight"):
                view.fill_(1.0)
            elif name.endswith(".bias"):
                view.zero_()
            else:
                view.copy_(torch.randn(view.shape, generator=generator) * 0.02)
        return model

    def required_names(self) -> set[str]:
        """The names a full checkpoint must carry (`lm_head.weight` only when not tied)."""
        names = set(self.named)
        if self.config.tie_word_embeddings:
            names.discard("lm_head.weight")
        return names

    def nbytes(self) -> int:
        """Bytes held by the weights (a tied output layer counted once)."""
        storages = {view.untyped_storage().data_ptr(): view.untyped_storage() for view in self.named.values()}
        return sum(storage.nbytes() for storage in storages.values())

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(view.shape) for name, view in self.named.items()}

    def validate_named_tensors(self, tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Raise `ModelLoadError` listing every unknown name, shape mismatch and non-floating tensor."""
        problems: list[str] = []
        for name, tensor in tensors:
            view = self.named.get(name)
            if view is None:
                problems.append(f"unknown parameter {name!r}")
            elif tuple(tensor.shape) != tuple(view.shape):
                problems.append(f"{name}: shape {list(tensor.shape)} but the model has {list(view.shape)}")
            elif not tensor.is_floating_point():
                problems.append(f"{name}: dtype {tensor.dtype} is not a floating-point type")
        if problems:
            raise ModelLoadError(f"{len(problems)} tensors do not fit the model", problems)

    @torch.inference_mode()
    def load_named_tensors(self, tensors: Sequence[tuple[str, Tensor]]) -> None:
        """Copy tensors (any subset, HuggingFace names) into the model; on any error nothing changes."""
        self.validate_named_tensors(tensors)
        for name, tensor in tensors:
            self.named[name].copy_(tensor)

    def move_weights(self, device: torch.device) -> None:
        """Move every parameter (and the rope tables) to `device`; the named views are rebuilt to match."""
        if device == self.device:
            return
        moved = type(self)(self.config, device, self.dtype, self._fused_requested, self._attention_requested)
        moved.load_named_tensors([(name, self.named[name]) for name in sorted(self.required_names())])
        self.__dict__.update(moved.__dict__)
