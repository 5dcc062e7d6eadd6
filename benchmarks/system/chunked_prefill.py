"""What chunked prefill does for the running requests: the built-in engine decodes a few requests, a long
prompt arrives, and we time the longest wait between two tokens of a running request while the long prompt
is prefilled, and the long prompt's time to its first token, for each `--chunked-prefill-size` side by side
in one process (each size a fresh engine, the sizes alternated over the rounds).

    uv run python benchmarks/system/chunked_prefill.py [--device cpu] [--prompt-len 2048] \
        [--chunk-sizes -1 256 1024] [--running 4] [--rounds 2]

SmolLM2-135M's weights (offline copy), the prefix cache off (each long prompt is computed whole), greedy.
A warm-up long prompt of the same length runs first on each engine, so the KV cache has its size and the
measured one pays no first-use cost. Figures are wall times (the machine's other jobs move them): compare
the columns of one run, not runs of different machines.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import threading
import time
from typing import Any

import torch

from asyncrl_core.models import smollm2_135m
from asyncrl_engine.engine import Engine
from asyncrl_engine.model import EngineModel
from asyncrl_engine.options import SamplingOptions
from asyncrl_engine.request import Request

WAIT_S = 600.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[-1, 256, 1024])
    parser.add_argument("--running", type=int, default=4, help="requests decoding when the long prompt comes")
    parser.add_argument("--rounds", type=int, default=2)
    return parser.parse_args()


def _request(prompt: list[int], max_new_tokens: int, on_update: Any) -> Request:
    return Request(
        rid=f"r{time.monotonic_ns()}",
        prompt_ids=prompt,
        options=SamplingOptions(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True),
        on_update=on_update,
        stream=True,
    )


def _long_prompt_time(engine: Engine, prompt: list[int]) -> tuple[float, float]:
    """(queued, first token) perf_counter times of `prompt` sent to `engine`."""
    first: list[float] = []
    done = threading.Event()

    def on_long(request: Request, finished: bool) -> None:
        if request.output_ids and not first:
            first.append(time.perf_counter())
        if finished:
            done.set()

    queued: list[float] = []
    long = _request(prompt, 1, on_long)
    engine.call(lambda: (queued.append(time.perf_counter()), engine.add_request(long)), timeout_s=WAIT_S)
    if not done.wait(WAIT_S):
        raise RuntimeError("the long prompt did not finish")
    return queued[0], first[0]


def measure(model: EngineModel, chunk: int, args: argparse.Namespace, rng: random.Random) -> dict[str, float]:
    vocab = model.config.vocab_size
    engine = Engine(
        model,
        max_running_requests=args.running + 1,
        context_length=args.prompt_len + 4096,
        prefix_cache=False,
        chunked_prefill_size=chunk,
    )
    engine.start()
    try:
        _long_prompt_time(engine, [rng.randrange(vocab) for _ in range(args.prompt_len)])  # warm-up
        times: list[list[float]] = [[] for _ in range(args.running)]
        running = [
            _request(
                [rng.randrange(vocab) for _ in range(16)],
                4000,
                lambda _r, _f, row=row: times[row].append(time.perf_counter()),
            )
            for row in range(args.running)
        ]
        engine.call(lambda: [engine.add_request(r) for r in running], timeout_s=WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while min(len(t) for t in times) < 16:
            if time.monotonic() > deadline:
                raise RuntimeError("the running requests made no progress")
            time.sleep(0.01)
        queued, first = _long_prompt_time(engine, [rng.randrange(vocab) for _ in range(args.prompt_len)])
        time.sleep(0.2)  # a few tokens after its first
        engine.call(lambda: [engine.abort(r.rid) for r in running], timeout_s=WAIT_S)
        steady = statistics.median(b - a for t in times for a, b in itertools.pairwise(t[4:16]))
        gaps = [
            b - a
            for t in times
            for a, b in itertools.pairwise(t)
            if b >= queued and a <= first  # the gaps that overlap the long prompt's prefill
        ]
        during = sum(1 for t in times for stamp in t if queued <= stamp <= first)
        return {
            "steady_gap_ms": 1e3 * steady,
            "longest_gap_ms": 1e3 * max(gaps),
            "ttft_ms": 1e3 * (first - queued),
            "tokens_during_prefill": during / args.running,
        }
    finally:
        engine.stop()


def main() -> int:
    args = parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = EngineModel.from_pretrained(smollm2_135m(), device, dtype)
    rng = random.Random(0)
    results: dict[int, list[dict[str, float]]] = {chunk: [] for chunk in args.chunk_sizes}
    for _ in range(args.rounds):
        for chunk in args.chunk_sizes:
            results[chunk].append(measure(model, chunk, args, rng))
    print(f"{args.running} decoding, a prompt of {args.prompt_len} tokens arrives ({device}, {dtype})")
    print("chunked_prefill_size | steady gap ms | longest gap ms | long TTFT ms | tokens each during prefill")
    baseline = statistics.median(r["longest_gap_ms"] for r in results[args.chunk_sizes[0]])
    for chunk, rows in results.items():
        cell = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        print(
            f"{chunk:>20} | {cell['steady_gap_ms']:13.1f} | {cell['longest_gap_ms']:14.1f} | "
            f"{cell['ttft_ms']:12.1f} | {cell['tokens_during_prefill']:.1f}"
            f"   (longest gap / first size's: {cell['longest_gap_ms'] / baseline:.2f})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
