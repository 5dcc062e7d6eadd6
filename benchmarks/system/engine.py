"""Generation throughput of the built-in engine against plain `transformers`, side by side in one run.

Measures, on the same model (same weights), the same prompts and lengths, greedy with every request running
to exactly `--new-tokens` tokens, for each batch size B:

  (a) `transformers` `generate` on a batch of B prompts (its dynamic KV cache);
  (b) `transformers` continuous batching (`generate_batch`), where the installed version has it;
  (c) the built-in engine in process: B requests submitted at once to `Engine` (scheduler thread, batched
      prefill, batched decode over the per-slot KV cache, CUDA graphs on a GPU), no HTTP;
  (d) the built-in engine through HTTP (`/generate`, one request per prompt, all concurrent) at the batch
      sizes of `--http-batch-sizes`;
  (e) on CUDA, the bound: the bare decode forward of the same model with a static KV cache, replayed as one
      CUDA graph per step (greedy argmax inside the graph, no scheduling), decode tokens only;
  (f) the agentic workload (`--agentic N`, after the rows): N concurrent trajectories of `--turns` turns; each
      turn's prompt is the previous turn's prompt, its output and an observation of 80-120 random tokens; each
      turn samples at temperature 1 with logprobs and stop strings, up to a max_new_tokens drawn from 48-256.
      The next turn is submitted the moment the previous one finishes (no tool latency: the engine's own
      speed). The whole workload runs once as a warm-up under other draws, then `--agentic-runs` times
      (default 3), measured and summed: the steady state of a long run, whose one-time costs (CUDA graph
      captures, the first allocation of the KV cache and of the prefix cache's pool) the warm-up pays. It
      prints generated tokens/s and its ratio to the fixed-shape row of the largest batch size (the same
      engine settings, measured in the same run), the prefill and prefix-cache token counts, and the share
      of the engine's time spent in prefill.

Tokens per second count generated tokens over the wall time from submission to the last token (prefill
included) for (a)-(d), and decode tokens over decode time for (e). Nothing is downloaded: the model is
SmolLM2-135M from `asyncrl_core.models` (real weights) or, with `--random-weights`, a random Llama of the same
shape (hidden 576, 30 layers, 9 heads, 3 KV heads, FFN 1536, vocab 49152, tied).

    python benchmarks/system/engine.py --device cpu --batch-sizes 1 8 32 --prompt-len 64 --new-tokens 32
    python benchmarks/system/engine.py --device cuda --random-weights --dtype bfloat16 \
        --batch-sizes 8 64 256 --prompt-len 128 --new-tokens 256 --json engine-gpu.json
    python benchmarks/system/engine.py --device cuda --random-weights --dtype bfloat16 --batch-sizes 256 \
        --prompt-len 128 --new-tokens 256 --skip-hf --agentic 256
    python benchmarks/system/engine.py --device cuda --random-weights --dtype bfloat16 \
        --batch-sizes 8 64 256 --http-batch-sizes --prompt-len 128 --new-tokens 256 --skip-hf \
        --agentic 256 --compare-overlap --rounds 2

`--compare-overlap` measures the engine rows and (f) with the overlap scheduler on, then off (SGLang's
`--disable-overlap-schedule`), `--rounds` times in one process, and prints each round and on / off.

The engine's host work: the scheduler thread's CPU time per generated token is measured for (c) and (f) (CPU
time, unlike wall time, is not inflated by other processes), split into device work (the model's forward
calls and the sampling operators; on a CPU their compute) and the rest, the host work (scheduling,
bookkeeping, stop strings, prefix-cache bookkeeping, clients), which a GPU cannot hide. `--tiny` (a random
Llama of hidden 64 and 2 layers; `--vocab-size` for its vocabulary) makes the compute small on a CPU, so
that the host work per token, which bounds a host-bound GPU engine, is measured on any machine:

    python benchmarks/system/engine.py --device cpu --tiny --vocab-size 4096 --batch-sizes 256 \
        --http-batch-sizes --prompt-len 128 --new-tokens 256 --skip-hf --agentic 256 --prefill-interval 8

(f) also prints its decode steps, their mean batch, and the bound that the longest trajectory puts on
agentic / fixed: no schedule takes fewer decode steps than its tokens, so at an equal cost per step the
ratio is at most the generated tokens over (longest trajectory x trajectories).

`--compare-extend-attention` measures only the model's prefill of agentic turns: `--extend-batch` sequences
of `--extend-new-tokens` new tokens each over 200-1,200 cached positions, prefilled right-padded
(`prefill_batch`: each layer gathers every row's KV up to the longest context and runs a masked SDPA) and
packed (`prefill_packed`: the extend-attention kernel reading the KV in place on CUDA, one SDPA per sequence
elsewhere; on CUDA also packed with the kernel off), alternating, `--rounds` times, and prints ms per prefill
and padded / packed:

    python benchmarks/system/engine.py --device cuda --random-weights --dtype bfloat16 \
        --compare-extend-attention --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

SMOLLM2_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}


TINY_SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 4,
}
"""What `--tiny` changes in SmolLM2's shape."""


