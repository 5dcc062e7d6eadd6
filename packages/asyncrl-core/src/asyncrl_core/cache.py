"""The user cache: what a run builds before it starts, kept once for every run that has the same inputs.

A start-up artefact (a model converted from GGUF, a random-initialised preset, a warm-started model, a
task's generated corpus) is a pure function of its inputs. `cached(kind, inputs, build)` returns the folder
`cache_dir()/<kind>/<key>`, where `key` is a digest of `inputs` (canonical JSON), building it first when
there is none:

- An entry appears atomically: `build` writes into a staging folder beside it, which is renamed into place
  once complete, under a lock across processes (tests, workers and two runs may ask for it at once). A
  failed build leaves nothing behind.
- An entry records its inputs and the size and BLAKE3 digest of every file (`ENTRY_FILE`). It is used only
  when the record names exactly the inputs asked for and every file still has its digest; otherwise the
  damage is named in a warning and the entry is built again. Inputs that differ give another key, hence
  another folder: an entry is never used for inputs it was not made from.
- `set_rebuild(True)` (`asyncrl-run --rebuild-cache`) builds every entry this process asks for once more,
  replacing the old one.

Inputs must say everything the result depends on, library versions included (`library_versions`); a
caller that reads a file names it by content (`folder_digest`), not by path.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Generator, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import blake3

logger = logging.getLogger(__name__)

ENTRY_FILE = ".entry.json"
"""The record of a cache entry: its format, kind, key, inputs, and each file's size and BLAKE3 digest."""
_FORMAT = "asyncrl-cache-1"
KEY_LENGTH = 20
"""Hex digits of a key: 80 bits of SHA-256 over the inputs' canonical JSON."""

_rebuild = False
_rebuilt: set[Path] = set()
_verified: set[Path] = set()
"""Entries this process found sound or built (each is checked once a process)."""


