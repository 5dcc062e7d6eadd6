"""An async HTTP client for one server speaking SGLang's native protocol (real SGLang or the built-in engine).

Every call has a hard bound: httpx's connect/read/write/pool timeouts bound each phase, and an overall
deadline bounds the whole call, retries included. Retries are bounded, with exponential backoff, and only
where a resend cannot do harm:
- a failure to connect (or to get a pooled connection) means the request never left: always retried;
- a read failure on an idempotent call (GETs, pause, continue, abort, flush, version relabel) is retried;
- a weight update, a group init or a distributed update that may have reached the server is never resent;
- `/generate` is resent after a dropped connection only under the same `rid`, after aborting that rid: the
  server holds at most one live request per rid (a second one is refused as a duplicate, which the client
  waits out), so a resend can never produce two generations for one call. A generation that times out is
  aborted on the server, so it stops using the engine.

Version differences the contract lists are absorbed here and in `asyncrl_sglang._schema`: pause and continue
always carry a JSON body, `/model_info` falls back to `/get_model_info` and `/get_weight_version`,
`/server_info` to `/get_server_info`, `/v1/loads` to `/get_load`, and a 404 from `/begin_weight_update` means
the server needs no update session.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Self, TypeVar, cast

import httpx
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel
from pydantic_core import to_json

from asyncrl_core.errors import (
    EngineControlError,
    EngineUnavailableError,
    GenerationError,
)
from asyncrl_core.metrics import ENGINE_NUM_GENERATED_TOKENS, ENGINE_PREFILL_S
from asyncrl_core.types import Generation, SamplingParams
from asyncrl_sglang._schema import (
    AbortStatusError,
    generate_body,
    parse_generation,
    parse_version,
    version_label,
)
from asyncrl_sglang.tensor_codec import TensorCodecError, encode_tensors
from asyncrl_sglang.wire import (
    DEFAULT_GROUP_NAME as DEFAULT_GROUP_NAME,
)
from asyncrl_sglang.wire import (
    DUPLICATE_RID,
    DestroyWeightsUpdateGroupRequest,
    GetWeightsByNameRequest,
    InitWeightsUpdateGroupRequest,
    LoadsReply,
    ModelInfo,
    UpdateResult,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightVersionRequest,
    WeightsReply,
    WeightsReplyModel,
    WeightVersionReply,
    WireError,
    error_message,
    parse_json,
)
from asyncrl_sglang.wire import (
    PauseMode as PauseMode,
)

if TYPE_CHECKING:
    import torch

    from asyncrl_core.protocols import NamedTensors

JsonObject = dict[str, object]
ModelT = TypeVar("ModelT", bound=BaseModel)

_GENERATION_TOKENS = "sglang:generation_tokens_total"
"""SGLang's counter of generated tokens in `/metrics`."""
_NEVER_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
_MAYBE_SENT = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError, httpx.WriteTimeout)


