"""Checkpoints of a whole run, written atomically, checked without loading weights, and resumed.

A checkpoint is the folder `<run_dir>/checkpoints/step_<n>/`, taken after step `n`:

- `actor/`: the actor's own checkpoint (weights, optimiser, version, and each rank's random generators).
- `buffer_core.bin`: the buffer core's snapshot (limits, counters, in-flight and buffered groups' ids and
  versions; versioned and checksummed by the core), and `buffer_groups.json`, the buffered groups' payloads.
- `ledger.json`: the prompt ledger (`asyncrl_core.runner.ledger`), as the run folder's `ledger.json`.
- `runner_state.json`: the step, the weight version, the dataloader's position and queues, and what the
  run must match to resume from it: the dataset (size and fingerprint), the seeds, the shuffle, the task.
- `manifest.json`: the size and BLAKE3 digest of every other file, written last.

Everything is written into a temporary folder next to it (`.step_<n>.tmp`); each file is flushed to disk,
then the folder is renamed into place, so the previous checkpoint stays usable until the new one is complete
and a folder named `step_<n>` is always whole. `verify_checkpoint` checks a folder against its manifest
(sizes and checksums, nothing loaded); `resume_from: latest` takes the newest checkpoint that passes it,
warning about each damaged one it skips.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from asyncrl_core.buffer import BufferSnapshot
from asyncrl_core.cache import file_digest
from asyncrl_core.runner.atomic import TEMPORARY_SUFFIX, atomic_write_bytes, fsync_dir
from asyncrl_core.runner.dataloader import LoaderState
from asyncrl_core.runner.workers import BufferState, RunnerError
from asyncrl_core.types import Group, Trajectory

if TYPE_CHECKING:
    from asyncrl_core.config import AsyncRLConfig
    from asyncrl_core.types import TaskSample

logger = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "step_"
CHECKPOINT_FORMAT = "asyncrl-checkpoint-1"
ACTOR_DIR = "actor"
RUNNER_STATE_FILE = "runner_state.json"
BUFFER_CORE_FILE = "buffer_core.bin"
BUFFER_GROUPS_FILE = "buffer_groups.json"
LEDGER_STATE_FILE = "ledger.json"
MANIFEST_FILE = "manifest.json"


def _json_bytes(data: Any) -> bytes:
    return (json.dumps(data, indent=1) + "\n").encode()


# --- manifest -----------------------------------------------------------------------------------------------


HASH = "blake3"
"""The manifest's digest of each file: BLAKE3 (PyPI's `blake3`, the Rust crate's bindings), 2.4x less CPU
than SHA-256 on one core here, and one file is hashed on several cores (benchmarks/README.md)."""
LEGACY_HASH = "sha256"
"""The digest of manifests written before BLAKE3; `verify_checkpoint` still checks them."""
_HASH_NAMES = {HASH: "BLAKE3", LEGACY_HASH: "SHA-256"}


def _digest(path: Path, algorithm: str = HASH) -> str:
    if algorithm == LEGACY_HASH:
        with open(path, "rb") as file:
            return hashlib.file_digest(file, LEGACY_HASH).hexdigest()
    return file_digest(path)


HASH_THREADS = min(8, os.cpu_count() or 1)
"""Files hashed at once: the hash releases the GIL, so a checkpoint of several files (model shards,
optimizer state, one per rank) is read and hashed on several cores."""


def _digests(paths: Sequence[Path], algorithms: Sequence[str] | None = None) -> list[str]:
    """`_digest` of each of `paths` (with its algorithm, BLAKE3 by default), in order, several at a time."""
    algorithms = list(algorithms) if algorithms is not None else [HASH] * len(paths)
    if len(paths) <= 1:
        return [_digest(path, algorithm) for path, algorithm in zip(paths, algorithms, strict=True)]
    with ThreadPoolExecutor(max_workers=HASH_THREADS, thread_name_prefix="checkpoint-hash") as pool:
        return list(pool.map(_digest, paths, algorithms))


def write_manifest(folder: Path) -> dict[str, Any]:
    """Flush every file under `folder` to disk and write `manifest.json`: each file's size and BLAKE3."""
    paths = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)
    for path in paths:
        with open(path, "rb") as file:
            os.fsync(file.fileno())
    files = {
        path.relative_to(folder).as_posix(): {"size": path.stat().st_size, HASH: digest}
        for path, digest in zip(paths, _digests(paths), strict=True)
    }
    for sub in sorted({p.parent for p in folder.rglob("*")} | {folder}):
        fsync_dir(sub)
    manifest = {"format": CHECKPOINT_FORMAT, "files": files}
    atomic_write_bytes(folder / MANIFEST_FILE, _json_bytes(manifest))
    return manifest


