"""One run at a time in a run folder: an OS lock on `<run_dir>/.lock`, held from before the folder is
prepared until the run has stopped.

The lock is `flock`'s, so the kernel releases it when its holder dies however it dies (SIGKILL included): a
stale lock file never blocks a resume, and nothing has to clean it up. The file keeps the holder's process
id, which a refused run names. Within one process the lock is re-entrant (`asyncrl-run` takes it before it
prepares the folder, `run` takes it again); the descriptor is not inherited by the processes a run starts
(Python opens files non-inheritable), so the engines and Ray's processes that outlive a killed driver do not
hold it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Generator
from pathlib import Path

from asyncrl_core.errors import AsyncRLError

LOCK_FILE = ".lock"

_held: dict[Path, tuple[int, int]] = {}
"""The run folders this process holds, by resolved path: the lock file's descriptor and how many `locked`
contexts hold it."""


class RunFolderBusy(AsyncRLError):
    """Another process holds the run folder's lock; nothing was changed in the folder."""


@contextlib.contextmanager
def locked(run_dir: Path) -> Generator[None]:
    """Hold `run_dir`'s lock (creating the folder) for the context; raises `RunFolderBusy` at once, naming
    the folder and the holder's process id, when another process holds it."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    key = run_dir.resolve()
    descriptor, depth = _held[key] if key in _held else (_acquire(run_dir), 0)
    _held[key] = (descriptor, depth + 1)
    try:
        yield
    finally:
        if depth == 0:
            del _held[key]
            os.close(descriptor)  # closing the descriptor releases the lock
        else:
            _held[key] = (descriptor, depth)


def _acquire(run_dir: Path) -> int:
    descriptor = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(descriptor, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(descriptor)
        raise RunFolderBusy(
            f"{run_dir} is in use by another run (process {holder}); wait for it to stop, stop it, or choose "
            "another `runner.run_dir`"
        ) from None
    except BaseException:
        os.close(descriptor)
        raise
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)
    return descriptor
