"""SGLang's native HTTP routes over the built-in engine (aiohttp): the application, its middlewares and the
control routes (pause, continue, flush, memory).

The handlers run on the asyncio loop and never touch torch directly: each engine operation goes through
`Engine.call_async` (executed on the scheduler thread between two steps). The routes are split by concern:
`generate` (`/generate`, `/abort_request`), `weights` (updates, the process group, sessions), `info` (info,
health, metrics, loads); they share one `AdmissionGate` (`gate`), which pauses and weight updates close.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

from aiohttp import web

from asyncrl_engine import (
    DEFAULT_CHUNKED_PREFILL_SIZE,
    DEFAULT_MAX_N,
    DEFAULT_MAX_QUEUED_REQUESTS,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
)
from asyncrl_engine._http import (
    MAX_REQUEST_BODY_BYTES,
    Handler,
    error_response,
    json_model,
    not_found,
    read_model,
    semantic_error,
)
from asyncrl_engine.calls import Limits
from asyncrl_engine.engine import Engine
from asyncrl_engine.gate import AdmissionGate
from asyncrl_engine.generate import GenerateRoutes, Tokenizer
from asyncrl_engine.info import InfoRoutes
from asyncrl_engine.request import EngineBusyError, EngineStoppedError
from asyncrl_engine.weights import WeightRoutes
from asyncrl_sglang.tensor_codec import encode_tensors as encode_safetensors
from asyncrl_sglang.wire import (
    ContinueRequest,
    GenerationControlResult,
    MemoryRequest,
    MemoryTag,
    PauseMode,
    PauseRequest,
    WireError,
)

__all__ = ["MAX_BODY_BYTES", "BuiltinServer", "ServerArgs", "Tokenizer", "encode_safetensors"]


MAX_BODY_BYTES = 1 << 36
"""Largest body of `/update_weights_from_tensor` (64 GiB). A weight update carries a whole bucket of base64
safetensors, and SGLang sets no limit on that route; aiohttp's default of 1 MiB would refuse any real model
with a 413. Every other route takes at most `ServerArgs.max_request_body_bytes`."""


@dataclass(frozen=True, slots=True)
class ServerArgs:
    """The launch arguments, named as SGLang's `ServerArgs` fields; `/server_info` reports them as given
    (`api_key`, `max_n` and `weight_version_route` excepted). The engine's flags that SGLang lacks
    (`--disable-fused-kernels`, `--num-threads`, `--port-file`, `--start-paused`) are shown by
    `launch_command` only."""

    model_path: str
    served_model_name: str
    tokenizer_path: str | None
    host: str = "127.0.0.1"
    port: int = 30000
    grpc_port: int | None = None
    api_key: str | None = None
    max_running_requests: int = 32
    chunked_prefill_size: int = DEFAULT_CHUNKED_PREFILL_SIZE
    """The most tokens of one prefill batch, and the chunk of a longer prompt (-1 or 0: no chunking), as
    SGLang's flag (`Engine.chunked_prefill_size`)."""
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS
    """The most requests waiting at once (SGLang's flag): a call that does not fit beside those waiting is
    answered 503 "The request queue is full.", a call larger than this is a 400."""
    max_n: int = DEFAULT_MAX_N
    """The largest `sampling_params.n` (400 above it)."""
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    """The largest body of every route but `/update_weights_from_tensor` (400 above it, before it is read
    whole); the engine's own flag."""
    context_length: int = 2048
    weight_version: str = "default"
    device: str = "cpu"
    dtype: str = "float32"
    enable_metrics: bool = False
    random_seed: int = 0
    load_format: str = "safetensors"
    disable_cuda_graph: bool = False
    attention_backend: Literal["triton", "torch_native"] = "triton"
    """SGLang's flag: `triton` runs the engine's Triton attention kernels (`decode_attention.py`,
    `extend_attention.py`) on CUDA, `torch_native` runs SDPA (as the CPU always does)."""
    disable_radix_cache: bool = False
    """The engine runs without its prefix cache (SGLang's flag of the same name)."""
    disable_overlap_schedule: bool = False
    """The scheduler reads each decode step's tokens before launching the next, rather than overlapping its
    host work with the device's (SGLang's flag of the same name)."""
    skip_server_warmup: bool = False
    """The server answers as soon as it listens, without its warm-up generation (SGLang's flag)."""
    log_level: str = "info"
    """The level of every logger of the server process (SGLang's flag)."""
    weight_version_route: Literal["old", "new"] = "new"
    """`/get_weight_version`: 200 as older SGLang servers answer, or 404 as newer ones do."""
    launch_command: str | None = None
    """The command line the server was started with (the API key redacted); None when built in-process."""