def verify_checkpoint(folder: Path | str) -> list[str]:
    """The problems of the checkpoint `folder`, empty when it is intact: a missing or unreadable manifest,
    a file listed there that is missing, of another size or another digest (BLAKE3, or SHA-256 in a
    manifest written before BLAKE3). Reads the files' bytes, loads no weights."""
    folder = Path(folder)
    path = folder / MANIFEST_FILE
    if not folder.is_dir():
        return [f"{folder} is not a folder"]
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        files = cast("dict[str, dict[str, Any]]", manifest["files"])
        if manifest.get("format") != CHECKPOINT_FORMAT:
            return [f"{path}: not an {CHECKPOINT_FORMAT} manifest"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        return [f"{path}: cannot read the manifest: {error}"]
    problems: list[str] = []
    if RUNNER_STATE_FILE not in files:
        problems.append(f"{path}: lists no {RUNNER_STATE_FILE}")
    to_hash: list[tuple[Path, str, object]] = []
    for name, expected in files.items():
        file = folder / name
        try:
            size = file.stat().st_size
        except OSError:
            problems.append(f"{file}: missing")
            continue
        if size != expected.get("size"):
            problems.append(f"{file}: {size} bytes, the manifest says {expected.get('size')}")
        else:
            algorithm = HASH if HASH in expected or LEGACY_HASH not in expected else LEGACY_HASH
            to_hash.append((file, algorithm, expected.get(algorithm)))
    digests = _digests([file for file, _, _ in to_hash], [algorithm for _, algorithm, _ in to_hash])
    for (file, algorithm, expected_digest), digest in zip(to_hash, digests, strict=True):
        if digest != expected_digest:
            problems.append(f"{file}: its {_HASH_NAMES[algorithm]} differs from the manifest's")
    return problems


# --- finding checkpoints ------------------------------------------------------------------------------------


def _step_of(path: Path) -> int | None:
    name = path.name
    if not name.startswith(CHECKPOINT_PREFIX) or not name[len(CHECKPOINT_PREFIX) :].isdigit():
        return None
    return int(name[len(CHECKPOINT_PREFIX) :])


def checkpoints(run_dir: Path) -> list[Path]:
    """The checkpoint folders under `<run_dir>/checkpoints` (complete by construction), oldest first."""
    folder = Path(run_dir) / "checkpoints"
    if not folder.is_dir():
        return []
    found = [(step, path) for path in folder.iterdir() if (step := _step_of(path)) is not None]
    return [path for _, path in sorted(found)]


def resolve_resume(run_dir: Path, resume_from: str) -> Path:
    """The checkpoint `checkpoint.resume_from` names: a folder, which must be intact, or `latest`, the
    newest intact one under the run folder; each damaged one passed over is named in a warning (on the log
    and in `warnings.log`)."""
    if resume_from != "latest":
        folder = Path(resume_from)
        problems = verify_checkpoint(folder)
        if problems:
            raise RunnerError(f"checkpoint.resume_from: {folder} is damaged: " + "; ".join(problems))
        return folder
    found = checkpoints(run_dir)
    if not found:
        raise RunnerError(
            f"checkpoint.resume_from is `latest` but {Path(run_dir) / 'checkpoints'} holds no checkpoint"
        )
    for folder in reversed(found):
        problems = verify_checkpoint(folder)
        if not problems:
            return folder
        message = f"checkpoint {folder} is damaged, passed over: " + "; ".join(problems)
        logger.warning("%s", message)
        with open(Path(run_dir) / "warnings.log", "a", encoding="utf-8") as log:
            log.write(f"resume: {message}\n")
    raise RunnerError(f"checkpoint.resume_from is `latest` but no checkpoint under {run_dir} is intact")


def read_runner_state(folder: Path) -> dict[str, Any]:
    path = Path(folder) / RUNNER_STATE_FILE
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise RunnerError(f"checkpoint.resume_from: cannot read {path}: {error}") from error
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:  # pyright: ignore[reportUnknownMemberType]
        raise RunnerError(f"checkpoint.resume_from: {path} does not hold an {CHECKPOINT_FORMAT} runner state")
    return cast("dict[str, Any]", state)


def checkpoint_step(folder: Path) -> int:
    """The step a checkpoint was taken after."""
    return int(read_runner_state(folder)["step"])


# --- what a checkpoint must match ---------------------------------------------------------------------------


def dataset_fingerprint(samples: Sequence[TaskSample]) -> str:
    """SHA-256 over the samples' ids, messages and answers, in order."""
    digest = hashlib.sha256()
    for sample in samples:
        record = [sample.sample_id, [[m.role, m.content] for m in sample.messages], list(sample.answers)]
        digest.update(json.dumps(record, ensure_ascii=False).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def run_identity(config: AsyncRLConfig, dataset_size: int, fingerprint: str) -> dict[str, Any]:
    """What a resumed run must share with its checkpoint: dataset, seeds, shuffle and task."""
    return {
        "task_name": config.agentloop.task_name,
        "dataset_size": dataset_size,
        "dataset_fingerprint": fingerprint,
        "runner.seed": config.runner.seed,
        "data.seed": config.data.seed,
        "data.shuffle": config.data.shuffle,
    }


def identity_problems(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Each way the run differs from the checkpoint's, named by its key."""
    return [
        f"{key}: the checkpoint's is {saved.get(key)!r}, this run's {value!r}"
        for key, value in current.items()
        if saved.get(key) != value
    ]


def check_resumable(folder: Path, identity: Mapping[str, Any]) -> dict[str, Any]:
    """The checkpoint's runner state, after checking that it belongs to a run of this `identity`
    (`run_identity`); raises `RunnerError` naming every difference otherwise."""
    state = read_runner_state(folder)
    problems = identity_problems(state.get("identity", {}), identity)
    if problems:
        raise RunnerError(
            f"checkpoint.resume_from: {folder} belongs to another run (" + "; ".join(problems) + "); "
            "resume with the same dataset, seeds and task, or start a new run folder"
        )
    return state


# --- buffer state as files ----------------------------------------------------------------------------------


def _group_to_json(group: Group) -> dict[str, Any]:
    return asdict(group)


def _group_from_json(data: Mapping[str, Any]) -> Group:
    fields: dict[str, Any] = dict(data)
    fields["trajectories"] = [Trajectory(**t) for t in cast("list[dict[str, Any]]", data["trajectories"])]
    return Group(**fields)


def write_buffer_state(folder: Path, state: BufferState) -> None:
    (folder / BUFFER_CORE_FILE).write_bytes(state.snapshot.core_state)
    groups = [_group_to_json(group) for _, group in sorted(state.snapshot.groups.items())]
    (folder / BUFFER_GROUPS_FILE).write_bytes(_json_bytes(groups))
    (folder / LEDGER_STATE_FILE).write_bytes(_json_bytes(state.ledger))


def read_buffer_state(folder: Path, loader: Mapping[str, Any]) -> BufferState:
    try:
        core_state = (folder / BUFFER_CORE_FILE).read_bytes()
        groups = [_group_from_json(g) for g in json.loads((folder / BUFFER_GROUPS_FILE).read_text("utf-8"))]
        ledger = json.loads((folder / LEDGER_STATE_FILE).read_text("utf-8"))
        restored = LoaderState(
            int(loader["epoch"]),
            int(loader["position"]),
            _tickets(loader["returned"]),
            _tickets(loader["next_returned"]),
            _tickets(loader["first"]),
        )
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise RunnerError(f"cannot read the buffer state of the checkpoint {folder}: {error!r}") from error
    snapshot = BufferSnapshot(core_state, {group.group_id: group for group in groups})
    return BufferState(snapshot, restored, ledger)


def _tickets(items: Iterable[Any]) -> tuple[tuple[int, int], ...]:
    return tuple((int(prompt), int(epoch)) for prompt, epoch in items)


# --- writing and rotating -----------------------------------------------------------------------------------


def temporary_folder(final: Path) -> Path:
    """Where the checkpoint `final` is written before it is renamed into place."""
    return final.with_name(f".{final.name}{TEMPORARY_SUFFIX}")


def folder_of(run_dir: Path, step: int) -> Path:
    """Where the checkpoint after `step` is."""
    return Path(run_dir) / "checkpoints" / f"{CHECKPOINT_PREFIX}{step}"


def begin(run_dir: Path, step: int) -> tuple[Path, Path]:
    """The final and the (fresh, empty) temporary folder of the checkpoint after `step`; temporary
    folders left by an earlier crash are removed."""
    final = folder_of(run_dir, step)
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    for leftover in parent.glob(f".{CHECKPOINT_PREFIX}*{TEMPORARY_SUFFIX}"):
        shutil.rmtree(leftover, ignore_errors=True)
    temporary = temporary_folder(final)
    temporary.mkdir()
    return final, temporary


def free_bytes(folder: Path) -> int:
    """Free bytes on the file system of `folder`."""
    return shutil.disk_usage(folder).free


def space_problem(run_dir: Path) -> str | None:
    """Why the next checkpoint may not fit: less free space where it goes than the last one took (the last
    is deleted only once the next is whole, so the next needs all of it); None when it fits or none exists."""
    saved = checkpoints(run_dir)
    if not saved:
        return None
    needed = sum(path.stat().st_size for path in saved[-1].rglob("*") if path.is_file())
    free = free_bytes(saved[-1].parent)
    if free >= needed:
        return None
    return (
        f"{free / 2**20:.1f} MiB free on the disk of {saved[-1].parent}, less than the last checkpoint "
        f"({saved[-1].name}) took, {needed / 2**20:.1f} MiB: the next one may not be written"
    )


def commit(temporary: Path, final: Path, runner_state: Mapping[str, Any], keep_last: int) -> Path:
    """Write `runner_state.json` and the manifest into `temporary`, flush it, rename it to `final` (a
    damaged folder of that name is moved aside first), then delete all but the newest `keep_last`."""
    (temporary / RUNNER_STATE_FILE).write_bytes(_json_bytes(runner_state))
    write_manifest(temporary)
    if final.exists():
        aside = final.with_name(f".{final.name}.old")
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
        os.replace(temporary, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(temporary, final)
    fsync_dir(final.parent)
    for old in checkpoints(final.parent.parent)[:-keep_last]:
        with contextlib.suppress(OSError):
            shutil.rmtree(old)
    return final
