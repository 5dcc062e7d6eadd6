"""The warm start: supervised fine-tuning on a task's demonstrations, laid out as the agent loop lays out
an episode, written as a model folder that the actor and the built-in engine load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl_agents.tasks.searchr1 import SearchR1MiniTask, SearchR1Task
from asyncrl_core import models, prompts
from asyncrl_core.actor.warm_start import WARM_START_FILE, sft_example, warm_start
from asyncrl_core.config import AsyncRLConfig, load_config
from asyncrl_core.errors import AsyncRLError
from asyncrl_core.types import ChatMessage, Demonstration


def _config(model: Path, *overrides: str) -> AsyncRLConfig:
    return load_config(None, [f"actor.model_path={model}", *overrides])


def test_demonstration_segments_follow_the_observation_spans() -> None:
    demonstration = Demonstration((ChatMessage("user", "q"),), "ab<obs>cd<o2>", ((2, 7), (9, 13)))
    assert demonstration.segments() == [("ab", True), ("<obs>", False), ("cd", True), ("<o2>", False)]
    with pytest.raises(ValueError, match="out of order or outside"):
        Demonstration((), "abc", ((2, 1),))
    with pytest.raises(ValueError, match="out of order or outside"):
        Demonstration((), "abc", ((0, 2), (1, 3)))


def test_only_the_model_text_carries_loss(tiny_llama_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_path))
    task = SearchR1MiniTask()
    demonstration = task.demonstrations()[1]  # two searches, two observations
    assert len(demonstration.observation_spans) == 2
    example = sft_example(tokenizer, demonstration)

    # The prompt is the agent loop's rendering of the question, and carries no loss.
    sample = next(s for s in task.dataset("train") if s.messages == demonstration.messages)
    prompt = prompts.prompt_ids(tokenizer, prompts.with_demonstrations(sample.messages, ()))
    assert example.input_ids[: len(prompt)] == prompt
    assert not any(example.loss_mask[: len(prompt)])

    # The response is its pieces tokenised one by one, as the loop appends sampled ids and observations.
    position = len(prompt)
    for text, is_model_text in demonstration.segments():
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert example.input_ids[position : position + len(ids)] == ids
        assert example.loss_mask[position : position + len(ids)] == [int(is_model_text)] * len(ids)
        position += len(ids)
    assert position == len(example.input_ids) == len(example.loss_mask)
    trained = [i for i, m in zip(example.input_ids, example.loss_mask, strict=True) if m]
    model_text = "".join(text for text, is_model_text in demonstration.segments() if is_model_text)
    assert tokenizer.decode(trained) == model_text
    assert "<information>" not in tokenizer.decode(trained)


def test_warm_start_lowers_the_loss_and_the_folder_serves(tiny_llama_path: Path, tmp_path: Path) -> None:
    from asyncrl_sglang.builtin.testing import serve_builtin

    settings = ("warm_start.num_steps=4", "warm_start.batch_size=2", "warm_start.lr=0.003")
    config = _config(tiny_llama_path, *settings, "warm_start.max_len=320")
    out = tmp_path / "warm"
    folder = warm_start(config, SearchR1MiniTask(), out)
    assert folder == out
    record = json.loads((folder / WARM_START_FILE).read_text())
    losses = record["losses"]
    assert len(losses) == 4
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.2
    assert (folder / "tokenizer.json").is_file()
    assert list(folder.glob("*.safetensors"))

    # The same settings again: the folder is reused, not rewritten.
    weights = next(folder.glob("*.safetensors"))
    written = weights.stat().st_mtime_ns
    assert warm_start(config, SearchR1MiniTask(), out) == out
    assert weights.stat().st_mtime_ns == written
    # Another seed is another warm start.
    reseeded = _config(tiny_llama_path, *settings, "warm_start.max_len=320", "runner.seed=7")
    assert warm_start(reseeded, SearchR1MiniTask(), out) == out
    assert json.loads((folder / WARM_START_FILE).read_text())["identity"]["seed"] == 7

    import urllib.request

    with serve_builtin(folder, max_running_requests=2) as server:
        body = json.dumps(
            {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}
        ).encode()
        request = urllib.request.Request(
            f"{server.url}/generate", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.loads(response.read())
    assert len(answer["output_ids"]) == 4


def test_warm_start_off_returns_the_configured_model(tiny_llama_path: Path, tmp_path: Path) -> None:
    config = _config(tiny_llama_path, "~warm_start")  # the section's defaults: no warm start
    assert config.warm_start.num_steps == 0
    assert warm_start(config, SearchR1MiniTask(), tmp_path / "warm") == tiny_llama_path
    assert not (tmp_path / "warm").exists()


def test_warm_start_needs_demonstrations(tiny_llama_path: Path, tmp_path: Path) -> None:
    config = _config(tiny_llama_path, "warm_start.num_steps=2")
    with pytest.raises(AsyncRLError, match=r"no demonstrations; set warm_start.num_steps: 0"):
        warm_start(config, SearchR1Task(), tmp_path / "warm")
    too_short = _config(tiny_llama_path, "warm_start.num_steps=2", "warm_start.max_len=8")
    with pytest.raises(AsyncRLError, match=r"warm_start.max_len \(8\)"):
        warm_start(too_short, SearchR1MiniTask(), tmp_path / "warm")


def test_tiny_llama_presets_are_named_models() -> None:
    folder = models.resolve_model_path("tiny-llama:test", key="actor.model_path")
    assert (folder / "config.json").is_file()
    assert models.named_model("tiny-llama:test") == folder
    assert models.named_model(str(folder)) is None
    with pytest.raises(AsyncRLError, match=r"actor.model_path: unknown model tiny-llama:huge"):
        models.resolve_model_path("tiny-llama:huge", key="actor.model_path")


def test_a_tiny_llama_takes_the_tokenizer_without_converting_smollm2(
    smollm2_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # In an empty cache (a fresh clone) the tokenizer is read from the GGUF; the model is not converted.
    monkeypatch.setenv("ASYNCRL_CACHE", str(tmp_path / "cache"))
    folder = models.tiny_llama_preset("test")
    assert folder.is_relative_to(tmp_path / "cache")
    assert not (tmp_path / "cache" / "models" / models.SMOLLM2_DIR_NAME).exists()
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert (folder / name).read_bytes() == (smollm2_path / name).read_bytes(), name

    def settings(model: Path) -> dict[str, object]:
        loaded = json.loads((model / "tokenizer_config.json").read_text())
        loaded.pop("local_files_only", None)  # how it was loaded, not what it is
        return loaded

    assert settings(folder) == settings(smollm2_path)
