"""SGLang's native HTTP routes over the built-in engine (aiohttp).

The handlers run on the asyncio loop and never touch torch directly: each engine operation goes through
`Engine.call_async` (executed on the scheduler thread between two steps), and tokens come back through
each request's `on_update` callback, forwarded to the loop with `call_soon_threadsafe`.

Admission gate. A `/generate` call registers its rids, then waits at the gate while the server is paused or a
weight update holds the writer side; requests past the gate count as in flight until their HTTP response is
done. A weight update outside a pause closes the gate and waits for the in-flight count to reach zero (the
reader/writer lock of SGLang's tokenizer manager); inside a pause it applies at once.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import datetime
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol

import torch
from aiohttp import web

from asyncrl_sglang.builtin.engine import Engine, EngineBusyError, PauseMode, Request
from asyncrl_sglang.builtin.model import ModelLoadError
from asyncrl_sglang.builtin.sampling import RequestError, SamplingOptions

logger = logging.getLogger(__name__)

Json = dict[str, Any]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SERVER_VERSION = "asyncrl-builtin-0.1.0"
SAFETENSORS_FORMAT = "safetensors"
_PAUSE_MODES: tuple[PauseMode, ...] = ("abort", "retract", "in_place")
_MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
_UNSUPPORTED_INPUTS = (
    "input_embeds",
    "image_data",
    "video_data",
    "audio_data",
    "lora_path",
    "session_params",
    "custom_logit_processor",
    "token_ids_logprob",
)


class Tokenizer(Protocol):
    """The two calls the server makes of a HuggingFace tokenizer."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass(frozen=True, slots=True)
class ServerArgs:
    """The launch arguments; `/server_info` reports them as given."""

    model_path: str
    served_model_name: str
    tokenizer_path: str | None
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    max_running_requests: int = 32
    context_length: int = 2048
    weight_version: str = "default"
    device: str = "cpu"
    dtype: str = "float32"
    enable_metrics: bool = False
    seed: int = 0
    load_format: str = "safetensors"
    weight_version_route: Literal["old", "new"] = "new"
    """`/get_weight_version`: 200 as older SGLang servers answer, or 404 as newer ones do."""
    cuda_graphs: bool = True


class SchemaError(Exception):
    """The body does not have the shape of the route's input: SGLang's ErrorResponse, 400."""


def error_response(message: str, status: int = 400, kind: str = "Bad Request") -> web.Response:
    """SGLang's `ErrorResponse` envelope (schema failures, HTTPExceptions)."""
    body = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    return web.json_response(body, status=status)


def semantic_error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def update_failure(message: str) -> web.Response:
    return web.json_response({"success": False, "message": message}, status=400)


@dataclass(slots=True)
class _Submission:
    """The engine requests of one `/generate` call and the loop-side queue of their updates."""

    requests: list[Request]
    queue: asyncio.Queue[tuple[int, int, bool]] = field(
        default_factory=lambda: asyncio.Queue[tuple[int, int, bool]]()
    )
    aborted_at_gate: bool = False


@dataclass(slots=True)
class _Output:
    """How to render a request's response."""

    return_text_in_logprobs: bool
    return_prompt_token_ids: bool
    started_s: float


MAX_BODY_BYTES = 1 << 36
"""Largest request body accepted (64 GiB). A weight update carries a whole bucket of base64 safetensors, and
SGLang sets no limit on that route; aiohttp's default of 1 MiB would refuse any real model with a 413."""


