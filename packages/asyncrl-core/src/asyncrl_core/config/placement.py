"""Device ids of the placement (`0-7`, `0,2,4`, `3`) and the devices this machine has.

GPUs are counted without importing torch: from `CUDA_VISIBLE_DEVICES` when it is set, else from
`nvidia-smi -L`. CPU cores are counted with `os.cpu_count()`.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from typing import Literal

MAX_DEVICE_ID = 65535
"""Largest device id accepted; keeps a typo such as `0-99999999` from describing a billion devices."""

_ID_PART = re.compile(r"^(\d+)(?:\s*-\s*(\d+))?$")


def parse_device_ids(text: str) -> tuple[int, ...]:
    """The ids `text` names, sorted: comma-separated ids and inclusive ranges (`0-3,6` is 0, 1, 2, 3, 6).

    Raises `ValueError` with a message that shows the fix for an empty part, a descending range (`8-3`),
    a negative or non-numeric id, an id above `MAX_DEVICE_ID` or an id listed twice.
    """
    ids: list[int] = []
    parts = [part.strip() for part in text.split(",")]
    for part in parts:
        match = _ID_PART.match(part)
        if match is None:
            raise ValueError(
                f"cannot read device ids {text!r} (part {part!r}); write ids and inclusive ranges such as "
                "`0-7`, `0,2,4` or `0-3,6`"
            )
        start = int(match.group(1))
        end = int(match.group(2)) if match.group(2) is not None else start
        if end < start:
            raise ValueError(f"range {part!r} runs backwards; write `{end}-{start}`")
        if end > MAX_DEVICE_ID:
            raise ValueError(f"device id {end} is above the largest allowed id {MAX_DEVICE_ID}")
        ids.extend(range(start, end + 1))
    if len(set(ids)) != len(ids):
        repeated = sorted({device_id for device_id in ids if ids.count(device_id) > 1})
        raise ValueError(f"device ids {repeated} are listed more than once in {text!r}")
    return tuple(sorted(ids))


def format_device_ids(ids: tuple[int, ...]) -> str:
    """Compact text of sorted ids: `(0, 1, 2, 3, 6)` gives `0-3,6`."""
    parts: list[str] = []
    index = 0
    while index < len(ids):
        end = index
        while end + 1 < len(ids) and ids[end + 1] == ids[end] + 1:
            end += 1
        parts.append(str(ids[index]) if end == index else f"{ids[index]}-{ids[end]}")
        index = end + 1
    return ",".join(parts)


def visible_gpu_count() -> int:
    """GPUs this process may use: `CUDA_VISIBLE_DEVICES` when set (empty or `-1` means none), else the
    lines of `nvidia-smi -L`, else 0. Imports no CUDA library."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [entry.strip() for entry in visible.split(",") if entry.strip()]
        if not entries or entries[0].startswith("-"):
            return 0
        return len(entries)
    return _nvidia_smi_gpu_count()


@functools.cache
def _nvidia_smi_gpu_count() -> int:
    executable = shutil.which("nvidia-smi")
    if executable is None:
        return 0
    try:
        listing = subprocess.run(
            [executable, "-L"], capture_output=True, text=True, timeout=10.0, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return 0
    if listing.returncode != 0:
        return 0
    return sum(1 for line in listing.stdout.splitlines() if line.startswith("GPU "))


def detect_devices(device_type: Literal["gpu", "cpu"]) -> int:
    """Devices of `device_type` present on this machine (0 when there is no GPU)."""
    if device_type == "gpu":
        return visible_gpu_count()
    return os.cpu_count() or 1