@dataclass(frozen=True, slots=True)
class ClientTimeouts:
    """Seconds each kind of call may take. Every call also has an overall deadline (the same number, plus the
    retries' backoff), so none can hang."""

    connect_s: float = 5.0
    """Opening a TCP connection."""
    control_s: float = 60.0
    """Control and info calls (pause, continue, abort, flush, model info, health, metrics, ...). A pause in
    `abort` mode waits for in-flight requests to return, so it gets this much time too."""
    generate_s: float = 600.0
    """One `/generate` call, including any time it is held by a pause for a weight sync."""
    weight_update_s: float = 600.0
    """One weight-update call (tensor or distributed bucket, group init, session begin/end)."""
    health_s: float = 5.0
    """One `/health` probe."""


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Bounded retries with exponential backoff (and jitter) for calls that may be resent."""

    max_attempts: int = 4
    """Attempts in all, the first one included."""
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 5.0

    def backoff_s(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number `attempt` (0-based)."""
        base = min(self.max_backoff_s, self.initial_backoff_s * (2.0**attempt))
        return base * (0.5 + random.random() / 2.0)

    def total_backoff_s(self) -> float:
        """The most time all backoffs of one call can take."""
        return sum(
            min(self.max_backoff_s, self.initial_backoff_s * (2.0**attempt))
            for attempt in range(self.max_attempts - 1)
        )


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """Saturation gauges of one engine, from its Prometheus `/metrics` (summed over label sets)."""

    num_running_requests: float
    num_queued_requests: float
    token_usage: float
    values: Mapping[str, float]
    """Every sample in the text, summed per metric name (histogram parts keep their `_bucket`/`_sum`
    suffixes)."""


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum every sample of a Prometheus text exposition per sample name (labels dropped, NaN samples skipped),
    read by `prometheus_client`'s parser. `ValueError` for text that is not the exposition format."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not math.isnan(sample.value):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def serialize_named_tensors(named_tensors: NamedTensors) -> str:
    """One `serialized_named_tensors` entry: the base64 text of a safetensors file holding `named_tensors`
    (`asyncrl_sglang.tensor_codec`). This is the format the built-in engine loads (`load_format:
    "safetensors"`): plain bytes, never a pickle. A name given twice: `EngineControlError`."""
    try:
        return encode_tensors(named_tensors)
    except TensorCodecError as error:
        raise EngineControlError(f"weight bucket: {error}") from None


_JSON_HEADERS = {"Content-Type": "application/json"}


def _json_bytes(body: JsonObject | None) -> bytes | None:
    """A request body as JSON bytes, by pydantic-core's serialiser: the standard library's takes 0.17 s over
    the 38 MB string of a 7M-parameter weight payload, this one a small fraction of that."""
    return None if body is None else to_json(body)


def _body(request: BaseModel) -> JsonObject:
    """The JSON of a request model, with only the fields that were set."""
    return request.model_dump(mode="json", exclude_unset=True)


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's spelling of a torch dtype (`torch.bfloat16` -> `"bfloat16"`)."""
    return str(dtype).removeprefix("torch.")


