"""`python -m asyncrl_engine --model-path DIR [...]`: serve SGLang's routes with the built-in engine.

Arguments are parsed before torch is imported, so `--help` is instant.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl_engine.flags import launch_command, parse_args

if TYPE_CHECKING:
    from asyncrl_engine.server import ServerArgs

logger = logging.getLogger("asyncrl_engine")


def launch_arguments(
    args: argparse.Namespace,
    *,
    model_path: Path,
    tokenizer_path: str | None,
    context_length: int,
    device: str,
    dtype: str,
    command: str,
) -> ServerArgs:
    """The launch arguments under SGLang's `ServerArgs` names (what `/server_info` reports): `args` as parsed,
    with the model path, tokenizer, context length, device and dtype as resolved at start."""
    from asyncrl_engine.server import ServerArgs

    return ServerArgs(
        model_path=str(model_path),
        served_model_name=args.served_model_name or model_path.name,
        tokenizer_path=tokenizer_path,
        host=args.host,
        port=args.port,
        grpc_port=args.grpc_port,
        api_key=args.api_key,
        max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size,
        max_queued_requests=args.max_queued_requests,
        max_n=args.max_n,
        max_request_body_bytes=args.max_request_body_bytes,
        context_length=context_length,
        weight_version=args.weight_version,
        device=device,
        dtype=dtype,
        enable_metrics=args.enable_metrics,
        random_seed=args.random_seed,
        load_format="dummy" if args.random_weights else "safetensors",
        disable_cuda_graph=args.disable_cuda_graph,
        attention_backend=args.attention_backend,
        disable_radix_cache=args.disable_radix_cache,
        disable_overlap_schedule=args.disable_overlap_schedule,
        skip_server_warmup=args.skip_server_warmup,
        log_level=args.log_level,
        weight_version_route=args.weight_version_route,
        launch_command=command,
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from asyncrl_core.errors import AsyncRLError
    from asyncrl_core.models import resolve_model_path

    try:
        model_path = resolve_model_path(args.model_path, key="--model-path")
    except AsyncRLError as error:
        print(f"python -m asyncrl_engine: error: {error}", file=sys.stderr)
        return 2
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args, model_path, launch_command(argv)))
    return 0


async def _serve(args: argparse.Namespace, model_path: Path, command: str) -> None:
    began = time.perf_counter()
    import torch
    from aiohttp import web

    from asyncrl_core.models import read_hf_config
    from asyncrl_core.server_process import bound_port, write_port_file
    from asyncrl_engine.engine import Engine
    from asyncrl_engine.info import Startup, available_memory_gb
    from asyncrl_engine.model import EngineModel
    from asyncrl_engine.model_config import ModelConfig
    from asyncrl_engine.server import BuiltinServer

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    device = torch.device(args.device)
    dtype_name = args.dtype if args.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    loop = asyncio.get_running_loop()
    available_gb = available_memory_gb(str(device))
    loading = time.perf_counter()
    if args.random_weights:
        config = ModelConfig.from_dict(read_hf_config(model_path))
        model = await asyncio.to_thread(
            EngineModel.random,
            config,
            device,
            dtype,
            args.random_seed,
            fused_kernels=not args.disable_fused_kernels,
            attention_kernels=args.attention_backend == "triton",
        )
    else:
        model = await asyncio.to_thread(
            EngineModel.from_pretrained,
            model_path,
            device,
            dtype,
            fused_kernels=not args.disable_fused_kernels,
            attention_kernels=args.attention_backend == "triton",
        )
    load_weight_s = time.perf_counter() - loading
    tokenizer_path = args.tokenizer_path or str(model_path)
    tokenizer = _load_tokenizer(tokenizer_path)
    context_length = args.context_length or min(model.config.max_position_embeddings, 4096)
    eos_ids = list(model.config.eos_token_ids)
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        eos_ids.append(int(tokenizer.eos_token_id))

    engine = Engine(
        model,
        max_running_requests=args.max_running_requests,
        context_length=context_length,
        weight_version=args.weight_version,
        seed=args.random_seed,
        eos_token_ids=eos_ids,
        decode_text=None if tokenizer is None else _text_decoder(tokenizer),
        use_cuda_graphs=not args.disable_cuda_graph,
        prefix_cache=not args.disable_radix_cache,
        overlap_schedule=not args.disable_overlap_schedule,
        chunked_prefill_size=args.chunked_prefill_size,
    )
    arguments = launch_arguments(
        args,
        model_path=model_path,
        tokenizer_path=tokenizer_path if tokenizer is not None else None,
        context_length=context_length,
        device=str(device),
        dtype=dtype_name,
        command=command,
    )
    engine.start()
    server = BuiltinServer(engine, tokenizer, arguments)
    if args.start_paused:
        # The gate closes before the server listens, so no request passes it first. Only the gate: the
        # scheduler runs the warm-up and the health probes (they go straight to it) and nothing else.
        await server.gate.pause("in_place")
    runner = web.AppRunner(server.app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = bound_port(runner, args.port)
    service = grpc_server = None
    if args.grpc_port is not None:
        from asyncrl_engine.grpc_service import SchedulerService, start_grpc_server

        service = SchedulerService(engine, server.gate, server.info, server.generation.limits)
        grpc_server, grpc_port = await start_grpc_server(service, args.host, args.grpc_port, args.api_key)
        print(f"asyncrl builtin engine serving gRPC on {args.host}:{grpc_port}", flush=True)
    if args.port_file:
        write_port_file(Path(args.port_file), port)
    logger.info("listening on http://%s:%d", args.host, port)
    print(f"asyncrl builtin engine listening on http://{args.host}:{port}", flush=True)

    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        if not args.skip_server_warmup:
            await asyncio.to_thread(_warmup, engine)
        server.info.startup = Startup(
            load_weight_s=load_weight_s,
            scheduler_e2e_s=time.perf_counter() - began,
            available_gb=available_gb,
        )
        server.ready = True
        if service is not None:
            service.ready = True
        logger.info("The server is fired up and ready to roll!")
        await stop.wait()
    finally:
        if service is not None:
            service.ready = False
        await server.stop()
        if grpc_server is not None:
            await grpc_server.stop(grace=5.0)
        await runner.cleanup()


def _warmup(engine: object) -> None:
    """One short greedy generation through the scheduler (captures CUDA graphs on CUDA)."""
    import threading

    from asyncrl_engine.engine import Engine
    from asyncrl_engine.options import SamplingOptions
    from asyncrl_engine.request import Request

    assert isinstance(engine, Engine)
    done = threading.Event()
    probe = Request(
        rid="warmup",
        prompt_ids=[0, 1, 2, 3],
        options=SamplingOptions(max_new_tokens=8, temperature=0.0, ignore_eos=True),
        on_update=lambda _request, finished: done.set() if finished else None,
    )
    engine.call(lambda: engine.add_request(probe), timeout_s=60.0)
    if not done.wait(600.0):
        raise RuntimeError("warm-up generation did not finish within 600 s")


def _text_decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """Token ids -> text as `tokenizer.decode(ids, skip_special_tokens=True)` gives it, for the stop-string
    matcher (a call per token of every request with stop strings). A fast tokenizer that cleans up no spaces
    decodes through its Rust backend directly: the same text, without the Python layers around it (about a
    third of the cost)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):

        def decode_backend(ids: list[int]) -> str:
            return backend.decode(ids, skip_special_tokens=True)

        return decode_backend

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    return decode


def _load_tokenizer(path: str) -> Any:
    if not (Path(path) / "tokenizer.json").exists() and not (Path(path) / "tokenizer_config.json").exists():
        logger.warning("no tokenizer in %s: text input and stop strings are refused", path)
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


if __name__ == "__main__":
    sys.exit(main())
