"""The random generators of one actor rank: seeded from `runner.seed`, saved in checkpoints, restored.

Python's `random`, numpy's global generator, torch's CPU generator and, where CUDA is up, the current
device's generator. Each rank writes its own `rng_state_rank<k>.json` into the actor's checkpoint folder;
the generators' states are stored as JSON (torch's as base64 bytes), nothing is unpickled.
"""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

RNG_FORMAT = "asyncrl-rng-1"


def seed_all(seed: int) -> None:
    """Seed every generator of this process from `seed` (`runner.seed`)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_file(folder: Path, rank: int) -> Path:
    return Path(folder) / f"rng_state_rank{rank}.json"


def rng_state() -> dict[str, Any]:
    """Every generator's state as JSON-ready values."""
    version, internal, gauss = random.getstate()
    name, keys, position, has_gauss, cached = cast("tuple[str, Any, int, int, float]", np.random.get_state())
    state: dict[str, Any] = {
        "format": RNG_FORMAT,
        "python": [version, list(internal), gauss],
        "numpy": [name, [int(k) for k in keys], int(position), int(has_gauss), float(cached)],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned. Raises `ValueError` for another format."""
    if state.get("format") != RNG_FORMAT:
        raise ValueError(f"not an {RNG_FORMAT} random-generator state")
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), position, has_gauss, cached))
    torch.set_rng_state(_bytes_tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_bytes_tensor(state["cuda"]))


def _bytes_tensor(encoded: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(encoded)), dtype=torch.uint8)


def save_rng(folder: Path, rank: int) -> None:
    """Write this rank's generators into `folder` (a temporary name renamed into place)."""
    path = rng_file(folder, rank)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(rng_state()) + "\n", encoding="utf-8")
    temporary.replace(path)


def load_rng(folder: Path, rank: int) -> dict[str, Any] | None:
    """This rank's saved generators, or None when the checkpoint holds none for it (an older one)."""
    path = rng_file(folder, rank)
    if not path.is_file():
        return None
    return cast("dict[str, Any]", json.loads(path.read_text(encoding="utf-8")))
