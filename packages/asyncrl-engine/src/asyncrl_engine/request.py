"""One request as the engine holds it (`Request`), the table of the live ones (`RequestTable`), and how the
engine ends a request it cannot serve.

Torch-free, like the scheduler that reads the table (`scheduler.py`): a request's state is plain Python,
mutated only by the engine's scheduler thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from asyncrl_engine.snapshot import WaitingQueue

if TYPE_CHECKING:
    import torch

    from asyncrl_engine.options import SamplingOptions

SHUTTING_DOWN = "The server is shutting down."
"""The message of every request the engine answers because it stops (and of calls it refuses then)."""


class EngineStoppedError(RuntimeError):
    """The engine has stopped (its server is shutting down): a call made now never runs."""


def shutdown_reason() -> dict[str, Any]:
    """The finish reason of a request cut off because the engine stops: an abort with status 503, as SGLang
    marks a request it cannot serve now (`FINISH_ABORT(message, HTTPStatus.SERVICE_UNAVAILABLE)`), which its
    server answers as a 503 rather than a partial output, so that a client sends the request again (to
    another engine, or to this one restarted) instead of taking the cut-off output as the model's end. A user
    abort (`abort_request`, a pause in abort mode) has status null and answers its partial output (200)."""
    return {"type": "abort", "message": SHUTTING_DOWN, "status_code": 503, "err_type": None}


INTERNAL_ERROR = 500
"""The status of a request the engine finishes because it failed on its own (`Batch.recover`, a callback that
raises), as SGLang marks an internal error (`FINISH_ABORT(message, HTTPStatus.INTERNAL_SERVER_ERROR)`): its
server answers it as an error, never with the partial output, which the model did not end."""


class EngineBusyError(RuntimeError):
    """A control operation that needs an idle engine was called while requests are held or running."""


@dataclass(slots=True, eq=False)
class Request:
    """One sequence being generated. Mutated only by the scheduler thread; lists only ever grow. Compared by
    identity (finding one among the running requests compares no fields)."""

    rid: str
    prompt_ids: list[int]
    options: SamplingOptions
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    on_update: Callable[[Request, bool], None] | None = None
    """Called on the scheduler thread after each new token (finished=False) and once at the end (True)."""
    stream: bool = False
    output_ids: list[int] = field(default_factory=lambda: list[int]())
    output_logprobs: list[float] = field(default_factory=lambda: list[float]())
    output_top_logprobs: list[list[tuple[float, int]]] = field(
        default_factory=lambda: list[list[tuple[float, int]]]()
    )
    input_logprobs: list[float | None] = field(default_factory=lambda: list[float | None]())
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(
        default_factory=lambda: list[list[tuple[float, int]] | None]()
    )
    version_marks: list[tuple[str, int]] = field(default_factory=lambda: list[tuple[str, int]]())
    """(version, first output position under it); the spans of `weight_versions`."""
    num_retractions: int = 0
    finish_reason: dict[str, Any] | None = None
    was_running: bool = False
    """False while it never left the waiting queue (then an abort response carries no `prompt_tokens`)."""
    created_s: float = field(default_factory=time.monotonic)
    generator: torch.Generator | None = None
    stop_prefix_offset: int = 0
    """Stop strings: the output position the incremental decode starts from (before `stop_read_offset`, so
    that the tokenizer sees the context a word's leading space depends on)."""
    stop_read_offset: int = 0
    """Stop strings: output tokens whose text has been matched against."""
    stop_tail: str = ""
    """Stop strings: the end of the matched text that a stop string completed by a later token can start in
    (the longest stop string's length minus one)."""
    cached_tokens: int = 0
    """Tokens whose KV came from the prefix cache instead of a prefill (summed over re-prefills)."""
    kv_weights_epoch: int = -1
    """The engine's `weights_epoch` when this request's KV was (re)computed at its last prefill."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def weight_versions(self, length: int | None = None) -> list[dict[str, Any]]:
        """Half-open spans over the first `length` output positions (all by default), empty ones dropped."""
        end_all = len(self.output_ids) if length is None else length
        spans: list[dict[str, Any]] = []
        for index, (version, start) in enumerate(self.version_marks):
            end = self.version_marks[index + 1][1] if index + 1 < len(self.version_marks) else end_all
            start, end = min(start, end_all), min(end, end_all)
            if end > start:
                spans.append({"version": version, "start": start, "end": end})
        if not spans:
            # Finished before its first token: one empty span under the last version.
            spans.append({"version": self.version_marks[-1][0], "start": 0, "end": 0})
        return spans

    def relabel(self, version: str) -> None:
        """Record that the weights are now labelled `version`: a boundary at the current output length."""
        position = len(self.output_ids)
        last_version, last_start = self.version_marks[-1]
        if last_start == position:
            self.version_marks[-1] = (version, position)
        elif last_version != version:
            self.version_marks.append((version, position))
        # Merge back if a relabel returned to the previous span's version with no token in between.
        if len(self.version_marks) >= 2 and self.version_marks[-2][0] == self.version_marks[-1][0]:
            self.version_marks.pop()


class RequestTable:
    """Where every live request is, in exactly one place: the running batch (`running`, row i in KV slot
    i), the waiting queue (`waiting`, FIFO), or the one request being prefilled in chunks (`chunked`, in the
    last slot, `chunk_slot`); and each by its rid. Mutated only by the engine's scheduler thread."""

    def __init__(self, max_running_requests: int) -> None:
        self.running: list[Request] = []
        self.waiting: WaitingQueue[Request] = WaitingQueue()
        self.by_rid: dict[str, Request] = {}
        """Live (queued, running or chunked) requests by rid."""
        self.chunked: Request | None = None
        """The request being prefilled in chunks, its KV in `chunk_slot`."""
        self.chunk_slot = max_running_requests - 1
        self.chunk_prefilled = 0
        """Positions of `chunked`'s KV in `chunk_slot` (its prefix-cache hit included)."""
        self.chunk_next = 0
        """Tokens of `chunked`'s chunk this step (set by the scheduler's `take_admitted`, 0: none)."""

    def add(self, request: Request) -> None:
        """Queue a request (FIFO) and make it findable by its rid."""
        self.by_rid[request.rid] = request
        self.waiting.append(request)

    def find(self, rid: str) -> Request | None:
        return self.by_rid.get(rid)

    def chunked_list(self) -> list[Request]:
        return [] if self.chunked is None else [self.chunked]

    def live(self) -> list[Request]:
        """Every live request: running (in slot order), chunked, then waiting (in queue order)."""
        return [*self.running, *self.chunked_list(), *self.waiting]

    def has_requests(self) -> bool:
        return bool(self.running or self.waiting or self.chunked is not None)

    def is_idle(self) -> bool:
        return not self.running and not self.waiting and self.chunked is None

    def forget(self, request: Request) -> None:
        """Drop a request that ends from the rid index (the caller takes it out of where it is)."""
        if self.by_rid.get(request.rid) is request:
            del self.by_rid[request.rid]

    def place(self, requests: Sequence[Request], slots: Sequence[int]) -> None:
        """Put prefilled requests into the batch: a slot below the batch size takes over a finished row, the
        next ones extend the batch in order."""
        for slot, request in zip(slots, requests, strict=True):
            if slot < len(self.running):
                self.running[slot] = request
            else:
                self.running.append(request)

    def remove_slot(self, slot: int) -> None:
        """Remove the running request in `slot`: the last running request takes its place (the caller moves
        its KV first)."""
        self.running[slot] = self.running[-1]
        self.running.pop()

    def relabel(self, version: str) -> None:
        """The weights are now labelled `version`: every live request records a boundary."""
        for request in self.live():
            request.relabel(version)
