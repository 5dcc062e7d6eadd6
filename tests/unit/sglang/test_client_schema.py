"""Every request body the client builds fits SGLang's own request schema.

The field sets below are SGLang's request dataclasses (`python/sglang/srt/managers/io_struct.py` and
`sampling/sampling_params.py`), written as data from the route table and sections 2-3 of the SGLang contract
(`sglang-contract.md`, which the package README links) and checked against io_struct at the contract's
snapshots. They are deliberately NOT derived from the client's code: a test that failed to notice a
misspelled or invented field would be worthless. `BaseReq` contributes `rid` to every control request.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import torch

from asyncrl_core.types import SamplingParams
from asyncrl_sglang.client import SGLangClient, serialize_named_tensors

# Contract §2: GenerateReqInput (fields a text RL client may send; the multimodal/PD ones are omitted
# because the client must never send them).
GENERATE_REQ_INPUT = {
    "text", "input_ids", "input_embeds", "sampling_params", "rid", "return_logprob", "logprob_start_len",
    "top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs", "stream", "return_hidden_states",
    "return_routed_experts", "return_prompt_token_ids", "lora_path", "session_params",
    "custom_logit_processor", "priority", "extra_key", "cache_salt", "routed_dp_rank", "log_metrics",
    "custom_labels", "max_thinking_tokens",
}  # fmt: skip
# Contract §2.1: SamplingParams keys (unknown keys are rejected by the server).
SAMPLING_PARAMS = {
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
    "repetition_penalty", "min_new_tokens", "n", "stop", "stop_token_ids", "stop_regex", "ignore_eos",
    "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "json_schema", "regex", "ebnf",
    "structural_tag", "custom_params", "stream_interval", "logit_bias", "sampling_seed", "beam_width",
}  # fmt: skip
# Contract §1 (route table) and §3: the control request inputs, required fields first.
BASE_REQ = {"rid"}


@dataclass(frozen=True)
class Schema:
    name: str
    required: frozenset[str]
    optional: frozenset[str]

    @property
    def fields(self) -> frozenset[str]:
        return self.required | self.optional | BASE_REQ


def schema(name: str, required: set[str], optional: set[str]) -> Schema:
    return Schema(name, frozenset(required), frozenset(optional))


SCHEMAS: dict[str, Schema] = {
    "/generate": schema("GenerateReqInput", set(), GENERATE_REQ_INPUT),
    "/abort_request": schema("AbortReq", set(), {"abort_all", "finished_reason", "abort_message"}),
    "/pause_generation": schema("PauseGenerationReqInput", set(), {"mode"}),
    "/continue_generation": schema("ContinueGenerationReqInput", set(), {"torch_empty_cache"}),
    "/update_weights_from_tensor": schema(
        "UpdateWeightsFromTensorReqInput",
        {"serialized_named_tensors"},
        {
            "load_format",
            "flush_cache",
            "abort_all_requests",
            "weight_version",
            "torch_empty_cache",
            "disable_draft_model",
            "selector",
        },
    ),
    "/init_weights_update_group": schema(
        "InitWeightsUpdateGroupReqInput",
        {"master_address", "master_port", "rank_offset", "world_size"},
        {"group_name", "backend"},
    ),
    "/update_weights_from_distributed": schema(
        "UpdateWeightsFromDistributedReqInput",
        {"names", "dtypes", "shapes"},
        {
            "group_name",
            "flush_cache",
            "abort_all_requests",
            "weight_version",
            "load_format",
            "torch_empty_cache",
            "selector",
        },
    ),
    "/destroy_weights_update_group": schema("DestroyWeightsUpdateGroupReqInput", set(), {"group_name"}),
    "/update_weight_version": schema("UpdateWeightVersionReqInput", {"new_version"}, {"abort_all_requests"}),
    "/begin_weight_update": schema("BeginWeightUpdateReqInput", set(), {"selector"}),
    "/end_weight_update": schema("EndWeightUpdateReqInput", set(), set()),
    "/release_memory_occupation": schema("ReleaseMemoryOccupationReqInput", set(), {"tags"}),
    "/resume_memory_occupation": schema("ResumeMemoryOccupationReqInput", set(), {"tags"}),
}
BODYLESS_ROUTES = {"/flush_cache"}
"""POST routes without a request dataclass: the client must send no JSON body."""


def generate_response(request: dict[str, Any]) -> dict[str, Any]:
    ids = [7, 8, 9]
    return {
        "text": "abc",
        "output_ids": ids,
        "meta_info": {
            "id": request["rid"],
            "finish_reason": {"type": "length", "length": 3},
            "prompt_tokens": len(request["input_ids"]),
            "completion_tokens": 3,
            "cached_tokens": 0,
            "weight_version": "3",
            "output_token_logprobs": [[-0.5, token_id, None] for token_id in ids],
        },
    }


class Recorder:
    """A transport that records each request and answers like a healthy SGLang server."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, object]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.requests.append((request.method, request.url.path, body))
        path = request.url.path
        if path == "/generate":
            return httpx.Response(200, json=generate_response(body))
        if path in ("/model_info", "/server_info"):
            return httpx.Response(200, json={"model_path": "m", "weight_version": "3", "is_generation": True})
        if path == "/metrics":
            return httpx.Response(200, text='sglang:num_running_reqs{model_name="m"} 1.0\n')
        if path == "/v1/loads":
            return httpx.Response(200, json={"loads": []})
        if path in ("/health", "/health_generate", "/abort_request"):
            return httpx.Response(200)
        if path in ("/pause_generation", "/continue_generation"):
            return httpx.Response(200, json={"status": "ok", "message": "ok"})
        if path == "/flush_cache":
            return httpx.Response(200, text="Cache flushed.\n")
        if path in ("/release_memory_occupation", "/resume_memory_occupation"):
            return httpx.Response(200, json=None)
        return httpx.Response(200, json={"success": True, "message": "ok"})