def random_config(args: argparse.Namespace) -> dict[str, Any]:
    """The shape of the random model: SmolLM2-135M's, or `--tiny`'s, with `--vocab-size` if given."""
    config = {**SMOLLM2_CONFIG, **(TINY_SHAPE if args.tiny else {})}
    if args.vocab_size is not None:
        config["vocab_size"] = args.vocab_size
    return config


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument(
        "--http-batch-sizes", type=int, nargs="*", default=None, help="default: the middle one"
    )
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--model-path", help="a HuggingFace folder (default: SmolLM2-135M from asyncrl_core)")
    parser.add_argument(
        "--random-weights", action="store_true", help="random weights of SmolLM2-135M's shape"
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="random weights of a tiny Llama (hidden 64, 2 layers, 2 heads of 4, one KV head, FFN 128; "
        "implies --random-weights): on a CPU its compute is small, and the engine's host work per token, "
        "which bounds a host-bound GPU engine, shows",
    )
    parser.add_argument(
        "--vocab-size", type=int, help="the random model's vocabulary (default: SmolLM2's, 49152)"
    )
    parser.add_argument("--skip-continuous-batching", action="store_true", help="skip (b)")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="the engine decodes eagerly on CUDA")
    parser.add_argument("--skip-hf", action="store_true", help="skip (a) and (b): engine rows only")
    parser.add_argument(
        "--agentic", type=int, default=0, metavar="N", help="(f) with N concurrent trajectories (0: skip)"
    )
    parser.add_argument("--turns", type=int, default=3, help="turns per agentic trajectory")
    parser.add_argument(
        "--agentic-runs",
        type=int,
        default=3,
        help="measured runs of (f), after its warm-up run; their sum is reported",
    )
    parser.add_argument(
        "--no-prefix-cache", action="store_true", help="the engine runs without its prefix cache"
    )
    parser.add_argument(
        "--tokenizer-path",
        help="tokenizer.json for the agentic stop strings (default: the SmolLM2 folder's, else a synthetic "
        "one-character-per-token text)",
    )
    parser.add_argument(
        "--prefill-interval", type=int, help="the engine's prefill_interval (default: the engine's)"
    )
    parser.add_argument(
        "--no-decode-kernel",
        action="store_true",
        help="the decode step attends with the masked SDPA over the whole KV capacity instead of the "
        "Triton kernel that reads each row up to its own length (CUDA)",
    )
    parser.add_argument(
        "--compare-decode-kernel",
        action="store_true",
        help="measure the rows and the agentic workload with the decode kernel on, then off, `--rounds` "
        "times, in this process, and print them side by side",
    )
    parser.add_argument(
        "--no-fused-kernels",
        action="store_true",
        help="the model runs torch's elementwise ops instead of the fused Triton kernels (residual add + "
        "RMSNorm, rotary embedding + KV cache write, SiLU * up) (CUDA)",
    )
    parser.add_argument(
        "--compare-fused-kernels",
        action="store_true",
        help="like --compare-decode-kernel, for the fused kernels: on, then off, `--rounds` times",
    )
    parser.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="the engine reads each decode step's tokens before launching the next (SGLang's flag)",
    )
    parser.add_argument(
        "--kv-grow",
        action="store_true",
        help="the KV cache grows on demand on CUDA too (kv_whole_context=False), as before it took the "
        "whole context length at once",
    )
    parser.add_argument(
        "--compare-overlap",
        action="store_true",
        help="like --compare-decode-kernel, for the engine's overlap scheduler: on, then off, `--rounds` "
        "times",
    )
    parser.add_argument(
        "--compare-extend-attention",
        action="store_true",
        help="time the padded prefill (KV gathered per layer, masked SDPA) against the packed prefill (the "
        "extend-attention kernel on CUDA) on agentic turns, `--rounds` times; print padded / packed, exit",
    )
    parser.add_argument(
        "--extend-batch", type=int, default=32, help="sequences per prefill of --compare-extend-attention"
    )
    parser.add_argument(
        "--extend-new-tokens",
        type=int,
        default=100,
        help="new tokens of each sequence of --compare-extend-attention (over 200-1,200 cached positions)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds of --compare-decode-kernel / --compare-fused-kernels / --compare-overlap / "
        "--compare-extend-attention",
    )
    parser.add_argument(
        "--profile",
        metavar="FILE",
        help="after the measurements, run the agentic workload once more under torch.profiler: print the "
        "GPU's busy share and the largest GPU kernels and CPU operators, and write a Chrome trace to FILE",
    )
    parser.add_argument("--json", dest="json_path", help="write the results here")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.tiny or args.vocab_size is not None:
        args.random_weights = True
    return args


def build_models(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any, str]:
    """(transformers model, engine model) with identical weights, and a description."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from asyncrl_engine.model import EngineModel
    from asyncrl_engine.model_config import ModelConfig

    if args.random_weights:
        torch.manual_seed(args.seed)
        shape = random_config(args)
        hf = LlamaForCausalLM(LlamaConfig(**shape)).to(dtype)
        config = ModelConfig.from_dict(shape)
        description = (
            f"random weights, {'tiny' if args.tiny else 'SmolLM2-135M'} shape, vocab {shape['vocab_size']}"
        )
    else:
        if args.model_path:
            path = Path(args.model_path)
        else:
            from asyncrl_core.models import smollm2_135m

            path = smollm2_135m()
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        config = ModelConfig.from_dict(json.loads((path / "config.json").read_text()))
        description = f"{path.name} weights"
    hf = hf.to(device).eval()
    engine_model = EngineModel(config, device, dtype)
    time_device_work(engine_model)
    state = hf.state_dict()
    engine_model.load_named_tensors([(n, state[n]) for n in sorted(engine_model.required_names())])
    if args.no_decode_kernel:
        engine_model.decode_kernel = False
    if args.no_fused_kernels:
        engine_model.fused_kernels = False
    return hf, engine_model, description


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_hf_generate(hf: Any, prompts: torch.Tensor, new_tokens: int) -> float:
    device = prompts.device
    attention_mask = torch.ones_like(prompts)
    kwargs = {
        "max_new_tokens": new_tokens,
        "min_new_tokens": new_tokens,
        "do_sample": False,
        "pad_token_id": 2,
    }
    with torch.inference_mode():
        warm = {**kwargs, "max_new_tokens": 2, "min_new_tokens": 2}
        hf.generate(prompts[:, :8], attention_mask=attention_mask[:, :8], **warm)
        synchronize(device)
        started = time.perf_counter()
        output = hf.generate(prompts, attention_mask=attention_mask, **kwargs)
        synchronize(device)
        elapsed = time.perf_counter() - started
    assert output.shape[1] == prompts.shape[1] + new_tokens
    return prompts.shape[0] * new_tokens / elapsed


def bench_hf_continuous(hf: Any, prompts: torch.Tensor, new_tokens: int) -> float:
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=2
    )
    inputs = prompts.tolist()
    with torch.inference_mode():
        hf.generate_batch(inputs=inputs[:1], generation_config=config, progress_bar=False)
        synchronize(prompts.device)
        started = time.perf_counter()
        results = hf.generate_batch(inputs=inputs, generation_config=config, progress_bar=False)
        synchronize(prompts.device)
        elapsed = time.perf_counter() - started
    generated = sum(len(r.generated_tokens) for r in results.values())
    return generated / elapsed


def scheduler_cpu_s(engine: Any) -> tuple[float, float]:
    """CPU seconds the engine's scheduler thread has used, and those of it spent in device work
    (`time_device_work`): unlike wall time, neither is inflated by other processes on the machine."""
    return engine.call(lambda: (time.thread_time(), DEVICE_WORK["cpu_s"]))


def cpu_us_per_token_since(engine: Any, before: tuple[float, float], tokens: int) -> tuple[float, float]:
    """(scheduler CPU us per token, of which in device work) since `before` (a `scheduler_cpu_s`)."""
    total, device_work = scheduler_cpu_s(engine)
    return (total - before[0]) * 1e6 / tokens, (device_work - before[1]) * 1e6 / tokens


DEVICE_WORK: dict[str, float] = {
    "cpu_s": 0.0,
    "decode_steps": 0,
    "decode_rows": 0,
    "graph_captures": 0,
    "graph_capture_s": 0.0,
    "cache_grows": 0,
    "prefill_calls": 0,
    "prefill_cpu_s": 0.0,
}
"""Once `time_device_work` has wrapped the engine's device work: the CPU seconds the scheduler thread spent
in the model's forward calls and the sampling operators, and the decode steps sampled and their rows (the
decode batch, finished rows still decoded included); the CUDA graphs captured and the wall seconds their
captures took, and the times the KV cache grew (each growth drops the graphs); the model's packed prefill
calls and the scheduler's CPU seconds in them."""


