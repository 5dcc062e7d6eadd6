"""The warm start: supervised fine-tuning on a task's demonstrations, laid out as the agent loop lays out
an episode, written as a model folder that the actor and the built-in engine load."""

from __future__ import annotations

import importlib.metadata
import json
import logging
from pathlib import Path

import pytest

from asyncrl_agents.tasks.searchr1 import SearchR1MiniTask, SearchR1Task
from asyncrl_core import cache, models, prompts
from asyncrl_core.actor.warm_start import WARM_START_FILE, sft_example, warm_start
from asyncrl_core.config import AsyncRLConfig, load_config
from asyncrl_core.errors import AsyncRLError
from asyncrl_core.tasks import load_task
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


@pytest.fixture
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty user cache for the test (the tiny Llama of the session lives elsewhere)."""
    monkeypatch.setenv("ASYNCRL_CACHE", str(tmp_path / "cache"))
    cache.set_rebuild(False)
    return tmp_path / "cache"


def test_warm_start_lowers_the_loss_and_the_folder_serves(
    tiny_llama_path: Path, own_cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from engine_process import serve_builtin

    settings = ("warm_start.num_steps=4", "warm_start.batch_size=2", "warm_start.lr=0.003")
    config = _config(tiny_llama_path, *settings, "warm_start.max_len=320")
    with caplog.at_level(logging.INFO, logger="asyncrl_core.actor.warm_start"):
        folder = warm_start(config, SearchR1MiniTask())
    assert folder.is_relative_to(own_cache.resolve() / "warm-start")
    assert "warm start: built " in caplog.text
    record = json.loads((folder / WARM_START_FILE).read_text())
    losses = record["losses"]
    assert len(losses) == 4
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.2
    assert (folder / "tokenizer.json").is_file()
    assert list(folder.glob("*.safetensors"))

    # The same inputs again (another run folder, another process): the folder is reused, not rewritten.
    weights = next(folder.glob("*.safetensors"))
    written = weights.stat().st_mtime_ns
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="asyncrl_core.actor.warm_start"):
        assert warm_start(config, SearchR1MiniTask()) == folder
    assert f"warm start: reused {folder.name}" in caplog.text
    assert weights.stat().st_mtime_ns == written

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


def test_a_cached_warm_start_serves_only_its_own_inputs(
    tiny_llama_path: Path, own_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each input changed in turn is another warm start, built anew; the original is still reused."""
    settings = ("warm_start.num_steps=1", "warm_start.batch_size=2", "warm_start.max_len=160")

    def built(model: Path, *overrides: str) -> tuple[Path, bool]:
        config = _config(model, *settings, *overrides)
        task = load_task(config.agentloop.task_name or "", dict(config.agentloop.task_args))
        before = set((own_cache / "warm-start").glob("*")) if (own_cache / "warm-start").exists() else set()
        folder = warm_start(config, task)
        return folder, folder not in before

    original, fresh = built(tiny_llama_path)
    assert fresh
    other_model = models.tiny_llama(tmp_path / "other-llama", seed=1)  # same shape, other weights
    changed = {
        "task arguments": built(tiny_llama_path, "agentloop.task_args.max_hops=2"),
        "task": built(tiny_llama_path, "agentloop.task_name=arith", "~agentloop.task_args"),
        "model": built(other_model),
        "steps": built(tiny_llama_path, "warm_start.num_steps=2"),
        "settings": built(tiny_llama_path, "warm_start.lr=0.002"),
        "seed": built(tiny_llama_path, "runner.seed=7"),
    }
    real_version = importlib.metadata.version
    with monkeypatch.context() as upgraded:
        upgraded.setattr(
            importlib.metadata,
            "version",
            lambda name: "99.0" if name == "transformers" else real_version(name),
        )
        changed["library version"] = built(tiny_llama_path)
    folders = {name: folder for name, (folder, _) in changed.items()}
    assert [name for name, (_, fresh) in changed.items() if not fresh] == []
    assert len({original, *folders.values()}) == len(changed) + 1
    assert built(tiny_llama_path) == (original, False)


def test_a_damaged_warm_start_is_named_and_built_again(
    tiny_llama_path: Path, own_cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = _config(tiny_llama_path, "warm_start.num_steps=1", "warm_start.batch_size=2")
    folder = warm_start(config, SearchR1MiniTask())
    weights = next(folder.glob("*.safetensors"))
    intact = weights.read_bytes()
    damaged = bytearray(intact)
    damaged[len(damaged) // 2] ^= 0xFF
    weights.write_bytes(bytes(damaged))
    cache._verified.clear()  # as a later run's process finds it  # pyright: ignore[reportPrivateUsage]
    with caplog.at_level(logging.INFO):
        assert warm_start(config, SearchR1MiniTask()) == folder
    assert f"{weights.name} has another BLAKE3 digest" in caplog.text
    assert "warm start: built " in caplog.text
    assert weights.read_bytes() == intact  # deterministic: the same warm start again


def test_warm_start_off_returns_the_configured_model(tiny_llama_path: Path) -> None:
    config = _config(tiny_llama_path, "~warm_start")  # the section's defaults: no warm start
    assert config.warm_start.num_steps == 0
    assert warm_start(config, SearchR1MiniTask()) == tiny_llama_path


def test_warm_start_needs_demonstrations(tiny_llama_path: Path) -> None:
    config = _config(tiny_llama_path, "warm_start.num_steps=2")
    with pytest.raises(AsyncRLError, match=r"no demonstrations; set warm_start.num_steps: 0"):
        warm_start(config, SearchR1Task())
    too_short = _config(tiny_llama_path, "warm_start.num_steps=2", "warm_start.max_len=8")
    with pytest.raises(AsyncRLError, match=r"warm_start.max_len \(8\)"):
        warm_start(too_short, SearchR1MiniTask())


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
    assert [entry.name for entry in (tmp_path / "cache" / "models").iterdir() if entry.is_dir()] == [
        folder.name
    ]
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert (folder / name).read_bytes() == (smollm2_path / name).read_bytes(), name

    def settings(model: Path) -> dict[str, object]:
        loaded = json.loads((model / "tokenizer_config.json").read_text())
        loaded.pop("local_files_only", None)  # how it was loaded, not what it is
        return loaded

    assert settings(folder) == settings(smollm2_path)
