"""`/generate` and `/abort_request` over the built-in engine: parse a `GenerateReqInput`, admit it through the
gate, submit it to the scheduler, and render the answer (one JSON body, or server-sent events).

Tokens come back through each request's `on_update` callback on the scheduler thread, forwarded to the loop
with `call_soon_threadsafe`. A client that goes away (streaming or not) has its unfinished requests aborted.

The steps every generation takes whatever its transport are in `calls.py` (`grpc_service` takes them too).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from aiohttp import web
from pydantic import BaseModel

from asyncrl_engine._http import Json, error_response, read_model, semantic_error
from asyncrl_engine.calls import (
    Call,
    Limits,
    QueueFullError,
    Update,
    abort_at_gate,
    abort_unfinished,
    add_requests,
    check_prompt,
    check_unique,
    error_abort,
    forwarder,
    prompt_requests,
)
from asyncrl_engine.engine import Engine
from asyncrl_engine.gate import AdmissionGate, Ticket
from asyncrl_engine.options import RequestError, SamplingOptions
from asyncrl_engine.request import Request
from asyncrl_sglang.wire import (
    AbortRequest,
    ErrorBody,
    ErrorDetail,
    GenerateRequest,
    GenerateResponse,
    SamplingParamsBody,
)

DISCONNECT_POLL_S = 0.5
"""How often a call that waits for tokens checks whether its client has gone when no update arrives (it also
checks at every update)."""
logger = logging.getLogger(__name__)


class Tokenizer(Protocol):
    """The two calls the server makes of a HuggingFace tokenizer."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass(slots=True)
class _Output:
    """How to render a request's response."""

    return_text_in_logprobs: bool
    return_prompt_token_ids: bool
    started_s: float


