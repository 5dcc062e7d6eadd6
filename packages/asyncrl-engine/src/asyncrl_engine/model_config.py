"""The architecture the engine runs (`ModelConfig`, read from a HuggingFace `config.json`: Llama or Qwen2),
the error of a checkpoint or weight update that does not fit it (`ModelLoadError`), and its RoPE frequencies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor

from asyncrl_core.errors import AsyncRLError

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


def inverse_frequencies(config: ModelConfig) -> Tensor:
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
