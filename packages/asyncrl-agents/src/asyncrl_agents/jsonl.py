"""JSON Lines files, the format of the corpora and question sets: one JSON object a line."""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import cast

from asyncrl_core.errors import AsyncRLError


def read_jsonl(path: Path) -> Iterator[tuple[int, dict[str, object]]]:
    """The rows of `path` with their line numbers (from 1), blank lines skipped; raises `AsyncRLError` naming
    the file and line of a row that is not JSON or not an object."""
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row: object = json.loads(line)
            except json.JSONDecodeError as error:
                raise AsyncRLError(f"{path}:{number}: not JSON: {error}") from error
            if not isinstance(row, dict):
                raise AsyncRLError(f"{path}:{number}: a row must be a JSON object")
            yield number, cast("dict[str, object]", row)


def write_jsonl(path: Path, rows: Iterable[Mapping[str, object]]) -> None:
    """Write rows atomically (a reader never sees a half-written file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{random.getrandbits(32):08x}.tmp")
    with staging.open("w", encoding="utf-8") as out:
        for row in rows:
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
    staging.replace(path)
