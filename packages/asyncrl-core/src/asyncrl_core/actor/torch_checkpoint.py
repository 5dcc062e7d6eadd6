"""The torch actor's checkpoint folder: its files, how each is written, and how its state is read back.

`TorchActor.save_checkpoint` writes, on rank 0, a HuggingFace model folder (`model.safetensors` with the
float32 master weights, `config.json`, the tokenizer's files), `optimizer.safetensors` (the optimiser state,
tensors by name and the rest as JSON metadata) and `actor_state.json` (format, version, data-parallel size,
optimiser, model path), each under a temporary name renamed into place; `load_checkpoint` reads them back
with these helpers.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import save_file

from asyncrl_core.errors import ActorError

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "actor_state.json"
CHECKPOINT_FORMAT = "asyncrl-torch-actor-1"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    "chat_template.jinja",
)
"""The files of the model folder's tokenizer, copied into a checkpoint so that it loads as a model."""


def copy_tokenizer_files(model_path: Path, folder: Path) -> None:
    """The tokenizer's files of `model_path` into `folder`, those it does not hold yet."""
    for name in TOKENIZER_FILES:
        if (model_path / name).is_file() and not (folder / name).exists():
            shutil.copyfile(model_path / name, folder / name)


def write_state(
    folder: Path, *, version: int, data_parallel_size: int, optimizer: str, model_path: str
) -> None:
    """`actor_state.json`, written under a temporary name and renamed into place."""
    state = {
        "format": CHECKPOINT_FORMAT,
        "version": version,
        "data_parallel_size": data_parallel_size,
        "optimizer": optimizer,
        "model_path": model_path,
    }
    temporary = folder / (STATE_FILE + ".tmp")
    temporary.write_text(json.dumps(state, indent=2) + "\n")
    os.replace(temporary, folder / STATE_FILE)


def read_version(folder: Path, optimizer: str) -> int:
    """The weight version `actor_state.json` in `folder` records, checked: a torch actor checkpoint, of an
    actor trained with `optimizer`. Raises `ActorError` naming what is wrong."""
    try:
        state = json.loads((folder / STATE_FILE).read_text())
    except (OSError, ValueError) as error:
        raise ActorError(f"{folder} holds no readable torch actor checkpoint: {error}") from error
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:  # pyright: ignore[reportUnknownMemberType]
        raise ActorError(f"{folder / STATE_FILE} is not a {CHECKPOINT_FORMAT} checkpoint")
    state = cast(dict[str, Any], state)
    if state.get("optimizer") != optimizer:
        raise ActorError(
            f"the checkpoint in {folder} was trained with optimizer {state.get('optimizer')!r}, "
            f"this actor uses {optimizer!r} (actor.optimizer)"
        )
    version = state.get("version")
    if not isinstance(version, int) or version < 0:
        raise ActorError(f"{folder / STATE_FILE} has no valid version")
    return version


def atomic_save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    temporary = path.with_name(path.name + ".tmp")
    save_file(tensors, str(temporary), metadata=metadata)
    os.replace(temporary, path)


def optimizer_to_safetensors(
    optimizer: torch.optim.Optimizer, name: str
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The optimiser's state as safetensors: tensors `state.<param>.<key>`, the rest as JSON metadata."""
    state_dict = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, float | int | bool] = {}
    for index, entry in state_dict["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{index}.{key}"] = value.detach().cpu().contiguous()
            elif isinstance(value, bool | int | float):
                scalars[f"{index}.{key}"] = value
            elif value is not None:
                raise ActorError(f"cannot checkpoint optimiser state {key!r} of type {type(value).__name__}")
    metadata = {
        "optimizer": name,
        "param_groups": json.dumps(state_dict["param_groups"]),
        "scalars": json.dumps(scalars),
    }
    return tensors, metadata


def optimizer_from_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> dict[str, Any]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        metadata: dict[str, str] = handle.metadata() or {}
    try:
        param_groups = json.loads(metadata["param_groups"])
        scalars: dict[str, Any] = json.loads(metadata["scalars"])
    except (KeyError, ValueError) as error:
        raise ActorError(f"{path} lacks the optimiser metadata: {error}") from error
    state: dict[int, dict[str, Any]] = {}
    for key, tensor in tensors.items():
        _, index, name = key.split(".", 2)
        state.setdefault(int(index), {})[name] = tensor
    for key, value in scalars.items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    return {"state": state, "param_groups": param_groups}
