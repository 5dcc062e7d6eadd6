"""Files written so that a crash leaves either the old content or the whole new one, never a part."""

from __future__ import annotations

import os
from pathlib import Path

TEMPORARY_SUFFIX = ".tmp"


def fsync_dir(folder: Path) -> None:
    """Flush a folder's entries (new names, renames) to disk."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that `path` holds either its old content or all of `data`: a temporary
    file beside it (`.<name>.tmp`), flushed to disk, renamed into place, the folder flushed."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}{TEMPORARY_SUFFIX}")
    with open(temporary, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)
    fsync_dir(path.parent)