def cache_dir() -> Path:
    """The cache's root: `$ASYNCRL_CACHE`, else `$XDG_CACHE_HOME/asyncrl` or `~/.cache/asyncrl`."""
    if env := os.environ.get("ASYNCRL_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "asyncrl"


def set_rebuild(rebuild: bool) -> None:
    """Build every entry this process asks for again (once each), replacing what the cache holds."""
    global _rebuild
    _rebuild = rebuild
    _rebuilt.clear()


def file_digest(path: Path) -> str:
    """BLAKE3 of the file at `path`, memory-mapped and split across the cores (the GIL is released while it
    hashes): the digest of checkpoint manifests and cache entries."""
    return blake3.blake3(max_threads=blake3.blake3.AUTO).update_mmap(path).hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(path for path in folder.rglob("*") if path.is_file() and path.name != ENTRY_FILE)


def folder_digest(folder: Path, names: Iterable[str] | None = None) -> str:
    """One digest of the contents of `folder` (or of the files `names` in it): every file's relative path
    and BLAKE3, so two folders of the same files digest alike wherever they are."""
    paths = [folder / name for name in names] if names is not None else _files(folder)
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(f"{path.relative_to(folder).as_posix()}\0{file_digest(path)}\n".encode())
    return digest.hexdigest()


def library_versions(*distributions: str) -> dict[str, str]:
    """The installed version of each distribution (`"absent"` when it is not installed): inputs of any
    entry that those libraries compute."""
    from importlib import metadata

    versions: dict[str, str] = {}
    for name in distributions:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


def key_of(inputs: Mapping[str, Any]) -> str:
    """The key of an entry made from `inputs` (JSON-serialisable: canonical JSON, keys sorted)."""
    canonical = json.dumps(inputs, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:KEY_LENGTH]


@dataclass(frozen=True, slots=True)
class CacheEntry:
    """A folder of the cache, ready to use."""

    path: Path
    key: str
    reused: bool
    """True when the folder was in the cache already; False when this call built it."""


def cached(kind: str, inputs: Mapping[str, Any], build: Callable[[Path], object]) -> CacheEntry:
    """The entry of `kind` made from `inputs`, built by `build(staging_folder)` when the cache has no sound
    one (see the module docstring). `kind` names a folder of the cache (`models`, `warm-start`, ...)."""
    inputs = cast(dict[str, Any], json.loads(json.dumps(inputs)))  # as the record will read back
    key = key_of(inputs)
    target = cache_dir().resolve() / kind / key
    rebuild = _rebuild and target not in _rebuilt
    if not rebuild and (target in _verified or _sound(target, kind, key, inputs, warn=False)):
        _verified.add(target)
        return CacheEntry(target, key, reused=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(target.with_name(f".{key}.lock")):
        # Another process may have built it while this one waited for the lock.
        if not rebuild and _sound(target, kind, key, inputs, warn=True):
            _verified.add(target)
            return CacheEntry(target, key, reused=True)
        # Staging folders of this key left by a builder that died: none is in use while we hold the lock.
        for stale in target.parent.glob(f".{key}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=target.parent))
        try:
            build(staging)
            files = {
                path.relative_to(staging).as_posix(): {
                    "size": path.stat().st_size,
                    "blake3": file_digest(path),
                }
                for path in _files(staging)
            }
            record = {"format": _FORMAT, "kind": kind, "key": key, "inputs": inputs, "files": files}
            (staging / ENTRY_FILE).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    _rebuilt.add(target)
    _verified.add(target)
    return CacheEntry(target, key, reused=False)


def entry_key(folder: Path) -> str | None:
    """The key of the sound cache entry `folder` is, None when it is no entry or not a sound one: what
    names a folder of the cache by content without hashing it again in this process."""
    try:
        record = json.loads((folder / ENTRY_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict):
        return None
    record = cast(dict[str, Any], record)
    kind, key, inputs = record.get("kind"), record.get("key"), record.get("inputs")
    if not (isinstance(kind, str) and isinstance(key, str) and isinstance(inputs, dict)):
        return None
    folder = folder.resolve()
    if folder not in _verified and _problem(folder, kind, key, cast(dict[str, Any], inputs)) is not None:
        return None
    _verified.add(folder)
    return key


def _sound(target: Path, kind: str, key: str, inputs: Mapping[str, Any], *, warn: bool) -> bool:
    """Whether `target` is a complete entry of `inputs` whose every file has its recorded digest; when it
    exists but is not, and `warn`, says why (it is then built again)."""
    if not target.exists():
        return False
    problem = _problem(target, kind, key, inputs)
    if problem is not None and warn:
        logger.warning("cache entry %s is damaged (%s); building it again", target, problem)
    return problem is None


def _problem(target: Path, kind: str, key: str, inputs: Mapping[str, Any]) -> str | None:
    try:
        record = json.loads((target / ENTRY_FILE).read_text())
    except FileNotFoundError:
        return f"no {ENTRY_FILE}"
    except (OSError, ValueError) as error:
        return f"{ENTRY_FILE} unreadable: {error}"
    if not isinstance(record, dict):
        return f"{ENTRY_FILE} is not a JSON object"
    record = cast(dict[str, Any], record)
    if (record.get("format"), record.get("kind"), record.get("key")) != (_FORMAT, kind, key):
        return f"{ENTRY_FILE} names another format, kind or key"
    if record.get("inputs") != inputs or key_of(inputs) != key:
        return "its recorded inputs are not its key's"
    files = record.get("files")
    if not isinstance(files, dict):
        return f"{ENTRY_FILE} lists no files"
    expected = cast(dict[str, dict[str, Any]], files)
    present = {path.relative_to(target).as_posix(): path for path in _files(target)}
    if missing := sorted(set(expected) - set(present)):
        return f"{missing[0]} is missing"
    if extra := sorted(set(present) - set(expected)):
        return f"{extra[0]} was not part of it"
    for name, path in present.items():
        if path.stat().st_size != expected[name].get("size"):
            return f"{name} has another size"
    for name, path in present.items():
        if file_digest(path) != expected[name].get("blake3"):
            return f"{name} has another BLAKE3 digest"
    return None


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Generator[None]:
    """Serialise builds of one entry across processes (released by the kernel if the holder dies)."""
    with open(lock_path, "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)
