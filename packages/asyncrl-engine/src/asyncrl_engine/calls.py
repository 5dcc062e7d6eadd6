"""A generation call as both transports run it (`generate` for HTTP, `grpc_service` for gRPC).

The steps every generation takes whatever its transport: `check_prompt`, `Limits.check_call` (n and the
call's size against the server's bounds, before any request exists), `prompt_requests` (a prompt's engine
requests, `n` samples included), `check_unique`, `add_requests` (which refuses a call the waiting queue cannot
take), `forwarder`, `abort_at_gate` and `abort_unfinished`; and how an abort that carries an error status is
answered (`error_abort`).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from asyncrl_engine import DEFAULT_MAX_N, DEFAULT_MAX_QUEUED_REQUESTS
from asyncrl_engine._http import Json
from asyncrl_engine.engine import Engine
from asyncrl_engine.gate import Ticket
from asyncrl_engine.options import RequestError, SamplingOptions, check_fits
from asyncrl_engine.request import Request
from asyncrl_sglang.wire import DUPLICATE_RID

QUEUE_FULL = "The request queue is full."
"""SGLang's message (with status 503) for a request the waiting queue cannot take."""


MAX_TOP_LOGPROB_ENTRIES = 1 << 20
"""The most top logprobs one request's response may hold: `top_logprobs_num` times its logprob positions
(the prompt's from `logprob_start_len`, and every new token). About 30 bytes each in JSON, so a response
stays within some 32 MB; unbounded, a prompt's logprobs over the whole vocabulary made responses of
gigabytes. SGLang bounds only `top_logprobs_num` (by the vocabulary)."""

Update = tuple[int, int, bool]
"""What a request's `on_update` posts to its call's queue: (index in the call, output length, finished)."""


class QueueFullError(RequestError):
    """The waiting queue cannot take the call's requests now (SGLang's 503 "The request queue is full."); a
    later call may fit."""


@dataclass(frozen=True, slots=True)
class Limits:
    """The server's bounds on a generation call, checked before anything is queued (both transports)."""

    max_n: int = DEFAULT_MAX_N
    """The largest `sampling_params.n`."""
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS
    """The most requests waiting at once; a call (its prompts times their `n`) larger than this is refused
    outright, one that does not fit beside those already waiting answers `QueueFullError`."""

    def check_call(self, samples: Sequence[int]) -> None:
        """`RequestError` when an `n` (one per prompt of the call) is above `max_n`, or when the call holds
        more requests than the queue could ever hold; checked before any request object is made."""
        for n in samples:
            if n > self.max_n:
                raise RequestError(
                    f"sampling_params.n must be at most {self.max_n} (the server's --max-n), got {n}"
                )
        total = sum(samples)
        if total > self.max_queued_requests:
            raise RequestError(
                f"The call holds {total} requests (prompts times n), more than the server queues at once "
                f"({self.max_queued_requests}, its --max-queued-requests): split it"
            )


@dataclass(slots=True)
class Call:
    """The engine requests of one generation call (HTTP or gRPC), its place at the gate and the loop-side
    queue of their updates."""

    requests: list[Request]
    ticket: Ticket
    queue: asyncio.Queue[Update] = field(default_factory=lambda: asyncio.Queue[Update]())


ABORTED_AT_GATE = "Abort before admission (blocked at the pause gate)"


def check_prompt(prompt: Sequence[int], vocab_size: int) -> None:
    """`RequestError` for an empty prompt or a token outside the vocabulary."""
    if not prompt:
        raise RequestError("input_ids is empty: a prompt needs at least one token")
    bad = [token for token in prompt if not 0 <= token < vocab_size]
    if bad:
        raise RequestError(f"input_ids {bad[:8]} are outside the vocabulary (size {vocab_size})")


def prompt_requests(
    engine: Engine,
    prompt: Sequence[int],
    options: SamplingOptions,
    *,
    rid: str,
    return_logprob: bool,
    logprob_start_len: int,
    top_logprobs_num: int,
    stream: bool,
) -> list[Request]:
    """The engine requests of one checked prompt: one with `rid`, or for `n > 1` one per sample, each with a
    fresh random rid (as SGLang regenerates them). `RequestError` when it cannot fit the context or asks for
    more top logprobs than the vocabulary has (or a negative number); `Limits.check_call` has checked `n`."""
    check_fits(prompt, options, engine.context_length)
    vocab = engine.model.config.vocab_size
    if return_logprob and not 0 <= top_logprobs_num <= vocab:
        raise RequestError(
            f"top_logprobs_num must be in [0, {vocab}] (the vocabulary size), got {top_logprobs_num}"
        )
    if return_logprob and top_logprobs_num > 0:
        check_top_logprob_entries(
            len(prompt), options, logprob_start_len, top_logprobs_num, engine.context_length
        )
    check_drawable(options, engine.eos_token_ids, vocab)
    rids = [rid] if options.n == 1 else [uuid.uuid4().hex for _ in range(options.n)]
    return [
        Request(
            rid=sample_rid,
            prompt_ids=list(prompt),
            options=options,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len if return_logprob else -1,
            top_logprobs_num=top_logprobs_num if return_logprob else 0,
            stream=stream,
        )
        for sample_rid in rids
    ]


