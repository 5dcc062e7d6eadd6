"""The Megatron actor's checkpoint folder, written through `megatron.core.dist_checkpointing` so that any
tensor-parallel (and data-parallel) layout can read it.

A folder holds:

- `dist/`: Megatron's distributed checkpoint (its `torch_dist` format, PyTorch's distributed checkpoint
  underneath): the model's parameters and the optimizer's state as global tensors, each rank writing the
  shards it owns (data-parallel replicas write nothing twice). To load, every rank describes the slices its
  own layout needs (its sharded state dict) and reads only those, so a checkpoint saved at TP = 2 loads at
  TP = 1 or TP = 4. Megatron also writes `common.pt` there (values every rank shares: the optimizer's
  hyperparameters and step), a `torch.save` file it reads back itself.
- `rng/rank-<rank>.json`: each rank's random generators (Python, numpy, torch, Megatron's tensor-parallel
  tracker) as JSON. They belong to one layout: restored when the world and the tensor-parallel size are the
  ones they were saved with, left as seeded otherwise.
- `hf/`: the weights as a HuggingFace folder, for the engines and for people.
- `actor_state.json`: format, version, optimizer, the layout it was saved at and the model path; written
  last, by rank 0, under a temporary name first.

The optimizer state: on a GPU Megatron's optimizer describes its own state (the distributed optimizer in its
`fully_sharded_model_space` form, which reshards); on a CPU, where the actor steps with `torch.optim`, each
state tensor (AdamW's moments) is sharded like its parameter (`dist_checkpointing.optimizer`'s helpers) and
the step count, the same for every parameter, is a shared value.
"""

from __future__ import annotations

import base64
import json
import os
import warnings
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from asyncrl_core.errors import AsyncRLError
from asyncrl_megatron.model import megatron_warnings_ignored

CHECKPOINT_FORMAT = "asyncrl-megatron-actor-2"
STATE_FILE = "actor_state.json"
DIST_FOLDER = "dist"
RNG_FOLDER = "rng"
HF_FOLDER = "hf"
DISTRIBUTED_OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "fully_sharded_model_space"}
"""How Megatron's distributed optimizer describes its state: by model-space slices, which any layout reads."""


class CheckpointError(AsyncRLError):
    """A Megatron actor checkpoint that cannot be read or does not fit the actor; nothing was changed."""


