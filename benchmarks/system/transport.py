"""Generation over HTTP (`/generate`, JSON) against gRPC (`SglangScheduler.Generate`, protobuf) on one engine.

One built-in engine, started by the launcher with both transports, serves a trivial model (one layer, a
hidden size of 2, random weights; every request asks for one new token, so the engine's work is a prefill of
almost no arithmetic). The same requests go through `SGLangClient` (HTTP) and `GrpcSGLangClient` (gRPC) in
turns, at each concurrency (1, 64, 512 requests in flight) and prompt length (128, 8,192 tokens). Per
request it reports the wall time (the run's wall time over its requests), the client's CPU time and the
engine process's CPU time (`/proc`), and the ratios HTTP / gRPC of each (above 1: gRPC is cheaper). Each
point is measured `--repeats` times alternating the transports, and the median is kept.

    uv run python benchmarks/system/transport.py [--concurrency 1 64 512] [--prompt-lengths 128 8192]

Prints a table and writes the figures as JSON (`--out`, default `benchmarks/results/transport.json`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from asyncrl_core.types import SamplingParams
from asyncrl_sglang.client import SGLangClient
from asyncrl_sglang.grpc_client import GrpcSGLangClient
from asyncrl_sglang.launcher import LaunchedEngines, builtin_command, pick_ports, start_engines

VOCAB_SIZE = 4096
TRIVIAL_MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 2,
    "intermediate_size": 2,
    "num_hidden_layers": 1,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "head_dim": 2,
    "max_position_embeddings": 16384,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "eos_token_id": 2,
}
ONE_TOKEN = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
TRANSPORTS = ("http", "grpc")


def engine_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` and its reaped children (Linux `/proc`)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = sum(int(value) for value in fields[11:15])
    return ticks / os.sysconf("SC_CLK_TCK")


async def run_point(
    client: SGLangClient, prompts: list[list[int]], concurrency: int, engine_pid: int
) -> dict[str, float]:
    """Send every prompt with at most `concurrency` in flight; wall, client CPU and engine CPU per request."""
    semaphore = asyncio.Semaphore(concurrency)

    async def one(prompt: list[int]) -> None:
        async with semaphore:
            generation = await client.generate(prompt, ONE_TOKEN)
            assert len(generation.output_ids) == 1
            assert generation.versions_verified

    engine_before, cpu_before, wall_before = (
        engine_cpu_s(engine_pid),
        time.process_time(),
        time.perf_counter(),
    )
    await asyncio.gather(*(one(prompt) for prompt in prompts))
    wall = time.perf_counter() - wall_before
    count = len(prompts)
    return {
        "wall_ms_per_request": 1e3 * wall / count,
        "client_cpu_ms_per_request": 1e3 * (time.process_time() - cpu_before) / count,
        "engine_cpu_ms_per_request": 1e3 * (engine_cpu_s(engine_pid) - engine_before) / count,
    }


async def measure(engines: LaunchedEngines, args: argparse.Namespace) -> list[dict[str, Any]]:
    url, target = engines.urls[0], engines.grpc_targets[0]
    assert target is not None
    engine_pid = engines.processes[0].pid
    rng = random.Random(0)
    results: list[dict[str, Any]] = []
    clients: dict[str, SGLangClient] = {
        "http": SGLangClient(url, max_connections=max(args.concurrency) + 8),
        "grpc": GrpcSGLangClient(url, target),
    }
    try:
        for client in clients.values():  # warm both paths (connections, the gRPC span detection)
            await run_point(client, [[3] * 8 for _ in range(4)], 4, engine_pid)
        for prompt_len in args.prompt_lengths:
            for concurrency in args.concurrency:
                count = max(args.min_requests, concurrency * args.rounds)
                prompts = [[rng.randrange(3, VOCAB_SIZE) for _ in range(prompt_len)] for _ in range(count)]
                runs: dict[str, list[dict[str, float]]] = {name: [] for name in TRANSPORTS}
                for repeat in range(args.repeats):
                    order = TRANSPORTS if repeat % 2 == 0 else TRANSPORTS[::-1]
                    for name in order:
                        runs[name].append(await run_point(clients[name], prompts, concurrency, engine_pid))
                point: dict[str, Any] = {
                    "prompt_len": prompt_len,
                    "concurrency": concurrency,
                    "requests": count,
                }
                for name in TRANSPORTS:
                    for key in runs[name][0]:
                        point[f"{name}_{key}"] = statistics.median(run[key] for run in runs[name])
                for key in runs["http"][0]:
                    point[f"ratio_{key}"] = point[f"http_{key}"] / point[f"grpc_{key}"]
                results.append(point)
                print(_row(point), flush=True)
    finally:
        for client in clients.values():
            await client.aclose()
    return results


def _row(point: dict[str, Any]) -> str:
    http, grpc = point["http_wall_ms_per_request"], point["grpc_wall_ms_per_request"]
    return (
        f"prompt {point['prompt_len']:>5}  concurrency {point['concurrency']:>4}  "
        f"wall ms/request http {http:8.3f} grpc {grpc:8.3f} (x{point['ratio_wall_ms_per_request']:.2f})  "
        f"client CPU x{point['ratio_client_cpu_ms_per_request']:.2f}  "
        f"engine CPU x{point['ratio_engine_cpu_ms_per_request']:.2f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 512])
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[128, 8192])
    parser.add_argument("--rounds", type=int, default=1, help="requests per point: concurrency x rounds")
    parser.add_argument("--min-requests", type=int, default=32, help="at least this many requests per point")
    parser.add_argument("--repeats", type=int, default=2, help="runs per transport and point (median kept)")
    parser.add_argument("--engine-threads", type=int, default=1, help="torch threads of the engine")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/transport.json"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="asyncrl-transport-") as folder:
        model = Path(folder) / "trivial"
        model.mkdir()
        (model / "config.json").write_text(json.dumps(TRIVIAL_MODEL))
        http_port, grpc_port = pick_ports("127.0.0.1", 2, None)
        command = builtin_command(
            model_path=str(model),
            host="127.0.0.1",
            port=http_port,
            grpc_port=grpc_port,
            max_running_requests=max(args.concurrency),
            context_length=max(args.prompt_lengths) + 8,
            enable_metrics=False,
            extra_args={"random_weights": True, "num_threads": args.engine_threads},
        )
        with start_engines([command], log_dir=Path(folder) / "logs", health_timeout_s=300.0) as engines:
            results = asyncio.run(measure(engines, args))
    report = {
        "benchmark": "transport",
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load": os.getloadavg()},
        "model": TRIVIAL_MODEL,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
