"""The client's reading of `/generate` responses across SGLang versions, and its error and retry policy."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from asyncrl_core.errors import EngineControlError, EngineUnavailableError, GenerationError
from asyncrl_core.types import SamplingParams, VersionSpan
from asyncrl_sglang._schema import AbortStatusError, parse_generation, parse_version
from asyncrl_sglang.client import ClientTimeouts, RetryPolicy, SGLangClient, parse_prometheus

FAST_RETRY = RetryPolicy(max_attempts=3, initial_backoff_s=0.001, max_backoff_s=0.002)


def response(ids: list[int], **meta: Any) -> dict[str, Any]:
    meta_info: dict[str, Any] = {
        "id": "r",
        "finish_reason": {"type": "length", "length": len(ids)},
        "prompt_tokens": 4,
        "completion_tokens": len(ids),
        "weight_version": "2",
        "output_token_logprobs": [[-0.25 * (i + 1), token_id, None] for i, token_id in enumerate(ids)],
    }
    meta_info.update(meta)
    return {"text": "t", "output_ids": ids, "meta_info": meta_info}


def test_per_token_spans_are_read_and_mark_the_boundary() -> None:
    body = response(
        [5, 6, 7, 8],
        weight_versions=[{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 4}],
        num_retractions=1,
    )
    generation = parse_generation(json.dumps(body), 4)
    assert generation.version_spans == (VersionSpan(3, 0, 1), VersionSpan(4, 1, 4))
    assert generation.versions_verified
    assert generation.token_versions() == [3, 4, 4, 4]
    assert generation.logprobs == [-0.25, -0.5, -0.75, -1.0]
    assert generation.num_retractions == 1
    assert generation.finish_reason == "length"


def test_older_servers_give_one_unverified_span_and_old_key_names() -> None:
    body = response([5, 6], total_retractions=2)
    body["token_ids"] = body.pop("output_ids")
    del body["meta_info"]["prompt_tokens"]  # abort responses from the waiting queue have none
    generation = parse_generation(json.dumps(body), 9)
    assert generation.output_ids == [5, 6]
    assert generation.version_spans == (VersionSpan(2, 0, 2),)
    assert not generation.versions_verified
    assert generation.num_retractions == 2
    assert generation.prompt_tokens == 9
    assert parse_generation(json.dumps(response([5])), 1).num_retractions == 0


@pytest.mark.parametrize(
    ("label", "version"), [("7", 7), ("default", 0), ("", 0), (None, 0), (3, 3), ("-1", -1)]
)
def test_version_labels_map_to_ints(label: object, version: int) -> None:
    assert parse_version(label) == version


def test_stop_reasons_keep_the_matched_stop() -> None:
    string_stop = response([5], finish_reason={"type": "stop", "matched": "</a>"})
    assert parse_generation(json.dumps(string_stop), 1).matched_stop == "</a>"
    token_stop = response([5], finish_reason={"type": "stop", "matched": [2, 3]})
    assert parse_generation(json.dumps(token_stop), 1).matched_stop == 2
    abort = response([], finish_reason={"type": "abort", "message": "Aborted", "status_code": None})
    aborted = parse_generation(json.dumps(abort), 1)
    assert aborted.finish_reason == "abort"
    assert aborted.output_ids == []


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda body: body["meta_info"].pop("output_token_logprobs"), "output_token_logprobs"),
        (lambda body: body["meta_info"]["output_token_logprobs"].pop(), "1 output logprobs for 2"),
        (lambda body: body["meta_info"].update(finish_reason=None), "finish_reason null"),
        (
            lambda body: body["meta_info"].update(weight_versions=[{"version": "1", "start": 0, "end": 1}]),
            "do not tile the 2 output tokens",
        ),
        (lambda body: body.pop("output_ids"), "output_ids: Field required"),
        (lambda body: body.update(output_ids=["5", 6]), r"output_ids\.0: Input should be a valid integer"),
        (lambda body: body["meta_info"].update(prompt_tokens=True), "meta_info.prompt_tokens"),
    ],
)
def test_malformed_responses_are_named(change: Any, needle: str) -> None:
    body = response([5, 6])
    change(body)
    with pytest.raises(GenerationError, match=needle):
        parse_generation(json.dumps(body), 1)


async def test_a_refused_request_raises_generation_error_with_the_server_message() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": "too long for the context length 64"}})

    async with SGLangClient("http://e", transport=httpx.MockTransport(handler), retry=FAST_RETRY) as client:
        with pytest.raises(GenerationError, match="context length 64"):
            await client.generate([1, 2], SamplingParams())
        assert client.num_outstanding == 0
        with pytest.raises(GenerationError, match="empty prompt"):
            await client.generate([], SamplingParams())


async def test_connection_failures_are_retried_then_reported() -> None:
    attempts: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        attempts.append(request.url.path)
        if len(attempts) < 3:
            raise httpx.ConnectError("refused")
        return httpx.Response(200, json=response([1]))

    async with SGLangClient("http://e", transport=httpx.MockTransport(handler), retry=FAST_RETRY) as client:
        generation = await client.generate([1], SamplingParams())
        assert generation.output_ids == [1]
        assert attempts == ["/generate"] * 3
        attempts.clear()

        def down(request: httpx.Request) -> httpx.Response:
            raise httpx.ConnectError("refused")

    async with SGLangClient("http://e", transport=httpx.MockTransport(down), retry=FAST_RETRY) as client:
        with pytest.raises(EngineUnavailableError, match="failed 3 times"):
            await client.generate([1], SamplingParams())
        with pytest.raises(EngineUnavailableError, match="failed 3 times"):
            await client.model_info()
        assert not await client.health()


async def test_a_dropped_generate_is_aborted_and_resent_under_the_same_rid() -> None:
    seen: list[tuple[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        seen.append((request.url.path, body))
        generates = [entry for entry in seen if entry[0] == "/generate"]
        if request.url.path == "/abort_request":
            return httpx.Response(200)
        if len(generates) == 1:
            raise httpx.RemoteProtocolError("server disconnected")
        if len(generates) == 2:
            # The first copy is still being torn down on the server.
            return httpx.Response(400, json={"error": {"message": "Duplicate request ID detected: x"}})
        return httpx.Response(200, json=response([4]))

    retry = RetryPolicy(max_attempts=4, initial_backoff_s=0.001, max_backoff_s=0.002)
    async with SGLangClient("http://e", transport=httpx.MockTransport(handler), retry=retry) as client:
        generation = await client.generate([1], SamplingParams(), rid="x")
    assert generation.output_ids == [4]
    paths = [path for path, _ in seen]
    assert paths == ["/generate", "/abort_request", "/generate", "/generate"]
    assert seen[1][1] == {"rid": "x"}
    assert {body["rid"] for path, body in seen if path == "/generate"} == {"x"}


async def test_a_full_queue_is_retried_then_reported_unavailable() -> None:
    """503 "The request queue is full.": nothing was queued, so the same request is sent again later."""
    attempts: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        attempts.append(json.loads(request.content)["rid"])
        if len(attempts) < 3:
            return httpx.Response(
                503, json={"object": "error", "message": "The request queue is full.", "code": 503}
            )
        return httpx.Response(200, json=response([7]))

    async with SGLangClient("http://e", transport=httpx.MockTransport(handler), retry=FAST_RETRY) as client:
        assert (await client.generate([1], SamplingParams(), rid="q")).output_ids == [7]
        assert attempts == ["q"] * 3

    def full(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            503, json={"object": "error", "message": "The request queue is full.", "code": 503}
        )

    async with SGLangClient("http://e", transport=httpx.MockTransport(full), retry=FAST_RETRY) as client:
        with pytest.raises(EngineUnavailableError, match="queue is full"):
            await client.generate([1], SamplingParams())


def aborted(ids: list[int], status: int | None, message: str) -> dict[str, Any]:
    """A finished result the engine aborted, as SGLang writes `FINISH_ABORT.to_json()`."""
    err_type = "BadRequestError" if status == 400 else None  # what `set_finish_with_abort` writes
    reason = {"type": "abort", "message": message, "status_code": status, "err_type": err_type}
    return response(ids, finish_reason=reason)


def last_event(stream: str) -> str:
    """The JSON of the last ordinary `data:` event of a server-sent `/generate` stream (before `[DONE]`)."""
    events = [chunk.removeprefix("data: ") for chunk in stream.split("\n\n") if chunk.strip()]
    assert events[-1] == "[DONE]"
    return events[-2]


@pytest.mark.parametrize(
    ("status", "message"),
    [
        (503, "The server is shutting down."),
        (500, "Internal engine error: RuntimeError: a cached block is unreadable"),
        (400, "The input (70 tokens) is longer than the model's context length (64 tokens)."),
    ],
)
def test_an_abort_with_a_status_is_no_output_in_a_body_or_as_a_streams_last_event(
    status: int, message: str
) -> None:
    # SGLang's native streamed /generate ends such a request with the abort, status included, as its last
    # ordinary event under HTTP 200; some versions send it in a 200 body too. Neither is the model's end.
    body = json.dumps(aborted([5, 6], status, message))
    partial = json.dumps(response([5]))
    stream = f"data: {partial}\n\ndata: {body}\n\ndata: [DONE]\n\n"
    for text in (body, last_event(stream)):
        with pytest.raises(AbortStatusError) as refused:
            parse_generation(text, 4)
        assert (refused.value.status, refused.value.message) == (status, message)
        assert isinstance(refused.value, GenerationError)  # a caller that does not look never trains on it


async def test_an_abort_with_status_503_in_a_200_body_is_resent_like_a_503() -> None:
    """The engine stopped under the request (SGLang's abort with status 503): the same request, under the
    same rid, later; once the retries are spent `EngineUnavailableError`, which the pool sends elsewhere."""
    seen: list[tuple[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, json.loads(request.content)))
        if len(seen) < 3:
            return httpx.Response(200, json=aborted([5, 6], 503, "The server is shutting down."))
        return httpx.Response(200, json=response([7, 8]))

    async with SGLangClient("http://e", transport=httpx.MockTransport(handler), retry=FAST_RETRY) as client:
        generation = await client.generate([1], SamplingParams(), rid="cut")
    assert generation.output_ids == [7, 8]
    assert generation.finish_reason == "length"
    # The aborted copy was ended by the engine (its answer came): nothing to abort before the resend.
    assert [(path, body["rid"]) for path, body in seen] == [("/generate", "cut")] * 3

    def stopping(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=aborted([5], 503, "The server is shutting down."))

    async with SGLangClient("http://e", transport=httpx.MockTransport(stopping), retry=FAST_RETRY) as client:
        with pytest.raises(EngineUnavailableError, match="answered 503: The server is shutting down"):
            await client.generate([1], SamplingParams())


@pytest.mark.parametrize(
    ("status", "message", "verb"),
    [
        (500, "Internal engine error: RuntimeError: a cached block is unreadable", "failed"),
        (400, "The input (70 tokens) is longer than the model's context length (64 tokens).", "refused"),
    ],
)
async def test_an_abort_with_status_500_or_400_in_a_200_body_is_final(
    status: int, message: str, verb: str
) -> None:
    """A request that failed alone (500) or that the engine refused (400, SGLang's `set_finish_with_abort`):
    `GenerationError` as for that answer, never sent again."""
    attempts: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        attempts.append(json.loads(request.content)["rid"])
        return httpx.Response(200, json=aborted([5, 6], status, message))

    async with SGLangClient("http://e", transport=httpx.MockTransport(handler), retry=FAST_RETRY) as client:
        with pytest.raises(GenerationError) as failed:
            await client.generate([1], SamplingParams(), rid="r")
        assert not isinstance(failed.value, AbortStatusError)
        assert str(failed.value) == f"http://e/generate {verb} request r ({status}): {message}"
        assert client.num_outstanding == 0
    assert attempts == ["r"]


async def test_a_user_abort_keeps_its_partial_output() -> None:
    """An abort with no status (`abort_request`, a pause in abort mode) is the output so far, finish reason
    `abort`, answered once."""
    attempts: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        attempts.append(json.loads(request.content)["rid"])
        return httpx.Response(200, json=aborted([5, 6], None, "Aborted"))

    async with SGLangClient("http://e", transport=httpx.MockTransport(handler), retry=FAST_RETRY) as client:
        generation = await client.generate([1], SamplingParams(), rid="u")
    assert (generation.output_ids, generation.finish_reason) == ([5, 6], "abort")
    assert generation.logprobs == [-0.25, -0.5]
    assert attempts == ["u"]


async def test_a_duplicate_rid_that_the_client_did_not_cause_is_an_error() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": "Duplicate request ID detected: x"}})

    async with SGLangClient("http://e", transport=httpx.MockTransport(handler), retry=FAST_RETRY) as client:
        with pytest.raises(GenerationError, match="Duplicate request ID"):
            await client.generate([1], SamplingParams(), rid="x")


async def test_control_calls_that_may_have_reached_the_server_are_not_resent() -> None:
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        raise httpx.ReadError("connection reset")

    async with SGLangClient("http://e", transport=httpx.MockTransport(handler), retry=FAST_RETRY) as client:
        with pytest.raises(EngineUnavailableError, match="not idempotent"):
            await client.update_weights_from_tensor("x", weight_version=1, flush_cache=False)
        assert calls == ["/update_weights_from_tensor"]
        calls.clear()
        with pytest.raises(EngineUnavailableError):
            await client.pause("retract")
        assert calls == ["/pause_generation"] * 3  # pausing twice is harmless


async def test_a_generation_past_its_deadline_is_aborted_on_the_server() -> None:
    aborted: list[Any] = []
    release = asyncio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/abort_request":
            aborted.append(json.loads(request.content))
            return httpx.Response(200)
        await release.wait()  # never answers in time
        return httpx.Response(200, json=response([1]))

    timeouts = ClientTimeouts(generate_s=0.05, control_s=1.0)
    retry = RetryPolicy(max_attempts=1)
    async with SGLangClient(
        "http://e", transport=httpx.MockTransport(handler), timeouts=timeouts, retry=retry
    ) as client:
        with pytest.raises(EngineUnavailableError, match="did not finish"):
            await client.generate([1], SamplingParams(), rid="slow")
    release.set()
    assert aborted == [{"rid": "slow"}]


async def test_a_cancelled_generation_is_aborted_on_the_server() -> None:
    aborted: list[Any] = []
    started = asyncio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/abort_request":
            aborted.append(json.loads(request.content))
            return httpx.Response(200)
        started.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async with SGLangClient("http://e", transport=httpx.MockTransport(handler)) as client:
        task = asyncio.create_task(client.generate([1], SamplingParams(), rid="gone"))
        await asyncio.wait_for(started.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert client.num_outstanding == 0
    assert aborted == [{"rid": "gone"}]


async def test_version_falls_back_to_the_deprecated_route_on_old_servers() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/model_info":
            return httpx.Response(404, json={"detail": "Not Found"})
        if request.url.path == "/get_model_info":
            return httpx.Response(200, json={"model_path": "m", "is_generation": True})
        if request.url.path == "/get_weight_version":
            return httpx.Response(200, json={"weight_version": "12"})
        return httpx.Response(404)

    async with SGLangClient("http://e", transport=httpx.MockTransport(handler)) as client:
        assert await client.weight_version() == 12


async def test_begin_weight_update_404_means_no_session_needed() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, json={"detail": "Not Found"})

    async with SGLangClient("http://e", transport=httpx.MockTransport(handler)) as client:
        assert await client.begin_weight_update() is False
        with pytest.raises(EngineControlError, match="--enable-metrics"):
            await client.metrics()


async def test_weight_update_failure_carries_the_server_message() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"success": False, "message": "unknown parameter model.foo"})

    async with SGLangClient("http://e", transport=httpx.MockTransport(handler)) as client:
        with pytest.raises(EngineControlError, match=r"400: unknown parameter model\.foo"):
            await client.update_weights_from_tensor("x", weight_version=1, flush_cache=False)


def test_prometheus_samples_are_summed_per_name() -> None:
    text = "\n".join(
        [
            "# HELP sglang:num_running_reqs The number of running requests.",
            "# TYPE sglang:num_running_reqs gauge",
            'sglang:num_running_reqs{model_name="m",engine_type="unified",tp_rank="0"} 2.0',
            'sglang:num_running_reqs{model_name="m",engine_type="unified",tp_rank="1"} 1.0',
            'sglang:num_queue_reqs{model_name="m"} 3',
            'sglang:e2e_request_latency_seconds_bucket{le="0.1",model_name="m"} 4.0 1700000000000',
            "sglang:token_usage NaN",
        ]
    )
    values = parse_prometheus(text)
    assert values["sglang:num_running_reqs"] == 3.0
    assert values["sglang:num_queue_reqs"] == 3.0
    assert values["sglang:e2e_request_latency_seconds_bucket"] == 4.0
    assert "sglang:token_usage" not in values
    with pytest.raises(ValueError, match="Invalid value"):
        parse_prometheus('sglang:num_running_reqs{model_name="m" 1.0')