@contextmanager
def _checkpoint_warnings_ignored() -> Generator[None]:
    """Megatron's warnings, and PyTorch's distributed checkpoint's deprecation notes for the calls Megatron
    makes into it (they name Megatron's code, not ours)."""
    with megatron_warnings_ignored(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\.checkpoint")
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed\.checkpoint")
        yield


def torch_optimizer_state(
    optimizer: torch.optim.Optimizer,
    model_state: dict[str, Any],
    parameters: list[torch.nn.Parameter],
    masters: list[torch.nn.Parameter] | None,
    *,
    is_loading: bool,
) -> dict[str, Any]:
    """The sharded state dict of a `torch.optim` optimizer over the model's trainable `parameters` (or over
    their float32 `masters`, in the same order, when the model is in bfloat16).

    Each per-parameter state tensor (and each master) becomes a sharded tensor laid out like its parameter
    in `model_state` (the model's sharded state dict); the step count, which every parameter shares, is a
    plain value. For loading, AdamW's moments are described as zeros of each parameter's shape (the
    optimizer may have no state yet), without touching the optimizer."""
    with megatron_warnings_ignored():
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            make_sharded_optimizer_tensor,
            optim_state_to_sharding_state,
        )

    state = optimizer.state_dict()
    # Copies of the per-parameter dicts: `state_dict()` shares them with the optimizer.
    per_parameter: dict[int, dict[str, Any]] = {
        index: dict(values) for index, values in state["state"].items()
    }
    stepped = masters if masters is not None else parameters
    if is_loading and isinstance(optimizer, torch.optim.AdamW):
        per_parameter = {
            index: {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
            for index, p in enumerate(stepped)
        }
    steps = {float(values.pop("step")) for values in per_parameter.values() if "step" in values}
    if len(steps) > 1:
        raise CheckpointError(f"the optimizer's parameters are at different steps {sorted(steps)}")
    state["state"] = per_parameter
    # Ids are positions in the optimizer's order, which is the parameters' order (masters included).
    by_id: Any = get_param_id_to_sharded_param_map(model_state, parameters)  # factories are handled too
    optim_state_to_sharding_state(state, by_id)
    result: dict[str, Any] = {"torch": state, "step": steps.pop() if steps else 0.0}
    if masters is not None:
        result["masters"] = {
            index: make_sharded_optimizer_tensor(
                by_id[index],
                torch.zeros_like(master) if is_loading else master.detach(),
                prefix="optimizer.state.fp32_param",
            )
            for index, master in enumerate(masters)
        }
    return result


def load_torch_optimizer_state(
    optimizer: torch.optim.Optimizer, masters: list[torch.nn.Parameter] | None, loaded: dict[str, Any]
) -> None:
    """Put what `torch_optimizer_state` described, once loaded, into `optimizer` (and the masters)."""
    state = loaded["torch"]
    if isinstance(optimizer, torch.optim.AdamW):
        for values in state["state"].values():
            values["step"] = torch.tensor(float(loaded["step"]))
    optimizer.load_state_dict(state)
    if masters is not None:
        with torch.no_grad():
            for index, master in enumerate(masters):
                master.copy_(loaded["masters"][index])


def detached(state: Any) -> Any:
    """`state` (a sharded state dict) with every sharded tensor's data replaced by a copy, so that loading
    into it leaves the live parameters and optimizer untouched until everything has been read."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if isinstance(state, dict):
        return {key: detached(value) for key, value in state.items()}  # pyright: ignore[reportUnknownVariableType]
    if isinstance(state, list):
        return [detached(value) for value in state]  # pyright: ignore[reportUnknownVariableType]
    if isinstance(state, ShardedTensor | ShardedTensorFactory) and isinstance(state.data, torch.Tensor):
        state.data = state.data.detach().clone()
    return state


def save_sharded(state: dict[str, Any], folder: Path) -> None:
    """Write the sharded state dict `state` into `folder` (collective: every rank of the world)."""
    with _checkpoint_warnings_ignored():
        from megatron.core import dist_checkpointing

        folder.mkdir(parents=True, exist_ok=True)
        dist.barrier()  # every rank sees the folder before any writes into it
        dist_checkpointing.save(state, str(folder))


def load_sharded(state: dict[str, Any], folder: Path) -> dict[str, Any]:
    """Read into `state` (this rank's sharded state dict) the slices it describes (collective)."""
    if not (folder / "metadata.json").is_file():
        raise CheckpointError(f"{folder} holds no Megatron distributed checkpoint (no metadata.json)")
    from torch.distributed.checkpoint.api import CheckpointException

    with _checkpoint_warnings_ignored():
        from megatron.core import dist_checkpointing

        try:
            loaded = dist_checkpointing.load(state, str(folder))
        except (OSError, RuntimeError, KeyError, ValueError, AssertionError, CheckpointException) as error:
            raise CheckpointError(f"cannot read the distributed checkpoint in {folder}: {error}") from error
    assert isinstance(loaded, dict), "strict=ASSUME_OK_UNEXPECTED returns the state dict alone"
    return loaded


# --- the description and the random generators ---------------------------------------------------------


def write_description(folder: Path, description: dict[str, Any]) -> None:
    temporary = folder / (STATE_FILE + ".tmp")
    temporary.write_text(json.dumps({"format": CHECKPOINT_FORMAT, **description}, indent=2) + "\n")
    os.replace(temporary, folder / STATE_FILE)


def read_description(folder: Path) -> dict[str, Any]:
    """`actor_state.json`, checked to be of this format with a valid version."""
    try:
        description = json.loads((folder / STATE_FILE).read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{folder} holds no readable Megatron actor checkpoint: {error}") from error
    if not isinstance(description, dict) or description.get("format") != CHECKPOINT_FORMAT:  # pyright: ignore[reportUnknownMemberType]
        raise CheckpointError(f"{folder / STATE_FILE} is not a {CHECKPOINT_FORMAT} checkpoint")
    result: dict[str, Any] = description  # pyright: ignore[reportUnknownVariableType]
    version = result.get("version")
    if not isinstance(version, int) or version < 0:
        raise CheckpointError(f"{folder / STATE_FILE} has no valid version")
    return result


def _rng_file(folder: Path, rank: int) -> Path:
    return folder / RNG_FOLDER / f"rank-{rank}.json"


def write_rng(folder: Path, rank: int, generators: dict[str, Any], tracker: dict[str, torch.Tensor]) -> None:
    """Rank `rank`'s generators (`asyncrl_core.actor.rng.rng_state()`) and Megatron's tracker states."""
    path = _rng_file(folder, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    encoded = {name: base64.b64encode(state.numpy().tobytes()).decode() for name, state in tracker.items()}
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps({"generators": generators, "tracker": encoded}))
    os.replace(temporary, path)


def read_rng(folder: Path, rank: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    path = _rng_file(folder, rank)
    try:
        saved = json.loads(path.read_text())
        tracker = {
            name: torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
            for name, text in saved["tracker"].items()
        }
        return saved["generators"], tracker
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"cannot read {path}: {error}") from error