def _timed(function: Any, counted: str | None = None) -> Any:
    """`function`, its scheduler CPU time added to `DEVICE_WORK["cpu_s"]` (and, with `counted`, its calls and
    CPU seconds to `DEVICE_WORK[counted + "_calls"]` and `[counted + "_cpu_s"]`)."""

    def timed(*args: Any, **kwargs: Any) -> Any:
        began = time.thread_time()
        try:
            return function(*args, **kwargs)
        finally:
            spent = time.thread_time() - began
            DEVICE_WORK["cpu_s"] += spent
            if counted is not None:
                DEVICE_WORK[counted + "_calls"] += 1
                DEVICE_WORK[counted + "_cpu_s"] += spent

    return timed


def time_device_work(model: Any) -> None:
    """Count the scheduler thread's CPU time in device work into `DEVICE_WORK`: the model's forward calls
    and the sampling operators the engine launches. On a CPU device that is the compute, so the thread's CPU
    time less it is the engine's host work per step (scheduling, bookkeeping, stop strings, clients), which
    a GPU cannot hide; on CUDA it is the host side of the launches. Also counts the decode steps launched
    and their rows."""
    import asyncrl_engine.cuda_graphs as graphs_module
    import asyncrl_engine.step_runner as runner_module

    for name in ("decode", "prefill_batch", "prefill_packed", "logits"):
        if hasattr(model, name):
            counted = "prefill" if name == "prefill_packed" else None
            setattr(model, name, _timed(getattr(model, name), counted))
    for name in ("sample_on_device", "sample_tokens"):
        function = getattr(runner_module, name, None)
        if function is not None and not getattr(function, "device_work", False):
            timed = _timed(function)
            timed.device_work = True
            setattr(runner_module, name, timed)
    launch = runner_module.StepRunner.launch_decode
    if not getattr(launch, "device_work", False):

        def counted(runner: Any, *args: Any, **kwargs: Any) -> Any:
            DEVICE_WORK["decode_steps"] += 1
            DEVICE_WORK["decode_rows"] += len(runner.scheduler.table.running)
            return launch(runner, *args, **kwargs)

        counted.device_work = True
        runner_module.StepRunner.launch_decode = counted
    capture = graphs_module.CudaGraphs._capture  # pyright: ignore[reportPrivateUsage]
    if not getattr(capture, "device_work", False):

        def captured(self: Any, *args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return capture(self, *args, **kwargs)
            finally:
                DEVICE_WORK["graph_captures"] += 1
                DEVICE_WORK["graph_capture_s"] += time.perf_counter() - began

        captured.device_work = True
        graphs_module.CudaGraphs._capture = captured  # pyright: ignore[reportPrivateUsage]
    ensure = runner_module.StepRunner.ensure_cache
    if not getattr(ensure, "device_work", False):

        def ensured(runner: Any, *args: Any, **kwargs: Any) -> Any:
            before = runner.cache
            cache = ensure(runner, *args, **kwargs)
            if before is not None and cache is not before:
                DEVICE_WORK["cache_grows"] += 1
            return cache

        ensured.device_work = True
        runner_module.StepRunner.ensure_cache = ensured


def bench_engine(
    engine: Any, prompts: torch.Tensor, new_tokens: int, cpu_us_per_token: dict[str, float] | None = None
) -> float:
    """Tokens/s of B requests submitted at once; `cpu_us_per_token["engine"]` gets the scheduler thread's CPU
    microseconds per generated token."""
    from asyncrl_engine.options import SamplingOptions
    from asyncrl_engine.request import Request

    options = SamplingOptions(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    remaining = [prompts.shape[0]]
    done = threading.Event()
    lock = threading.Lock()

    def on_update(_request: Request, finished: bool) -> None:
        if finished:
            with lock:
                remaining[0] -= 1
                if remaining[0] == 0:
                    done.set()

    requests = [
        Request(rid=f"bench-{i}", prompt_ids=row, options=options, on_update=on_update)
        for i, row in enumerate(prompts.tolist())
    ]
    cpu_before = scheduler_cpu_s(engine)
    started = time.perf_counter()
    engine.call(lambda: [engine.add_request(r) for r in requests])
    if not done.wait(3600):
        raise RuntimeError("the engine did not finish within an hour")
    elapsed = time.perf_counter() - started
    assert all(len(r.output_ids) == new_tokens for r in requests)
    if cpu_us_per_token is not None:
        total, device_work = cpu_us_per_token_since(engine, cpu_before, len(requests) * new_tokens)
        cpu_us_per_token["engine"], cpu_us_per_token["device_work"] = total, device_work
    return len(requests) * new_tokens / elapsed


def bench_http(engine: Any, prompts: torch.Tensor, new_tokens: int) -> float:
    """The same requests through `/generate` on a loopback aiohttp server in this process."""
    import aiohttp
    from aiohttp import web

    from asyncrl_engine.server import BuiltinServer, ServerArgs

    async def run() -> float:
        args = ServerArgs(model_path="bench", served_model_name="bench", tokenizer_path=None, port=0)
        server = BuiltinServer(engine, None, args)
        server.ready = True
        runner = web.AppRunner(server.app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        params = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
        try:
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=connector) as session:

                async def one(row: list[int]) -> int:
                    body = {"input_ids": row, "sampling_params": params}
                    async with session.post(f"http://127.0.0.1:{port}/generate", json=body) as response:
                        return len((await response.json())["output_ids"])

                started = time.perf_counter()
                counts = await asyncio.gather(*(one(row) for row in prompts.tolist()))
                elapsed = time.perf_counter() - started
        finally:
            await runner.cleanup()
        assert all(c == new_tokens for c in counts)
        return sum(counts) / elapsed

    return asyncio.run(run())


def bench_bound(model: Any, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Bare decode forward (no sampling) with a static KV cache, one CUDA graph replay per step."""
    from asyncrl_engine.kv_cache import KVCache

    device = model.device
    capacity = prompt_len + new_tokens + 1
    cache = KVCache(model.config, batch, capacity, device, model.dtype)
    ids = torch.zeros(batch, dtype=torch.long, device=device)
    positions = torch.full((batch,), prompt_len, dtype=torch.long, device=device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            model.decode(ids, positions, cache, capacity)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        hidden = model.decode(ids, positions, cache, capacity)
        logits = model.logits(hidden)
        ids.copy_(logits.argmax(dim=-1))
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    for step in range(new_tokens):
        positions.fill_(prompt_len + step)
        graph.replay()
    torch.cuda.synchronize(device)
    return batch * new_tokens / (time.perf_counter() - started)


STOP_STRINGS = ("</tool_call>", "\n\nObservation:")
"""The agentic turns' stop strings (rarely matched by random weights: they are checked at every token)."""


@dataclass
class AgenticResult:
    """What one agentic run produced (the test of the workload reads `turns`)."""

    tokens_per_s: float
    generated_tokens: int
    elapsed_s: float
    prefill_tokens: int
    cached_tokens: int
    prefill_busy_share: float
    cpu_us_per_token: float
    """CPU microseconds of the scheduler thread per generated token (`scheduler_cpu_s`)."""
    device_work_cpu_us_per_token: float
    """Of `cpu_us_per_token`, those in device work (`time_device_work`)."""
    longest_trajectory_tokens: int
    """Output tokens of the longest trajectory: no schedule takes fewer decode steps."""
    decode_steps: int
    decode_rows: int
    """Rows of those decode steps (`time_device_work`): their mean is the batch's occupancy."""
    graph_captures: int
    """CUDA graphs captured during the run (a KV cache growth drops them all)."""
    graph_capture_s: float
    cache_grows: int
    prefill_calls: int
    """The model's packed prefill calls (admissions and chunks)."""
    prefill_cpu_s: float
    """The scheduler thread's CPU seconds in them (on CUDA: their launches)."""
    turns: list[list[Any]] = field(default_factory=lambda: list[list[Any]]())
    """Per trajectory, its finished turn requests in order."""


def _cached_total(counters: Any) -> int:
    """Prefix-cache hits so far (0 for an engine without a prefix cache)."""
    return int(getattr(counters, "cached_tokens_total", 0))


def synthetic_decoder(vocab_size: int) -> Any:
    """Token ids -> text, one printable character per id (a stand-in when no tokenizer is at hand)."""
    alphabet = "abcdefghijklmnopqrstuvwxyz <>/_\n:ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    table = [alphabet[i % len(alphabet)] for i in range(vocab_size)]

    def decode(ids: list[int]) -> str:
        return "".join(table[i] for i in ids)

    return decode


def tokenizer_decoder(path: Path) -> Any:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    return decode


def run_agentic(
    engine: Any,
    num_trajectories: int,
    turns: int,
    prompt_len: int,
    vocab_size: int,
    seed: int = 0,
    new_tokens: tuple[int, int] = (48, 256),
    observation_tokens: tuple[int, int] = (80, 120),
    timeout_s: float = 3600.0,
) -> AgenticResult:
    """Run the agentic workload on a started `Engine` and wait for every trajectory's last turn."""
    from asyncrl_engine.options import SamplingOptions
    from asyncrl_engine.request import Request

    rng = random.Random(seed)
    draws = [
        [
            (
                rng.randint(*new_tokens),
                [rng.randrange(3, vocab_size) for _ in range(rng.randint(*observation_tokens))],
            )
            for _ in range(turns)
        ]
        for _ in range(num_trajectories)
    ]
    prompts = [[rng.randrange(3, vocab_size) for _ in range(prompt_len)] for _ in range(num_trajectories)]
    history: list[list[Any]] = [[] for _ in range(num_trajectories)]
    remaining = [num_trajectories]
    done = threading.Event()
    lock = threading.Lock()

    def make(index: int, turn: int, prompt: list[int]) -> Any:
        max_new, _ = draws[index][turn]
        options = SamplingOptions(max_new_tokens=max_new, temperature=1.0, stop=STOP_STRINGS)

        def on_update(request: Any, finished: bool) -> None:
            if not finished:
                return
            history[index].append(request)
            if turn + 1 < turns and request.finish_reason.get("type") != "abort":
                observation = draws[index][turn + 1][1]
                # Runs on the scheduler thread: `call_async` queues the next turn inline.
                follow = make(index, turn + 1, request.prompt_ids + request.output_ids + observation)
                engine.call_async(lambda: engine.add_request(follow))
                return
            with lock:
                remaining[0] -= 1
                if remaining[0] == 0:
                    done.set()

        return Request(
            rid=f"agentic-{index}-{turn}",
            prompt_ids=prompt,
            options=options,
            return_logprob=True,
            on_update=on_update,
        )

    first = [make(index, 0, prompts[index]) for index in range(num_trajectories)]
    counters = engine.counters
    before = (counters.prefill_tokens_total, _cached_total(counters), counters.prefill_busy_us)
    cpu_before = scheduler_cpu_s(engine)
    steps_before = (DEVICE_WORK["decode_steps"], DEVICE_WORK["decode_rows"])
    counted = ("graph_captures", "graph_capture_s", "cache_grows", "prefill_calls", "prefill_cpu_s")
    counted_before = {k: DEVICE_WORK[k] for k in counted}
    started = time.perf_counter()
    engine.call(lambda: [engine.add_request(r) for r in first])
    if not done.wait(timeout_s):
        raise RuntimeError(f"the agentic workload did not finish within {timeout_s} s")
    elapsed = time.perf_counter() - started
    cpu_us, device_work_cpu_us = cpu_us_per_token_since(
        engine, cpu_before, sum(len(r.output_ids) for turns_of in history for r in turns_of)
    )
    generated = sum(len(r.output_ids) for turns_of in history for r in turns_of)
    prefill_busy_s = (counters.prefill_busy_us - before[2]) / 1e6
    return AgenticResult(
        tokens_per_s=generated / elapsed,
        generated_tokens=generated,
        elapsed_s=elapsed,
        prefill_tokens=counters.prefill_tokens_total - before[0],
        cached_tokens=_cached_total(counters) - before[1],
        prefill_busy_share=prefill_busy_s / elapsed,
        cpu_us_per_token=cpu_us,
        device_work_cpu_us_per_token=device_work_cpu_us,
        longest_trajectory_tokens=max(sum(len(r.output_ids) for r in turns_of) for turns_of in history),
        decode_steps=int(DEVICE_WORK["decode_steps"] - steps_before[0]),
        decode_rows=int(DEVICE_WORK["decode_rows"] - steps_before[1]),
        graph_captures=int(DEVICE_WORK["graph_captures"] - counted_before["graph_captures"]),
        graph_capture_s=DEVICE_WORK["graph_capture_s"] - counted_before["graph_capture_s"],
        cache_grows=int(DEVICE_WORK["cache_grows"] - counted_before["cache_grows"]),
        prefill_calls=int(DEVICE_WORK["prefill_calls"] - counted_before["prefill_calls"]),
        prefill_cpu_s=DEVICE_WORK["prefill_cpu_s"] - counted_before["prefill_cpu_s"],
        turns=history,
    )


def main() -> int:
    args = parse_args()
    device = torch.device(args.device)
    dtype = (
        getattr(torch, args.dtype)
        if args.dtype
        else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    )

    hf, engine_model, description = build_models(args, device, dtype)
    generator = torch.Generator().manual_seed(args.seed)
    largest = max(args.batch_sizes)
    all_prompts = torch.randint(
        3, engine_model.config.vocab_size, (largest, args.prompt_len), generator=generator
    )
    http_sizes = args.http_batch_sizes
    if http_sizes is None:
        http_sizes = [sorted(args.batch_sizes)[len(args.batch_sizes) // 2]]
    print(
        f"device={device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else os.cpu_count()} "
        f"{'GPU' if device.type == 'cuda' else 'CPUs'}), dtype={str(dtype).removeprefix('torch.')}, "
        f"{description}, torch threads={torch.get_num_threads()}, prompt {args.prompt_len}, "
        f"{args.new_tokens} new tokens, greedy",
        flush=True,
    )
    with torch.inference_mode():
        check = all_prompts[0].to(device)
        reference = hf(check.unsqueeze(0)).logits[0].float()
        difference = (engine_model.forward_logits(check) - reference).abs().max().item()
    print(f"same model: max |engine logits - transformers logits| = {difference:.3g}", flush=True)
    if args.compare_extend_attention:
        extend = compare_extend_attention(args, engine_model, device)
        if args.json_path:
            result = {"args": vars(args), "device": str(device), "dtype": str(dtype), "model": description}
            Path(args.json_path).write_text(json.dumps({**result, "extend_attention": extend}, indent=2))
        return 0
    # What --compare-* switches (a model attribute, or the engine option OVERLAP) and what "off" runs.
    compared = {
        "decode_kernel": (args.compare_decode_kernel, "decode kernel", "masked SDPA"),
        "fused_kernels": (args.compare_fused_kernels, "fused kernels", "torch's elementwise ops"),
        OVERLAP: (args.compare_overlap, "overlap scheduler", "each step read before the next launch"),
    }
    chosen = [name for name, (asked, _, _) in compared.items() if asked]
    if len(chosen) > 1:
        print(
            "--compare-decode-kernel, --compare-fused-kernels and --compare-overlap are one at a time",
            file=sys.stderr,
        )
        return 2
    switch = chosen[0] if chosen else None
    if switch is not None and switch != OVERLAP and not getattr(engine_model, switch):
        print(
            f"--compare-{switch.replace('_', '-')} needs the {compared[switch][1]} (CUDA with Triton)",
            file=sys.stderr,
        )
        return 2
    variants = [None] if switch is None else [True, False] * args.rounds
    measured: list[tuple[bool | None, list[dict[str, Any]], dict[str, Any] | None]] = []
    for setting in variants:
        variant_args = args
        if switch is not None and setting is not None:
            if switch == OVERLAP:
                variant_args = argparse.Namespace(**{**vars(args), "disable_overlap_schedule": not setting})
            else:
                setattr(engine_model, switch, setting)
            _, label, instead = compared[switch]
            print(f"\n-- {label} {'on' if setting else f'off ({instead})'}", flush=True)
        measured.append((setting, *measure(variant_args, engine_model, all_prompts, http_sizes, device, hf)))
    if switch is not None and switch != OVERLAP:
        setattr(engine_model, switch, True)
    _, rows, agentic = measured[0]
    if args.profile:
        profile_agentic(args, engine_model, device, Path(args.profile))
    result = {
        "agentic": agentic,
        "args": vars(args),
        "device": str(device),
        "dtype": str(dtype),
        "model": description,
        "max_logit_difference": difference,
        "rows": rows,
    }
    if switch is not None:
        result[f"{switch}_variants"] = [
            {switch: setting, "rows": r, "agentic": a} for setting, r, a in measured
        ]
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2))
    print("\ntokens/s        " + "  ".join(f"{'B=' + str(r['batch']):>10}" for r in rows))
    for key in ("hf_generate", "hf_continuous_batching", "engine", "engine_http", "bound_cuda_graph_decode"):
        values = [r.get(key) for r in rows]
        if any(v is not None for v in values):
            cells = "  ".join(f"{v:10.1f}" if v is not None else f"{'-':>10}" for v in values)
            print(f"{key:<24}{cells}")
    if all("engine_over_hf_generate" in r for r in rows):
        print("engine / generate       " + "  ".join(f"{r['engine_over_hf_generate']:10.2f}" for r in rows))
    if agentic is not None:
        print(
            f"\nagentic: {args.agentic} trajectories x {args.turns} turns, {agentic['runs']} runs after a "
            f"warm-up run: {agentic['tokens_per_s']:.1f} tokens/s "
            f"({agentic['generated_tokens']} tokens in {agentic['elapsed_s']:.1f} s; by run "
            f"{', '.join(f'{v:.0f}' for v in agentic['run_tokens_per_s'])}) = "
            f"{agentic['over_fixed']:.2f} x the fixed-shape B={agentic['fixed_batch']} row; prefill "
            f"{agentic['prefill_tokens']} tokens, {agentic['cached_tokens']} from the prefix cache, prefill "
            f"{100 * agentic['prefill_busy_share']:.0f}% of the time"
        )
        fixed = max(rows, key=lambda r: r["batch"])
        print(
            f"scheduler thread CPU per token: agentic {agentic['cpu_us_per_token']:.1f} us (host "
            f"{agentic['host_us_per_token']:.1f} us outside the model and sampling), fixed-shape "
            f"{fixed['engine_cpu_us_per_token']:.1f} us (host {fixed['engine_host_us_per_token']:.1f} us); "
            f"agentic / fixed in tokens per CPU second {agentic['over_fixed_cpu']:.2f}, per host second "
            f"{agentic['over_fixed_host']:.2f}"
        )
        if agentic["decode_steps"]:
            print(
                f"agentic decode steps: {agentic['decode_steps']}, mean batch "
                f"{agentic['decode_rows'] / agentic['decode_steps']:.0f} rows (of {args.agentic}), "
                f"{agentic['generated_tokens'] / agentic['decode_steps']:.0f} tokens per step; a run's "
                "longest trajectory takes as many decode steps as it has tokens (at most "
                f"{agentic['longest_trajectory_tokens']}), so at equal cost per step agentic / fixed is at "
                f"most {agentic['step_bound']:.2f}"
            )
        print(
            f"agentic KV cache growths: {agentic['cache_grows']}, CUDA graphs captured: "
            f"{agentic['graph_captures']} ({agentic['graph_capture_s']:.2f} s of the run)"
        )
        if agentic["prefill_calls"]:
            calls = agentic["prefill_calls"]
            wall_ms = 1e3 * agentic["prefill_busy_share"] * agentic["elapsed_s"] / calls
            print(
                f"agentic prefills: {calls} model calls, {agentic['prefill_tokens'] / calls:.0f} tokens "
                f"each; per call {wall_ms:.1f} ms of "
                f"the scheduler's wall time in admission, {1e3 * agentic['prefill_cpu_s'] / calls:.1f} ms "
                "of its CPU in the model's prefill"
            )
    if switch is not None:
        print(f"\nside by side ({compared[switch][1]} on / off, alternating):")
        print(
            f"{'kernel':>8} {'fixed B=' + str(largest):>14} {'agentic':>10} {'ratio':>6} "
            f"{'prefill share':>14}"
        )
        for kernel, r, a in measured:
            fixed = max(r, key=lambda row: row["batch"])["engine"]
            if a is None:
                print(f"{'on' if kernel else 'off':>8} {fixed:14.1f}")
                continue
            print(
                f"{'on' if kernel else 'off':>8} {fixed:14.1f} {a['tokens_per_s']:10.1f} "
                f"{a['over_fixed']:6.2f} {100 * a['prefill_busy_share']:13.0f}%"
            )
    if switch is not None:
        print_ratios(measured, compared[switch][1])
    for r in rows:
        if "hf_continuous_batching_error" in r:
            error = r["hf_continuous_batching_error"]
            print(f"B={r['batch']}: transformers continuous batching failed: {error}")
    return 0


OVERLAP = "overlap_schedule"
"""The engine option `--compare-overlap` switches (`Engine(overlap_schedule=...)`)."""


def compare_extend_attention(args: argparse.Namespace, model: Any, device: torch.device) -> dict[str, Any]:
    """Milliseconds per prefill of agentic turns, right-padded against packed, alternating `--rounds` times
    (a drift of the machine falls on both); prints each round and padded / packed of the rounds' medians."""
    from asyncrl_engine.kv_cache import KVCache

    rng = random.Random(args.seed)
    batch, new_tokens = args.extend_batch, args.extend_new_tokens
    prefixes = [rng.randint(200, 1200) for _ in range(batch)]
    sequences = [[rng.randrange(3, model.config.vocab_size) for _ in range(new_tokens)] for _ in range(batch)]
    slots = list(range(batch))
    # Capacity as the engine grows it (steps of 256). The cached prefixes' KV is random: attention reads it
    # all the same, and both paths read the same values.
    capacity = -(-(max(prefixes) + new_tokens + 1) // 256) * 256
    cache = KVCache(model.config, batch, capacity, device, model.dtype)
    cache.kv.normal_(generator=torch.Generator(device=device).manual_seed(args.seed))
    kernel = model.extend_kernel

    def packed(use_kernel: bool) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            model.extend_kernel = use_kernel
            return model.prefill_packed(sequences, cache, slots, prefixes)

        return run

    variants: dict[str, Callable[[], torch.Tensor]] = {
        "padded": lambda: model.prefill_batch(sequences, cache, slots, prefixes),
        "packed": packed(kernel),
    }
    if kernel:
        variants["packed_sdpa"] = packed(False)
    names = {
        "padded": "padded, KV gathered + masked SDPA",
        "packed": f"packed, {'extend kernel' if kernel else 'SDPA per sequence'}",
        "packed_sdpa": "packed, SDPA per sequence",
    }
    print(
        f"\nprefill of {batch} sequences x {new_tokens} new tokens over {min(prefixes)}-{max(prefixes)} "
        f"cached positions (mean {sum(prefixes) / batch:.0f}), ms per prefill:",
        flush=True,
    )
    outputs = {name: run() for name, run in variants.items()}  # warm-up (compiles the kernels)
    padded = torch.cat([outputs["padded"][row, :new_tokens] for row in range(batch)])
    difference = max((out - padded).abs().max().item() for name, out in outputs.items() if name != "padded")
    print(f"max |packed - padded| hidden state = {difference:.3g}", flush=True)
    iterations = 5 if device.type == "cuda" else 1
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_index in range(args.rounds):
        for name, run in variants.items():
            synchronize(device)
            began = time.perf_counter()
            for _ in range(iterations):
                run()
            synchronize(device)
            times[name].append((time.perf_counter() - began) / iterations * 1e3)
        figures = ", ".join(f"{names[name]} {times[name][-1]:.2f}" for name in variants)
        print(f"round {round_index + 1}: {figures}", flush=True)
    model.extend_kernel = kernel
    medians = {name: sorted(values)[len(values) // 2] for name, values in times.items()}
    ratios = {
        f"padded_over_{name}": medians["padded"] / medians[name] for name in variants if name != "padded"
    }
    print(
        "padded / packed: "
        + ", ".join(f"{names[k.removeprefix('padded_over_')]} {v:.2f}x" for k, v in ratios.items())
    )
    return {
        "batch": batch,
        "new_tokens": new_tokens,
        "prefixes": prefixes,
        "extend_kernel": kernel,
        "max_hidden_difference": difference,
        "ms_per_prefill": times,
        **ratios,
    }


def print_ratios(
    measured: list[tuple[bool | None, list[dict[str, Any]], dict[str, Any] | None]], label: str
) -> None:
    """The engine's tokens/s of every row and the agentic workload in each round, on and off, then on / off
    of the rounds' means (rounds alternate, so a drift of the machine falls on both)."""
    columns = [f"B={row['batch']}" for row in measured[0][1]] + (["agentic"] if measured[0][2] else [])

    def figures(rows: list[dict[str, Any]], agentic: dict[str, Any] | None) -> list[float]:
        return [row["engine"] for row in rows] + ([agentic["tokens_per_s"]] if agentic else [])

    print(f"\nengine tokens/s, {label} on / off:")
    print(f"{'':>8} " + " ".join(f"{c:>12}" for c in columns))
    for setting, rows, agentic in measured:
        print(f"{'on' if setting else 'off':>8} " + " ".join(f"{v:12.1f}" for v in figures(rows, agentic)))
    means = {
        state: [
            sum(values) / len(values)
            for values in zip(*(figures(r, a) for s, r, a in measured if s is state), strict=True)
        ]
        for state in (True, False)
    }
    ratios = [on / off for on, off in zip(means[True], means[False], strict=True)]
    print(f"{'on / off':>8} " + " ".join(f"{v:12.2f}" for v in ratios))


def measure(
    args: argparse.Namespace,
    engine_model: Any,
    all_prompts: torch.Tensor,
    http_sizes: list[int],
    device: torch.device,
    hf: Any,
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The fixed-shape rows, then the agentic workload and its ratio to the largest row."""
    from asyncrl_engine.engine import Engine

    rows: list[dict[str, Any]] = []
    for batch in args.batch_sizes:
        prompts = all_prompts[:batch].to(device)
        row: dict[str, Any] = {"batch": batch}
        if not args.skip_hf:
            row["hf_generate"] = bench_hf_generate(hf, prompts, args.new_tokens)
        if not args.skip_hf and not args.skip_continuous_batching and hasattr(hf, "generate_batch"):
            try:
                row["hf_continuous_batching"] = bench_hf_continuous(hf, prompts, args.new_tokens)
            except Exception as error:  # reported, not fatal: the feature is young and version-dependent
                row["hf_continuous_batching_error"] = f"{type(error).__name__}: {error}"[:200]
        engine = Engine(
            engine_model,
            max_running_requests=batch,
            context_length=args.prompt_len + args.new_tokens + 8,
            use_cuda_graphs=not args.no_cuda_graphs,
            **engine_options(args),
        )
        engine.start()
        try:
            bench_engine(engine, prompts[:, :16], 4)  # warm-up (and CUDA graph capture)
            cpu: dict[str, float] = {}
            row["engine"] = bench_engine(engine, prompts, args.new_tokens, cpu)
            row["engine_cpu_us_per_token"] = cpu["engine"]
            row["engine_host_us_per_token"] = cpu["engine"] - cpu["device_work"]
            if batch in http_sizes:
                row["engine_http"] = bench_http(engine, prompts, args.new_tokens)
        finally:
            engine.stop()
        if device.type == "cuda":
            row["bound_cuda_graph_decode"] = bench_bound(
                engine_model, batch, args.prompt_len, args.new_tokens
            )
        if "hf_generate" in row:
            row["engine_over_hf_generate"] = row["engine"] / row["hf_generate"]
        rows.append(row)
        print(_format_row(row), flush=True)
    agentic: dict[str, Any] | None = None
    if args.agentic:
        agentic = bench_agentic(args, engine_model, device)
        fixed = max(rows, key=lambda r: r["batch"])
        agentic["fixed_batch"] = fixed["batch"]
        agentic["over_fixed"] = agentic["tokens_per_s"] / fixed["engine"]
        # The same ratio in scheduler CPU time per token (what bounds a host-bound engine; robust to load).
        agentic["host_us_per_token"] = agentic["cpu_us_per_token"] - agentic["device_work_cpu_us_per_token"]
        agentic["over_fixed_cpu"] = fixed["engine_cpu_us_per_token"] / agentic["cpu_us_per_token"]
        agentic["over_fixed_host"] = fixed["engine_host_us_per_token"] / agentic["host_us_per_token"]
    return rows, agentic


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options that the command line sets (none by default, so that an older engine runs)."""
    options: dict[str, Any] = {}
    if args.no_prefix_cache:
        options["prefix_cache"] = False
    if args.prefill_interval is not None:
        options["prefill_interval"] = args.prefill_interval
    if args.disable_overlap_schedule:
        options["overlap_schedule"] = False
    if args.kv_grow:
        options["kv_whole_context"] = False
    return options


def bench_agentic(
    args: argparse.Namespace,
    engine_model: Any,
    device: torch.device,
    around: tuple[Callable[[Any], Any], Callable[[Any], Any]] | None = None,
) -> dict[str, Any]:
    """(f) on a fresh engine: a warm-up run of the whole workload under other draws, then `--agentic-runs`
    measured runs, summed (`combine_agentic`). The warm-up leaves the engine as a long run keeps it: every
    CUDA graph the workload replays captured, the KV cache and the prefix cache's pool allocated, the prefix
    cache full (its random prefixes never match the measured runs'). `around`: two functions of the engine run
    on its scheduler thread just before and just after the measured runs."""
    from asyncrl_engine.engine import Engine

    vocab = engine_model.config.vocab_size
    if args.tokenizer_path:
        decode_text = tokenizer_decoder(Path(args.tokenizer_path))
    elif not args.random_weights:
        from asyncrl_core.models import smollm2_135m

        decode_text = tokenizer_decoder(Path(args.model_path or smollm2_135m()) / "tokenizer.json")
    else:
        decode_text = synthetic_decoder(vocab)
    engine = Engine(
        engine_model,
        max_running_requests=args.agentic,
        context_length=args.prompt_len + args.turns * (256 + 120) + 8,
        use_cuda_graphs=not args.no_cuda_graphs,
        decode_text=decode_text,
        seed=args.seed,
        **engine_options(args),
    )
    engine.start()
    runs: list[AgenticResult] = []
    try:
        run_agentic(engine, args.agentic, args.turns, args.prompt_len, vocab, seed=args.seed + WARM_UP_SEED)
        if around is not None:
            engine.call(lambda: around[0](engine))
        for run in range(args.agentic_runs):
            runs.append(
                run_agentic(engine, args.agentic, args.turns, args.prompt_len, vocab, seed=args.seed + run)
            )
        if around is not None:
            engine.call(lambda: around[1](engine))
    finally:
        engine.stop()
    summary = combine_agentic(runs, args.agentic)
    print(_format_row({"batch": f"agentic {args.agentic}", **summary}), flush=True)
    return summary


WARM_UP_SEED = 1000
"""Added to `--seed` for the agentic warm-up run's draws (measured run r draws with `--seed` + r)."""


def combine_agentic(runs: list[AgenticResult], trajectories: int) -> dict[str, Any]:
    """Measured agentic runs as one: counts and seconds summed, rates and shares over the totals, each run's
    tokens/s in `run_tokens_per_s`, and `step_bound`: what the longest trajectories allow agentic / fixed at
    an equal cost per step (see (f) in the module's docstring)."""
    tokens = sum(r.generated_tokens for r in runs)
    elapsed = sum(r.elapsed_s for r in runs)
    summed = (
        "generated_tokens", "elapsed_s", "prefill_tokens", "cached_tokens", "decode_steps", "decode_rows",
        "graph_captures", "graph_capture_s", "cache_grows", "prefill_calls", "prefill_cpu_s",
    )  # fmt: skip
    return {
        **{name: sum(getattr(r, name) for r in runs) for name in summed},
        "runs": len(runs),
        "tokens_per_s": tokens / elapsed,
        "run_tokens_per_s": [r.tokens_per_s for r in runs],
        "prefill_busy_share": sum(r.prefill_busy_share * r.elapsed_s for r in runs) / elapsed,
        "cpu_us_per_token": sum(r.cpu_us_per_token * r.generated_tokens for r in runs) / tokens,
        "device_work_cpu_us_per_token": (
            sum(r.device_work_cpu_us_per_token * r.generated_tokens for r in runs) / tokens
        ),
        "longest_trajectory_tokens": max(r.longest_trajectory_tokens for r in runs),
        "step_bound": tokens / sum(r.longest_trajectory_tokens * trajectories for r in runs),
    }


PROFILE_WINDOW_S = 3.0
"""Seconds of the agentic workload that `--profile` records."""


def profile_agentic(
    args: argparse.Namespace, engine_model: Any, device: torch.device, trace_path: Path
) -> None:
    """(f) under torch.profiler (slower than the measured run: the figures are shares, not a rate). The GPU's
    busy share is the union of its kernels' intervals over the recorded window."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    # Started and stopped on the scheduler thread: the profiler records the CPU operators of the thread that
    # starts it (the GPU's kernels, of every thread). It records the first PROFILE_WINDOW_S of the workload
    # (its events over the whole run would take minutes to summarise).
    profiler = profile(activities=activities)
    window: dict[str, float] = {}

    def stop() -> None:
        if "ended" not in window:
            profiler.stop()
            window["ended"] = time.perf_counter()

    def start(engine: Any) -> None:
        profiler.start()
        window["began"] = time.perf_counter()
        timer = threading.Timer(PROFILE_WINDOW_S, lambda: engine.call_async(stop))
        timer.daemon = True
        timer.start()

    bench_agentic(args, engine_model, device, around=(start, lambda _engine: stop()))
    wall_us = (window["ended"] - window["began"]) * 1e6
    print(f"\nprofile: the first {wall_us / 1e6:.1f} s of the agentic workload", flush=True)
    profiler.export_chrome_trace(str(trace_path))
    events = profiler.key_averages()
    if device.type == "cuda":
        intervals = sorted(
            (e.time_range.start, e.time_range.end)
            for e in profiler.events()
            if e.device_type == torch.autograd.DeviceType.CUDA
        )
        busy, reach = 0.0, float("-inf")
        for start, end in intervals:
            if end > reach:
                busy += end - max(start, reach)
                reach = end
        print(f"profile: GPU busy {100 * busy / wall_us:.0f}% of the window", flush=True)
        print(events.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60), flush=True)


def _format_row(row: dict[str, Any]) -> str:
    parts = [f"B={row['batch']}"]
    for key, value in row.items():
        if key != "batch" and isinstance(value, float):
            parts.append(f"{key}={value:.1f}")
    return "  ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