async def drive_every_call(client: SGLangClient) -> None:
    sampling = SamplingParams(max_new_tokens=3, stop=("</a>",), stop_token_ids=(2,), ignore_eos=True)
    await client.generate([1, 2, 3], sampling)
    await client.generate([1], SamplingParams(no_stop_trim=True), rid="r1")
    await client.abort("r1")
    await client.abort_all()
    for mode in ("abort", "retract", "in_place"):
        await client.pause(mode)
    await client.continue_generation()
    await client.flush_cache()
    await client.release_memory_occupation()
    await client.resume_memory_occupation(["weights", "kv_cache"])
    await client.begin_weight_update()
    payload = serialize_named_tensors([("w", torch.zeros(2))])
    await client.update_weights_from_tensor(payload, weight_version=4, flush_cache=False)
    await client.update_weights_from_tensor([payload, payload], weight_version=None, flush_cache=True)
    await client.end_weight_update()
    await client.init_weights_update_group(
        master_address="127.0.0.1", master_port=29500, rank_offset=1, world_size=2
    )
    await client.update_weights_from_distributed(
        ["w"], ["float32"], [[2]], weight_version=5, flush_cache=False
    )
    await client.update_weights_from_distributed(
        ["w"], ["bfloat16"], [[2]], weight_version=None, flush_cache=True
    )
    await client.destroy_weights_update_group()
    await client.update_weight_version(6)
    await client.model_info()
    await client.weight_version()
    await client.server_info()
    await client.loads()
    await client.metrics()
    await client.health()
    await client.health_generate()


async def test_every_body_uses_only_sglang_fields_and_sends_the_required_ones() -> None:
    recorder = Recorder()
    async with SGLangClient("http://engine", transport=httpx.MockTransport(recorder)) as client:
        await drive_every_call(client)
    posted = [(path, body) for method, path, body in recorder.requests if method == "POST"]
    assert {path for path, _ in posted} == set(SCHEMAS) | BODYLESS_ROUTES
    for path, body in posted:
        if path in BODYLESS_ROUTES:
            assert body is None, f"{path} takes no body"
            continue
        spec = SCHEMAS[path]
        assert isinstance(body, dict), f"{path} must always carry a JSON object body"
        unknown = set(body) - spec.fields
        assert not unknown, f"{path} sends fields {unknown} that {spec.name} does not have"
        missing = spec.required - set(body)
        assert not missing, f"{path} omits required fields {missing} of {spec.name}"
        if path == "/generate":
            unknown_sampling = set(body["sampling_params"]) - SAMPLING_PARAMS
            assert not unknown_sampling, (
                f"sampling_params keys {unknown_sampling} are not SamplingParams keys"
            )
            assert body["input_ids"]
            assert body["return_logprob"] is True
            assert isinstance(body["rid"], str)


async def test_values_have_the_types_sglang_parses() -> None:
    recorder = Recorder()
    async with SGLangClient("http://engine", transport=httpx.MockTransport(recorder)) as client:
        await drive_every_call(client)
    by_path: dict[str, list[dict[str, Any]]] = {}
    for _, path, body in recorder.requests:
        if isinstance(body, dict):
            by_path.setdefault(path, []).append(body)
    # Versions travel as decimal strings; update_weight_version must not abort (its server default does).
    assert by_path["/update_weight_version"] == [{"new_version": "6", "abort_all_requests": False}]
    assert [body.get("weight_version") for body in by_path["/update_weights_from_tensor"]] == ["4", None]
    tensor_bodies = by_path["/update_weights_from_tensor"]
    assert all(
        isinstance(payload, str) for body in tensor_bodies for payload in body["serialized_named_tensors"]
    )
    assert len(tensor_bodies[1]["serialized_named_tensors"]) == 2
    assert [body["flush_cache"] for body in tensor_bodies] == [False, True]
    distributed = by_path["/update_weights_from_distributed"][0]
    assert distributed["shapes"] == [[2]]
    assert distributed["dtypes"] == ["float32"]
    assert distributed["weight_version"] == "5"
    assert {body["mode"] for body in by_path["/pause_generation"]} == {"abort", "retract", "in_place"}
    assert by_path["/continue_generation"] == [{}]
    assert by_path["/abort_request"] == [{"rid": "r1"}, {"abort_all": True}]
    first_generate = by_path["/generate"][0]
    assert first_generate["sampling_params"] == {
        "max_new_tokens": 3,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "stop": ["</a>"],
        "stop_token_ids": [2],
        "ignore_eos": True,
    }
    assert by_path["/generate"][1]["rid"] == "r1"


@pytest.mark.parametrize(
    "call",
    [
        lambda client: client.flush_cache(),
        lambda client: client.pause("retract"),
        lambda client: client.update_weight_version(1),
    ],
)
async def test_api_key_goes_in_a_bearer_header(
    call: Callable[[SGLangClient], Coroutine[Any, Any, Any]],
) -> None:
    seen: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        return httpx.Response(200, json={"success": True, "message": ""})

    async with SGLangClient("http://engine", api_key="k", transport=httpx.MockTransport(handler)) as client:
        await call(client)
    assert seen == ["Bearer k"]
