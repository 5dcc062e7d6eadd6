"""SGLang's gRPC scheduler service (`SglangScheduler`, from `smg-grpc-proto`) over the built-in engine.

It serves beside the HTTP routes, in the same process and event loop, from the same scheduler: `Generate`,
`Abort`, `HealthCheck`, `GetModelInfo`, `GetServerInfo` and `GetLoads` (the other calls of the service answer
UNIMPLEMENTED). Control (pause, continue, weight updates) stays on HTTP, as with SGLang's gRPC mode.

`Generate` takes the same path as `/generate`: the request is validated by the same rules (the proto
`SamplingParams` read into a `sampling_params` object, `asyncrl_sglang.grpc_wire`), waits at the shared
admission gate (so every pause mode and every weight update treats it exactly as an HTTP request), counts as
in flight while it runs, and is aborted when its RPC is cancelled. With `stream` it answers one
`GenerateStreamChunk` per new tokens (the new ids and their logprobs, at most one per `stream_interval`
tokens) and a `GenerateComplete` per completion; without, only the `GenerateComplete`s, which always carry
every output id and logprob. The per-token version spans and the retraction counts follow in trailing
metadata (`asyncrl-weight-versions`, `asyncrl-num-retractions`).

Errors are gRPC status codes with the meaning of the HTTP errors: a bad value, an unknown or unsupported
sampling field, an empty or out-of-vocabulary prompt, a prompt too long for the context or a duplicate
request id is INVALID_ARGUMENT (what SGLang's servicer answers for its `ValueError`s, the over-context case
included), with the message `/generate` gives; a full waiting queue, and a request cut off or refused because
the engine stops, are UNAVAILABLE (SGLang's 503: the client sends it again); a request that failed on its own
in the engine (`Internal engine error: ...`) is INTERNAL (SGLang's 500: the request failed, its partial output
is no answer); a missing or wrong API key is UNAUTHENTICATED (`HealthCheck`, like `/health`, needs none).
"""

from __future__ import annotations