def check_top_logprob_entries(
    prompt_len: int,
    options: SamplingOptions,
    logprob_start_len: int,
    top_logprobs_num: int,
    context_length: int,
) -> None:
    """`RequestError` naming `top_logprobs_num` when the response would hold more than
    `MAX_TOP_LOGPROB_ENTRIES` top logprobs: `top_logprobs_num` times (the prompt positions from
    `logprob_start_len`, when it is >= 0, plus `max_new_tokens`, or the rest of the context when unset)."""
    input_positions = max(0, prompt_len - logprob_start_len) if logprob_start_len >= 0 else 0
    max_new = options.max_new_tokens if options.max_new_tokens is not None else context_length - prompt_len
    entries = top_logprobs_num * (input_positions + max(0, max_new))
    if entries > MAX_TOP_LOGPROB_ENTRIES:
        raise RequestError(
            f"top_logprobs_num {top_logprobs_num} at {input_positions + max_new} positions "
            f"({input_positions} of the prompt from logprob_start_len, up to {max_new} new tokens) would "
            f"return {entries} top logprobs, more than the {MAX_TOP_LOGPROB_ENTRIES} the built-in engine "
            "returns for one request: lower top_logprobs_num, raise logprob_start_len (-1: none of the "
            "prompt) or lower max_new_tokens"
        )


def check_drawable(options: SamplingOptions, eos_token_ids: Collection[int], vocab_size: int) -> None:
    """`RequestError` naming `stop_token_ids` when the ids banned before `min_new_tokens` (the stop ids, and
    EOS unless `ignore_eos`) cover the whole vocabulary: no token could be drawn."""
    if options.min_new_tokens <= 0:
        return
    banned = set(options.stop_token_ids)
    if not options.ignore_eos:
        banned.update(t for t in eos_token_ids if 0 <= t < vocab_size)
    if len(banned) >= vocab_size:
        raise RequestError(
            "sampling_params.stop_token_ids (with EOS unless ignore_eos) cover the whole vocabulary "
            f"({vocab_size} ids), and min_new_tokens {options.min_new_tokens} bans them: nothing can be drawn"
        )


def check_unique(requests: Sequence[Request], live: Collection[str]) -> None:
    """SGLang's duplicate-rid `RequestError` when two requests of a call, or one and a live request, share
    a rid."""
    seen: set[str] = set()
    for request in requests:
        if request.rid in live or request.rid in seen:
            raise RequestError(f"{DUPLICATE_RID} detected: {request.rid}")
        seen.add(request.rid)


def add_requests(engine: Engine, requests: Sequence[Request], limits: Limits) -> None:
    """Queue a call's requests on the scheduler (run it on the engine thread, `Engine.call_async`), all or
    none: nothing is queued when the engine holds one of the rids already (a request of the other transport:
    SGLang's duplicate-rid `RequestError`) or when the waiting queue cannot take them all (`QueueFullError`).
    """
    for request in requests:
        if engine.find(request.rid) is not None:
            raise RequestError(f"{DUPLICATE_RID} detected: {request.rid}")
    if engine.num_waiting + len(requests) > limits.max_queued_requests:
        raise QueueFullError(QUEUE_FULL)
    for request in requests:
        engine.add_request(request)


def forwarder(
    loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[Update], index: int, *, every_token: bool
) -> Callable[[Request, bool], None]:
    """An `on_update` that posts an `Update` to the loop-side queue: on every token for a stream, only when
    finished otherwise."""

    def forward(request: Request, finished: bool) -> None:
        if finished or every_token:
            loop.call_soon_threadsafe(queue.put_nowait, (index, len(request.output_ids), finished))

    return forward


def abort_at_gate(engine: Engine, requests: Sequence[Request]) -> None:
    """Finish requests that a pause in abort mode turned away at the gate: aborted, no token, one empty span
    at the current version."""
    for request in requests:
        request.version_marks = [(engine.weight_version, 0)]
        request.finish_reason = abort_reason(ABORTED_AT_GATE)


def abort_unfinished(engine: Engine, requests: Sequence[Request]) -> None:
    """Abort the call's requests that have not finished (its client went away); returns at once."""
    unfinished = [r.rid for r in requests if not r.finished]
    if unfinished:
        engine.call_async(lambda: [engine.abort(rid) for rid in unfinished])


ERROR_STATUSES = (500, 503)
"""The statuses of an abort that SGLang answers as an error (`_handle_abort_finish_reason`), never with the
partial output: 503, the engine stopped (`request.shutdown_reason`), and 500, the request failed on its own
(`request.INTERNAL_ERROR`)."""


def error_abort(requests: Sequence[Request]) -> tuple[int, str] | None:
    """The status and message of the first of the call's requests that the engine ended with an error (an
    abort carrying a status of `ERROR_STATUSES`), or None. The call is then answered as SGLang answers it: an
    HTTPException of that status (its `ErrorResponse`, `type` the status's digits), gRPC `UNAVAILABLE` for 503
    (the client sends the request again) or `INTERNAL` for 500 (the request failed: the client does not take
    it for an answer). A stream already sent has the abort, status included, in its last event, as SGLang's.
    Either way no client takes the output cut off by the error for the model's end."""
    for request in requests:
        reason = request.finish_reason or {}
        status = reason.get("status_code")
        if reason.get("type") == "abort" and status in ERROR_STATUSES:
            return int(status), str(reason.get("message"))
    return None


def abort_reason(message: str) -> Json:
    """SGLang's `FINISH_ABORT.to_json()` with no status code."""
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}
