"""What every worker of a run shares: the error that stops a run, the failures of a group that retrying
cannot mend, and the pinning of a process to its cores."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from asyncrl_core.errors import AsyncRLError, GenerationError, PromptTooLongError

if TYPE_CHECKING:
    pass


class RunnerError(AsyncRLError):
    """A worker of the run failed or did not answer in time; the run stops with this message."""


PERMANENT_ERRORS: tuple[type[AsyncRLError], ...] = (PromptTooLongError, GenerationError)
"""Failures of a group that retrying cannot mend (a prompt too long for `data.max_prompt_len`, a request the
engine refused with a 400 or failed with a 500): the prompt is dropped for good with the error as its reason,
and its group is never trained. Every other
`AsyncRLError` of a group (an engine that died or did not answer) hands the prompt back to be issued again."""


def pin_to_cores(cores: Sequence[int]) -> None:
    """Run this process (and the processes it starts) on `cores` only, with one torch thread per core.

    On a machine without GPUs the placement's ids are CPU cores: pinning makes actor and rollout really run
    side by side instead of competing for every core.
    """
    if not cores:
        return
    available = os.sched_getaffinity(0)
    chosen = {core for core in cores if core in available}
    if not chosen:
        raise RunnerError(
            f"none of the cores {list(cores)} is available to this process ({sorted(available)})"
        )
    # Every thread of the process: `sched_setaffinity(0, ...)` alone moves only the calling thread, and an
    # async Ray actor runs `__init__` beside its event loop's thread, which would stay where it was.
    for thread_id in _thread_ids():
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(thread_id, chosen)
    # torch sizes its thread pool from OMP_NUM_THREADS when it is imported; a process that has imported it
    # already is told directly. Importing torch here only for that would cost the engine and agent-loop
    # workers, which never use it, seconds of their start.
    os.environ["OMP_NUM_THREADS"] = str(len(chosen))
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(len(chosen))


def _thread_ids() -> list[int]:
    """The ids of this process's threads (Linux), or this thread's (0) where `/proc` does not list them."""
    try:
        return [int(name) for name in os.listdir("/proc/self/task")]
    except OSError:
        return [0]
