"""What code written for SGLang 0.5.23 expects of a server, checked against the built-in engine.

The key sets below are written as data from SGLang 0.5.23's source (the wheel installs with `--no-deps`):
`srt/managers/tokenizer_manager.py` (`_handle_batch_output`: the `meta_info` of every output,
`add_logprob_to_meta_info`, `_handle_abort_req`), `srt/observability/req_time_stats.py`
(`convert_to_output_meta_info`), `srt/managers/schedule_batch.py` (`FINISH_*.to_json`),
`srt/entrypoints/http_server.py` (`model_info`, `server_info`, `pause_generation`, `continue_generation`, the
weight routes), `srt/utils/common.py` (`build_server_info`), `srt/managers/scheduler.py` (`get_init_info`),
`srt/managers/scheduler_components/internal_state.py` and `memory_usage.py` (`internal_states`),
`srt/observability/startup_time.py`, `srt/mem_cache/hicache_storage.py` (`disabled_l3_layout`),
`srt/entrypoints/v1_loads.py` and `srt/managers/load_snapshot.py` (`/v1/loads`). They are deliberately not
derived from asyncrl's wire model: a key the engine invented, or one SGLang always writes that the engine
forgot, must fail here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from engine_process import serve_builtin

from asyncrl_sglang.client import SGLangClient
from asyncrl_sglang.wire import GenerateResponse, ModelInfo, UpdateResult

# tokenizer_manager._handle_batch_output: written for every output of a generation request.
META_ALWAYS = {
    "id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions", "reasoning_tokens",
    "completion_tokens", "cached_tokens",
}  # fmt: skip
# Every other key SGLang 0.5.23 may write into meta_info (logprobs, spans, timings, metrics, speculative
# decoding, multimodal counts, hidden states, routed experts, DP rank).
META_OPTIONAL = {
    "weight_versions", "cached_tokens_details", "e2e_latency", "response_sent_to_client_ts",
    "request_received_ts", "first_token_latency", "api_server_dispatch_finish_ts", "request_finished_ts",
    "decode_throughput", "input_token_logprobs", "output_token_logprobs", "output_token_logprobs_length",
    "input_top_logprobs", "output_top_logprobs", "input_token_ids_logprobs", "output_token_ids_logprobs",
    "output_token_sampling_mask", "output_token_sampling_logprobs", "output_token_sampling_mask_length",
    "image_tokens", "audio_tokens", "video_tokens", "hidden_states", "routed_experts", "indexer_topk",
    "dp_rank", "sequence_score", "spec_accept_rate", "spec_accept_length", "spec_num_correct_drafts",
    "spec_num_proposed_drafts", "spec_verify_ct", "spec_cap_length", "spec_block_accept_length",
    "spec_correct_drafts_histogram", "spec_cap_lens_histogram",
}  # fmt: skip
# _handle_abort_req: a request aborted before it left the waiting queue.
META_ABORT_WAITING = {"id", "finish_reason", "weight_version", "e2e_latency", "completion_tokens"}
RESPONSE_KEYS = {"text", "output_ids", "meta_info", "prompt_token_ids", "index"}
FINISH_KEYS = {
    "length": {"type", "length"},
    "stop": {"type", "matched"},
    "abort": {"type", "message", "status_code", "err_type"},
}
# http_server.model_info: every key, always.
MODEL_INFO_KEYS = {
    "model_path", "served_model_name", "tokenizer_path", "is_generation", "preferred_sampling_params",
    "weight_version", "load_format", "reasoning_parser", "tool_call_parser", "disaggregation_mode",
    "has_image_understanding", "has_audio_understanding", "model_type", "architectures",
}  # fmt: skip
# http_server.server_info = build_server_info (ServerArgs.resolved_dict, launch_command, the scheduler's
# get_init_info, kv_events) + startup_time, internal_states, version, frontend.
SERVER_INFO_ALWAYS = {
    "launch_command", "max_total_num_tokens", "max_req_input_len", "startup_time", "hicache_object_layout",
    "kv_events", "internal_states", "version", "frontend",
}  # fmt: skip
SERVER_INFO_OPTIONAL = {"status", "kv_event_sources"}  # in the handshake of some scheduler layouts
# Fields of SGLang 0.5.23's ServerArgs (srt/arg_groups/fields/*.py; `enable_dp_attention` is added by
# resolved_dict) that describe one instance. SGLang writes every field; a server that is not SGLang writes
# those that apply to it, under these names. `api_key` is a field too, which the built-in engine never echoes.
SERVER_ARGS = {
    "model_path", "served_model_name", "tokenizer_path", "host", "port", "grpc_port", "max_running_requests",
    "chunked_prefill_size", "max_queued_requests", "context_length", "weight_version", "device", "dtype",
    "enable_metrics", "random_seed", "load_format", "disable_cuda_graph", "disable_radix_cache",
    "disable_overlap_schedule", "skip_server_warmup", "log_level", "tp_size", "dp_size", "pp_size",
    "enable_dp_attention", "attention_backend",
}  # fmt: skip
# Flags of `python -m asyncrl_engine` that are no ServerArgs field: `/server_info` leaves them out
# (`launch_command` shows them). `--random-weights` is reported as SGLang names it, `load_format: dummy`;
# `--api-key` is a field the engine never echoes. `--start-paused` is the launcher's for a restarted engine
# (SGLang has none: the launcher refuses to start an SGLang server paused).
BUILTIN_ONLY_FLAGS = {
    "port_file", "api_key", "max_n", "weight_version_route", "random_weights", "disable_fused_kernels",
    "num_threads", "start_paused", "max_request_body_bytes",
}  # fmt: skip
STARTUP_TIME_KEYS = {"load_weight", "kv_cache_allocation", "scheduler_e2e", "cuda_graph"}
GRAPH_PHASES = {"prefill", "decode", "target_verify", "draft_prefill", "draft_decode", "draft_extend"}
HICACHE_LAYOUT_KEYS = {"enabled", "backend", "page_size", "hicache_object_layout", "reason"}
# internal_state.get_internal_state: the resolved server args plus these (the disaggregation keys are written
# once init_disaggregation has run, which every scheduler does at start).
INTERNAL_STATE_ALWAYS = {
    "world_size", "startup_time", "effective_max_running_requests_per_dp", "last_gen_throughput",
    "memory_usage", "disaggregation_mode", "decode_cuda_graph_bs", "decode_cuda_graph_memory_gb",
}  # fmt: skip
INTERNAL_STATE_OPTIONAL = {
    "is_scaling_elastic_ep", "effective_ep_size", "pending_ep_size", "scale_phase", "elastic_ep_last_error",
    "avg_spec_accept_length", "dspark_info_record", "step_time_dict", "rust_mm_transport",
    "rust_server_startup_time", "env_vars",
}  # fmt: skip
MEMORY_USAGE_KEYS = {
    "weight",
    "kvcache",
    "startup_available",
    "token_capacity",
    "token_capacity_swa",
    "graph",
}
# v1_loads.get_loads, and LoadSnapshot.to_dict for each entry: every core key, then the sections present.
LOADS_KEYS = {"timestamp", "version", "accelerator", "num_accelerators", "loads"}
LOAD_CORE_KEYS = {
    "timestamp", "dp_rank", "num_running_reqs", "num_waiting_reqs", "num_waiting_uncached_tokens",
    "num_used_tokens", "num_total_tokens", "num_active_tokens", "num_prealloc_ready_tokens",
    "max_total_num_tokens", "max_running_requests", "token_usage", "gen_throughput", "cache_hit_rate",
    "utilization", "total_prefill_uncached_tokens", "total_prefill_busy_us", "decode_moments",
}  # fmt: skip
LOAD_SECTIONS = {
    "memory": {"weight_gb", "kv_cache_gb", "graph_gb", "token_capacity"},
    "speculative": {"accept_length", "accept_rate"},
    "lora": {"slots_used", "slots_total", "utilization"},
    "disaggregation": {
        "mode", "prefill_bootstrap_queue_reqs", "prefill_inflight_queue_reqs", "decode_prealloc_queue_reqs",
        "decode_transfer_queue_reqs", "decode_retracted_queue_reqs", "kv_transfer_speed_gb_s",
        "kv_transfer_latency_ms",
    },
    "queues": {"waiting", "grammar", "paused", "retracted", "prealloc_ready"},
}  # fmt: skip
# load_inquirer.get_loads: written whatever the features (memory whenever the scheduler can measure it).
LOAD_SECTIONS_ALWAYS = {"memory", "disaggregation", "queues"}
# srt/observability/metrics_collector.py: names of the scheduler's and tokenizer's collectors that a server of
# one instance without speculative decoding, LoRA, disaggregation or hierarchical cache writes.
METRIC_NAMES = {
    "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:num_paused_reqs", "sglang:num_retracted_reqs",
    "sglang:gen_throughput", "sglang:num_used_tokens", "sglang:token_usage", "sglang:cache_hit_rate",
    "sglang:num_grammar_queue_reqs", "sglang:prompt_tokens_total", "sglang:generation_tokens_total",
    "sglang:num_requests_total", "sglang:num_aborted_requests_total", "sglang:num_retracted_requests_total",
    "sglang:num_retracted_input_tokens_total", "sglang:num_retracted_output_tokens_total",
    "sglang:weight_load_duration_seconds",
}  # fmt: skip
ERROR_RESPONSE_KEYS = {"object", "message", "type", "param", "code"}
CONTROL_KEYS = {"message", "status"}
UPDATE_KEYS = {"success", "message"}


def check_keys(found: dict[str, Any], always: set[str], optional: set[str], what: str) -> None:
    """`found` has every key of `always` and no key outside `always | optional`."""
    assert set(found) >= always, f"{what} lacks {always - set(found)}"
    extra = set(found) - always - optional
    assert not extra, f"{what}: keys SGLang 0.5.23 does not write: {extra}"


def check_generate_body(body: dict[str, Any], *, finished: bool = True) -> None:
    assert set(body) <= RESPONSE_KEYS, set(body) - RESPONSE_KEYS
    meta = body["meta_info"]
    reason = meta["finish_reason"]
    if reason is not None and reason["type"] == "abort" and "prompt_tokens" not in meta:
        assert set(meta) - {"weight_versions", "response_sent_to_client_ts"} == META_ABORT_WAITING
    else:
        check_keys(meta, META_ALWAYS, META_OPTIONAL, "meta_info")
    if reason is not None:
        assert set(reason) == FINISH_KEYS[reason["type"]]
    assert finished == (reason is not None)
    GenerateResponse.model_validate_json(json.dumps(body))


async def test_generate_responses_carry_exactly_sglang_keys(http: httpx.AsyncClient) -> None:
    sampling = {"max_new_tokens": 4, "ignore_eos": True}
    single = await http.post(
        "/generate",
        json={
            "input_ids": [1, 2, 3],
            "sampling_params": sampling,
            "return_logprob": True,
            "top_logprobs_num": 2,
            "logprob_start_len": 0,
            "return_prompt_token_ids": True,
        },
    )
    assert single.status_code == 200, single.text
    check_generate_body(single.json())
    assert single.json()["meta_info"]["reasoning_tokens"] == 0
    batch = await http.post("/generate", json={"input_ids": [[1, 2], [3]], "sampling_params": sampling})
    for body in batch.json():
        check_generate_body(body)
    stop = await http.post(
        "/generate", json={"input_ids": [5], "sampling_params": {"max_new_tokens": 3, "stop_token_ids": [0]}}
    )
    check_generate_body(stop.json())


async def test_streamed_events_carry_exactly_sglang_keys(http: httpx.AsyncClient) -> None:
    body = {"input_ids": [[1, 2], [4]], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
    events: list[dict[str, Any]] = []
    async with http.stream("POST", "/generate", json={**body, "stream": True}) as reply:
        async for line in reply.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line.removeprefix("data: ")))
    assert events
    for event in events:
        check_generate_body(event, finished=event["meta_info"]["finish_reason"] is not None)
        assert "index" in event


async def test_model_info_has_every_key_sglang_writes(http: httpx.AsyncClient) -> None:
    info = (await http.get("/model_info")).json()
    assert set(info) == MODEL_INFO_KEYS
    assert info["disaggregation_mode"] == "null"
    ModelInfo.model_validate_json(json.dumps(info))


def check_server_args(info: dict[str, Any]) -> None:
    assert set(info) >= SERVER_ARGS, SERVER_ARGS - set(info)
    assert "api_key" not in info


async def test_server_info_has_every_key_sglang_writes(http: httpx.AsyncClient) -> None:
    for path in ("/server_info", "/get_server_info"):
        info = (await http.get(path)).json()
        check_server_args(info)
        check_keys(info, SERVER_INFO_ALWAYS, SERVER_INFO_OPTIONAL | SERVER_ARGS, path)
        assert set(info["startup_time"]) == STARTUP_TIME_KEYS
        assert set(info["startup_time"]["cuda_graph"]) == GRAPH_PHASES
        assert set(info["hicache_object_layout"]) == HICACHE_LAYOUT_KEYS
        assert info["max_req_input_len"] == info["context_length"] - 1
        assert "--model-path" in info["launch_command"]
        (state,) = info["internal_states"]
        check_server_args(state)
        check_keys(
            state, INTERNAL_STATE_ALWAYS, INTERNAL_STATE_OPTIONAL | SERVER_ARGS, f"{path} internal state"
        )
        assert set(state["memory_usage"]) == MEMORY_USAGE_KEYS
        assert set(state["memory_usage"]["graph"]) == GRAPH_PHASES
        assert state["memory_usage"]["weight"] > 0
        assert state["disaggregation_mode"] == "null"


def check_load(load: dict[str, Any], sections: set[str]) -> None:
    assert set(load) == LOAD_CORE_KEYS | sections, set(load) ^ (LOAD_CORE_KEYS | sections)
    for section in sections:
        assert set(load[section]) == LOAD_SECTIONS[section], section
    assert isinstance(load["timestamp"], float)


async def test_metrics_are_named_as_sglang_names_them(http: httpx.AsyncClient) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    text = (await http.get("/metrics")).text
    names = {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}
    assert names <= METRIC_NAMES, names - METRIC_NAMES
    assert {"sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage"} <= names


async def test_loads_carry_sglang_keys_and_honour_the_query(http: httpx.AsyncClient) -> None:
    report = (await http.get("/v1/loads")).json()
    assert set(report) == LOADS_KEYS
    (load,) = report["loads"]
    check_load(load, LOAD_SECTIONS_ALWAYS)
    assert load["disaggregation"]["mode"] == "null"
    assert load["memory"]["token_capacity"] == load["max_total_num_tokens"]
    for include, sections in [
        ("core", set()),
        ("queues", {"queues"}),
        ("memory,disagg", {"memory", "disaggregation"}),
        ("core,all", LOAD_SECTIONS_ALWAYS),
    ]:
        (load,) = (await http.get("/v1/loads", params={"include": include})).json()["loads"]
        check_load(load, sections)
    assert (await http.get("/v1/loads", params={"dp_rank": 0})).json()["loads"] != []
    assert (await http.get("/v1/loads", params={"dp_rank": 1})).json()["loads"] == []
    refused = await http.get("/v1/loads", params={"include": "core,gpu"})
    assert refused.status_code == 400
    assert set(refused.json()) == ERROR_RESPONSE_KEYS
    assert "gpu" in refused.json()["message"]
    refused = await http.get("/v1/loads", params={"dp_rank": "first"})
    assert refused.status_code == 400
    assert set(refused.json()) == ERROR_RESPONSE_KEYS
    text = (await http.get("/v1/loads", params={"format": "prometheus"})).text
    gauges = {line.split("{")[0] for line in text.splitlines() if not line.startswith("#")}
    assert {
        "sglang_num_running_reqs",
        "sglang_memory_weight_gb",
        "sglang_disagg_kv_transfer_speed_gb_s",
    } <= gauges
    assert "sglang_queues_paused" in gauges
    assert "sglang_dp_rank" not in gauges
    assert 'sglang_num_running_reqs{dp_rank="0"} 0' in text


async def test_grpc_server_info_reports_what_server_info_does(
    http: httpx.AsyncClient, engine_url: str, engine_grpc_target: str
) -> None:
    from google.protobuf.json_format import MessageToDict

    from asyncrl_sglang.grpc_client import GrpcSGLangClient

    info = (await http.get("/server_info")).json()
    async with GrpcSGLangClient(engine_url, engine_grpc_target) as grpc_client:
        reply = await grpc_client.grpc_server_info()
        loads = await grpc_client.grpc_loads()
    arguments = MessageToDict(reply.server_args)
    check_server_args(arguments)
    assert set(arguments) <= set(info)
    assert {key: info[key] for key in arguments} == arguments
    handshake = MessageToDict(reply.scheduler_info)
    assert set(handshake) <= set(info)
    assert handshake["max_req_input_len"] == info["max_req_input_len"]
    assert loads.loads[0].memory.token_capacity == info["max_total_num_tokens"]
    assert loads.loads[0].disaggregation.mode == "null"


async def test_control_and_update_answers_carry_sglang_keys(http: httpx.AsyncClient) -> None:
    paused = await http.post("/pause_generation", json={"mode": "retract"})
    continued = await http.post("/continue_generation", json={})
    assert set(paused.json()) == CONTROL_KEYS
    assert set(continued.json()) == CONTROL_KEYS
    refused = await http.post("/destroy_weights_update_group", json={"group_name": "none"})
    assert refused.status_code == 400
    assert set(refused.json()) == UPDATE_KEYS
    assert not UpdateResult.model_validate_json(refused.content).success


async def test_max_new_tokens_zero_is_prefill_only(http: httpx.AsyncClient) -> None:
    reply = await http.post(
        "/generate",
        json={
            "input_ids": [4, 5, 6, 7],
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
        },
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    meta = body["meta_info"]
    assert body["output_ids"] == []
    assert meta["completion_tokens"] == 0
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["output_token_logprobs"] == []
    # Scoring callers read the prompt's logprobs: one per prompt token (the first has none).
    assert [token for _, token, _ in meta["input_token_logprobs"]] == [4, 5, 6, 7]
    assert meta["input_token_logprobs"][0][0] is None
    assert all(isinstance(lp, float) for lp, _, _ in meta["input_token_logprobs"][1:])


async def test_ready_is_503_while_paused(http: httpx.AsyncClient) -> None:
    assert (await http.get("/ready")).status_code == 200
    await http.post("/pause_generation", json={"mode": "abort"})
    try:
        assert (await http.get("/ready")).status_code == 503
        assert (await http.get("/health")).status_code == 200
    finally:
        await http.post("/continue_generation", json={})
    assert (await http.get("/ready")).status_code == 200


async def _running(client: SGLangClient) -> float:
    return (await client.metrics()).num_running_requests


async def _wait(client: SGLangClient, *, running: int) -> None:
    async with asyncio.timeout(60):
        while True:
            if await _running(client) == running:
                return
            await asyncio.sleep(0.02)


LONG = {"input_ids": [9, 8, 7], "sampling_params": {"max_new_tokens": None, "ignore_eos": True}}
"""Decodes until the context is full: long enough to be running when the client leaves."""


async def _aborted_total(client: SGLangClient) -> float:
    return (await client.metrics()).values["sglang:num_aborted_requests_total"]


async def test_a_non_streaming_client_that_disconnects_has_its_request_aborted(
    engine_url: str, client: SGLangClient
) -> None:
    before = await _aborted_total(client)
    async with httpx.AsyncClient(base_url=engine_url, trust_env=False) as http:
        call = asyncio.create_task(http.post("/generate", json=LONG, timeout=300))
        await _wait(client, running=1)
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call
    await _wait(client, running=0)
    assert await _aborted_total(client) == before + 1


async def test_a_streaming_client_that_disconnects_is_aborted_without_an_error_log(
    engine_url: str, client: SGLangClient, engine_log_path: Path
) -> None:
    before = await _aborted_total(client)
    log_size = await asyncio.to_thread(lambda: engine_log_path.stat().st_size)
    async with (
        httpx.AsyncClient(base_url=engine_url, trust_env=False) as http,
        http.stream("POST", "/generate", json={**LONG, "stream": True}, timeout=300) as reply,
    ):
        async for line in reply.aiter_lines():
            if line.startswith("data: "):
                break
    await _wait(client, running=0)
    assert await _aborted_total(client) == before + 1
    await asyncio.sleep(0.5)  # let the engine write whatever it logs about the disconnect
    written = (await asyncio.to_thread(engine_log_path.read_bytes))[log_size:].decode(errors="replace")
    assert "ERROR" not in written, written
    assert "Traceback" not in written, written


def test_auth_exempts_probes_and_matches_the_scheme_case_insensitively(tiny_llama_path: Path) -> None:
    with (
        serve_builtin(tiny_llama_path, "--api-key", "k", "--enable-metrics") as server,
        httpx.Client(base_url=server.url, trust_env=False, timeout=60) as http,
    ):
        for path in ("/health", "/health_generate", "/ready", "/metrics"):
            assert http.get(path).status_code == 200, path
        assert http.get("/model_info").status_code == 401
        assert http.get("/model_info", headers={"Authorization": "Bearer wrong"}).status_code == 401
        for scheme in ("Bearer", "bearer", "BEARER"):
            reply = http.get("/model_info", headers={"Authorization": f"{scheme} k"})
            assert reply.status_code == 200, scheme


@pytest.mark.parametrize(
    ("model_path", "needle"),
    [
        ("model.Q4_1.gguf", "is a GGUF file; give a HuggingFace model folder"),
        ("no/such/folder", "does not exist"),
    ],
)
def test_the_server_command_refuses_what_it_cannot_load_in_one_line(
    tmp_path: Path, model_path: str, needle: str
) -> None:
    target = tmp_path / model_path
    if target.suffix == ".gguf":
        target.write_bytes(b"GGUF")
    done = subprocess.run(
        [sys.executable, "-m", "asyncrl_engine", "--model-path", str(target)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert needle in lines[0]
    assert "smollm2-135m" in lines[0]


def test_the_server_command_takes_the_model_aliases_the_launcher_takes() -> None:
    # The launcher accepts `smollm2-135m`; the server command resolves it through the same resolver, so a
    # name the launcher passes through is one the server loads.
    from asyncrl_core.models import SMOLLM2_ALIAS
    from asyncrl_engine.flags import parse_args

    assert parse_args(["--model-path", SMOLLM2_ALIAS]).model_path == SMOLLM2_ALIAS


def test_the_launch_command_shown_is_the_arguments_with_the_api_key_redacted() -> None:
    from asyncrl_engine.flags import launch_command

    shown = launch_command(["--model-path", "m", "--api-key", "k", "--port", "1", "--api-key=k2"])
    assert shown == "--model-path m --api-key <redacted> --port 1 --api-key=<redacted>"


def test_server_info_reports_every_sglang_flag_the_engine_takes() -> None:
    # Every flag is given a value other than its default; each one SGLang has must come back under its name.
    from asyncrl_engine.__main__ import launch_arguments
    from asyncrl_engine.flags import parse_args
    from asyncrl_engine.info import server_args

    argv = [
        "--model-path", "m", "--tokenizer-path", "t", "--served-model-name", "s", "--host", "::1",
        "--port", "1", "--port-file", "p", "--grpc-port", "2", "--api-key", "k",
        "--max-running-requests", "3", "--chunked-prefill-size", "9", "--max-queued-requests", "4",
        "--max-n", "5", "--context-length", "6",
        "--weight-version", "v", "--device", "cuda:1", "--dtype", "float16", "--enable-metrics",
        "--random-seed", "7", "--random-weights", "--weight-version-route", "old", "--disable-cuda-graph",
        "--disable-overlap-schedule", "--disable-fused-kernels", "--disable-radix-cache",
        "--skip-server-warmup", "--start-paused", "--num-threads", "8", "--log-level", "debug",
    ]  # fmt: skip
    args = parse_args(argv)
    arguments = launch_arguments(
        args,
        model_path=Path(args.model_path),
        tokenizer_path=args.tokenizer_path,
        context_length=args.context_length,
        device=args.device,
        dtype=args.dtype,
        command=" ".join(argv),
    )
    reported = server_args(arguments)
    for flag, value in vars(args).items():
        if flag in BUILTIN_ONLY_FLAGS:
            assert flag not in reported, flag
        else:
            assert flag in SERVER_ARGS, f"--{flag}: not a ServerArgs field of SGLang 0.5.23"
            assert reported[flag] == value, flag
    assert reported["load_format"] == "dummy"
    assert set(reported) <= SERVER_ARGS, set(reported) - SERVER_ARGS