class BuiltinServer:
    """The HTTP front of one engine. `app` is the aiohttp application; `engine` must already be started."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer | None, args: ServerArgs) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.args = args
        self.gate = AdmissionGate()
        self._control = asyncio.Lock()
        """Held by each pause and continue for its whole length: the gate and the scheduler change together,
        so two control calls at once never leave the gate open over a paused scheduler."""
        self.generation = GenerateRoutes(
            engine,
            tokenizer,
            self.gate,
            Limits(max_n=args.max_n, max_queued_requests=args.max_queued_requests),
        )
        self.weights = WeightRoutes(engine, self.gate)
        self.info = InfoRoutes(engine, self.gate, args)
        self.app = web.Application(
            middlewares=[self._errors_middleware, self._auth_middleware], client_max_size=MAX_BODY_BYTES
        )
        self.app[MAX_REQUEST_BODY_BYTES] = args.max_request_body_bytes
        self._add_routes()

    @property
    def ready(self) -> bool:
        """Warmup is done: `/health` answers 200."""
        return self.info.ready

    @ready.setter
    def ready(self, value: bool) -> None:
        self.info.ready = value

    @property
    def paused(self) -> PauseMode | None:
        return self.gate.paused

    async def stop(self) -> None:
        """Stop generating, answering every call: `/health` answers 503, the engine stops (each request it
        holds is answered 503 "The server is shutting down.", as is each call that reaches it from now on),
        then the calls held at the pause gate go on to that answer too. The routes keep serving until the
        application is cleaned up."""
        self.ready = False
        await asyncio.to_thread(self.engine.stop)
        await self.gate.stop()

    # ---------------------------------------------------------------------------------------------- routing
    def _add_routes(self) -> None:
        r = self.app.router
        generation, weights, info = self.generation, self.weights, self.info
        r.add_route("POST", "/generate", generation.generate)
        r.add_route("PUT", "/generate", generation.generate)
        r.add_post("/abort_request", generation.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        for path, handler in (
            ("/flush_cache", self.flush_cache),
            ("/release_memory_occupation", self.release_memory_occupation),
            ("/resume_memory_occupation", self.resume_memory_occupation),
        ):
            r.add_get(path, handler, allow_head=False)
            r.add_post(path, handler)
        r.add_post("/update_weights_from_tensor", weights.update_weights_from_tensor)
        r.add_post("/update_weights_from_disk", weights.update_weights_from_disk)
        r.add_post("/init_weights_update_group", weights.init_weights_update_group)
        r.add_post("/update_weights_from_distributed", weights.update_weights_from_distributed)
        r.add_post("/destroy_weights_update_group", weights.destroy_weights_update_group)
        r.add_post("/update_weight_version", weights.update_weight_version)
        r.add_post("/begin_weight_update", weights.begin_weight_update)
        r.add_post("/end_weight_update", weights.end_weight_update)
        r.add_get("/get_weights_by_name", weights.get_weights_by_name, allow_head=False)
        r.add_post("/get_weights_by_name", weights.get_weights_by_name)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, info.model_info, allow_head=False)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, info.server_info, allow_head=False)
        for path in ("/get_weight_version", "/weight_version"):
            r.add_get(path, info.get_weight_version, allow_head=False)
        r.add_get("/health", info.health, allow_head=False)
        r.add_get("/ready", info.ready_route, allow_head=False)
        r.add_get("/health_generate", info.health_generate, allow_head=False)
        r.add_get("/metrics", info.metrics, allow_head=False)
        r.add_get("/v1/loads", info.loads, allow_head=False)

    @web.middleware
    async def _errors_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPNotFound:
            return not_found()
        except web.HTTPMethodNotAllowed:
            return web.json_response({"detail": "Method Not Allowed"}, status=405)
        except WireError as error:
            return error_response(str(error))
        except EngineStoppedError:
            # A request that reaches a server shutting down (a connection kept alive) may go to another
            # engine, or to this one once restarted: unavailable, as SGLang answers while it shuts down.
            return error_response("The server is shutting down.", 503, "Service Unavailable")

    @web.middleware
    async def _auth_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        key = self.args.api_key
        if (
            key is not None
            and not auth_exempt(request.path)
            and not authorized(request.headers.get("Authorization"), key)
        ):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def _engine(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self.engine.call_async(fn))

    # ------------------------------------------------------------------------------------------ pause
    async def pause_generation(self, request: web.Request) -> web.Response:
        mode = (await read_model(request, PauseRequest, required=True)).mode
        async with self._control:
            await self.gate.pause(mode)
            await self._engine(lambda: self.engine.pause(mode))
            if mode == "abort":
                # Returns once every in-flight /generate call has answered (their partial outputs are final).
                deadline = time.monotonic() + 60.0
                while self.gate.num_in_flight > 0 and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                    if self.gate.num_in_flight > 0:
                        await self._engine(self.engine.abort_all)
        return json_model(GenerationControlResult(message="Generation paused successfully.", status="ok"))

    async def continue_generation(self, request: web.Request) -> web.Response:
        await read_model(request, ContinueRequest, required=True)
        async with self._control:
            await self._engine(self.engine.resume)
            await self.gate.resume()
        return json_model(GenerationControlResult(message="Generation continued successfully.", status="ok"))

    # -------------------------------------------------------------------------------------- caches, memory
    async def flush_cache(self, request: web.Request) -> web.Response:
        try:
            await self._engine(self.engine.flush_cache)
        except EngineBusyError as error:
            return web.Response(status=400, text=f"Cache not flushed: {error}\n")
        return web.Response(status=200, text="Cache flushed.\n")

    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        tags = _memory_tags(await read_model(request, MemoryRequest, required=False))
        try:
            await self._engine(lambda: self.engine.release_memory(tags))
        except EngineBusyError as error:
            return semantic_error(str(error))
        return web.json_response(None)

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        tags = _memory_tags(await read_model(request, MemoryRequest, required=False))
        await self._engine(lambda: self.engine.resume_memory(tags))
        await self._engine(lambda: None)  # wakes the scheduler for requests queued while released
        return web.json_response(None)


def _memory_tags(body: MemoryRequest) -> list[str]:
    return list(body.tags) if body.tags is not None else list(get_args(MemoryTag))


def authorized(header: str | None, key: str) -> bool:
    """Whether an `Authorization` header carries `key` under the Bearer scheme (matched case-insensitively,
    the key compared in constant time), as SGLang checks it."""
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), key.encode())


def auth_exempt(path: str) -> bool:
    """Health, readiness and metrics routes need no key (probes and scrapers carry no secret)."""
    return path.startswith(("/health", "/ready", "/metrics"))