import asyncio
import datetime
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.struct_pb2 import Struct
from google.protobuf.timestamp_pb2 import Timestamp
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from asyncrl_engine.calls import (
    Call,
    Limits,
    QueueFullError,
    abort_at_gate,
    abort_reason,
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
from asyncrl_engine.info import (
    HEALTH_CHECK_TIMEOUT_S,
    SERVER_VERSION,
    InfoRoutes,
    Load,
    load_sections,
    probe_health,
    scheduler_info,
    server_args,
)
from asyncrl_engine.options import RequestError, SamplingOptions
from asyncrl_engine.request import EngineStoppedError, Request
from asyncrl_sglang.grpc_wire import authorization, encode_trailer, sampling_fields
from asyncrl_sglang.wire import SamplingParamsBody, WireError, parse_object

SERVER_TYPE = "grpc"
_ABORT_CODES = {503: grpc.StatusCode.UNAVAILABLE, 500: grpc.StatusCode.INTERNAL}
"""The code of a call one of whose requests the engine ended with an error (`calls.error_abort`), as
SGLang's servicer maps the status of such an abort."""
_UNSUPPORTED_FIELDS = (
    "mm_inputs",
    "input_embeds",
    "lora_id",
    "token_ids_logprob",
    "return_hidden_states",
    "custom_logit_processor",
    "disaggregated_params",
)


class SchedulerService(pb_grpc.SglangSchedulerServicer):
    """The `SglangScheduler` service of one engine; `gate` is the HTTP server's admission gate."""

    def __init__(
        self, engine: Engine, gate: AdmissionGate, info: InfoRoutes, limits: Limits | None = None
    ) -> None:
        self.engine = engine
        self.gate = gate
        self.info = info
        self.limits = limits or Limits()
        """The bounds of a call (`--max-n`, `--max-queued-requests`), shared with `/generate`."""
        """The HTTP server's information routes: the launch arguments and startup this service reports too."""
        self.ready = False
        """Set once warm-up is done: `HealthCheck` is unhealthy before."""
        self.started_s = time.time()
        self._live: dict[str, Call] = {}

    async def _engine(self, fn: Callable[[], Any], *, drain: bool = True) -> Any:
        return await asyncio.wrap_future(self.engine.call_async(fn, drain=drain))

    # ---------------------------------------------------------------------------------------------- Generate
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            # Stop strings are compiled off the event loop, as over HTTP; the rid check reads loop state.
            requests = await asyncio.to_thread(self._requests, request)
            check_unique(requests, self._live)
        except RequestError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        call = Call(requests, Ticket(len(requests)))
        for engine_request in requests:
            self._live[engine_request.rid] = call
        try:
            # The answer is sent before the call leaves the gate: a pause in abort mode, which returns once
            # nothing is in flight, returns after every aborted request has been answered.
            async with self.gate.admitted(call.ticket) as admitted:
                if not admitted:
                    abort_at_gate(self.engine, requests)
                else:
                    try:
                        await self._submit(call, request.stream)
                    except (QueueFullError, EngineStoppedError) as error:
                        await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
                    except RequestError as error:
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
                    async for response in self._responses(call, request.stream):
                        yield response
                    failed = error_abort(requests)
                    if failed is not None:
                        status, message = failed
                        await context.abort(_ABORT_CODES[status], message)
                context.set_trailing_metadata(
                    encode_trailer(
                        [
                            [(s["version"], s["start"], s["end"]) for s in r.weight_versions()]
                            for r in requests
                        ],
                        [r.num_retractions for r in requests],
                    )
                )
                for index, engine_request in enumerate(requests):
                    yield _response(engine_request, _complete(engine_request, index))
        except asyncio.CancelledError:
            # The RPC was cancelled (the client gave up or went away): its requests must not keep decoding.
            abort_unfinished(self.engine, requests)
            raise
        finally:
            for engine_request in requests:
                self._live.pop(engine_request.rid, None)

    def _requests(self, request: pb.GenerateRequest) -> list[Request]:
        """Validate a `GenerateRequest` into engine requests (n of them for `sampling_params.n = n`)."""
        for name in _UNSUPPORTED_FIELDS:
            value = getattr(request, name)
            present = request.HasField(name) if name in ("mm_inputs", "disaggregated_params") else bool(value)
            if present:
                raise RequestError(f"`{name}` is not supported by the built-in engine")
        prompt = list(request.tokenized.input_ids)
        vocab = self.engine.model.config.vocab_size
        check_prompt(prompt, vocab)
        try:
            params = parse_object(SamplingParamsBody, sampling_fields(request.sampling_params))
        except WireError as error:
            raise RequestError(str(error)) from None
        options = SamplingOptions.from_wire(params, vocab)
        self.limits.check_call([options.n])
        requests = prompt_requests(
            self.engine,
            prompt,
            options,
            rid=request.request_id or uuid.uuid4().hex,
            return_logprob=request.return_logprob,
            logprob_start_len=request.logprob_start_len,
            top_logprobs_num=request.top_logprobs_num,
            stream=request.stream,
        )
        return requests

    async def _submit(self, call: Call, stream: bool) -> None:
        """Queue the call's requests on the scheduler; refused when an HTTP request holds one of the rids."""
        loop = asyncio.get_running_loop()
        for index, engine_request in enumerate(call.requests):
            engine_request.on_update = forwarder(loop, call.queue, index, every_token=stream)

        # Queuing touches nothing a launched decode step reads: no need to wait for it.
        await self._engine(lambda: add_requests(self.engine, call.requests, self.limits), drain=False)

    async def _responses(self, call: Call, stream: bool) -> AsyncIterator[pb.GenerateResponse]:
        """Chunks of new tokens while the requests run (when streaming); returns once all have finished."""
        requests = call.requests
        sent = [0] * len(requests)
        finished: set[int] = set()
        while len(finished) < len(requests):
            updates = [await call.queue.get()]
            while not call.queue.empty():
                updates.append(call.queue.get_nowait())
            for index, _, done in updates:
                if done:
                    finished.add(index)
            if not stream:
                continue
            for index, engine_request in enumerate(requests):
                length = len(engine_request.output_ids)
                interval = engine_request.options.stream_interval
                due = length > sent[index] and (index in finished or length - sent[index] >= interval)
                if due:
                    yield _response(engine_request, _chunk(engine_request, index, sent[index], length))
                    sent[index] = length

    # ---------------------------------------------------------------------------------------------- Abort
    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.AbortResponse:
        rid = request.request_id
        call = self._live.get(rid)
        found = await self._engine(lambda: self.engine.abort(rid, "Aborted"))
        if call is not None and not any(r.was_running or r.finished for r in call.requests):
            await self.gate.abort_waiting([call.ticket])
            found = True
        return pb.AbortResponse(success=found, message=f"Request {rid} {'aborted' if found else 'not found'}")

    # ---------------------------------------------------------------------------------------------- health
    async def HealthCheck(
        self, request: pb.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.HealthCheckResponse:
        """Healthy once warm-up is done and a one-token probe gets through the scheduler in time
        (`info.probe_health`)."""
        if not self.ready:
            return pb.HealthCheckResponse(healthy=False, message="The server is starting")
        if not await probe_health(self.engine):
            return pb.HealthCheckResponse(
                healthy=False, message=f"Health check timeout after {HEALTH_CHECK_TIMEOUT_S:.0f}s"
            )
        return pb.HealthCheckResponse(healthy=True, message="Health check passed")

    # ---------------------------------------------------------------------------------------------- info
    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetModelInfoResponse:
        config = self.engine.model.config
        return pb.GetModelInfoResponse(
            model_path=self.info.args.model_path,
            tokenizer_path=self.info.args.tokenizer_path or "",
            is_generation=True,
            weight_version=self.engine.weight_version,
            served_model_name=self.info.args.served_model_name,
            max_context_length=self.engine.context_length,
            vocab_size=config.vocab_size,
            model_type=config.model_type,
            eos_token_ids=sorted(self.engine.eos_token_ids),
            max_req_input_len=self.engine.context_length - 1,
            architectures=config.architectures,
        )

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetServerInfoResponse:
        """The launch arguments and the scheduler's handshake that `/server_info` reports, and the state."""
        engine = self.engine
        snapshot = engine.snapshot
        arguments = Struct()
        arguments.update(server_args(self.info.args))
        handshake = scheduler_info(engine, self.info.startup)
        scheduler = Struct()
        scheduler.update(handshake)
        start_time = Timestamp()
        start_time.FromSeconds(int(self.started_s))
        return pb.GetServerInfoResponse(
            server_args=arguments,
            scheduler_info=scheduler,
            active_requests=snapshot.num_running + snapshot.num_waiting + self.gate.num_waiting,
            is_paused=self.gate.paused is not None,
            uptime_seconds=time.time() - self.started_s,
            sglang_version=SERVER_VERSION,
            server_type=SERVER_TYPE,
            start_time=start_time,
            max_total_num_tokens=handshake["max_total_num_tokens"],
        )

    async def GetLoads(
        self, request: pb.GetLoadsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetLoadsResponse:
        """The reading `/v1/loads` reports, as `SchedulerLoad` (core keys, then the sections asked for)."""
        try:
            sections = load_sections(request.include)
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        if request.HasField("dp_rank") and request.dp_rank != 0:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"dp_rank {request.dp_rank}: there is only 0"
            )
        reading = Load.read(self.engine, self.gate)
        report = reading.sglang_json(sections)
        load = pb.SchedulerLoad(
            dp_rank=0,
            num_running_reqs=reading.num_running_reqs,
            num_waiting_reqs=reading.num_waiting_reqs,
            num_total_reqs=reading.num_running_reqs + reading.num_waiting_reqs,
            num_used_tokens=reading.num_used_tokens,
            max_total_num_tokens=reading.max_total_num_tokens,
            token_usage=report["token_usage"],
            gen_throughput=report["gen_throughput"],
            cache_hit_rate=report["cache_hit_rate"],
            utilization=report["utilization"],
            max_running_requests=reading.max_running_requests,
            num_waiting_uncached_tokens=report["num_waiting_uncached_tokens"],
        )
        if "memory" in report:
            load.memory.CopyFrom(pb.MemoryMetrics(**report["memory"]))
        if "disaggregation" in report:
            disaggregation = dict(report["disaggregation"])
            # The proto names SGLang's `prefill_bootstrap_queue_reqs` `prefill_prealloc_queue_reqs`.
            disaggregation["prefill_prealloc_queue_reqs"] = disaggregation.pop("prefill_bootstrap_queue_reqs")
            load.disaggregation.CopyFrom(pb.DisaggregationMetrics(**disaggregation))
        if "queues" in report:
            queues = report["queues"]
            load.queues.CopyFrom(
                pb.QueueMetrics(
                    waiting=queues["waiting"],
                    grammar=queues["grammar"],
                    paused=queues["paused"],
                    retracted=queues["retracted"],
                )
            )
        return pb.GetLoadsResponse(
            timestamp=datetime.datetime.now(datetime.UTC).isoformat(),
            version=SERVER_VERSION,
            dp_rank_count=1,
            loads=[load],
            aggregate=pb.AggregateMetrics(
                total_running_reqs=load.num_running_reqs,
                total_waiting_reqs=load.num_waiting_reqs,
                total_reqs=load.num_total_reqs,
                avg_token_usage=load.token_usage,
                avg_throughput=load.gen_throughput,
                avg_utilization=load.utilization,
            ),
        )


def _output_logprobs(request: Request, start: int, end: int) -> pb.OutputLogProbs | None:
    if not request.return_logprob:
        return None
    top = [
        pb.TopLogProbs(values=[value for value, _ in row], token_ids=[token for _, token in row])
        for row in request.output_top_logprobs[start:end]
    ]
    return pb.OutputLogProbs(
        token_logprobs=request.output_logprobs[start:end],
        token_ids=request.output_ids[start:end],
        top_logprobs=top,
    )


def _input_logprobs(request: Request) -> pb.InputLogProbs | None:
    if not request.return_logprob or not request.input_logprobs:
        return None
    prompt = request.prompt_ids
    return pb.InputLogProbs(
        token_logprobs=[
            pb.InputTokenLogProb() if value is None else pb.InputTokenLogProb(value=value)
            for value in request.input_logprobs
        ],
        token_ids=prompt[len(prompt) - len(request.input_logprobs) :],
        top_logprobs=[
            pb.TopLogProbs(values=[v for v, _ in row or ()], token_ids=[t for _, t in row or ()])
            for row in request.input_top_logprobs
        ],
    )


def _chunk(request: Request, index: int, start: int, end: int) -> pb.GenerateStreamChunk:
    return pb.GenerateStreamChunk(
        token_ids=request.output_ids[start:end],
        prompt_tokens=len(request.prompt_ids),
        completion_tokens=end,
        cached_tokens=request.cached_tokens,
        output_logprobs=_output_logprobs(request, start, end),
        input_logprobs=_input_logprobs(request) if start == 0 else None,
        index=index,
    )


def _complete(request: Request, index: int) -> pb.GenerateComplete:
    reason = request.finish_reason or abort_reason("unfinished")
    complete = pb.GenerateComplete(
        output_ids=request.output_ids,
        finish_reason=str(reason["type"]),
        prompt_tokens=len(request.prompt_ids) if request.was_running else 0,
        completion_tokens=len(request.output_ids),
        cached_tokens=request.cached_tokens,
        output_logprobs=_output_logprobs(request, 0, len(request.output_ids)),
        input_logprobs=_input_logprobs(request),
        index=index,
    )
    matched = reason.get("matched")
    if isinstance(matched, int):
        complete.matched_token_id = matched
    elif isinstance(matched, str):
        complete.matched_stop_str = matched
    return complete


def _response(request: Request, message: pb.GenerateStreamChunk | pb.GenerateComplete) -> pb.GenerateResponse:
    if isinstance(message, pb.GenerateStreamChunk):
        return pb.GenerateResponse(request_id=request.rid, chunk=message)
    return pb.GenerateResponse(request_id=request.rid, complete=message)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but `HealthCheck` without `authorization: Bearer KEY` (UNAUTHENTICATED)."""

    def __init__(self, api_key: str) -> None:
        self._expected = authorization(api_key)[0]

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        method = handler_call_details.method or ""
        metadata = tuple(handler_call_details.invocation_metadata or ())
        handler = await continuation(handler_call_details)
        if handler is None or method.endswith("/HealthCheck") or self._expected in metadata:
            return handler
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
    async def refuse(_request: object, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "Unauthorized: send `authorization: Bearer KEY`")

    async def refuse_stream(
        _request: object, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "Unauthorized: send `authorization: Bearer KEY`")
        yield None  # pragma: no cover (abort raises)

    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(
            refuse_stream,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    return grpc.unary_unary_rpc_method_handler(
        refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


async def start_grpc_server(
    service: SchedulerService, host: str, port: int, api_key: str | None
) -> tuple[grpc.aio.Server, int]:
    """Serve `service` on `host:port` (0 picks a free port); returns the started server and its port. A
    message larger than the server's `--max-request-body-bytes` is refused by gRPC (`RESOURCE_EXHAUSTED`)
    before it is read whole; responses are not bounded."""
    max_receive = min(service.info.args.max_request_body_bytes, 2**31 - 1)  # a C int
    server = grpc.aio.server(
        interceptors=[ApiKeyInterceptor(api_key)] if api_key else None,
        options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", max_receive)],
    )
    pb_grpc.add_SglangSchedulerServicer_to_server(service, server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind the gRPC server to {address}")
    await server.start()
    return server, bound
