"""The information routes of the built-in engine: model and server info, the weight version, health, the
Prometheus `/metrics` and the `/v1/loads` report.

What the server reports about itself is built here once, for HTTP and gRPC alike: the launch arguments under
SGLang's field names (`server_args`), the scheduler's handshake (`scheduler_info`), and one reading of the
load (`Load`), which `/v1/loads`, `/metrics` and gRPC's `GetLoads` render. The keys are those SGLang 0.5.23
writes (`http_server.server_info`, `utils.common.build_server_info`, `scheduler.get_init_info`,
`scheduler_components.internal_state`, `load_snapshot.LoadSnapshot`); values the built-in engine does not have
(hierarchical cache, speculative decoding, LoRA, disaggregation) are reported as SGLang reports them when the
feature is off.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from asyncrl_engine._http import Json, error_response, json_model, not_found
from asyncrl_engine.engine import Engine
from asyncrl_engine.gate import AdmissionGate
from asyncrl_engine.options import SamplingOptions
from asyncrl_engine.request import Request
from asyncrl_engine.snapshot import EngineSnapshot
from asyncrl_sglang.wire import LoadsQuery, ModelInfo, WeightVersionReply, parse_object

if TYPE_CHECKING:
    from asyncrl_engine.server import ServerArgs

SERVER_VERSION = "asyncrl-builtin-0.1.0"
LOAD_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})
"""The `include` sections of a load report (SGLang's `LoadSnapshot.VALID_SECTIONS`)."""
GRAPH_PHASES = ("prefill", "decode", "target_verify", "draft_prefill", "draft_decode", "draft_extend")
"""The CUDA-graph phases SGLang reports memory and capture time for; the built-in engine captures `decode`."""
HEALTH_CHECK_TIMEOUT_S = 20.0
"""How long the one-token health probe may take (SGLang's `SGLANG_HEALTH_CHECK_TIMEOUT` default)."""
_NOT_SERVER_ARGS = frozenset(
    {"api_key", "weight_version_route", "launch_command", "max_n", "max_request_body_bytes"}
)
"""Launch arguments SGLang's `ServerArgs` has no field for (or that must not be shown: the key)."""
_GB = float(1 << 30)


def available_memory_gb(device: str) -> float:
    """Memory free on `device` now, in GiB: the GPU's free memory, or the host's available RAM on CPU."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.mem_get_info(torch.device(device))[0] / _GB
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / _GB


@dataclass(frozen=True, slots=True)
class Startup:
    """How the server started: seconds spent loading the weights and from launch to serving, and the memory
    free before the weights were loaded (GiB). All zero for a server built in-process without measuring."""

    load_weight_s: float = 0.0
    scheduler_e2e_s: float = 0.0
    available_gb: float = 0.0

    def startup_time(self) -> Json:
        """SGLang's `startup_time` record. The KV cache grows on demand and CUDA graphs are captured at their
        first use, so neither costs startup time."""
        return {
            "load_weight": self.load_weight_s,
            "kv_cache_allocation": 0.0,
            "scheduler_e2e": self.scheduler_e2e_s,
            "cuda_graph": dict.fromkeys(GRAPH_PHASES, 0.0),
        }


async def probe_health(engine: Engine, timeout_s: float = HEALTH_CHECK_TIMEOUT_S) -> bool:
    """Whether a one-token greedy request gets through the scheduler within `timeout_s` (`/health_generate`,
    gRPC `HealthCheck`). It goes straight to the scheduler, past the admission gate, as SGLang's probe does,
    so a long pause makes it time out; a probe that times out is aborted."""
    probe = Request(
        rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
        prompt_ids=[0],
        options=SamplingOptions(max_new_tokens=1, temperature=0.0),
    )
    done = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_update(_request: Request, finished: bool) -> None:
        if finished:
            loop.call_soon_threadsafe(done.set)

    probe.on_update = on_update
    await asyncio.wrap_future(engine.call_async(lambda: engine.add_request(probe)))
    try:
        await asyncio.wait_for(done.wait(), timeout=timeout_s)
    except TimeoutError:
        engine.call_async(lambda: engine.abort(probe.rid))
        return False
    return True


def server_args(args: ServerArgs) -> Json:
    """The launch arguments under SGLang's `ServerArgs` field names, one rank of one instance. The API key is
    left out: a server that checks a key does not hand it to whoever can read its info."""
    fields = {key: value for key, value in asdict(args).items() if key not in _NOT_SERVER_ARGS}
    return fields | {"tp_size": 1, "dp_size": 1, "pp_size": 1, "enable_dp_attention": False}


def scheduler_info(engine: Engine, startup: Startup) -> Json:
    """The scheduler's handshake (`Scheduler.get_init_info`), in `/server_info` and `GetServerInfo`."""
    return {
        "status": "ready",
        "max_total_num_tokens": engine.max_running_requests * engine.context_length,
        "max_req_input_len": engine.context_length - 1,
        "startup_time": startup.startup_time(),
        "hicache_object_layout": {
            "enabled": False,
            "backend": None,
            "page_size": None,
            "hicache_object_layout": {"pools": []},
            "reason": "Hierarchical cache is disabled",
        },
    }


@dataclass(frozen=True, slots=True)
class Load:
    """One reading of the engine's load: the scheduler's last published `EngineSnapshot` (at most one
    scheduler iteration old, never half a step) and the admission gate's count."""

    num_running_reqs: int
    num_waiting_reqs: int
    num_waiting_tokens: int
    num_paused_reqs: int
    num_retracted_reqs: int
    num_used_tokens: int
    max_total_num_tokens: int
    max_running_requests: int
    gen_throughput: float
    prefill_tokens_total: int
    cache_hit_rate: float
    prefill_busy_us: int
    weight_gb: float
    kv_cache_gb: float
    graph_gb: float
    snapshot: EngineSnapshot
    """The scheduler's snapshot this reading was taken from (its counters feed `/metrics`)."""

    @classmethod
    def read(cls, engine: Engine, gate: AdmissionGate) -> Load:
        snapshot = engine.snapshot  # one immutable object: every value below is of the same moment
        return cls(
            num_running_reqs=snapshot.num_running,
            num_waiting_reqs=snapshot.num_waiting,
            num_waiting_tokens=snapshot.num_waiting_tokens,
            num_paused_reqs=gate.num_waiting,
            num_retracted_reqs=snapshot.num_retracted_waiting,
            num_used_tokens=snapshot.num_used_tokens,
            max_total_num_tokens=engine.max_running_requests * engine.context_length,
            max_running_requests=engine.max_running_requests,
            gen_throughput=snapshot.counters.gen_throughput,
            prefill_tokens_total=snapshot.counters.prefill_tokens_total,
            cache_hit_rate=snapshot.counters.cache_hit_rate,
            prefill_busy_us=snapshot.counters.prefill_busy_us,
            weight_gb=engine.model.nbytes() / _GB,
            kv_cache_gb=snapshot.kv_cache_bytes / _GB,
            graph_gb=snapshot.cuda_graph_bytes / _GB,
            snapshot=snapshot,
        )

    @property
    def token_usage(self) -> float:
        """Share of the KV capacity (`max_total_num_tokens`) in use."""
        return self.num_used_tokens / self.max_total_num_tokens

    @property
    def utilization(self) -> float:
        """Share of the running-batch limit in use."""
        return self.num_running_reqs / self.max_running_requests

    def sglang_json(self, include: Collection[str] | None = None) -> Json:
        """One entry of `/v1/loads` (`LoadSnapshot.to_dict`): the core keys always, then the sections asked
        for (`include`; None or `all`: every section SGLang reports with these features off)."""
        load: Json = {
            "timestamp": time.time(),
            "dp_rank": 0,
            "num_running_reqs": self.num_running_reqs,
            "num_waiting_reqs": self.num_waiting_reqs,
            "num_waiting_uncached_tokens": self.num_waiting_tokens,
            "num_used_tokens": self.num_used_tokens,
            "num_total_tokens": self.num_used_tokens + self.num_waiting_tokens,
            "num_active_tokens": self.num_used_tokens + self.num_waiting_tokens,
            "num_prealloc_ready_tokens": 0,
            "max_total_num_tokens": self.max_total_num_tokens,
            "max_running_requests": self.max_running_requests,
            "token_usage": round(self.token_usage, 4),
            "gen_throughput": round(self.gen_throughput, 2),
            "cache_hit_rate": round(self.cache_hit_rate, 4),
            "utilization": round(self.utilization, 4),
            "total_prefill_uncached_tokens": self.prefill_tokens_total,
            "total_prefill_busy_us": self.prefill_busy_us,
            "decode_moments": None,
        }
        sections = LOAD_SECTIONS if include is None or "all" in include else include
        if "memory" in sections:
            load["memory"] = {
                "weight_gb": round(self.weight_gb, 3),
                "kv_cache_gb": round(self.kv_cache_gb, 3),
                "graph_gb": round(self.graph_gb, 3),
                "token_capacity": self.max_total_num_tokens,
            }
        if "disagg" in sections:
            load["disaggregation"] = {
                "mode": "null",
                "prefill_bootstrap_queue_reqs": 0,
                "prefill_inflight_queue_reqs": 0,
                "decode_prealloc_queue_reqs": 0,
                "decode_transfer_queue_reqs": 0,
                "decode_retracted_queue_reqs": 0,
                "kv_transfer_speed_gb_s": 0.0,
                "kv_transfer_latency_ms": 0.0,
            }
        if "queues" in sections:
            load["queues"] = {
                "waiting": self.num_waiting_reqs,
                "grammar": 0,
                "paused": self.num_paused_reqs,
                "retracted": self.num_retracted_reqs,
                "prealloc_ready": 0,
            }
        return load


def load_sections(include: Collection[str]) -> set[str] | None:
    """The sections a load report asks for (None: all); `ValueError` naming the unknown ones."""
    sections = {section.strip() for section in include}
    unknown = sections - LOAD_SECTIONS
    if unknown:
        raise ValueError(f"Invalid include sections: {unknown}. Valid options: {sorted(LOAD_SECTIONS)}")
    return sections or None


class InfoRoutes:
    """Read-only routes; `ready` is set once warmup is done (`/health` answers 503 before)."""

    def __init__(self, engine: Engine, gate: AdmissionGate, args: ServerArgs) -> None:
        self.engine = engine
        self.gate = gate
        self.args = args
        self.ready = False
        self.startup = Startup(available_gb=available_memory_gb(args.device))
        """How the server started; the command line replaces it with what it measured."""

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
            architectures=config.architectures,
        )
        return json_model(info)

    async def server_info(self, request: web.Request) -> web.Response:
        """Launch arguments, the scheduler's handshake and one internal state (`http_server.server_info`).
        Its `weight_version` is the launch value; `/model_info` has the current one."""
        engine, load = self.engine, Load.read(self.engine, self.gate)
        arguments = server_args(self.args)
        state = arguments | {
            "world_size": 1,
            "startup_time": self.startup.startup_time(),
            "effective_max_running_requests_per_dp": engine.max_running_requests,
            "last_gen_throughput": load.gen_throughput,
            "memory_usage": {
                "weight": round(load.weight_gb, 3),
                "kvcache": round(load.kv_cache_gb, 3),
                "startup_available": round(self.startup.available_gb, 3),
                "token_capacity": load.max_total_num_tokens,
                "token_capacity_swa": None,
                "graph": dict.fromkeys(GRAPH_PHASES, 0.0) | {"decode": round(load.graph_gb, 3)},
            },
            "disaggregation_mode": "null",
            "decode_cuda_graph_bs": list(load.snapshot.cuda_graph_batch_sizes),
            "decode_cuda_graph_memory_gb": round(load.graph_gb, 3),
        }
        info = arguments | {"launch_command": self.args.launch_command}
        info |= scheduler_info(engine, self.startup)
        info |= {
            "kv_events": None,
            "internal_states": [state],
            "version": SERVER_VERSION,
            "frontend": "python",
        }
        return web.json_response(info)

    async def get_weight_version(self, request: web.Request) -> web.Response:
        if self.args.weight_version_route == "old":
            return json_model(WeightVersionReply(weight_version=self.engine.weight_version))
        return error_response(
            f"The '{request.path}' endpoint is deprecated. Please use '/model_info' instead.", 404, "404"
        )

    @property
    def can_serve(self) -> bool:
        """Up, and the scheduler forms batches whenever the gate admits requests (a pause holds both, a
        continue releases both: the gate open over a paused scheduler would serve nothing)."""
        return self.ready and not (self.gate.paused is None and self.engine.paused is not None)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.can_serve else 503)

    async def ready_route(self, request: web.Request) -> web.Response:
        """`/ready`: whether new requests are admitted now (up, and not paused), as SGLang answers it."""
        paused = self.gate.paused is not None or self.engine.paused is not None
        return web.Response(status=200 if self.can_serve and not paused else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        if not self.ready:
            return web.Response(status=503)
        return web.Response(status=200 if await probe_health(self.engine) else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        if not self.args.enable_metrics:
            return not_found()
        load = Load.read(self.engine, self.gate)
        counters = load.snapshot.counters
        label = f'{{model_name="{self.args.served_model_name}",engine_type="unified"}}'
        gauges = {
            "num_running_reqs": ("Requests in the running batch.", load.num_running_reqs),
            "num_queue_reqs": (
                "Requests in the waiting queue (retracted ones included).",
                load.num_waiting_reqs,
            ),
            "num_paused_reqs": ("Requests blocked at the pause gate.", load.num_paused_reqs),
            "num_retracted_reqs": ("Retracted requests waiting to be re-prefilled.", load.num_retracted_reqs),
            "gen_throughput": ("Decode tokens per second.", load.gen_throughput),
            "num_used_tokens": ("Tokens held in the KV cache.", load.num_used_tokens),
            "token_usage": ("Fraction of the KV capacity in use.", load.token_usage),
            "cache_hit_rate": (
                "Prefix-cache hit rate of the latest prefill batch (cached over all its tokens).",
                load.cache_hit_rate,
            ),
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
        """`/v1/loads?dp_rank=&include=&format=`: SGLang's load report, in JSON or Prometheus text."""
        query = parse_object(LoadsQuery, dict(request.query))
        try:
            include = load_sections(query.include.split(",")) if query.include else None
        except ValueError as error:
            return error_response(str(error), 400, "400")
        load = Load.read(self.engine, self.gate)
        loads = [load.sglang_json(include)] if query.dp_rank in (None, 0) else []
        if query.format == "prometheus":
            return web.Response(text=_loads_prometheus(loads), content_type="text/plain", charset="utf-8")
        return web.json_response(
            {
                "timestamp": datetime.datetime.now(datetime.UTC).isoformat(),
                "version": SERVER_VERSION,
                "accelerator": _accelerator_name(self.args.device),
                "num_accelerators": 1,
                "loads": loads,
            }
        )


def _accelerator_name(device: str) -> str | None:
    """The accelerator's name as SGLang reports it (`torch.cuda.get_device_name`); None on CPU."""
    if not device.startswith("cuda"):
        return None
    import torch

    return torch.cuda.get_device_name(torch.device(device))


def _loads_prometheus(loads: list[Json]) -> str:
    """`/v1/loads?format=prometheus`: one gauge per numeric key, `sglang_<key>` or `sglang_<section>_<key>`
    (`spec`, `disagg` for the speculative and disaggregation sections), labelled with the DP rank."""
    prefixes = {"speculative": "spec", "disaggregation": "disagg"}
    samples: dict[str, list[tuple[int, float]]] = {}
    for load in loads:
        rank = int(load["dp_rank"])
        for key, value in load.items():
            if key == "dp_rank":
                continue
            if isinstance(value, dict):
                prefix = prefixes.get(key, key)
                numbers = [(f"sglang_{prefix}_{sub_key}", number) for sub_key, number in value.items()]
            else:
                numbers = [(f"sglang_{key}", value)]
            for name, number in numbers:
                if isinstance(number, int | float):
                    samples.setdefault(name, []).append((rank, number))
    lines: list[str] = []
    for name, values in samples.items():
        lines.append(f"# TYPE {name} gauge")
        lines += [f'{name}{{dp_rank="{rank}"}} {number}' for rank, number in values]
    return "\n".join(lines) + "\n"