class SGLangClient:
    """Client of one engine at `base_url` (`http://host:port`); implements `GenerationClient`.

    Use it as an async context manager (or call `aclose`): it owns a pooled `httpx.AsyncClient`.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeouts: ClientTimeouts | None = None,
        retry: RetryPolicy | None = None,
        max_connections: int = 1024,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """`max_connections` bounds concurrent HTTP connections (hence concurrent `/generate` calls) to this
        engine; `transport` replaces the network (tests record requests with `httpx.MockTransport`)."""
        self.base_url = base_url.rstrip("/")
        self.timeouts = timeouts or ClientTimeouts()
        self.retry = retry or RetryPolicy()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=64),
            transport=transport,
            # Loopback engines must never be sent through an HTTP proxy from the environment.
            trust_env=False,
        )
        self._num_outstanding = 0

    def __repr__(self) -> str:
        return f"SGLangClient({self.base_url!r})"

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool; the client is not used afterwards."""
        await self._http.aclose()

    @property
    def num_outstanding(self) -> int:
        """`/generate` calls of this client that have not returned yet."""
        return self._num_outstanding

    # ---------------------------------------------------------------------------------------------------
    # Transport with timeouts and retries

    def _timeout(self, total_s: float) -> httpx.Timeout:
        return httpx.Timeout(total_s, connect=min(self.timeouts.connect_s, total_s), pool=total_s)

    def _deadline_s(self, timeout_s: float) -> float:
        """The bound of a whole call whose attempts may each take `timeout_s`: one attempt, every backoff of
        the retry policy and one connect. Every call with retries has it, `/generate` and the gRPC
        `Generate` included."""
        return timeout_s + self.retry.total_backoff_s() + self.timeouts.connect_s

    async def _send(
        self,
        method: str,
        path: str,
        *,
        body: JsonObject | None = None,
        params: Mapping[str, str | float] | None = None,
        timeout_s: float,
        idempotent: bool,
    ) -> httpx.Response:
        """One call with retries; `EngineUnavailableError` once they are spent or the deadline has passed."""
        deadline_s = self._deadline_s(timeout_s)
        try:
            async with asyncio.timeout(deadline_s):
                return await self._send_with_retries(method, path, body, params, timeout_s, idempotent)
        except TimeoutError as exc:
            raise EngineUnavailableError(
                f"{method} {self.base_url}{path} did not complete within {deadline_s:.0f} s"
            ) from exc

    async def _send_with_retries(
        self,
        method: str,
        path: str,
        body: JsonObject | None,
        params: Mapping[str, str | float] | None,
        timeout_s: float,
        idempotent: bool,
    ) -> httpx.Response:
        last_error: Exception | None = None
        for attempt in range(self.retry.max_attempts):
            if attempt:
                await asyncio.sleep(self.retry.backoff_s(attempt - 1))
            try:
                return await self._http.request(
                    method,
                    path,
                    content=_json_bytes(body),
                    headers=_JSON_HEADERS if body is not None else None,
                    params=params,
                    timeout=self._timeout(timeout_s),
                )
            except _NEVER_SENT as exc:
                last_error = exc
            except (*_MAYBE_SENT, httpx.ReadTimeout) as exc:
                if not idempotent:
                    raise EngineUnavailableError(
                        f"{method} {self.base_url}{path} failed after the request may have reached the "
                        f"server ({type(exc).__name__}: {exc}); it is not resent because it is not idempotent"
                    ) from exc
                last_error = exc
        raise EngineUnavailableError(
            f"{method} {self.base_url}{path} failed {self.retry.max_attempts} times; last error: "
            f"{type(last_error).__name__}: {last_error}"
        ) from last_error

    @staticmethod
    def _json(response: httpx.Response) -> object:
        try:
            return response.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None

    def _control_error(self, path: str, response: httpx.Response) -> EngineControlError:
        message = error_message(response.content, response.text.strip() or response.reason_phrase)
        return EngineControlError(f"{self.base_url}{path} answered {response.status_code}: {message}")

    async def _control(
        self,
        method: str,
        path: str,
        body: JsonObject | None = None,
        *,
        timeout_s: float | None = None,
        idempotent: bool = True,
        params: Mapping[str, str | float] | None = None,
    ) -> httpx.Response:
        response = await self._send(
            method,
            path,
            body=body,
            params=params,
            timeout_s=timeout_s or self.timeouts.control_s,
            idempotent=idempotent,
        )
        if response.status_code != 200:
            raise self._control_error(path, response)
        return response

    async def _update(self, path: str, body: JsonObject, *, idempotent: bool = False) -> str:
        """A weight-update style call answering `{"success": bool, "message": str}`; returns the message."""
        response = await self._send(
            "POST", path, body=body, timeout_s=self.timeouts.weight_update_s, idempotent=idempotent
        )
        try:
            result = parse_json(UpdateResult, response.content)
        except WireError:
            result = None
        if response.status_code != 200 or result is None or not result.success:
            raise self._control_error(path, response)
        return result.message

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
        """Sample a continuation of `input_ids` (see `GenerationClient.generate`).

        `rid` names the request on the server (a fresh uuid4 hex when None), so it can be aborted;
        `routing_key` is ignored (one engine: every request goes to it). Raises
        `GenerationError` with the server's message when the engine refuses the request (400: too long for
        the context, bad sampling values, a rid already in flight) or fails it (500: an internal error of
        the engine, such as a request that fails a step on its own; never sent again), and
        `EngineUnavailableError` when the engine cannot be reached, keeps answering 503 or the request does
        not finish within `timeouts.generate_s`. A 200 body whose finish reason is an abort carrying a
        status is read as an answer of that status (`_schema.AbortStatusError`); an abort without one
        (`abort(rid)`, a pause in abort mode) is returned: its partial output, finish reason `abort`.
        """
        rid = rid or uuid.uuid4().hex
        body = generate_body(input_ids, sampling, rid)
        self._num_outstanding += 1
        try:
            return await self._post_generate(body, rid, len(input_ids))
        finally:
            self._num_outstanding -= 1

    async def _post_generate(self, body: JsonObject, rid: str, num_prompt_tokens: int) -> Generation:
        timeout_s = self.timeouts.generate_s
        resent = False
        last_error: Exception | None = None
        try:
            async with asyncio.timeout(self._deadline_s(timeout_s)):
                for attempt in range(self.retry.max_attempts):
                    if attempt:
                        await asyncio.sleep(self.retry.backoff_s(attempt - 1))
                    try:
                        response = await self._http.post(
                            "/generate",
                            content=_json_bytes(body),
                            headers=_JSON_HEADERS,
                            timeout=self._timeout(timeout_s),
                        )
                    except _NEVER_SENT as exc:
                        last_error = exc
                        continue
                    except _MAYBE_SENT as exc:
                        # The server may still be running this rid: abort it before the same rid goes again.
                        last_error = exc
                        resent = True
                        await self._abort_quietly(rid)
                        continue
                    if response.status_code == 200:
                        try:
                            return parse_generation(response.content, num_prompt_tokens)
                        except AbortStatusError as abort:
                            # An abort with a status in a 200 body is the answer of that status.
                            status, message = abort.status, abort.message
                    else:
                        status = response.status_code
                        message = error_message(response.content, response.text.strip())
                    if resent and status == 400 and DUPLICATE_RID in message:
                        # The copy sent before the connection dropped is still being aborted.
                        continue
                    if status == 503:
                        # The engine's queue is full (nothing was queued), or it stopped under the request
                        # (which it ended): the same request, later; once the retries are spent the pool
                        # sends it to another engine if this one no longer answers /health.
                        last_error = EngineUnavailableError(
                            f"{self.base_url}/generate answered 503: {message}"
                        )
                        continue
                    # Final: a 4xx refuses the request as it is, a 500 is a failure the engine met running it
                    # alone (SGLang's internal error): sent again, it would fail again.
                    verb = "failed" if status >= 500 else "refused"
                    raise GenerationError(
                        f"{self.base_url}/generate {verb} request {rid} ({status}): {message}"
                    )
        except TimeoutError as exc:
            await self._abort_quietly(rid)
            raise EngineUnavailableError(
                f"{self.base_url}/generate request {rid} did not finish within {timeout_s:.0f} s; "
                "it was aborted on the server"
            ) from exc
        except httpx.ReadTimeout as exc:
            await self._abort_quietly(rid)
            raise EngineUnavailableError(
                f"{self.base_url}/generate request {rid} got no answer within {timeout_s:.0f} s; "
                "it was aborted on the server"
            ) from exc
        except asyncio.CancelledError:
            # The caller gave up: the engine should stop spending compute on this request.
            await asyncio.shield(self._abort_quietly(rid))
            raise
        raise EngineUnavailableError(
            f"{self.base_url}/generate request {rid} failed {self.retry.max_attempts} times; last error: "
            f"{type(last_error).__name__}: {last_error}"
        ) from last_error

    async def _abort_quietly(self, rid: str) -> None:
        with contextlib.suppress(EngineUnavailableError, EngineControlError, httpx.HTTPError, TimeoutError):
            async with asyncio.timeout(self.timeouts.control_s):
                await self.abort(rid)

    # ---------------------------------------------------------------------------------------------------
    # Control: abort, pause, continue, flush, memory

    async def abort(self, rid: str) -> None:
        """Abort request `rid`: it returns at once with its partial output and `finish_reason` abort. Unknown
        rids are ignored by the server. A request held at a paused server's admission gate has not reached
        the scheduler and is not aborted by rid: use `abort_all`."""
        await self._control("POST", "/abort_request", {"rid": rid})

    async def abort_all(self) -> None:
        """Abort every request on the engine."""
        await self._control("POST", "/abort_request", {"abort_all": True})

    async def pause(self, mode: PauseMode) -> None:
        """Pause generation (`PauseMode` says what happens to in-flight requests); new requests are held at
        the server until `continue_generation`. In `abort` mode this returns once every in-flight request
        has returned. SGLang 0.5.5 and older ignore the mode and always abort."""
        await self._control("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        """Resume after `pause`: retracted and frozen requests continue, held requests are admitted."""
        await self._control("POST", "/continue_generation", {})

    async def flush_cache(self) -> None:
        """Drop the prefix (radix) cache. The engine refuses (`EngineControlError`) unless it is idle."""
        await self._control("POST", "/flush_cache")

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Free the engine's weights and/or KV cache memory (tags `weights`, `kv_cache`; None for all).
        The engine must be idle."""
        await self._control(
            "POST", "/release_memory_occupation", {} if tags is None else {"tags": list(tags)}
        )

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Undo `release_memory_occupation`."""
        await self._control("POST", "/resume_memory_occupation", {} if tags is None else {"tags": list(tags)})

    # ---------------------------------------------------------------------------------------------------
    # Weight updates

    async def begin_weight_update(self) -> bool:
        """Open a weight-update session; False when the server has no session API (404), which is fine."""
        response = await self._send(
            "POST", "/begin_weight_update", body={}, timeout_s=self.timeouts.weight_update_s, idempotent=False
        )
        if response.status_code == 404:
            return False
        if response.status_code != 200:
            raise self._control_error("/begin_weight_update", response)
        try:
            result = parse_json(UpdateResult, response.content)
        except WireError as error:
            raise EngineControlError(f"{self.base_url}/begin_weight_update answered {error}") from None
        if not result.success:
            raise self._control_error("/begin_weight_update", response)
        return True

    async def end_weight_update(self) -> None:
        """Close the session `begin_weight_update` opened."""
        await self._update("/end_weight_update", {}, idempotent=True)

    async def update_weights_from_tensor(
        self,
        serialized: str | Sequence[str],
        *,
        weight_version: int | None,
        flush_cache: bool,
        num_ranks: int = 1,
        load_format: str | None = "safetensors",
    ) -> str:
        """Load one bucket of weights sent in the request body; returns the server's message.

        `serialized` is one payload for every tensor-parallel rank (repeated `num_ranks` times) or one per
        rank; `serialize_named_tensors` builds the built-in engine's safetensors payload. `weight_version`,
        when given, becomes the server's version once the bucket is loaded (send it with the last bucket of
        a sync). `flush_cache` must be False while requests are held by a retract or in_place pause.
        """
        payloads = [serialized] * num_ranks if isinstance(serialized, str) else list(serialized)
        request = UpdateWeightsFromTensorRequest(
            serialized_named_tensors=payloads,
            load_format=load_format,
            flush_cache=flush_cache,
            abort_all_requests=False,
            weight_version=None if weight_version is None else version_label(weight_version),
        )
        message = await self._update("/update_weights_from_tensor", _body(request))
        if weight_version is not None:
            self._relabelled(weight_version)
        return message

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = DEFAULT_GROUP_NAME,
        backend: str = "nccl",
    ) -> str:
        """Join the process group the trainer broadcasts weights over. The call returns only once every
        member has joined, so the trainer must join concurrently."""
        request = InitWeightsUpdateGroupRequest(
            master_address=master_address,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )
        return await self._update("/init_weights_update_group", _body(request))

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        weight_version: int | None,
        flush_cache: bool,
        group_name: str = DEFAULT_GROUP_NAME,
    ) -> str:
        """Receive one bucket broadcast by the trainer (rank 0) over the group; the trainer must broadcast
        the tensors in `names` order concurrently, or this call waits for them."""
        request = UpdateWeightsFromDistributedRequest(
            names=list(names),
            dtypes=list(dtypes),
            shapes=[list(shape) for shape in shapes],
            group_name=group_name,
            flush_cache=flush_cache,
            abort_all_requests=False,
            weight_version=None if weight_version is None else version_label(weight_version),
        )
        message = await self._update("/update_weights_from_distributed", _body(request))
        if weight_version is not None:
            self._relabelled(weight_version)
        return message

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP_NAME) -> None:
        """Leave the weight-update process group."""
        request = DestroyWeightsUpdateGroupRequest(group_name=group_name)
        await self._update("/destroy_weights_update_group", _body(request))

    async def update_weight_version(self, version: int) -> None:
        """Relabel the server's weights as `version` without aborting anything (spans split at this point)."""
        request = UpdateWeightVersionRequest(new_version=version_label(version), abort_all_requests=False)
        await self._update("/update_weight_version", _body(request), idempotent=True)
        self._relabelled(version)

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> WeightsReply:
        """The engine's parameter `name` (HuggingFace name), its first `truncate_size` rows (or values) as
        float32 lists: for checking that a weight sync arrived, not for moving weights."""
        request = GetWeightsByNameRequest(name=name, truncate_size=truncate_size)
        response = await self._control("POST", "/get_weights_by_name", _body(request))
        try:
            return parse_json(WeightsReplyModel, response.content).root
        except WireError as error:
            raise EngineControlError(
                f"{self.base_url}/get_weights_by_name answered an unexpected body: {error}"
            ) from None

    def _relabelled(self, version: int) -> None:
        """The server took `version` as its weight version (an update that carried it, or
        `update_weight_version`). Nothing to do here; a client that derives version spans records it."""

    # ---------------------------------------------------------------------------------------------------
    # Info and health

    async def _get(self, paths: Sequence[str]) -> tuple[str, httpx.Response]:
        """GET the first of `paths` the server has (a 404 moves to the next); returns (path, response)."""
        response: httpx.Response | None = None
        for path in paths:
            response = await self._send("GET", path, timeout_s=self.timeouts.control_s, idempotent=True)
            if response.status_code == 404:
                continue
            if response.status_code != 200:
                raise self._control_error(path, response)
            return path, response
        assert response is not None
        raise self._control_error(paths[-1], response)

    async def _get_model(self, paths: Sequence[str], model: type[ModelT]) -> ModelT:
        path, response = await self._get(paths)
        try:
            return parse_json(model, response.content)
        except WireError as error:
            raise EngineControlError(f"{self.base_url}{path} answered an unexpected body: {error}") from None

    async def _get_object(self, paths: Sequence[str]) -> JsonObject:
        path, response = await self._get(paths)
        body = self._json(response)
        if not isinstance(body, dict):
            raise EngineControlError(f"{self.base_url}{path} answered {body!r}, not a JSON object")
        return cast(JsonObject, body)

    async def model_info(self) -> JsonObject:
        """`/model_info` (or the older `/get_model_info`): model path, `is_generation`, `weight_version`...
        (every key the server sent; the ones `wire.ModelInfo` knows are checked)."""
        return (await self._model_info()).model_dump(exclude_unset=True)

    async def _model_info(self) -> ModelInfo:
        return await self._get_model(("/model_info", "/get_model_info"), ModelInfo)

    async def weight_version(self) -> int:
        """The asyncrl version of the weights the server holds now (`/model_info.weight_version`; on older
        servers `/get_weight_version`). A non-numeric label (SGLang's `"default"`) is version 0."""
        info = await self._model_info()
        if info.weight_version is not None:
            return parse_version(info.weight_version)
        reply = await self._get_model(("/get_weight_version", "/weight_version"), WeightVersionReply)
        return parse_version(reply.weight_version)

    async def server_info(self) -> JsonObject:
        """`/server_info` (or `/get_server_info`): resolved server arguments and scheduler state. Its
        `weight_version` is the launch value; the current one is `weight_version()`."""
        return await self._get_object(("/server_info", "/get_server_info"))

    async def loads(self) -> object:
        """Load report: `/v1/loads` (JSON object with a `loads` list), or the legacy `/get_load` list."""
        return self._json((await self._get(("/v1/loads", "/get_load")))[1])

    async def engine_counters(self) -> dict[str, float]:
        """The engine's cumulative counters, by the name of the step metric their growth makes:
        `ENGINE_PREFILL_S`, seconds from `/v1/loads`' `total_prefill_busy_us` summed over the data-parallel
        ranks, and `ENGINE_NUM_GENERATED_TOKENS` from `/metrics`' `sglang:generation_tokens_total`. A counter
        the server does not report (a server without `/v1/loads` or that key, metrics off) is left out; any
        other failure raises (`EngineControlError`, `EngineUnavailableError`)."""
        loads_response, values = await asyncio.gather(
            self._send(
                "GET",
                "/v1/loads",
                params={"include": "core"},
                timeout_s=self.timeouts.control_s,
                idempotent=True,
            ),
            self._metrics_values(),
        )
        counters: dict[str, float] = {}
        if loads_response.status_code not in (200, 404):
            raise self._control_error("/v1/loads", loads_response)
        if loads_response.status_code == 200:
            try:
                reply = parse_json(LoadsReply, loads_response.content)
            except WireError as error:
                raise EngineControlError(
                    f"{self.base_url}/v1/loads answered an unexpected body: {error}"
                ) from None
            busy_us = [load.total_prefill_busy_us for load in reply.loads]
            if busy_us and all(value is not None for value in busy_us):
                counters[ENGINE_PREFILL_S] = sum(value or 0.0 for value in busy_us) / 1e6
        if values is not None and _GENERATION_TOKENS in values:
            counters[ENGINE_NUM_GENERATED_TOKENS] = values[_GENERATION_TOKENS]
        return counters

    async def health(self) -> bool:
        """True when the server is up and past warmup (`/health` 200); False while it starts, shuts down or
        cannot be reached. One probe, no retries: poll it (`wait_healthy`)."""
        try:
            response = await self._http.get("/health", timeout=self._timeout(self.timeouts.health_s))
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def health_generate(self) -> bool:
        """True when a one-token probe request gets an answer (`/health_generate`). Do not use it during a
        pause: the probe is held at the gate and the server answers 503."""
        try:
            response = await self._http.get(
                "/health_generate", timeout=self._timeout(self.timeouts.control_s)
            )
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def wait_healthy(self, timeout_s: float, *, poll_interval_s: float = 0.25) -> None:
        """Poll `/health` until it answers 200; `EngineUnavailableError` after `timeout_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not await self.health():
            if loop.time() >= deadline:
                raise EngineUnavailableError(f"{self.base_url} was not healthy within {timeout_s:.0f} s")
            await asyncio.sleep(poll_interval_s)

    async def _metrics_values(self) -> dict[str, float] | None:
        """Every sample of `/metrics` summed per name (`parse_prometheus`); None when the server serves no
        metrics (404: started without `--enable-metrics`)."""
        response = await self._send("GET", "/metrics", timeout_s=self.timeouts.control_s, idempotent=True)
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise self._control_error("/metrics", response)
        try:
            return parse_prometheus(response.text)
        except ValueError as error:
            raise EngineControlError(f"{self.base_url}/metrics is not Prometheus text: {error}") from None

    async def metrics(self) -> EngineMetrics:
        """The engine's saturation gauges from `/metrics` (needs the server flag `--enable-metrics`)."""
        values = await self._metrics_values()
        if values is None:
            raise EngineControlError(
                f"{self.base_url}/metrics answered 404: start the server with --enable-metrics"
            )
        return EngineMetrics(
            num_running_requests=values.get("sglang:num_running_reqs", 0.0),
            num_queued_requests=values.get("sglang:num_queue_reqs", 0.0),
            token_usage=values.get("sglang:token_usage", 0.0),
            values=values,
        )
