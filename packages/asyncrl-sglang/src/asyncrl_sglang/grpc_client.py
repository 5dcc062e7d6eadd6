"""Generation over SGLang's gRPC scheduler service; control stays on HTTP.

`GrpcSGLangClient` is an `SGLangClient` whose `generate` sends token ids to the `SglangScheduler` service
(`smg-grpc-proto`) instead of posting JSON to `/generate`: ids travel as packed varints in both directions
and nothing is parsed from text. Pause, continue, weight updates and versions go over HTTP exactly as
before, so the pool, the weight sync and the agent loop use it unchanged.

Which weights produced which tokens. The service has no weight-version field. The built-in engine sends
each request's per-token spans in trailing metadata (`asyncrl_sglang.grpc_wire`); the client reads them
and the generation is `versions_verified`. Against a server that does not send them (real SGLang), the
client derives spans from its own record of the syncs it performed (`SyncRecord`): it asks for a streamed
response and labels each chunk of tokens with the version its record held when the chunk arrived, or,
while one of its pauses is open, the version from before the pause (tokens that arrive then were sampled
before it). Those spans are `versions_verified=False`: they see only the syncs made through this client
object, and a token sampled just before a pause but delivered after the continue would be labelled new.
Once a server has sent spans, requests to it are no longer streamed (one message per request).

Errors keep the HTTP client's meaning: a request the engine refuses (`INVALID_ARGUMENT`, `OUT_OF_RANGE`,
`UNAUTHENTICATED`, ...) or fails (`INTERNAL`, HTTP's 500) raises `GenerationError` with the server's message;
`UNAVAILABLE` is retried under the same request id after aborting it (a duplicate id that the client's own
resend caused is waited out), and raises `EngineUnavailableError` once the retries or `timeouts.generate_s`
are spent, with the HTTP client's retry policy and overall deadline. An abort that carries an HTTP status
reaches the client as the call's code, never as a `GenerateComplete` (which has no status field): SGLang's
servicer maps 400 to `INVALID_ARGUMENT`, 503 to `UNAVAILABLE`, 500 to `INTERNAL`, as the built-in engine
does, so a `GenerateComplete` with finish reason `abort` is a user's abort. A call cancelled by the caller
cancels its RPC, which aborts the request on the server. An engine that cannot be reached is waited for by
the pool, as over HTTP: `health` is `/health` and a connected gRPC channel, and the channel reconnects on the
retry policy's backoff (`channel_options`).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from asyncrl_core.errors import EngineUnavailableError, GenerationError
from asyncrl_core.types import Generation, SamplingParams, VersionSpan
from asyncrl_sglang._schema import parse_version, tiles
from asyncrl_sglang.client import ClientTimeouts, PauseMode, RetryPolicy, SGLangClient
from asyncrl_sglang.grpc_wire import (
    FINISH_REASONS,
    TrailerError,
    authorization,
    decode_trailer,
    sampling_message,
)
from asyncrl_sglang.wire import DUPLICATE_RID


def channel_options(retry: RetryPolicy) -> tuple[tuple[str, int], ...]:
    """The channel's options. No message-size limit: a long prompt and its logprobs are one message each.
    A lost server is connected to again on `retry`'s backoff (from `initial_backoff_s`, at most
    `max_backoff_s` apart) rather than gRPC's own, which grows to 120 s: a channel waits that out failing
    every call at once (`UNAVAILABLE`), so an engine restarted on its address would stay out of reach through
    it long after it answers, where the HTTP client connects anew at each attempt."""
    return (
        ("grpc.max_send_message_length", -1),
        ("grpc.max_receive_message_length", -1),
        ("grpc.initial_reconnect_backoff_ms", max(1, round(retry.initial_backoff_s * 1000))),
        ("grpc.max_reconnect_backoff_ms", max(1, round(retry.max_backoff_s * 1000))),
    )


@dataclass(slots=True)
class SyncRecord:
    """The weight versions this client set, for deriving spans against servers that do not report them.

    `version` is the version the engine holds as far as this client knows (None until first read);
    `held` is the version from before an open pause (tokens that arrive during it were sampled before it).
    """

    version: int | None = None
    held: int | None = None
    num_pauses: int = 0

    def label(self) -> int | None:
        """The version a token arriving now was sampled under."""
        return self.held if self.num_pauses > 0 else self.version

    def set_version(self, version: int) -> None:
        self.version = version


class GrpcSGLangClient(SGLangClient):
    """`SGLangClient` generating over gRPC at `grpc_target` (`host:port`); everything else over HTTP at
    `base_url`. Implements `GenerationClient`; create it inside the event loop that uses it."""

    def __init__(
        self,
        base_url: str,
        grpc_target: str,
        *,
        api_key: str | None = None,
        timeouts: ClientTimeouts | None = None,
        retry: RetryPolicy | None = None,
        max_connections: int = 1024,
    ) -> None:
        super().__init__(
            base_url, api_key=api_key, timeouts=timeouts, retry=retry, max_connections=max_connections
        )
        self.grpc_target = grpc_target
        self._metadata = authorization(api_key)
        self._channel = grpc.aio.insecure_channel(grpc_target, options=channel_options(self.retry))
        self._stub = pb_grpc.SglangSchedulerStub(self._channel)
        self.syncs = SyncRecord()
        self.server_sends_spans: bool | None = None
        """Whether the server reports per-token spans (None until its first answer)."""

    def __repr__(self) -> str:
        return f"GrpcSGLangClient({self.base_url!r}, {self.grpc_target!r})"

    async def aclose(self) -> None:
        await self._channel.close()
        await super().aclose()

    # ---------------------------------------------------------------------------------------------------
    # Generation

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        rid: str | None = None,
        routing_key: str | None = None,
    ) -> Generation:
        """Sample a continuation of `input_ids` over gRPC (see `SGLangClient.generate`)."""
        if not input_ids:
            raise GenerationError("cannot generate from an empty prompt: input_ids has no token")
        rid = rid or uuid.uuid4().hex
        stream = self.server_sends_spans is not True
        if self.server_sends_spans is False and self.syncs.version is None:
            self.syncs.version = await self.weight_version()
        request = pb.GenerateRequest(
            request_id=rid,
            tokenized=pb.TokenizedInput(input_ids=[int(token_id) for token_id in input_ids]),
            sampling_params=sampling_message(sampling),
            return_logprob=True,
            logprob_start_len=-1,
            stream=stream,
        )
        self._num_outstanding += 1
        try:
            return await self._generate_with_retries(request, len(input_ids))
        finally:
            self._num_outstanding -= 1

    async def _generate_with_retries(self, request: pb.GenerateRequest, num_prompt_tokens: int) -> Generation:
        rid = request.request_id
        timeout_s = self.timeouts.generate_s
        resent = False
        last_error: grpc.aio.AioRpcError | None = None
        try:
            async with asyncio.timeout(self._deadline_s(timeout_s)):
                for attempt in range(self.retry.max_attempts):
                    if attempt:
                        await asyncio.sleep(self.retry.backoff_s(attempt - 1))
                    try:
                        return await self._generate_once(request, num_prompt_tokens, timeout_s)
                    except grpc.aio.AioRpcError as error:
                        code, details = error.code(), error.details() or ""
                        if code == grpc.StatusCode.UNAVAILABLE:
                            # Sent or not, the server may hold this rid: abort it before the rid goes again.
                            last_error, resent = error, True
                            await self._abort_quietly(rid)
                            continue
                        if resent and code == grpc.StatusCode.INVALID_ARGUMENT and DUPLICATE_RID in details:
                            last_error = error  # the copy sent before the failure is still being aborted
                            continue
                        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                            raise TimeoutError from error
                        verb = "failed" if code == grpc.StatusCode.INTERNAL else "refused"
                        raise GenerationError(
                            f"{self.grpc_target} Generate {verb} request {rid} ({code.name}): {details}"
                        ) from None
        except TimeoutError as exc:
            await self._abort_quietly(rid)
            raise EngineUnavailableError(
                f"{self.grpc_target} Generate request {rid} did not finish within {timeout_s:.0f} s; "
                "it was aborted on the server"
            ) from exc
        failure = "no attempt" if last_error is None else f"{last_error.code().name}: {last_error.details()}"
        raise EngineUnavailableError(
            f"{self.grpc_target} Generate request {rid} failed {self.retry.max_attempts} times; last error: "
            f"{failure}"
        ) from last_error

    async def _generate_once(
        self, request: pb.GenerateRequest, num_prompt_tokens: int, timeout_s: float
    ) -> Generation:
        call = self._stub.Generate(request, metadata=self._metadata, timeout=timeout_s)
        streamed_ids: list[int] = []
        streamed_logprobs: list[float] = []
        labels: list[tuple[int, int | None]] = []
        """(output length after a chunk, the version label when it arrived)."""
        complete: pb.GenerateComplete | None = None
        async for response in call:
            if response.HasField("chunk"):
                chunk = response.chunk
                streamed_ids.extend(chunk.token_ids)
                streamed_logprobs.extend(chunk.output_logprobs.token_logprobs)
                labels.append((len(streamed_ids), self.syncs.label()))
            elif response.HasField("complete"):
                complete = response.complete
        if complete is None:
            raise GenerationError(
                f"malformed Generate answer from {self.grpc_target}: the stream of request "
                f"{request.request_id} ended without a GenerateComplete"
            )
        try:
            spans, retractions = decode_trailer(await call.trailing_metadata())
        except TrailerError as error:
            raise GenerationError(f"malformed Generate answer from {self.grpc_target}: {error}") from None
        self.server_sends_spans = spans is not None
        if spans is None and self.syncs.version is None:
            # The first answer of a server that does not report spans: learn the version it started from.
            self.syncs.version = await self.weight_version()
            labels = [(end, self.syncs.version if label is None else label) for end, label in labels]
        return self._generation(
            complete, streamed_ids, streamed_logprobs, labels, spans, retractions, num_prompt_tokens
        )

    def _generation(
        self,
        complete: pb.GenerateComplete,
        streamed_ids: list[int],
        streamed_logprobs: list[float],
        labels: list[tuple[int, int | None]],
        spans: list[list[tuple[str, int, int]]] | None,
        retractions: list[int] | None,
        num_prompt_tokens: int,
    ) -> Generation:
        def malformed(what: str) -> GenerationError:
            return GenerationError(f"malformed Generate answer from {self.grpc_target}: {what}")

        # GenerateComplete holds every output id (the built-in engine) or, after a stream, possibly only the
        # last delta (SGLang's servicer): the streamed chunks are the whole output then.
        output_ids = list(complete.output_ids)
        logprobs = list(complete.output_logprobs.token_logprobs)
        if streamed_ids and len(output_ids) != complete.completion_tokens:
            output_ids, logprobs = streamed_ids, streamed_logprobs
        if len(output_ids) != complete.completion_tokens:
            raise malformed(f"{len(output_ids)} output ids, completion_tokens {complete.completion_tokens}")
        if len(logprobs) != len(output_ids):
            raise malformed(f"{len(logprobs)} output logprobs for {len(output_ids)} output ids")
        finish = FINISH_REASONS.get(complete.finish_reason)
        if finish is None:
            raise malformed(f"unknown finish_reason {complete.finish_reason!r}")
        matched_kind = complete.WhichOneof("matched_stop")
        matched: int | str | None = None if matched_kind is None else getattr(complete, matched_kind)
        index = complete.index
        if spans is not None:
            if index >= len(spans):
                raise malformed(f"no version spans for completion index {index}")
            version_spans = tuple(VersionSpan(parse_version(v), start, end) for v, start, end in spans[index])
            if not tiles(version_spans, len(output_ids)):
                raise malformed(f"version spans {spans[index]} do not tile the {len(output_ids)} output ids")
            verified = True
        else:
            version_spans = self._derived_spans(labels, len(output_ids))
            verified = False
        num_retractions = 0
        if retractions is not None and index < len(retractions):
            num_retractions = retractions[index]
        return Generation(
            output_ids=[int(token_id) for token_id in output_ids],
            logprobs=[float(logprob) for logprob in logprobs],
            text="",
            finish_reason=finish,
            version_spans=version_spans,
            versions_verified=verified,
            matched_stop=matched,
            prompt_tokens=complete.prompt_tokens or num_prompt_tokens,
            num_retractions=num_retractions,
        )

    def _derived_spans(
        self, labels: list[tuple[int, int | None]], num_tokens: int
    ) -> tuple[VersionSpan, ...]:
        """Spans from the labels of the streamed chunks; tokens no chunk covered get the label of now."""
        fallback = self.syncs.label()
        spans: list[VersionSpan] = []
        start = 0
        for end, label in [*labels, (num_tokens, fallback)]:
            end = min(end, num_tokens)
            if end <= start:
                continue
            version = label if label is not None else 0
            if spans and spans[-1].version == version:
                spans[-1] = VersionSpan(version, spans[-1].start, end)
            else:
                spans.append(VersionSpan(version, start, end))
            start = end
        if not spans:
            spans.append(VersionSpan(fallback if fallback is not None else 0, 0, 0))
        return tuple(spans)

    async def _abort_quietly(self, rid: str) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, TimeoutError):
            async with asyncio.timeout(self.timeouts.control_s):
                await self.abort(rid)

    async def health(self) -> bool:
        """`/health` answers 200 (`SGLangClient.health`) and the channel to the gRPC service connects within
        `timeouts.health_s`. Generation goes over gRPC, so an engine whose HTTP server answers while its
        gRPC service cannot be reached yet (it is restarting, or the channel waits out its reconnect
        backoff) is not up: the pool keeps routing around it, and a request that waits for it keeps
        waiting, exactly as when its HTTP server is unreachable."""
        if not await super().health():
            return False
        try:
            async with asyncio.timeout(self.timeouts.health_s):
                await self._channel.channel_ready()
        except TimeoutError:
            return False
        return True

    # ---------------------------------------------------------------------------------------------------
    # Calls of the gRPC service besides Generate

    async def abort(self, rid: str) -> None:
        """Abort request `rid` through the service's `Abort` (a no-op for an unknown rid)."""
        await self._stub.Abort(
            pb.AbortRequest(request_id=rid, reason="aborted by the client"),
            metadata=self._metadata,
            timeout=self.timeouts.control_s,
        )

    async def grpc_health(self) -> bool:
        """The service's `HealthCheck` (one probe, no retries): False while starting, paused long enough
        for the probe to time out, or unreachable."""
        try:
            reply = await self._stub.HealthCheck(
                pb.HealthCheckRequest(), metadata=self._metadata, timeout=self.timeouts.health_s + 20.0
            )
        except grpc.aio.AioRpcError:
            return False
        return reply.healthy

    async def grpc_model_info(self) -> pb.GetModelInfoResponse:
        return await self._stub.GetModelInfo(
            pb.GetModelInfoRequest(), metadata=self._metadata, timeout=self.timeouts.control_s
        )

    async def grpc_server_info(self) -> pb.GetServerInfoResponse:
        return await self._stub.GetServerInfo(
            pb.GetServerInfoRequest(), metadata=self._metadata, timeout=self.timeouts.control_s
        )

    async def grpc_loads(self) -> pb.GetLoadsResponse:
        return await self._stub.GetLoads(
            pb.GetLoadsRequest(), metadata=self._metadata, timeout=self.timeouts.control_s
        )

    # ---------------------------------------------------------------------------------------------------
    # Control over HTTP, recorded for derived spans

    async def pause(self, mode: PauseMode) -> None:
        if self.syncs.num_pauses == 0:
            self.syncs.held = self.syncs.version
        self.syncs.num_pauses += 1
        try:
            await super().pause(mode)
        except BaseException:
            self.syncs.num_pauses -= 1
            raise

    async def continue_generation(self) -> None:
        # Tokens sampled after the continue can only arrive after it was sent: stop holding the label now.
        self.syncs.num_pauses = 0
        await super().continue_generation()

    def _relabelled(self, version: int) -> None:
        self.syncs.set_version(version)


def grpc_health_check(target: str, api_key: str | None, *, timeout_s: float) -> bool:
    """One blocking `HealthCheck` of the service at `target` (the launcher polls it before handing out
    clients): True when it answers healthy within `timeout_s`, False otherwise (starting, unreachable)."""
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.SglangSchedulerStub(channel)
        try:
            reply = stub.HealthCheck(
                pb.HealthCheckRequest(), metadata=authorization(api_key), timeout=timeout_s
            )
        except grpc.RpcError:
            return False
    return bool(reply.healthy)
