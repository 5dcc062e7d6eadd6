"""How a task's chat becomes the prompt the model continues: one rendering for rollout and warm start.

The agent loop generates from `prompt_ids(tokenizer, with_demonstrations(sample.messages, shots))`, and a
warm start trains on exactly the same ids followed by a demonstration's response, so what the model learns
before RL is what it is asked during RL. The tokenizer is any HuggingFace tokenizer with a chat template;
transformers is imported only by `load_tokenizer`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from asyncrl_core.errors import AsyncRLError
from asyncrl_core.types import ChatMessage, Demonstration

if TYPE_CHECKING:
    from pathlib import Path

    from transformers import PreTrainedTokenizerBase


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The HuggingFace tokenizer of the model folder `path` (local files only)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def with_demonstrations(
    messages: Sequence[ChatMessage], demonstrations: Sequence[Demonstration]
) -> list[ChatMessage]:
    """The chat the model continues: the system messages, then each demonstration as earlier turns (its
    non-system messages and its response as an assistant message), then the rest of `messages`."""
    system = [message for message in messages if message.role == "system"]
    rest = [message for message in messages if message.role != "system"]
    shots: list[ChatMessage] = []
    for demonstration in demonstrations:
        shots.extend(message for message in demonstration.messages if message.role != "system")
        shots.append(ChatMessage("assistant", demonstration.response))
    return [*system, *shots, *rest]


def prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: Sequence[ChatMessage]) -> list[int]:
    """Token ids of `messages` with the chat template and its generation prompt applied, tokenised once
    (no special tokens added beyond what the template writes)."""
    chat = [{"role": message.role, "content": message.content} for message in messages]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    if not isinstance(text, str):
        raise AsyncRLError(f"the tokenizer's chat template returned {type(text).__name__}, not text")
    return list(tokenizer.encode(text, add_special_tokens=False))
