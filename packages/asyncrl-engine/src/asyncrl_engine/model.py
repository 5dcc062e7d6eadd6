"""A compact Llama / Qwen2 decoder that loads HuggingFace safetensors by their HuggingFace names.

The engine keeps the projections fused (`q|k|v` in one matrix, `gate|up` in another) because one matmul beats
three on every device; each HuggingFace name is a *view* into a fused tensor, so `load_named_tensors` copies a
tensor sent under its HuggingFace name straight into place. Tied embeddings share one tensor, so
`lm_head.weight` is accepted for a tied model and lands in the embedding.

Three entry points:
- `forward_logits(input_ids)`: a plain full-sequence forward without a cache (reference and tests).
- `prefill(input_ids, cache, slot)`, `prefill_packed(...)`: run prompts into KV-cache slots (hidden states);
  `prefill_packed` (what the engine runs) concatenates the sequences without padding and reads cached
  prefixes in place. `prefill_batch(...)`, the same right-padded, is its reference in tests and benchmarks.
- `decode(input_ids, positions, cache)`: one token for each of the first `B` slots, batched.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor

from asyncrl_core.errors import AsyncRLError
from asyncrl_core.models import read_hf_config
from asyncrl_engine import decode_attention, extend_attention
from asyncrl_engine import fused_kernels as fused

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


class ModelLoadError(AsyncRLError):
    """A checkpoint or a weight update does not fit the model. `problems` lists every offending name."""

    def __init__(self, message: str, problems: Sequence[str] = ()) -> None:
        self.problems: tuple[str, ...] = tuple(problems)
        text = message if not problems else f"{message}: " + "; ".join(problems)
        super().__init__(text)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The architecture, read from a HuggingFace `config.json` (Llama or Qwen2)."""

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
    rope_scaling: dict[str, float | str] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    """q/k/v projections carry a bias (always for Qwen2; `attention_bias` for Llama)."""
    eos_token_ids: tuple[int, ...]

    @property
    def architectures(self) -> list[str]:
        """The HuggingFace model class, as `/model_info` and `GetModelInfo` report it."""
        return ["Qwen2ForCausalLM" if self.model_type == "qwen2" else "LlamaForCausalLM"]

    @classmethod
    def from_dict(cls, raw: dict[str, object]) -> ModelConfig:
        model_type = str(raw.get("model_type", ""))
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"model_type {model_type!r} is not supported; the built-in engine runs "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        hidden_size = _int(raw, "hidden_size")
        num_heads = _int(raw, "num_attention_heads")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ModelLoadError(f"rope parameters must be a mapping, got {rope!r}")
        rope_dict: dict[str, float | str] = {
            str(k): v for k, v in rope.items() if isinstance(v, float | int | str)
        }
        theta = rope_dict.pop("rope_theta", _float(raw, "rope_theta", 10000.0))
        rope_type = str(rope_dict.get("rope_type", rope_dict.get("type", "default")))
        scaling = None if rope_type == "default" else {**rope_dict, "rope_type": rope_type}
        eos = raw.get("eos_token_id")
        eos_list = cast(list[object], eos) if isinstance(eos, list) else [eos]
        eos_ids = tuple(e for e in eos_list if isinstance(e, int))
        head_dim = raw.get("head_dim")
        return cls(
            model_type=model_type,
            vocab_size=_int(raw, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_int(raw, "intermediate_size"),
            num_layers=_int(raw, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=_int(raw, "num_key_value_heads", num_heads),
            head_dim=int(head_dim) if isinstance(head_dim, int) else hidden_size // num_heads,
            rms_norm_eps=_float(raw, "rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=_int(raw, "max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            eos_token_ids=eos_ids,
        )


def _float(raw: dict[str, object], key: str, default: float) -> float:
    value = raw.get(key, default)
    if not isinstance(value, float | int):
        raise ModelLoadError(f"config.json: `{key}` must be a number, got {value!r}")
    return float(value)


def _int(raw: dict[str, object], key: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    if value is None:
        value = default
    if not isinstance(value, int):
        raise ModelLoadError(f"config.json: `{key}` must be an int, got {value!r}")
    return value


def _inverse_frequencies(config: ModelConfig) -> Tensor:
    """RoPE inverse frequencies [head_dim / 2], with the `linear` and `llama3` scalings applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        original = float(scaling.get("original_max_position_embeddings", 8192))
        wavelength = 2 * math.pi / inv_freq
        low_wavelength, high_wavelength = original / low, original / high
        smooth = (original / wavelength - low) / (high - low)
        smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        scaled = torch.where(wavelength > low_wavelength, inv_freq / factor, inv_freq)
        medium = (wavelength >= high_wavelength) & (wavelength <= low_wavelength)
        return torch.where(medium, smoothed, scaled)
    raise ModelLoadError(f"rope scaling {rope_type!r} is not supported (default, linear and llama3 are)")


class KVCache:
    """Per-slot KV buffers of the running requests, one tensor for every layer:
    `kv` [num_layers, 2 (K, V), num_slots, kv_heads, capacity, head_dim]; `keys[l]` and `values[l]` are views.

    Slot `s` holds one request's KV at positions `0..length-1`. The engine keeps the running requests in slots
    `0..B-1` (it moves the last slot into a freed one), so a decode step reads one contiguous view; with every
    layer in one tensor, that move is a single copy.
    """

    def __init__(
        self, config: ModelConfig, num_slots: int, capacity: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.num_slots = num_slots
        self.capacity = capacity
        shape = (config.num_layers, 2, num_slots, config.num_kv_heads, capacity, config.head_dim)
        self.kv = torch.zeros(shape, device=device, dtype=dtype)
        self.keys = list(self.kv[:, 0].unbind(0))
        self.values = list(self.kv[:, 1].unbind(0))

    @staticmethod
    def bytes_for(config: ModelConfig, num_slots: int, capacity: int, dtype: torch.dtype) -> int:
        """The bytes of a cache of `num_slots` x `capacity` positions."""
        per_position = 2 * config.num_layers * config.num_kv_heads * config.head_dim
        return per_position * num_slots * capacity * dtype.itemsize

    def move_slot(self, source: int, target: int, length: int) -> None:
        """Copy the first `length` positions of slot `source` into slot `target` (every layer at once)."""
        self.kv[:, :, target, :, :length].copy_(self.kv[:, :, source, :, :length])

    def copy_from(self, other: KVCache, num_slots: int, length: int) -> None:
        """Copy the first `length` positions of the first `num_slots` slots of `other` (a smaller cache)."""
        self.kv[:, :, :num_slots, :, :length].copy_(other.kv[:, :, :num_slots, :, :length])

    def copy_slot_from(self, other: KVCache, slot: int, length: int) -> None:
        """Copy the first `length` positions of slot `slot` of `other` (a smaller cache), into that slot."""
        self.kv[:, :, slot, :, :length].copy_(other.kv[:, :, slot, :, :length])

    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


def aligned_bounds(sizes: Sequence[int]) -> tuple[list[tuple[int, int]], int]:
    """Where columns of `sizes` int64 values go in one tensor so that each starts on a 16-byte boundary
    whatever the sizes: ([(start, stop)] per column, the total length). Triton specializes a kernel on its
    pointers' 16-byte alignment, so a view that is aligned or not by the parity of a batch's length would
    compile a second variant of the kernel in the middle of serving."""
    bounds: list[tuple[int, int]] = []
    end = 0
    for size in sizes:
        bounds.append((end, end + size))
        end += size + size % 2  # 2 int64 = 16 bytes
    return bounds, end


@dataclass(frozen=True, slots=True)
class PackedPrefill:
    """A packed prefill batch on the host (`EngineModel.pack_prefill`), as `forward_packed` reads it.

    `columns` (int64, in this order): per token its id, position and slot ([N] each); per sequence its slot,
    cached prefix and the offsets of its rows ([B], [B], [B + 1]); per program of the extend kernel its
    sequence and first token ([I] each, `extend_attention.work_items`; empty without the kernel). The lists
    are what the torch path reads."""

    columns: tuple[Tensor, ...]
    slots: list[int]
    starts: list[int]
    lengths: list[int]
    end: int
    """The furthest position written (the rope table must cover it)."""

    @property
    def total(self) -> int:
        return self.columns[0].shape[0]

    @property
    def num_sequences(self) -> int:
        return len(self.slots)

    @property
    def shape(self) -> PackedShape:
        """Its own sizes, unpadded."""
        return PackedShape(self.total, self.num_sequences, self.columns[-1].numel())

    def padded(self, shape: PackedShape, capacity: int) -> Tensor:
        """The columns padded to `shape` (which must fit them) as one host tensor laid out by
        `shape.bounds`, for a cache of `capacity` positions. Padding tokens (id 0) write their K/V at the
        cache's last position of slot 0, which the capacity rule keeps free of live KV, and no work item takes
        them, so their rows are left as they are (rows do not mix outside attention); padding sequences have
        no tokens; padding work items start past every sequence and do nothing."""
        if not shape.fits(self):
            raise ValueError(f"a packed prefill of {self.total} tokens does not fit {shape}")
        bounds, end = shape.bounds
        packed = torch.zeros(end, dtype=torch.long)
        fills = (0, capacity - 1, 0, 0, 0, self.total, 0, extend_attention.NO_WORK)
        for (start, stop), column, fill in zip(bounds, self.columns, fills, strict=True):
            packed[start : start + column.numel()] = column
            packed[start + column.numel() : stop] = fill
        return packed


@dataclass(frozen=True, slots=True)
class PackedShape:
    """The fixed sizes of a padded packed prefill (a CUDA graph's): tokens, sequences, extend-kernel
    programs."""

    tokens: int
    sequences: int
    work: int

    @property
    def bounds(self) -> tuple[list[tuple[int, int]], int]:
        """Where each column lies in the tensor of `PackedPrefill.padded` (`aligned_bounds`)."""
        return aligned_bounds(
            [self.tokens] * 3 + [self.sequences] * 2 + [self.sequences + 1] + [self.work] * 2
        )

    def columns(self, packed: Tensor) -> list[Tensor]:
        """The columns of a tensor laid out by `bounds`, as views."""
        return [packed[start:stop] for start, stop in self.bounds[0]]

    def fits(self, batch: PackedPrefill) -> bool:
        return (
            batch.total <= self.tokens
            and batch.num_sequences <= self.sequences
            and batch.columns[-1].numel() <= self.work
        )


PrefillReplay = Callable[[PackedPrefill, "KVCache"], Tensor | None]
"""Runs a packed prefill another way (a CUDA graph): its hidden states, or None where it cannot."""


class EngineModel:
    """The decoder. Parameters are plain tensors (no autograd) in fused layouts with HuggingFace-named views.

    Not thread-safe: the engine calls it from its one scheduler thread.
    """

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
        inv_freq = _inverse_frequencies(c)
        self._inv_freq = inv_freq
        self._rope_cos = torch.empty(0, device=device)
        self._rope_sin = torch.empty(0, device=device)
        self.ensure_rope(c.max_position_embeddings)
        self._attention_requested = attention_kernels
        self.decode_kernel = attention_kernels and decode_attention.available(device)
        """Whether `decode` uses the Triton kernel that reads each row's KV up to its own length (requested,
        the default, and CUDA with Triton; set False to measure the masked SDPA it replaces)."""
        self.extend_kernel = attention_kernels and extend_attention.available(device)
        """Whether `prefill_packed` attends with the Triton kernel that reads each sequence's cached KV in
        place (requested, the default, and CUDA with Triton; set False to measure the per-sequence SDPA, its
        reference)."""
        self._fused_requested = fused_kernels
        self.fused_kernels = fused_kernels and fused.available(device)
        """Whether the forwards use the fused Triton kernels (`fused_kernels.py`: residual add + RMSNorm,
        rotary embedding + KV cache write, SiLU * up) instead of torch's elementwise ops: requested (the
        default) and available (CUDA with Triton, first launches equal to torch). Set it to switch paths."""

    # ---------------------------------------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        fused_kernels: bool = True,
        attention_kernels: bool = True,
    ) -> EngineModel:
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
    ) -> EngineModel:
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
        moved = EngineModel(self.config, device, self.dtype, self._fused_requested, self._attention_requested)
        moved.load_named_tensors([(name, self.named[name]) for name in sorted(self.required_names())])
        self.__dict__.update(moved.__dict__)

    # ---------------------------------------------------------------------------------------------- forward
    def ensure_rope(self, length: int) -> None:
        """Make the rope tables cover positions below `length`. Growing them allocates new tables, which a
        CUDA graph captured before does not see: graphs over a cache are captured after covering its
        capacity."""
        if self._rope_cos.shape[0] >= length:
            return
        positions = torch.arange(length, dtype=torch.float64)
        angles = torch.outer(positions, self._inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self._rope_cos = angles.cos().to(self.device, torch.float32)
        self._rope_sin = angles.sin().to(self.device, torch.float32)

    def _rms_norm(self, x: Tensor, weight: Tensor) -> Tensor:
        if self.fused_kernels:
            return fused.rms_norm(x, weight, self.config.rms_norm_eps)
        return fused.torch_rms_norm(x, weight, self.config.rms_norm_eps)

    def _add_norm(self, x: Tensor, residual: Tensor | None, weight: Tensor) -> tuple[Tensor, Tensor]:
        """(x + residual, RMSNorm of it): one kernel when fused; without a residual, x and its norm."""
        if residual is None:
            return x, self._rms_norm(x, weight)
        if self.fused_kernels:
            return fused.add_rms_norm(x, residual, weight, self.config.rms_norm_eps)
        x = x + residual
        return x, fused.torch_rms_norm(x, weight, self.config.rms_norm_eps)

    def _project_qkv(self, layer: int, h: Tensor) -> Tensor:
        """The fused q|k|v projection [..., (heads + 2 kv_heads) * head_dim]."""
        return F.linear(h, self.qkv[layer], self.qkv_bias[layer])

    def _split_qkv(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        c = self.config
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        return qkv[..., :q_size], qkv[..., q_size : q_size + kv_size], qkv[..., q_size + kv_size :]

    def _rotary(
        self,
        qkv: Tensor,
        positions: Tensor,
        cache: tuple[Tensor, Tensor] | None = None,
        slots: Tensor | None = None,
        write_positions: Tensor | None = None,
    ) -> None:
        """The fused rotary kernel on q|k|v in place (and the K/V cache write); see `fused_kernels.rotary`."""
        c = self.config
        fused.rotary(
            qkv,
            positions,
            self._rope_cos,
            self._rope_sin,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            cache,
            slots,
            write_positions,
        )

    def _heads(self, qkv: Tensor, batch: int, length: int) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v of a q|k|v projection [B, T, ...] as [B, heads, T, head_dim] views."""
        c = self.config
        q, k, v = self._split_qkv(qkv)
        return (
            q.view(batch, length, c.num_heads, c.head_dim).transpose(1, 2),
            k.view(batch, length, c.num_kv_heads, c.head_dim).transpose(1, 2),
            v.view(batch, length, c.num_kv_heads, c.head_dim).transpose(1, 2),
        )

    def _silu_mul(self, gate_up: Tensor) -> Tensor:
        if self.fused_kernels:
            return fused.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def _layers(self, x: Tensor, attend: Callable[[int, Tensor], Tensor]) -> Tensor:
        """The decoder layers over the residual stream x [..., hidden]. `attend(layer, h)` maps the normed
        input to the attention's output [..., heads * head_dim] (before o_proj). Each residual add is done
        with the norm after it (one kernel when fused); the last layer's is done alone."""
        residual: Tensor | None = None
        for layer in range(self.config.num_layers):
            x, h = self._add_norm(x, residual, self.attn_norm[layer])
            attention = F.linear(attend(layer, h), self.o_proj[layer])
            x, h = self._add_norm(x, attention, self.mlp_norm[layer])
            residual = F.linear(self._silu_mul(F.linear(h, self.gate_up[layer])), self.down[layer])
        return x if residual is None else x + residual

    def logits(self, hidden: Tensor) -> Tensor:
        """Final norm and LM head: hidden [..., hidden_size] -> float32 logits [..., vocab]."""
        return F.linear(self._rms_norm(hidden, self.final_norm), self.lm_head).float()

    @torch.inference_mode()
    def forward_logits(self, input_ids: Tensor) -> Tensor:
        """Full causal forward without a cache: input_ids LongTensor[T] -> float32 logits [T, vocab]."""
        hidden = self._forward_batch(input_ids.to(self.device).unsqueeze(0), cache=None, slots=None)
        return self.logits(hidden[0])

    @torch.inference_mode()
    def prefill(self, input_ids: Tensor, cache: KVCache, slot: int) -> Tensor:
        """Run input_ids [T] from position 0, write their KV into `slot`; return hidden states [T, hidden]."""
        return self._forward_batch(input_ids.to(self.device).unsqueeze(0), cache, [slot])[0]

    @torch.inference_mode()
    def prefill_batch(
        self,
        sequences: Sequence[Sequence[int]],
        cache: KVCache,
        slots: Sequence[int],
        starts: Sequence[int] | None = None,
    ) -> Tensor:
        """Prefill several sequences at once, right-padded to the longest: returns hidden [B, T_max, hidden].
        (The engine runs `prefill_packed`; this is its reference, and what the benchmark compares it with.)

        Row b holds the tokens at positions `starts[b]..` (0 by default) of the sequence in `slots[b]`,
        whose KV before `starts[b]` is already in the cache (a prefix-cache hit); its queries attend over that
        cached KV and their own. Row b is valid up to len(sequences[b]); its valid positions never see the
        padding after them, and the K/V written for padding lands beyond the row's length (or, with a cached
        prefix, at the cache's last position, which no request uses), where later steps overwrite it.
        """
        longest = max(len(s) for s in sequences)
        padded = torch.zeros((len(sequences), longest), dtype=torch.long)
        for row, tokens in enumerate(sequences):
            padded[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        if starts is None or not any(starts):
            return self._forward_batch(padded.to(self.device), cache, list(slots))
        return self._forward_extend(
            padded.to(self.device), [len(s) for s in sequences], cache, list(slots), list(starts)
        )

    @torch.inference_mode()
    def prefill_packed(
        self,
        sequences: Sequence[Sequence[int]],
        cache: KVCache,
        slots: Sequence[int],
        starts: Sequence[int] | None = None,
        replay: PrefillReplay | None = None,
    ) -> Tensor:
        """Prefill several sequences as one packed batch: returns hidden states [N, hidden], N the total
        token count, sequence b's at rows `sum(len(s) for s in sequences[:b])..` (no padding anywhere).

        Sequence b holds the tokens at positions `starts[b]..` (0 by default) of the sequence in `slots[b]`,
        whose KV before `starts[b]` is already in the cache (a prefix-cache hit). Each token's K/V is written
        at (its slot, its position) and its query attends causally over its slot's positions up to its own,
        read in place: the extend kernel on CUDA (`extend_kernel`), one SDPA per sequence otherwise.
        `replay`: tried first (the engine's CUDA graphs of `forward_packed`); eager where it returns None.
        """
        batch = self.pack_prefill(sequences, cache, slots, starts)
        self.ensure_rope(batch.end)
        if replay is not None:
            hidden = replay(batch, cache)
            if hidden is not None:
                return hidden
        # Moved in one copy that does not wait for the device (a blocking copy would wait for the decode
        # step in flight beside which the engine admits).
        shape = batch.shape
        packed = batch.padded(shape, cache.capacity).to(self.device, non_blocking=True)
        return self.forward_packed(shape.columns(packed), cache, batch)

    def pack_prefill(
        self,
        sequences: Sequence[Sequence[int]],
        cache: KVCache,
        slots: Sequence[int],
        starts: Sequence[int] | None = None,
    ) -> PackedPrefill:
        """The host side of `prefill_packed`: its arguments checked against `cache`, as columns."""
        num = len(sequences)
        starts = [0] * num if starts is None else list(starts)
        lengths = [len(s) for s in sequences]
        if num == 0 or len(slots) != num or len(starts) != num:
            raise ValueError(
                f"{num} sequences but {len(slots)} slots and {len(starts)} starts (one each, >= 1)"
            )
        for row, (slot, start, length) in enumerate(zip(slots, starts, lengths, strict=True)):
            if length == 0 or start < 0 or start + length > cache.capacity or not 0 <= slot < cache.num_slots:
                raise ValueError(
                    f"sequence {row}: {length} tokens from position {start} in slot {slot} do not fit a "
                    f"cache of {cache.num_slots} slots x {cache.capacity} positions (each needs a token)"
                )
        c = self.config
        total = sum(lengths)
        length_t = torch.tensor(lengths)
        offsets = torch.zeros(num + 1, dtype=torch.long)
        torch.cumsum(length_t, 0, out=offsets[1:])
        slot_t, start_t = torch.tensor(slots), torch.tensor(starts)
        owner = torch.repeat_interleave(torch.arange(num), length_t)
        positions = torch.arange(total) - offsets[owner] + start_t[owner]
        tokens = torch.tensor(list(itertools.chain.from_iterable(sequences)), dtype=torch.long)
        if self.extend_kernel:
            per_program = extend_attention.tokens_per_program(c.num_heads, c.num_kv_heads)
            work = extend_attention.work_items(length_t, per_program)
        else:
            work = torch.empty((2, 0), dtype=torch.long)
        return PackedPrefill(
            (tokens, positions, slot_t[owner], slot_t, start_t, offsets, work[0], work[1]),
            list(slots),
            starts,
            lengths,
            max(start + length for start, length in zip(starts, lengths, strict=True)),
        )

    @property
    def packed_from_columns(self) -> bool:
        """Whether `forward_packed` runs from its device columns alone, as a CUDA graph replays it: the
        extend kernel and the fused kernels are on (the torch path reads the batch's host lists)."""
        return self.extend_kernel and self.fused_kernels

    def forward_packed(
        self, columns: Sequence[Tensor], cache: KVCache, batch: PackedPrefill | None
    ) -> Tensor:
        """The forward of a packed prefill: `columns` those of a `PackedPrefill` on the device, hidden states
        [N, hidden] for their N tokens. `batch` (the host side) is read by the torch path only; without it
        (a CUDA graph's static columns, padded to its bucket: tokens that no work item takes, sequences of
        no tokens, work items past every sequence) the extend kernel and the fused kernels must be on."""
        c = self.config
        (
            input_ids,
            positions,
            token_slots,
            slot_index,
            prefix_lengths,
            cu_seqlens,
            work_sequence,
            work_first,
        ) = columns
        total = input_ids.shape[0]
        fused_path = self.fused_kernels
        use_kernel = self.extend_kernel
        if batch is None and not self.packed_from_columns:
            raise ValueError("a packed prefill without its host side needs the extend and fused kernels")
        # [N, 1, D] each, for the torch path.
        rope = (
            None
            if fused_path
            else (self._rope_cos[positions].unsqueeze(1), self._rope_sin[positions].unsqueeze(1))
        )

        def attend(layer: int, h: Tensor) -> Tensor:
            qkv = self._project_qkv(layer, h)  # [N, width]
            layer_keys, layer_values = cache.keys[layer], cache.values[layer]
            if fused_path:
                # One row of one token per token: its own slot and position.
                self._rotary(qkv, positions, (layer_keys, layer_values), token_slots)
                q = self._split_qkv(qkv)[0].view(total, c.num_heads, c.head_dim)
            else:
                assert rope is not None
                q, k, v = self._split_qkv(qkv)
                q = fused.torch_rotate(q.view(total, c.num_heads, c.head_dim), *rope)
                k = fused.torch_rotate(k.view(total, c.num_kv_heads, c.head_dim), *rope)
                layer_keys[token_slots, :, positions] = k
                layer_values[token_slots, :, positions] = v.view(total, c.num_kv_heads, c.head_dim)
            if use_kernel:
                attn = extend_attention.extend_attention(
                    q,
                    layer_keys,
                    layer_values,
                    slot_index,
                    prefix_lengths,
                    cu_seqlens,
                    work_sequence,
                    work_first,
                )
            else:
                assert batch is not None
                attn = extend_attention.torch_extend_attention(
                    q, layer_keys, layer_values, batch.slots, batch.starts, batch.lengths
                )
            return attn.reshape(total, -1)

        return self._layers(self.embed[input_ids], attend)

    def _prefill_attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """Attention of a prefill: causal (top-left aligned) without `mask`, else under the boolean `mask`.

        On CUDA the kernel is chosen here rather than by SDPA's heuristics: flash (or memory-efficient) for
        the causal case, memory-efficient with an explicit mask. Torch's default for these shapes is cuDNN,
        which plans every new (batch, length) shape at its first call (~60 ms on an H200), and prefill shapes
        under continuous batching are nearly always new.
        """
        if q.device.type != "cuda":
            if mask is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if mask is None:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        group = q.shape[1] // k.shape[1]
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def _forward_batch(self, input_ids: Tensor, cache: KVCache | None, slots: list[int] | None) -> Tensor:
        """input_ids [B, T] from position 0 -> hidden states [B, T, hidden]; K/V go to `slots` of `cache`."""
        batch, length = input_ids.shape
        self.ensure_rope(length)
        cos, sin = self._rope_cos[:length], self._rope_sin[:length]
        slot_index = None if slots is None else torch.tensor(slots, device=self.device)
        positions = torch.arange(length, device=self.device) if self.fused_kernels else None

        def attend(layer: int, h: Tensor) -> Tensor:
            qkv = self._project_qkv(layer, h)
            if positions is not None:
                kv = None if cache is None else (cache.keys[layer], cache.values[layer])
                self._rotary(qkv, positions, kv, slot_index)
                q, k, v = self._heads(qkv, batch, length)
            else:
                q, k, v = self._heads(qkv, batch, length)
                q, k = fused.torch_rotate(q, cos, sin), fused.torch_rotate(k, cos, sin)
                if cache is not None and slot_index is not None:
                    cache.keys[layer][slot_index, :, :length] = k
                    cache.values[layer][slot_index, :, :length] = v
            attn = self._prefill_attention(q, k, v, None)
            return attn.transpose(1, 2).reshape(batch, length, -1)

        return self._layers(self.embed[input_ids], attend)

    def _forward_extend(
        self, input_ids: Tensor, lengths: list[int], cache: KVCache, slots: list[int], starts: list[int]
    ) -> Tensor:
        """input_ids [B, T] at positions `starts[b]..` of `slots[b]`, whose earlier KV is in `cache`."""
        batch, length = input_ids.shape
        device = self.device
        offsets = torch.arange(length, device=device)
        start_t = torch.tensor(starts, device=device).unsqueeze(1)
        positions = start_t + offsets  # [B, T]
        valid = offsets < torch.tensor(lengths, device=device).unsqueeze(1)
        # Padding writes its K/V at the last cache position, which the capacity rule keeps free.
        write_positions = torch.where(valid, positions, cache.capacity - 1)
        attend_length = max(start + n for start, n in zip(starts, lengths, strict=True))
        self.ensure_rope(attend_length)
        fused_path = self.fused_kernels
        # [B, 1, T, D] each, for the torch path.
        rope = (
            None
            if fused_path
            else (self._rope_cos[positions].unsqueeze(1), self._rope_sin[positions].unsqueeze(1))
        )
        slot_index = torch.tensor(slots, device=device)
        slot_column = slot_index.unsqueeze(1)
        # [B, 1, T, L]: query at position p sees keys 0..p of its own slot.
        mask = torch.arange(attend_length, device=device).view(1, 1, 1, attend_length) <= positions.view(
            batch, 1, length, 1
        )

        def attend(layer: int, h: Tensor) -> Tensor:
            qkv = self._project_qkv(layer, h)
            layer_keys, layer_values = cache.keys[layer], cache.values[layer]
            if fused_path:
                self._rotary(qkv, positions, (layer_keys, layer_values), slot_index, write_positions)
                q = self._heads(qkv, batch, length)[0]
            else:
                assert rope is not None
                q, k, v = self._heads(qkv, batch, length)
                q, k = fused.torch_rotate(q, *rope), fused.torch_rotate(k, *rope)
                # Advanced indices around a slice put their dims first: the target is [B, T, kv_heads, D].
                layer_keys[slot_column, :, write_positions] = k.transpose(1, 2)
                layer_values[slot_column, :, write_positions] = v.transpose(1, 2)
            keys = layer_keys[slot_index, :, :attend_length]
            values = layer_values[slot_index, :, :attend_length]
            attn = self._prefill_attention(q, keys, values, mask)
            return attn.transpose(1, 2).reshape(batch, length, -1)

        return self._layers(self.embed[input_ids], attend)

    @torch.inference_mode()
    def decode(
        self,
        input_ids: Tensor,
        positions: Tensor,
        cache: KVCache,
        attend_length: int,
        lengths: Tensor | None = None,
    ) -> Tensor:
        """One decode step for slots 0..B-1: input_ids [B] at positions [B] -> hidden states [B, hidden].

        Writes the new K/V at `positions`; row b attends to its first `lengths[b]` positions (default
        `positions + 1`). With the decode kernel (`decode_kernel`, CUDA with Triton) each row reads only its
        own length; otherwise SDPA attends over the first `attend_length` positions of each slot (at least
        max(lengths)), masking positions beyond each row's own. Shapes depend only on B and `attend_length`,
        so a captured CUDA graph replays this unchanged.
        """
        c = self.config
        batch = input_ids.shape[0]
        group = c.num_heads // c.num_kv_heads
        fused_path = self.fused_kernels
        # [B, 1, D] each, for the torch path.
        rope = (
            None
            if fused_path
            else (self._rope_cos[positions].unsqueeze(1), self._rope_sin[positions].unsqueeze(1))
        )
        rows = torch.arange(batch, device=input_ids.device)
        if lengths is None:
            lengths = positions + 1
        mask = None
        if not self.decode_kernel:
            # [B, 1, 1, L]: a row may attend to its first lengths[b] positions.
            mask = (torch.arange(attend_length, device=input_ids.device) < lengths.unsqueeze(1)).view(
                batch, 1, 1, attend_length
            )
        row_lengths = lengths

        def attend(layer: int, h: Tensor) -> Tensor:
            qkv = self._project_qkv(layer, h)
            layer_keys, layer_values = cache.keys[layer], cache.values[layer]
            if fused_path:
                # Row b writes its K/V into slot b at positions[b].
                self._rotary(qkv, positions, (layer_keys, layer_values))
                q = self._split_qkv(qkv)[0]
            else:
                assert rope is not None
                q, k, v = self._split_qkv(qkv)
                q = fused.torch_rotate(q.view(batch, c.num_heads, c.head_dim), *rope)
                k = fused.torch_rotate(k.view(batch, c.num_kv_heads, c.head_dim), *rope)
                layer_keys[rows, :, positions] = k
                layer_values[rows, :, positions] = v.view(batch, c.num_kv_heads, c.head_dim)
            # Grouped-query attention without repeating K/V: the `group` query heads that share a KV head
            # become the query-length axis of one attention over that head.
            q = q.reshape(batch, c.num_kv_heads, group, c.head_dim)
            if mask is None:
                attn = decode_attention.decode_attention(q, layer_keys, layer_values, row_lengths)
            else:
                attn = F.scaled_dot_product_attention(
                    q,
                    layer_keys[:batch, :, :attend_length],
                    layer_values[:batch, :, :attend_length],
                    attn_mask=mask,
                )
            return attn.reshape(batch, -1)

        return self._layers(self.embed[input_ids], attend)
