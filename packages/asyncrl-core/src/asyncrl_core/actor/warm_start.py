"""Warm start: supervised fine-tuning of the policy on the task's demonstrations, once, before RL.

A randomly initialised or weak model almost never earns a reward on an agentic task, and a policy gradient
cannot lift a reward that is always zero. The warm start teaches the format and the moves of the task from
`Task.demonstrations()` so that RL starts from a policy that sometimes succeeds.

Each demonstration becomes one training sequence laid out exactly as the agent loop lays out an episode
(`asyncrl_agents.loop`): the prompt is `asyncrl_core.prompts.prompt_ids` of the demonstration's messages (the
chat template with its generation prompt), and the response follows as its pieces tokenised one by one,
the model's turns and the observations each on its own, as the loop appends the sampled ids and then the
encoded observation. The loss is the cross-entropy of the model's own text only: the prompt and the
observations (`Demonstration.observation_spans`) carry none, as in the RL loss mask.

`warm_start(config, task)` returns a HuggingFace model folder (safetensors, config, tokenizer and
`warm_start.json` with the settings and the loss of every step) that the actor and the engines load as
their model. The fine-tuning is a pure function of its inputs (`warm_start_inputs`: the task and its
arguments, the base model by content, the demonstrations, the settings, the seed, the device type and the
libraries that compute it), so its result is kept in the user cache (`asyncrl_core.cache`, kind
`warm-start`) under a key of those inputs and reused by every later run, resumed or new, that has the same
ones. torch and transformers are imported when a fine-tuning runs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl_core import cache, models, prompts
from asyncrl_core.errors import AsyncRLError
from asyncrl_core.types import Demonstration

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from asyncrl_core.config import AsyncRLConfig, WarmStartConfig
    from asyncrl_core.protocols import Task

logger = logging.getLogger(__name__)

WARM_START_FILE = "warm_start.json"
"""The file in a warm-started model folder that records how it was made and the loss of every step."""
_FORMAT = "asyncrl-warm-start-1"


@dataclass(frozen=True, slots=True)
class SftExample:
    """One training sequence: token ids and, per token, whether it is a target of the loss (1: the model
    wrote it in the demonstration; 0: prompt or observation)."""

    input_ids: list[int]
    loss_mask: list[int]


def sft_example(tokenizer: PreTrainedTokenizerBase, demonstration: Demonstration) -> SftExample:
    """`demonstration` as the agent loop would have produced it: prompt ids, then each response piece
    tokenised on its own; only the model's pieces are targets."""
    input_ids = prompts.prompt_ids(tokenizer, demonstration.messages)
    loss_mask = [0] * len(input_ids)
    for text, is_model_text in demonstration.segments():
        piece: list[int] = list(tokenizer.encode(text, add_special_tokens=False))
        input_ids += piece
        loss_mask += [int(is_model_text)] * len(piece)
    return SftExample(input_ids, loss_mask)


def warm_start(config: AsyncRLConfig, task: Task) -> Path:
    """The model folder the run starts from: `actor.model_path` fine-tuned on `task`'s demonstrations
    (`warm_start` section), from the cache when it holds one of the same inputs; or the resolved
    `actor.model_path` itself when `warm_start.num_steps` is 0.

    Call it once, before engines and actor start, and give both the returned folder as their model. Says in
    one line whether it reused or built the warm start, and its key. Raises `AsyncRLError` when the task has
    no demonstrations or none fits `warm_start.max_len` with a token left to learn.
    """
    settings = config.warm_start
    base = models.resolve_model_path(config.actor.model_path, key="actor.model_path")
    if settings.num_steps == 0:
        return base
    demonstrations = list(task.demonstrations())
    if not demonstrations:
        raise AsyncRLError(
            f"warm_start.num_steps is {settings.num_steps} but task {config.agentloop.task_name!r} has no "
            "demonstrations; set warm_start.num_steps: 0"
        )
    started = time.perf_counter()
    inputs = warm_start_inputs(config, base, demonstrations)
    entry = cache.cached(
        "warm-start",
        inputs,
        lambda folder: fine_tune(
            base, demonstrations, folder, settings, seed=config.runner.seed, identity=inputs
        ),
    )
    seconds = time.perf_counter() - started
    if entry.reused:
        logger.info("warm start: reused %s (%.1f s)", entry.key, seconds)
    else:
        logger.info("warm start: built %s in %.1f s (%s)", entry.key, seconds, entry.path)
    return entry.path


