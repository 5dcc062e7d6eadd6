"""The information routes of the built-in engine: model and server info, the weight version, health, the
Prometheus `/metrics` and the `/v1/loads` report."""

from __future__ import annotations

import asyncio
import datetime
import uuid
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from aiohttp import web

from asyncrl_sglang.builtin._http import Json, error_response, json_model, not_found
from asyncrl_sglang.builtin.engine import Engine, Request
from asyncrl_sglang.builtin.gate import AdmissionGate
from asyncrl_sglang.builtin.sampling import SamplingOptions
from asyncrl_sglang.wire import ModelInfo, WeightVersionReply

if TYPE_CHECKING:
    from asyncrl_sglang.builtin.server import ServerArgs

SERVER_VERSION = "asyncrl-builtin-0.1.0"


class InfoRoutes:
    """Read-only routes; `ready` is set once warmup is done (`/health` answers 503 before)."""

    def __init__(self, engine: Engine, gate: AdmissionGate, args: ServerArgs) -> None:
        self.engine = engine
        self.gate = gate
        self.args = args
        self.ready = False

    async def _engine(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self.engine.call_async(fn))

    async def model_info(self, request: web.Request) -> web.Response:
        config = self.engine.model.config
        info = ModelInfo(
            model_path=self.args.model_path,
            served_model_name=self.args.served_model_name,
            tokenizer_path=self.args.tokenizer_path,
            is_generation=True,
            preferred_sampling_params=None,
            weight_version=self.engine.weight_version,
            load_format=self.args.load_format,
            reasoning_parser=None,
            tool_call_parser=None,
            disaggregation_mode="null",
            has_image_understanding=False,
            has_audio_understanding=False,
            model_type=config.model_type,
            architectures=["Qwen2ForCausalLM" if config.model_type == "qwen2" else "LlamaForCausalLM"],
        )
        return json_model(info)

    async def server_info(self, request: web.Request) -> web.Response:
        info: Json = asdict(self.args)
        info.pop("api_key", None)
        engine = self.engine
        cache_bytes = engine.kv_cache_bytes
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
            return json_model(WeightVersionReply(weight_version=self.engine.weight_version))
        return error_response(
            f"The '{request.path}' endpoint is deprecated. Please use '/model_info' instead.", 404, "404"
        )

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.ready else 503)

    async def ready_route(self, request: web.Request) -> web.Response:
        """`/ready`: whether new requests are admitted now (up, and not paused), as SGLang answers it."""
        return web.Response(status=200 if self.ready and self.gate.paused is None else 503)

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
            return not_found()
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
            "num_paused_reqs": ("Requests blocked at the pause gate.", self.gate.num_waiting),
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
                "paused": self.gate.num_waiting,
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