class GenerateRoutes:
    """`/generate` and `/abort_request`; `gate` is shared with the pause and weight-update routes."""

    def __init__(
        self, engine: Engine, tokenizer: Tokenizer | None, gate: AdmissionGate, limits: Limits | None = None
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.gate = gate
        self.limits = limits or Limits()
        self._live: dict[str, Call] = {}

    async def _engine(self, fn: Callable[[], Any], *, drain: bool = True) -> Any:
        return await asyncio.wrap_future(self.engine.call_async(fn, drain=drain))

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await read_model(request, GenerateRequest, required=True)
        try:
            # Tokenising a long text and compiling many stop strings take seconds: off the event loop, so
            # that /health and every other call keep answering. The rid check reads loop-side state.
            requests, output, is_list = await asyncio.to_thread(self._parse_generate, body)
            check_unique(requests, self._live)
        except RequestError as error:
            if body.stream:
                return await self._stream_error(request, str(error))
            return semantic_error(str(error))
        submission = Call(requests, Ticket(len(requests)))
        for engine_request in requests:
            self._live[engine_request.rid] = submission
        try:
            async with self.gate.admitted(submission.ticket) as admitted:
                if not admitted:
                    return await self._respond_aborted_at_gate(
                        request, submission, output, is_list, body.stream
                    )
                loop = asyncio.get_running_loop()
                for index, engine_request in enumerate(requests):
                    engine_request.on_update = forwarder(
                        loop, submission.queue, index, every_token=body.stream
                    )
                try:
                    # Queuing touches nothing a launched decode step reads: no need to wait for it.
                    await self._engine(lambda: add_requests(self.engine, requests, self.limits), drain=False)
                except QueueFullError as error:
                    if body.stream:
                        return await self._stream_error(request, str(error), 503)
                    return error_response(str(error), 503, "503")  # SGLang's abort with status 503
                except RequestError as error:
                    if body.stream:
                        return await self._stream_error(request, str(error))
                    return semantic_error(str(error))
                if body.stream:
                    return await self._stream(request, submission, output, is_list)
                return await self._wait_all(request, submission, output, is_list)
        except ConnectionError:
            # The client went away: nothing can be sent, and its requests must not keep decoding.
            abort_unfinished(self.engine, requests)
            logger.info("client of %s disconnected: aborted", ", ".join(r.rid for r in requests[:4]))
            return web.Response(status=499)
        except asyncio.CancelledError:
            abort_unfinished(self.engine, requests)
            raise
        finally:
            for engine_request in requests:
                self._live.pop(engine_request.rid, None)

    def _parse_generate(self, body: GenerateRequest) -> tuple[list[Request], _Output, bool]:
        """Turn a validated `GenerateReqInput` into engine requests; returns them, the render options and
        whether the response is a list (batch input or n > 1). Values the engine refuses: `RequestError`.
        Runs in a worker thread: it reads nothing the event loop changes (`check_unique` is the caller's)."""
        unsupported = body.unsupported_inputs()
        if unsupported:
            raise RequestError(f"`{unsupported[0]}` is not supported by the built-in engine")
        if body.return_hidden_states not in (False, []):
            raise RequestError("return_hidden_states needs a server flag the built-in engine does not have")
        prompts, is_batch = self._prompts(body)
        count = len(prompts)
        vocab = self.engine.model.config.vocab_size
        params = _per_item(body.sampling_params, SamplingParamsBody(), count, "sampling_params")
        options = [SamplingOptions.from_wire(p, vocab) for p in params]
        return_logprob = _per_item(body.return_logprob, False, count, "return_logprob")
        start_len = _per_item(body.logprob_start_len, -1, count, "logprob_start_len")
        top_num = _per_item(body.top_logprobs_num, 0, count, "top_logprobs_num")
        rids = self._rids(body.rid, count, is_batch)
        self.limits.check_call([o.n for o in options])
        output = _Output(
            return_text_in_logprobs=body.return_text_in_logprobs,
            return_prompt_token_ids=body.return_prompt_token_ids,
            started_s=time.monotonic(),
        )
        requests: list[Request] = []
        for index, prompt in enumerate(prompts):
            if options[index].stop and self.tokenizer is None:
                raise RequestError("stop strings need a tokenizer; this server runs without one")
            requests += prompt_requests(
                self.engine,
                prompt,
                options[index],
                rid=rids[index],
                return_logprob=return_logprob[index],
                logprob_start_len=start_len[index],
                top_logprobs_num=top_num[index],
                stream=body.stream,
            )
        return requests, output, is_batch or len(requests) > 1

    def _prompts(self, body: GenerateRequest) -> tuple[list[list[int]], bool]:
        vocab = self.engine.model.config.vocab_size
        if body.input_ids is not None:
            ids = body.input_ids
            is_batch = bool(ids) and isinstance(ids[0], list)
            prompts = _nested(ids) or [[]]
            for prompt in prompts:
                check_prompt(prompt, vocab)
            return prompts, is_batch
        if body.text is not None:
            is_batch = isinstance(body.text, list)
            texts = body.text if isinstance(body.text, list) else [body.text]
            if not texts:
                raise RequestError("text is an empty list: a batch needs at least one prompt")
            if self.tokenizer is None:
                raise RequestError(
                    "text input needs a tokenizer; this server runs without one: send input_ids"
                )
            prompts = [self.tokenizer.encode(t) for t in texts]
            if any(not p for p in prompts):
                raise RequestError("The prompt text encodes to no tokens")
            return prompts, is_batch
        raise RequestError("Either text, input_ids or input_embeds should be provided.")

    @staticmethod
    def _rids(rid: str | list[str] | None, count: int, is_batch: bool) -> list[str]:
        if rid is None:
            return [uuid.uuid4().hex for _ in range(count)]
        if isinstance(rid, str):
            return [rid] if not is_batch else [f"{rid}_{i}" for i in range(count)]
        if len(rid) != count:
            raise RequestError(f"rid has {len(rid)} entries for a batch of {count}")
        return list(rid)

    async def _next_update(self, http: web.Request, submission: Call) -> Update:
        """The next update of the submission's requests; `ConnectionResetError` once the client is gone
        (checked at every update, and every `DISCONNECT_POLL_S` while nothing arrives: a call whose samples
        keep finishing notices as soon as one that waits alone)."""
        while True:
            try:
                update = await asyncio.wait_for(submission.queue.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                update = None
            if http.transport is None or http.transport.is_closing():
                raise ConnectionResetError("the client disconnected")
            if update is not None:
                return update

    async def _wait_all(
        self, http: web.Request, submission: Call, output: _Output, is_list: bool
    ) -> web.Response:
        finished: set[int] = set()
        while len(finished) < len(submission.requests):
            index, _, done = await self._next_update(http, submission)
            if done:
                finished.add(index)
        failed = error_abort(submission.requests)
        if failed is not None:
            status, message = failed
            return error_response(message, status, str(status))
        bodies = [self._render(r, len(r.output_ids), True, output) for r in submission.requests]
        if not is_list:
            reason = submission.requests[0].finish_reason or {}
            if reason.get("type") == "abort" and reason.get("status_code") == 400:
                return semantic_error(str(reason.get("message")))
        return _json_response(bodies, is_list)

    async def _stream(
        self, http: web.Request, submission: Call, output: _Output, is_list: bool
    ) -> web.StreamResponse:
        response = await _start_stream(http)
        requests = submission.requests
        finished: set[int] = set()
        sent: dict[int, int] = {}
        while len(finished) < len(requests):
            items = [await self._next_update(http, submission)]
            while not submission.queue.empty():
                items.append(submission.queue.get_nowait())
            # Coalesce: per request only the newest count matters (events are cumulative).
            latest: dict[int, tuple[int, bool]] = {}
            for index, length, done in items:
                previous = latest.get(index)
                latest[index] = (
                    max(length, previous[0] if previous else 0),
                    done or bool(previous and previous[1]),
                )
            events: list[GenerateResponse] = []
            for index, (length, done) in sorted(latest.items()):
                engine_request = requests[index]
                if index in finished:
                    continue
                interval = engine_request.options.stream_interval
                if not done and (length == sent.get(index) or length % interval != 0):
                    continue
                events.append(self._render(engine_request, length, done, output, index if is_list else None))
                sent[index] = length
                if done:
                    finished.add(index)
            await _write_events(response, events)
        return await _end_stream(response)

    async def _stream_error(self, http: web.Request, message: str, code: int = 400) -> web.StreamResponse:
        """HTTP 200 and one SSE error event: a refused request (400), or a full queue (503, retryable)."""
        response = await _start_stream(http)
        kind = "invalid_request_error" if code == 400 else "service_unavailable"
        error = ErrorBody(error=ErrorDetail(message=message, type=kind, code=code, retryable=code == 503))
        await _write_events(response, [error])
        return await _end_stream(response)

    async def _respond_aborted_at_gate(
        self, http: web.Request, submission: Call, output: _Output, is_list: bool, stream: bool
    ) -> web.StreamResponse:
        abort_at_gate(self.engine, submission.requests)
        bodies = [
            self._render(r, 0, True, output, index if is_list and stream else None)
            for index, r in enumerate(submission.requests)
        ]
        if not stream:
            return _json_response(bodies, is_list)
        response = await _start_stream(http)
        await _write_events(response, bodies)
        return await _end_stream(response)

    def _render(
        self, request: Request, length: int, finished: bool, output: _Output, index: int | None = None
    ) -> GenerateResponse:
        """The `/generate` response object for the first `length` output tokens of `request`."""
        output_ids = request.output_ids[:length]
        reason = request.finish_reason if finished else None
        meta: Json = {"id": request.rid, "finish_reason": reason}
        if request.was_running or not finished or reason is None or reason.get("type") != "abort":
            meta["prompt_tokens"] = len(request.prompt_ids)
            meta["reasoning_tokens"] = 0
            meta["cached_tokens"] = request.cached_tokens
            meta["num_retractions"] = request.num_retractions
        meta["completion_tokens"] = length
        spans = request.weight_versions(length)
        meta["weight_version"] = spans[-1]["version"] if finished else request.version_marks[-1][0]
        if finished:
            meta["weight_versions"] = spans
            meta["e2e_latency"] = time.monotonic() - output.started_s
            meta["response_sent_to_client_ts"] = time.time()
        if request.return_logprob:
            text_of = self._token_text if output.return_text_in_logprobs else _no_text
            meta["input_token_logprobs"] = [
                (lp, token, text_of(token))
                for lp, token in zip(
                    request.input_logprobs,
                    request.prompt_ids[len(request.prompt_ids) - len(request.input_logprobs) :],
                    strict=True,
                )
            ]
            output_logprobs = [
                (lp, token, text_of(token))
                for lp, token in zip(request.output_logprobs[:length], output_ids, strict=False)
            ]
            meta["output_token_logprobs"] = output_logprobs
            meta["output_token_logprobs_length"] = len(output_logprobs)
            if request.top_logprobs_num > 0:
                meta["input_top_logprobs"] = [
                    None if top is None else [(lp, t, text_of(t)) for lp, t in top]
                    for top in request.input_top_logprobs
                ]
                meta["output_top_logprobs"] = [
                    [(lp, t, text_of(t)) for lp, t in top] for top in request.output_top_logprobs[:length]
                ]
        body: Json = {}
        if self.tokenizer is not None:
            body["text"] = self._text(request, output_ids, reason)
        body["output_ids"] = output_ids
        if output.return_prompt_token_ids:
            body["prompt_token_ids"] = request.prompt_ids
        body["meta_info"] = meta
        if index is not None:
            body["index"] = index
        return GenerateResponse.model_validate(body, strict=False)

    def _text(self, request: Request, output_ids: list[int], reason: Json | None) -> str:
        assert self.tokenizer is not None
        options = request.options
        matched = reason.get("matched") if reason is not None and reason.get("type") == "stop" else None
        if isinstance(matched, int) and not options.no_stop_trim and output_ids:
            output_ids = output_ids[:-1]
        text = self.tokenizer.decode(output_ids, skip_special_tokens=options.skip_special_tokens)
        if isinstance(matched, str) and not options.no_stop_trim:
            index = text.find(matched)
            if index >= 0:
                text = text[:index]
        return text

    def _token_text(self, token: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token], skip_special_tokens=False)

    # ------------------------------------------------------------------------------------------ abort
    async def abort_request(self, request: web.Request) -> web.Response:
        body = await read_model(request, AbortRequest, required=False)
        rid, abort_all = body.rid, body.abort_all
        if abort_all:
            await self._engine(self.engine.abort_all)
            await self._abort_gated(None)
        elif rid:
            if rid in self._live:
                await self._engine(lambda: self.engine.abort(rid))
                await self._abort_gated(rid)
        else:
            logger.warning("abort_request with an empty rid and abort_all=false: ignored")
        return web.Response(status=200)

    async def _abort_gated(self, rid: str | None) -> None:
        """Abort requests still blocked at the gate (all of them, or the submission holding `rid`)."""
        await self.gate.abort_waiting(
            [
                submission.ticket
                for key, submission in self._live.items()
                if (rid is None or key == rid)
                and not any(r.was_running or r.finished for r in submission.requests)
            ]
        )


def _no_text(token: int) -> None:
    return None


def _json_response(bodies: list[GenerateResponse], is_list: bool) -> web.Response:
    if is_list:
        text = "[" + ",".join(b.model_dump_json(exclude_unset=True) for b in bodies) + "]"
    else:
        text = bodies[0].model_dump_json(exclude_unset=True)
    return web.Response(text=text, content_type="application/json")


async def _start_stream(http: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(
        status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(http)
    return response


async def _write_events(response: web.StreamResponse, events: Sequence[BaseModel]) -> None:
    """Server-sent events, one `data: {json}` each."""
    if events:
        await response.write(
            b"".join(b"data: " + e.model_dump_json(exclude_unset=True).encode() + b"\n\n" for e in events)
        )


async def _end_stream(response: web.StreamResponse) -> web.StreamResponse:
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


_T = TypeVar("_T")


def _per_item(value: _T | list[_T] | None, default: _T, count: int, name: str) -> list[_T]:
    """A per-prompt value: one value for all prompts, or a list of `count` (for batches)."""
    if value is None:
        return [default] * count
    if isinstance(value, list):
        if len(value) != count:
            raise RequestError(f"{name} has {len(value)} entries for a batch of {count}")
        return value
    return [value] * count


def _nested(ids: list[int] | list[list[int]]) -> list[list[int]]:
    """The prompts of `input_ids`: a flat list is one prompt, a nested one a batch."""
    if ids and isinstance(ids[0], list):
        return [list(prompt) for prompt in ids if isinstance(prompt, list)]
    return [[token for token in ids if isinstance(token, int)]]