def fine_tune(
    base: Path,
    demonstrations: Sequence[Demonstration],
    out_dir: Path,
    settings: WarmStartConfig,
    *,
    seed: int,
    identity: dict[str, Any] | None = None,
) -> list[float]:
    """Fine-tune the model folder `base` on `demonstrations` for `settings.num_steps` steps and write the
    result into the folder `out_dir` (created when missing).

    Each step draws `settings.batch_size` demonstrations, going through them in an order shuffled anew
    every epoch by `seed`. The loss is the mean cross-entropy over the target tokens of the batch. AdamW,
    linear warm-up over the first tenth of the steps, then cosine decay to a tenth of `settings.lr`,
    gradient norm clipped to 1. Returns the loss of every step.
    """
    import torch
    from transformers import AutoTokenizer

    from asyncrl_core.actor.torch_actor import default_device, load_causal_lm

    if settings.num_steps < 1:
        raise ValueError(f"num_steps must be at least 1, got {settings.num_steps}")
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(base), local_files_only=True)
    examples = [_truncated(sft_example(tokenizer, d), settings.max_len) for d in demonstrations]
    examples = [example for example in examples if any(example.loss_mask[1:])]
    if not examples:
        raise AsyncRLError(
            f"no demonstration keeps a token to learn within warm_start.max_len ({settings.max_len}); "
            "raise it"
        )
    device = default_device()
    torch.manual_seed(seed)
    model = load_causal_lm(base, device, torch.float32)
    model.train()
    pad_id = getattr(model.config, "pad_token_id", None)
    pad_id = pad_id if isinstance(pad_id, int) else 0
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    warmup = max(1, settings.num_steps // 10)

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, settings.num_steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    order = _batches(len(examples), settings.batch_size, settings.num_steps, seed)
    losses: list[float] = []
    for step, indices in enumerate(order):
        loss = _batch_loss(model, [examples[i] for i in indices], pad_id, device)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(float(loss.item()))
        if (step + 1) % max(1, settings.num_steps // 10) == 0 or step + 1 == settings.num_steps:
            logger.info("warm start: step %d/%d, loss %.4f", step + 1, settings.num_steps, losses[-1])

    record = {
        "format": _FORMAT,
        "identity": identity,
        "num_examples": len(examples),
        "time_s": time.perf_counter() - started,
        "losses": losses,
    }
    _write_folder(model, tokenizer, out_dir, record)
    # The warm start runs in the launching process, which lives on beside the engines and the actor: hand
    # the device memory of the model and its optimiser state back (20 GB for a 135M model on a GPU).
    del model, optimizer, scheduler
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return losses


def _truncated(example: SftExample, max_len: int) -> SftExample:
    return SftExample(example.input_ids[:max_len], example.loss_mask[:max_len])


def _batches(num_examples: int, batch_size: int, num_steps: int, seed: int) -> list[list[int]]:
    """`num_steps` batches of example indices: epochs of a seeded shuffle, laid end to end."""
    rng = random.Random(seed)
    stream: list[int] = []
    while len(stream) < num_steps * batch_size:
        epoch = list(range(num_examples))
        rng.shuffle(epoch)
        stream += epoch
    return [stream[i * batch_size : (i + 1) * batch_size] for i in range(num_steps)]


def _batch_loss(
    model: PreTrainedModel, batch: Sequence[SftExample], pad_id: int, device: torch.device
) -> torch.Tensor:
    """Mean cross-entropy of the batch's target tokens. The output layer runs only at the positions that
    predict a target (the prompt, usually most of a row, skips the 49152-wide logits)."""
    import torch

    width = max(len(example.input_ids) for example in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    targets = torch.zeros((len(batch), width), dtype=torch.bool)
    for row, example in enumerate(batch):
        input_ids[row, : len(example.input_ids)] = torch.tensor(example.input_ids)
        targets[row, : len(example.loss_mask)] = torch.tensor(example.loss_mask, dtype=torch.bool)
    targets[:, 0] = False  # nothing predicts the first token
    input_ids, targets = input_ids.to(device), targets.to(device)
    # Right padding needs no attention mask: causal attention never lets a real token see a later pad.
    positions = torch.arange(width, device=device).expand(len(batch), width)
    hidden = model.base_model(input_ids=input_ids, position_ids=positions).last_hidden_state
    predicting = targets[:, 1:]
    output_layer = model.get_output_embeddings()
    if output_layer is None:
        raise AsyncRLError(f"{type(model).__name__} has no output embeddings to train")
    logits = output_layer(hidden[:, :-1][predicting])
    return torch.nn.functional.cross_entropy(logits.float(), input_ids[:, 1:][predicting])


def warm_start_inputs(
    config: AsyncRLConfig, base: Path, demonstrations: Sequence[Demonstration]
) -> dict[str, Any]:
    """Everything a warm start's result depends on, the key of its cache entry: the task and its
    arguments, the base model by content (a named model by its own cache entry), the demonstrations, the
    settings, the seed, the device type it trains on, and the versions of the libraries that compute it."""
    from asyncrl_core.config.placement import visible_gpu_count

    digest = hashlib.sha256()
    for demonstration in demonstrations:
        digest.update(repr(demonstration).encode())
    return {
        "format": _FORMAT,
        "task": config.agentloop.task_name,
        "task_args": dict(config.agentloop.task_args),
        "base": _model_identity(base),
        "demonstrations": digest.hexdigest(),
        "settings": config.warm_start.model_dump(mode="json"),
        "seed": config.runner.seed,
        # `fine_tune` trains on the current CUDA device when there is one (known here without torch).
        "device_type": "cuda" if visible_gpu_count() > 0 else "cpu",
        "libraries": cache.library_versions("asyncrl-core", "torch", "transformers", "safetensors"),
    }


def _model_identity(folder: Path) -> dict[str, str]:
    """A model folder by what it holds: the key of the cache entry it is (verified when it was resolved),
    or the digest of its files."""
    entry = cache.entry_key(folder)
    if entry is not None:
        return {"cache_entry": entry}
    return {"files": cache.folder_digest(folder)}


def _write_folder(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out_dir: Path, record: dict[str, Any]
) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    (out_dir / WARM_START_FILE).write_text(json.dumps(record, indent=2) + "\n")