class BuiltinServer:
    """The HTTP front of one engine. `app` is the aiohttp application; `engine` must already be started."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer | None, args: ServerArgs) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.args = args
        self.ready = False
        self.paused: PauseMode | None = None
        self._writers = 0
        self._in_flight = 0
        self._session_open = False
        self._session_writer = False
        self._live: dict[str, _Submission] = {}
        self._gate = asyncio.Condition()
        self._num_gated = 0
        self._group_name: str | None = None
        self._group: Any = None
        self._group_device = torch.device("cpu")
        self.app = web.Application(
            middlewares=[self._errors_middleware, self._auth_middleware], client_max_size=MAX_BODY_BYTES
        )
        self._add_routes()

    # ---------------------------------------------------------------------------------------------- routing
    def _add_routes(self) -> None:
        r = self.app.router
        r.add_route("POST", "/generate", self.generate)
        r.add_route("PUT", "/generate", self.generate)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        for path, handler in (
            ("/flush_cache", self.flush_cache),
            ("/release_memory_occupation", self.release_memory_occupation),
            ("/resume_memory_occupation", self.resume_memory_occupation),
        ):
            r.add_get(path, handler, allow_head=False)
            r.add_post(path, handler)
        r.add_post("/update_weights_from_tensor", self.update_weights_from_tensor)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/init_weights_update_group", self.init_weights_update_group)
        r.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        r.add_post("/destroy_weights_update_group", self.destroy_weights_update_group)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_post("/begin_weight_update", self.begin_weight_update)
        r.add_post("/end_weight_update", self.end_weight_update)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info, allow_head=False)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info, allow_head=False)
        for path in ("/get_weight_version", "/weight_version"):
            r.add_get(path, self.get_weight_version, allow_head=False)
        r.add_get("/health", self.health, allow_head=False)
        r.add_get("/health_generate", self.health_generate, allow_head=False)
        r.add_get("/metrics", self.metrics, allow_head=False)
        r.add_get("/v1/loads", self.loads, allow_head=False)

    @web.middleware
    async def _errors_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPNotFound:
            return web.json_response({"detail": "Not Found"}, status=404)
        except web.HTTPMethodNotAllowed:
            return web.json_response({"detail": "Method Not Allowed"}, status=405)
        except SchemaError as error:
            return error_response(str(error))

    @web.middleware
    async def _auth_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        key = self.args.api_key
        exempt = request.path in ("/health", "/metrics")
        if key is not None and not exempt and request.headers.get("Authorization", "") != f"Bearer {key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    # ---------------------------------------------------------------------------------------------- helpers
    async def _body(self, request: web.Request, *, required: bool) -> Json:
        """The JSON object body; an absent body is `{}` unless `required`. Malformed: `SchemaError`."""
        raw = await request.read()
        if not raw.strip():
            if required:
                raise SchemaError("A JSON request body is required.")
            return {}
        try:
            parsed = json.loads(raw, parse_constant=_reject_constant)
        except (ValueError, UnicodeDecodeError) as error:
            raise SchemaError(f"Malformed JSON body: {error}") from None
        if not isinstance(parsed, dict):
            raise SchemaError(f"The body must be a JSON object, got {type(parsed).__name__}.")
        return parsed  # pyright: ignore[reportUnknownVariableType]

    async def _engine(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self.engine.call_async(fn))

    async def _open_gate(self) -> None:
        async with self._gate:
            self._gate.notify_all()

    def _gate_closed(self) -> bool:
        return self.paused is not None or self._writers > 0

    # ---------------------------------------------------------------------------------------------- generate
    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request, required=True)
        stream = _field(body, "stream", bool, False)
        try:
            requests, output, is_list = self._parse_generate(body)
        except RequestError as error:
            if error.schema:
                raise SchemaError(str(error)) from None
            if stream:
                return await self._stream_error(request, str(error))
            return semantic_error(str(error))
        submission = _Submission(requests)
        for engine_request in requests:
            self._live[engine_request.rid] = submission
        try:
            if not await self._pass_gate(submission):
                return await self._respond_aborted_at_gate(request, submission, output, is_list, stream)
            self._in_flight += 1
            try:
                loop = asyncio.get_running_loop()
                for index, engine_request in enumerate(requests):
                    engine_request.on_update = _forwarder(loop, submission.queue, index)
                await self._engine(lambda: [self.engine.add_request(r) for r in requests])
                if stream:
                    return await self._stream(request, submission, output, is_list)
                return await self._wait_all(submission, output, is_list)
            finally:
                self._in_flight -= 1
                if self._in_flight == 0:
                    await self._open_gate()
        except (asyncio.CancelledError, ConnectionError):
            # The client went away: its requests must not keep decoding.
            unfinished = [r.rid for r in requests if not r.finished]
            if unfinished:
                self.engine.call_async(lambda: [self.engine.abort(rid) for rid in unfinished])
            raise
        finally:
            for engine_request in requests:
                self._live.pop(engine_request.rid, None)

    async def _pass_gate(self, submission: _Submission) -> bool:
        """Wait while paused or a weight update is writing; False if the requests were aborted meanwhile."""
        async with self._gate:
            if self._gate_closed():
                self._num_gated += len(submission.requests)
                try:
                    await self._gate.wait_for(lambda: not self._gate_closed() or submission.aborted_at_gate)
                finally:
                    self._num_gated -= len(submission.requests)
        return not submission.aborted_at_gate

    def _parse_generate(self, body: Json) -> tuple[list[Request], _Output, bool]:
        """Validate a `GenerateReqInput` into engine requests; returns them, the render options and whether
        the response is a list (batch input or n > 1)."""
        for key in _UNSUPPORTED_INPUTS:
            if body.get(key) not in (None, False, [], {}):
                raise RequestError(f"`{key}` is not supported by the built-in engine")
        if body.get("return_hidden_states") not in (None, False):
            raise RequestError("return_hidden_states needs a server flag the built-in engine does not have")
        prompts, is_batch = self._prompts(body)
        count = len(prompts)
        params = _per_item(body, "sampling_params", count, (dict,), None)
        options = [SamplingOptions.from_json(p, self.engine.model.config.vocab_size) for p in params]
        return_logprob = _per_item(body, "return_logprob", count, (bool,), False)
        start_len = _per_item(body, "logprob_start_len", count, (int,), -1)
        top_num = _per_item(body, "top_logprobs_num", count, (int,), 0)
        for value in top_num:
            if value < 0:
                raise RequestError(f"top_logprobs_num must be >= 0, got {value}")
        rids = self._rids(body, count, is_batch)
        output = _Output(
            return_text_in_logprobs=_field(body, "return_text_in_logprobs", bool, False),
            return_prompt_token_ids=_field(body, "return_prompt_token_ids", bool, False),
            started_s=time.monotonic(),
        )
        _field(body, "stream", bool, False)
        requests: list[Request] = []
        for index, prompt in enumerate(prompts):
            item_options = options[index]
            self._check_fits(prompt, item_options)
            if item_options.stop and self.tokenizer is None:
                raise RequestError("stop strings need a tokenizer; this server runs without one")
            # n > 1: the samples of one prompt get fresh random rids (as SGLang regenerates them).
            samples = (
                [rids[index]] if item_options.n == 1 else [uuid.uuid4().hex for _ in range(item_options.n)]
            )
            for rid in samples:
                requests.append(
                    Request(
                        rid=rid,
                        prompt_ids=list(prompt),
                        options=item_options,
                        return_logprob=return_logprob[index],
                        logprob_start_len=start_len[index],
                        top_logprobs_num=top_num[index] if return_logprob[index] else 0,
                        stream=_field(body, "stream", bool, False),
                    )
                )
        seen: set[str] = set()
        for engine_request in requests:
            if engine_request.rid in self._live or engine_request.rid in seen:
                raise RequestError(f"Duplicate request ID detected: {engine_request.rid}")
            seen.add(engine_request.rid)
        return requests, output, is_batch or len(requests) > 1

    def _prompts(self, body: Json) -> tuple[list[list[int]], bool]:
        input_ids = body.get("input_ids")
        text = body.get("text")
        vocab = self.engine.model.config.vocab_size
        if input_ids is not None:
            if not isinstance(input_ids, list):
                raise RequestError(
                    "input_ids: expected a list of ints or a list of lists of ints", schema=True
                )
            ids_list: list[object] = input_ids  # pyright: ignore[reportUnknownVariableType]
            is_batch = bool(ids_list) and all(isinstance(item, list) for item in ids_list)
            prompts_raw: list[object] = ids_list if is_batch else [ids_list]
            prompts: list[list[int]] = []
            for prompt in prompts_raw:
                if not isinstance(prompt, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool)
                    for t in prompt  # pyright: ignore[reportUnknownVariableType]
                ):
                    raise RequestError(
                        "input_ids: expected a list of ints or a list of lists of ints", schema=True
                    )
                tokens = [int(t) for t in prompt]  # pyright: ignore[reportUnknownVariableType, reportUnknownArgumentType]
                if not tokens:
                    raise RequestError("input_ids is empty: a prompt needs at least one token")
                bad = [t for t in tokens if not 0 <= t < vocab]
                if bad:
                    raise RequestError(f"input_ids {bad[:8]} are outside the vocabulary (size {vocab})")
                prompts.append(tokens)
            if not prompts:
                raise RequestError("input_ids is empty: a prompt needs at least one token")
            return prompts, is_batch
        if text is not None:
            is_batch = isinstance(text, list)
            texts: list[object] = text if is_batch else [text]  # pyright: ignore[reportUnknownVariableType]
            if not all(isinstance(t, str) for t in texts) or (is_batch and not texts):
                raise RequestError("text: expected a string or a non-empty list of strings", schema=True)
            if self.tokenizer is None:
                raise RequestError(
                    "text input needs a tokenizer; this server runs without one: send input_ids"
                )
            prompts = [self.tokenizer.encode(str(t)) for t in texts]
            if any(not p for p in prompts):
                raise RequestError("The prompt text encodes to no tokens")
            return prompts, is_batch
        raise RequestError("Either text, input_ids or input_embeds should be provided.")

    def _rids(self, body: Json, count: int, is_batch: bool) -> list[str]:
        rid = body.get("rid")
        if rid is None:
            return [uuid.uuid4().hex for _ in range(count)]
        if isinstance(rid, str):
            return [rid] if not is_batch else [f"{rid}_{i}" for i in range(count)]
        if isinstance(rid, list) and all(isinstance(r, str) for r in rid):  # pyright: ignore[reportUnknownVariableType]
            if len(rid) != count:  # pyright: ignore[reportUnknownArgumentType]
                raise RequestError(f"rid has {len(rid)} entries for a batch of {count}")  # pyright: ignore[reportUnknownArgumentType]
            return [str(r) for r in rid]  # pyright: ignore[reportUnknownVariableType]
        raise RequestError("rid: expected a string or a list of strings", schema=True)

    def _check_fits(self, prompt: list[int], options: SamplingOptions) -> None:
        context = self.engine.context_length
        if options.max_new_tokens is None:
            if len(prompt) >= context:
                raise RequestError(
                    f"The input ({len(prompt)} tokens) is longer than the model's context length "
                    f"({context} tokens)."
                )
            return
        total = len(prompt) + options.max_new_tokens
        if total > context:
            raise RequestError(
                f"Requested token count exceeds the model's maximum context length of {context} tokens. "
                f"You requested a total of {total} tokens: {len(prompt)} tokens from the input messages and "
                f"{options.max_new_tokens} tokens for the completion. Please reduce the number of tokens in "
                "the input messages or the completion to fit within the limit."
            )

    async def _wait_all(self, submission: _Submission, output: _Output, is_list: bool) -> web.Response:
        finished: set[int] = set()
        while len(finished) < len(submission.requests):
            index, _, done = await submission.queue.get()
            if done:
                finished.add(index)
        bodies = [self._render(r, len(r.output_ids), True, output) for r in submission.requests]
        if not is_list:
            reason = submission.requests[0].finish_reason or {}
            if reason.get("type") == "abort" and reason.get("status_code") == 400:
                return semantic_error(str(reason.get("message")))
        return web.json_response(bodies if is_list else bodies[0], dumps=_dumps)

    async def _stream(
        self, http: web.Request, submission: _Submission, output: _Output, is_list: bool
    ) -> web.StreamResponse:
        response = await self._start_stream(http)
        requests = submission.requests
        finished: set[int] = set()
        sent: dict[int, int] = {}
        while len(finished) < len(requests):
            items = [await submission.queue.get()]
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
            for index, (length, done) in sorted(latest.items()):
                engine_request = requests[index]
                if index in finished:
                    continue
                interval = engine_request.options.stream_interval
                if not done and (length == sent.get(index) or length % interval != 0):
                    continue
                event = self._render(engine_request, length, done, output)
                if is_list:
                    event["index"] = index
                await response.write(b"data: " + _dumps(event).encode() + b"\n\n")
                sent[index] = length
                if done:
                    finished.add(index)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _start_stream(self, http: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(http)
        return response

    async def _stream_error(self, http: web.Request, message: str) -> web.StreamResponse:
        response = await self._start_stream(http)
        error = {
            "error": {"message": message, "type": "invalid_request_error", "code": 400, "retryable": False}
        }
        await response.write(b"data: " + _dumps(error).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _respond_aborted_at_gate(
        self, http: web.Request, submission: _Submission, output: _Output, is_list: bool, stream: bool
    ) -> web.StreamResponse:
        for engine_request in submission.requests:
            engine_request.version_marks = [(self.engine.weight_version, 0)]
            engine_request.finish_reason = _abort_reason("Abort before admission (blocked at the pause gate)")
        bodies = [self._render(r, 0, True, output) for r in submission.requests]
        if not stream:
            return web.json_response(bodies if is_list else bodies[0], dumps=_dumps)
        response = await self._start_stream(http)
        for index, event in enumerate(bodies):
            if is_list:
                event["index"] = index
            await response.write(b"data: " + _dumps(event).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def _render(self, request: Request, length: int, finished: bool, output: _Output) -> Json:
        """The `/generate` response object for the first `length` output tokens of `request`."""
        output_ids = request.output_ids[:length]
        reason = request.finish_reason if finished else None
        meta: Json = {"id": request.rid, "finish_reason": reason}
        if request.was_running or not finished or reason is None or reason.get("type") != "abort":
            meta["prompt_tokens"] = len(request.prompt_ids)
        meta["completion_tokens"] = length
        meta["cached_tokens"] = 0
        spans = request.weight_versions(length)
        meta["weight_version"] = spans[-1]["version"] if finished else request.version_marks[-1][0]
        meta["num_retractions"] = request.num_retractions
        if finished:
            meta["weight_versions"] = spans
            meta["e2e_latency"] = time.monotonic() - output.started_s
            meta["response_sent_to_client_ts"] = time.time()
        if request.return_logprob:
            with_text = output.return_text_in_logprobs
            meta["input_token_logprobs"] = [
                [lp, token, self._token_text(token) if with_text else None]
                for lp, token in zip(
                    request.input_logprobs,
                    request.prompt_ids[len(request.prompt_ids) - len(request.input_logprobs) :],
                    strict=True,
                )
            ]
            meta["output_token_logprobs"] = [
                [lp, token, self._token_text(token) if with_text else None]
                for lp, token in zip(request.output_logprobs[:length], output_ids, strict=False)
            ]
            meta["output_token_logprobs_length"] = len(meta["output_token_logprobs"])
            if request.top_logprobs_num > 0:
                meta["input_top_logprobs"] = [
                    None
                    if top is None
                    else [[lp, t, self._token_text(t) if with_text else None] for lp, t in top]
                    for top in request.input_top_logprobs
                ]
                meta["output_top_logprobs"] = [
                    [[lp, t, self._token_text(t) if with_text else None] for lp, t in top]
                    for top in request.output_top_logprobs[:length]
                ]
        body: Json = {}
        if self.tokenizer is not None:
            body["text"] = self._text(request, output_ids, reason)
        body["output_ids"] = output_ids
        if output.return_prompt_token_ids:
            body["prompt_token_ids"] = request.prompt_ids
        body["meta_info"] = meta
        return body

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

    # ------------------------------------------------------------------------------------------ abort, pause
    async def abort_request(self, request: web.Request) -> web.Response:
        body = await self._body(request, required=False)
        rid = _field(body, "rid", str, "")
        abort_all = _field(body, "abort_all", bool, False)
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
        async with self._gate:
            for key, submission in self._live.items():
                if (rid is None or key == rid) and not any(
                    r.was_running or r.finished for r in submission.requests
                ):
                    submission.aborted_at_gate = True
            self._gate.notify_all()

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await self._body(request, required=True)
        mode = body.get("mode", "abort")
        if mode not in _PAUSE_MODES:
            raise SchemaError(f"mode must be one of {', '.join(_PAUSE_MODES)}, got {mode!r}")
        pause_mode: PauseMode = mode
        async with self._gate:
            self.paused = pause_mode
        await self._engine(lambda: self.engine.pause(pause_mode))
        if pause_mode == "abort":
            # Returns once every in-flight /generate call has answered (their partial outputs are final).
            deadline = time.monotonic() + 60.0
            while self._in_flight > 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
                if self._in_flight > 0:
                    await self._engine(self.engine.abort_all)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await self._body(request, required=True)
        await self._engine(self.engine.resume)
        async with self._gate:
            self.paused = None
            self._gate.notify_all()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    # -------------------------------------------------------------------------------------- caches, memory
    async def flush_cache(self, request: web.Request) -> web.Response:
        try:
            await self._engine(self.engine.flush_cache)
        except EngineBusyError as error:
            return web.Response(status=400, text=f"Cache not flushed: {error}\n")
        return web.Response(status=200, text="Cache flushed.\n")

    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        tags = self._memory_tags(await self._body(request, required=False))
        try:
            await self._engine(lambda: self.engine.release_memory(tags))
        except EngineBusyError as error:
            return semantic_error(str(error))
        return web.json_response(None)

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        tags = self._memory_tags(await self._body(request, required=False))
        await self._engine(lambda: self.engine.resume_memory(tags))
        await self._engine(lambda: None)  # wakes the scheduler for requests queued while released
        return web.json_response(None)

    def _memory_tags(self, body: Json) -> list[str]:
        tags = body.get("tags")
        if tags is None:
            return list(_MEMORY_TAGS)
        if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):  # pyright: ignore[reportUnknownVariableType]
            raise SchemaError("tags: expected a list of strings or null")
        unknown = [t for t in tags if t not in _MEMORY_TAGS]  # pyright: ignore[reportUnknownVariableType]
        if unknown:
            raise SchemaError(f"unknown memory tags {unknown}; known: {', '.join(_MEMORY_TAGS)}")
        return [str(t) for t in tags]  # pyright: ignore[reportUnknownVariableType]

    # ---------------------------------------------------------------------------------------------- weights
    async def _apply_update(
        self, body: Json, tensors_fn: Callable[[], Awaitable[list[tuple[str, torch.Tensor]]]]
    ) -> web.Response:
        """The common path of weight updates: locking, abort, validation, load, version, flush.

        `tensors_fn` produces the tensors (decoding or receiving); it runs before anything changes.
        """
        flush = _field(body, "flush_cache", bool, True)
        abort_all = _field(body, "abort_all_requests", bool, False)
        version = _field(body, "weight_version", str, None)
        try:
            tensors = await tensors_fn()
        except (ValueError, ModelLoadError, RuntimeError) as error:
            return update_failure(f"Failed to update weights: {error}")
        if abort_all:
            await self._engine(self.engine.abort_all)
        holds_writer = self.paused is None and not self._session_open
        if holds_writer:
            await self._acquire_writer()
        try:

            def load() -> None:
                if flush and not self.engine.is_idle():
                    raise EngineBusyError(
                        f"flush_cache=true needs an idle engine, but {self.engine.num_running} running and "
                        f"{self.engine.num_waiting} waiting requests are held by the pause; send "
                        "flush_cache=false with retract and in_place pauses. Nothing was loaded."
                    )
                self.engine.load_weights(tensors, version)
                if flush:
                    self.engine.flush_cache()

            try:
                await self._engine(load)
            except (ModelLoadError, EngineBusyError) as error:
                return update_failure(f"Failed to update weights: {error}")
        finally:
            if holds_writer:
                await self._release_writer()
        message = f"Succeeded to update model weights ({len(tensors)} tensors)."
        if version is not None:
            message += f" Weight version updated to {version}."
        return web.json_response({"success": True, "message": message})

    async def _acquire_writer(self) -> None:
        async with self._gate:
            self._writers += 1
            # `generate` notifies the gate when the in-flight count drops to zero.
            await self._gate.wait_for(lambda: self._in_flight == 0)

    async def _release_writer(self) -> None:
        async with self._gate:
            self._writers -= 1
            self._gate.notify_all()

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        body = await self._body(request, required=True)
        payloads = body.get("serialized_named_tensors")
        if not isinstance(payloads, list) or not all(isinstance(p, str) for p in payloads):  # pyright: ignore[reportUnknownVariableType]
            raise SchemaError("serialized_named_tensors: a list of base64 strings is required")
        load_format = body.get("load_format")
        if load_format != SAFETENSORS_FORMAT:
            return update_failure(
                f"load_format {load_format!r} is not accepted: the built-in engine takes only "
                f'"{SAFETENSORS_FORMAT}" (each payload the base64 of a safetensors file; never a pickle)'
            )
        texts = [str(p) for p in payloads]  # pyright: ignore[reportUnknownVariableType]

        async def decode() -> list[tuple[str, torch.Tensor]]:
            if len(texts) != 1:
                raise ValueError(f"expected one payload (tensor parallel size 1), got {len(texts)}")
            return await asyncio.to_thread(_decode_safetensors, texts[0])

        return await self._apply_update(body, decode)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await self._body(request, required=True)
        model_path = body.get("model_path")
        if not isinstance(model_path, str):
            raise SchemaError("model_path: a string is required")

        async def read() -> list[tuple[str, torch.Tensor]]:
            return await asyncio.to_thread(_read_safetensors_folder, model_path)

        response = await self._apply_update(body, read)
        payload = json.loads(response.text or "{}")
        payload["num_paused_requests"] = 0
        return web.json_response(payload, status=response.status)

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        body = await self._body(request, required=True)
        address = _required(body, "master_address", str)
        port = _required(body, "master_port", int)
        rank_offset = _required(body, "rank_offset", int)
        world_size = _required(body, "world_size", int)
        group_name = _field(body, "group_name", str, "weight_update_group")
        backend = _field(body, "backend", str, "nccl")
        if self._group_name is not None:
            return update_failure(
                f"a weight update group ({self._group_name!r}) already exists; destroy it first"
            )
        if backend == "nccl" and self.engine.model.device.type != "cuda":
            return update_failure("backend nccl needs a CUDA engine; a CPU engine joins with backend gloo")
        if not 0 < rank_offset < world_size:
            return update_failure(f"rank_offset {rank_offset} must be in [1, world_size={world_size})")

        def join() -> Any:
            return _join_weight_update_group(address, port, world_size, rank_offset, group_name, backend)

        try:
            group = await asyncio.to_thread(join)
        except Exception as error:
            return update_failure(f"Failed to init the weight update group: {error}")
        self._group = group
        self._group_name = group_name
        self._group_device = self.engine.model.device if backend == "nccl" else torch.device("cpu")
        return web.json_response(
            {"success": True, "message": "Succeeded to initialize custom process group."}
        )

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        body = await self._body(request, required=True)
        names = _required(body, "names", list)
        dtypes = _required(body, "dtypes", list)
        shapes = _required(body, "shapes", list)
        group_name = _field(body, "group_name", str, "weight_update_group")
        if not (len(names) == len(dtypes) == len(shapes)):
            raise SchemaError(
                f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})"
            )
        if body.get("load_format") not in (None,):
            return update_failure("load_format: only null (one broadcast per tensor) is accepted")
        if self._group_name is None or group_name != self._group_name:
            return update_failure(
                f"no weight update group named {group_name!r}; call /init_weights_update_group"
            )
        specs: list[tuple[str, torch.dtype, list[int]]] = []
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            torch_dtype = _TORCH_DTYPES.get(str(dtype).removeprefix("torch."))
            if not isinstance(name, str) or torch_dtype is None or not isinstance(shape, list):
                raise SchemaError(f"bad tensor spec: name={name!r} dtype={dtype!r} shape={shape!r}")
            specs.append((name, torch_dtype, [int(s) for s in shape]))  # pyright: ignore[reportUnknownVariableType, reportUnknownArgumentType]
        device = self._group_device
        group = self._group

        async def receive() -> list[tuple[str, torch.Tensor]]:
            def run() -> list[tuple[str, torch.Tensor]]:
                import torch.distributed as dist

                options = dist.BroadcastOptions()
                options.rootRank = 0
                received: list[tuple[str, torch.Tensor]] = []
                for name, dtype, shape in specs:
                    tensor = torch.empty(shape, dtype=dtype, device=device)
                    group.broadcast([tensor], options).wait(_GROUP_TIMEOUT)
                    received.append((name, tensor))
                return received

            # Receive everything first even if a name is wrong, so the trainer's broadcasts never hang.
            return await asyncio.to_thread(run)

        return await self._apply_update(body, receive)

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        body = await self._body(request, required=False)
        group_name = _field(body, "group_name", str, "weight_update_group")
        if self._group_name is None or group_name != self._group_name:
            return update_failure(f"no weight update group named {group_name!r}")

        group = self._group

        def leave() -> None:
            import torch.distributed as dist

            dist.destroy_process_group(group)

        self._group_name = None
        self._group = None
        await asyncio.to_thread(leave)
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await self._body(request, required=True)
        version = _required(body, "new_version", str)
        if _field(body, "abort_all_requests", bool, True):
            await self._engine(self.engine.abort_all)
        await self._engine(lambda: self.engine.set_weight_version(version))
        return web.json_response(
            {"success": True, "message": f"Weight version updated to {version}", "new_version": version}
        )

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        """Open an update session: outside a pause it holds the writer side until `/end_weight_update`, so
        the buckets of one update are never sampled from half-applied."""
        body = await self._body(request, required=False)
        selector = _field(body, "selector", str, "all")
        if selector not in ("all", "target"):
            return update_failure(f"selector {selector!r}: the built-in engine has no draft model")
        if self._session_open:
            return web.json_response({"success": True, "message": "A weight update session is already open."})
        self._session_open = True
        if self.paused is None:
            await self._acquire_writer()
            self._session_writer = True
        else:
            self._session_writer = False
        return web.json_response({"success": True, "message": "Weight update session opened."})

    async def end_weight_update(self, request: web.Request) -> web.Response:
        await self._body(request, required=False)
        if not self._session_open:
            return web.json_response({"success": True, "message": "No weight update session was open."})
        self._session_open = False
        if self._session_writer:
            await self._release_writer()
        return web.json_response({"success": True, "message": "Weight update session closed."})

    # ---------------------------------------------------------------------------------------------- info
    async def model_info(self, request: web.Request) -> web.Response:
        config = self.engine.model.config
        return web.json_response(
            {
                "model_path": self.args.model_path,
                "served_model_name": self.args.served_model_name,
                "tokenizer_path": self.args.tokenizer_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.engine.weight_version,
                "load_format": self.args.load_format,
                "reasoning_parser": None,
                "tool_call_parser": None,
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": config.model_type,
                "architectures": ["Qwen2ForCausalLM" if config.model_type == "qwen2" else "LlamaForCausalLM"],
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        info: Json = asdict(self.args)
        info.pop("api_key", None)
        engine = self.engine
        cache_bytes = 0 if engine._cache is None else engine._cache.nbytes()  # pyright: ignore[reportPrivateUsage]
        info.update(
            {
                "tp_size": 1,
                "dp_size": 1,
                "max_total_num_tokens": engine.max_running_requests * engine.context_length,
                "max_req_input_len": engine.context_length - 1,
                "internal_states": [
                    {
                        "last_gen_throughput": engine.counters.gen_throughput,
                        "effective_max_running_requests_per_dp": engine.max_running_requests,
                        "memory_usage": {"kv_cache_bytes": cache_bytes},
                    }
                ],
                "version": SERVER_VERSION,
            }
        )
        return web.json_response(info)

    async def get_weight_version(self, request: web.Request) -> web.Response:
        if self.args.weight_version_route == "old":
            return web.json_response({"weight_version": self.engine.weight_version})
        return error_response(
            f"The '{request.path}' endpoint is deprecated. Please use '/model_info' instead.", 404, "404"
        )

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.ready else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        if not self.ready:
            return web.Response(status=503)
        probe = Request(
            rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", prompt_ids=[0], options=SamplingOptions(max_new_tokens=1)
        )
        done = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_update(_request: Request, finished: bool) -> None:
            if finished:
                loop.call_soon_threadsafe(done.set)

        probe.on_update = on_update
        await self._engine(lambda: self.engine.add_request(probe))
        try:
            await asyncio.wait_for(done.wait(), timeout=20.0)
        except TimeoutError:
            self.engine.call_async(lambda: self.engine.abort(probe.rid))
            return web.Response(status=503)
        return web.Response(status=200)

    async def metrics(self, request: web.Request) -> web.Response:
        if not self.args.enable_metrics:
            return web.json_response({"detail": "Not Found"}, status=404)
        engine = self.engine
        counters = engine.counters
        label = f'{{model_name="{self.args.served_model_name}",engine_type="unified"}}'
        used_tokens = sum(r.num_tokens for r in engine.running)
        capacity = engine.max_running_requests * engine.context_length
        gauges = {
            "num_running_reqs": ("Requests in the running batch.", engine.num_running),
            "num_queue_reqs": (
                "Requests in the waiting queue (retracted ones included).",
                engine.num_waiting,
            ),
            "num_paused_reqs": ("Requests blocked at the pause gate.", self._num_gated),
            "num_retracted_reqs": (
                "Retracted requests waiting to be re-prefilled.",
                sum(1 for r in engine.waiting if r.num_retractions > 0 and not r.finished),
            ),
            "gen_throughput": ("Decode tokens per second.", counters.gen_throughput),
            "num_used_tokens": ("Tokens held in the KV cache.", used_tokens),
            "token_usage": ("Fraction of the KV capacity in use.", used_tokens / capacity),
            "max_running_requests": ("The running-batch limit.", engine.max_running_requests),
        }
        totals = {
            "prompt_tokens_total": ("Prompt tokens prefilled.", counters.prompt_tokens_total),
            "generation_tokens_total": ("Tokens generated.", counters.generation_tokens_total),
            "num_requests_total": ("Requests admitted.", counters.num_requests_total),
            "num_aborted_requests_total": ("Requests aborted.", counters.num_aborted_requests_total),
            "num_retracted_requests_total": ("Retractions.", counters.num_retracted_requests_total),
            "num_retracted_output_tokens_total": (
                "Output tokens recomputed after retractions.",
                counters.num_retracted_output_tokens_total,
            ),
            "num_weight_updates_total": ("Weight updates applied.", counters.num_weight_updates_total),
        }
        lines: list[str] = []
        for kind, table in (("gauge", gauges), ("counter", totals)):
            for name, (help_text, value) in table.items():
                lines += [
                    f"# HELP sglang:{name} {help_text}",
                    f"# TYPE sglang:{name} {kind}",
                    f"sglang:{name}{label} {float(value)}",
                ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8")

    async def loads(self, request: web.Request) -> web.Response:
        engine = self.engine
        used_tokens = sum(r.num_tokens for r in engine.running)
        capacity = engine.max_running_requests * engine.context_length
        load = {
            "dp_rank": 0,
            "timestamp": datetime.datetime.now(datetime.UTC).isoformat(),
            "num_running_reqs": engine.num_running,
            "num_waiting_reqs": engine.num_waiting,
            "num_used_tokens": used_tokens,
            "num_total_tokens": capacity,
            "max_total_num_tokens": capacity,
            "token_usage": used_tokens / capacity,
            "gen_throughput": engine.counters.gen_throughput,
            "cache_hit_rate": 0.0,
            "max_running_requests": engine.max_running_requests,
            "queues": {
                "waiting": engine.num_waiting,
                "grammar": 0,
                "paused": self._num_gated,
                "retracted": sum(1 for r in engine.waiting if r.num_retractions > 0),
            },
        }
        return web.json_response(
            {
                "timestamp": datetime.datetime.now(datetime.UTC).isoformat(),
                "version": SERVER_VERSION,
                "accelerator": engine.model.device.type,
                "num_accelerators": 1,
                "loads": [load],
            }
        )


def _forwarder(
    loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[tuple[int, int, bool]], index: int
) -> Callable[[Request, bool], None]:
    """An `on_update` that posts (index, output length, finished) to the loop-side queue."""

    def forward(request: Request, finished: bool) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, (index, len(request.output_ids), finished))

    return forward


def _abort_reason(message: str) -> Json:
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not valid JSON")


def _dumps(value: object) -> str:
    return json.dumps(value, allow_nan=False, separators=(",", ":"))


def _field(body: Mapping[str, object], key: str, kind: type[Any], default: Any) -> Any:
    """`body[key]` checked against `kind` (bool is not an int); absent or null gives `default`."""
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise SchemaError(f"{key}: expected {kind.__name__}, got {value!r}")
    return value


def _required(body: Mapping[str, object], key: str, kind: type[Any]) -> Any:
    if body.get(key) is None:
        raise SchemaError(f"{key}: field required")
    return _field(body, key, kind, None)


def _per_item(body: Json, key: str, count: int, kinds: tuple[type, ...], default: Any) -> list[Any]:
    """A per-prompt value: one value for all, or a list of `count` (for batches)."""
    value = body.get(key)
    if value is None:
        return [default] * count
    if isinstance(value, list):
        items: list[object] = value  # pyright: ignore[reportUnknownVariableType]
        if len(items) != count:
            raise RequestError(f"{key} has {len(items)} entries for a batch of {count}")
        return [_check_kind(key, item, kinds, default) for item in items]
    return [_check_kind(key, value, kinds, default)] * count


def _check_kind(key: str, value: object, kinds: tuple[type, ...], default: Any) -> Any:
    if value is None:
        return default
    if not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool)):
        names = " or ".join(k.__name__ for k in kinds)
        raise RequestError(f"{key}: expected {names}, got {value!r}", schema=True)
    return value


_GROUP_TIMEOUT = datetime.timedelta(seconds=120)


def _join_weight_update_group(
    address: str, port: int, world_size: int, rank: int, group_name: str, backend: str
) -> Any:
    """The engine's end of the weight-update group, as SGLang's engines build it: the trainer (rank 0)
    hosts a TCP store at `address:port`; the group's keys live under the group name (a `PrefixStore`), and
    the group is its own communicator, not this process's default group."""
    import inspect

    from torch._C._distributed_c10d import PrefixStore, TCPStore
    from torch.distributed import distributed_c10d as c10d

    store = TCPStore(address, port, world_size, is_master=False, timeout=_GROUP_TIMEOUT)
    prefixed = PrefixStore(group_name, store)
    helper: Any = c10d._new_process_group_helper  # pyright: ignore[reportPrivateUsage]
    # The option argument of this (private, but shared by SGLang and the RL trainers) helper was renamed.
    options_name = (
        "backend_options" if "backend_options" in inspect.signature(helper).parameters else "pg_options"
    )
    group, _ = helper(
        world_size,
        rank,
        [],
        c10d.Backend(backend),
        prefixed,
        group_name=group_name,
        timeout=_GROUP_TIMEOUT,
        **{options_name: None},
    )
    c10d._world.pg_group_ranks[group] = {r: r for r in range(world_size)}  # pyright: ignore[reportPrivateUsage]
    return group


def _decode_safetensors(payload: str) -> list[tuple[str, torch.Tensor]]:
    """base64 of a safetensors file -> named tensors (safetensors only: no pickle is ever read)."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as error:
        raise ValueError(f"a payload is not valid base64: {error}") from None
    try:
        return list(load(raw).items())
    except (SafetensorError, ValueError) as error:
        raise ValueError(f"a payload is not a safetensors file: {error}") from None


def _read_safetensors_folder(path: str) -> list[tuple[str, torch.Tensor]]:
    from pathlib import Path

    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors file in {path}")
    tensors: list[tuple[str, torch.Tensor]] = []
    for file in files:
        tensors.extend(load_file(str(file)).items())
    return tensors


def encode_safetensors(tensors: Sequence[tuple[str, torch.Tensor]]) -> str:
    """Named tensors -> the base64 payload `/update_weights_from_tensor` takes (one entry of the list)."""
    from safetensors.torch import save

    return base64.b64encode(save({name: t.detach().contiguous().cpu() for name, t in tensors})).decode()
