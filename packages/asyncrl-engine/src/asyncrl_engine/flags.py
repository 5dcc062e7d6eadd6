"""The command line of `python -m asyncrl_engine`: SGLang's flag names where SGLang has the flag.

`python -m asyncrl_engine.flags FLAGS...` parses the flags as the engine does and starts nothing: it exits 0
when the engine takes them, and 2 with argparse's message when it does not. asyncrl-sglang's launcher runs it
so that a flag the engine does not take is refused before any engine starts, without importing the engine.
Nothing here imports more than the standard library, so `--help` and the check are instant.
"""

from __future__ import annotations

import argparse
import sys

from asyncrl_engine import (
    DEFAULT_CHUNKED_PREFILL_SIZE,
    DEFAULT_MAX_N,
    DEFAULT_MAX_QUEUED_REQUESTS,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m asyncrl_engine",
        description="The asyncrl built-in engine: a small PyTorch server speaking SGLang's HTTP routes.",
    )
    parser.add_argument(
        "--model-path",
        required=True,
        help="HuggingFace folder (config.json, safetensors), or `smollm2-135m` (the offline SmolLM2-135M)",
    )
    parser.add_argument("--tokenizer-path", help="tokenizer folder (default: the model folder)")
    parser.add_argument(
        "--served-model-name", help="the model_name label of metrics (default: the folder name)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    parser.add_argument("--port", type=int, default=30000, help="0 picks a free port (see --port-file)")
    parser.add_argument("--port-file", help="write the bound port to this file once the server listens")
    parser.add_argument(
        "--grpc-port",
        type=int,
        help="also serve SGLang's gRPC scheduler service (generation) on this port; 0 picks a free one",
    )
    parser.add_argument("--api-key", help="require `Authorization: Bearer KEY` on every route but /health")
    parser.add_argument("--max-running-requests", type=int, default=32)
    parser.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=DEFAULT_CHUNKED_PREFILL_SIZE,
        help="the most tokens one prefill batch holds; a longer prompt is prefilled in chunks of this many, "
        "one per decode step of the running requests (-1 or 0: no chunking, a longer prompt goes alone)",
    )
    parser.add_argument(
        "--max-queued-requests",
        type=_positive,
        default=DEFAULT_MAX_QUEUED_REQUESTS,
        help="most requests waiting at once: a call that does not fit is answered 503, a larger one 400",
    )
    parser.add_argument(
        "--max-n",
        type=_positive,
        default=DEFAULT_MAX_N,
        help="the largest sampling_params.n a request may ask for (400 above)",
    )
    parser.add_argument(
        "--max-request-body-bytes",
        type=_positive,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="the largest request body of every route but /update_weights_from_tensor: a larger one is "
        "answered 400 before it is read whole",
    )
    parser.add_argument("--context-length", type=int, help="default: min(max_position_embeddings, 4096)")
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--enable-metrics", action="store_true", help="serve Prometheus text at /metrics")
    parser.add_argument("--random-seed", type=int, default=0, help="seed of the sampling generator")
    parser.add_argument(
        "--random-weights",
        action="store_true",
        help="random weights of the model's shape (SGLang's --load-format dummy); updates fill real ones",
    )
    parser.add_argument(
        "--weight-version-route",
        choices=["old", "new"],
        default="new",
        help="/get_weight_version: 200 like older SGLang servers, or 404 like newer ones",
    )
    parser.add_argument("--disable-cuda-graph", action="store_true", help="decode eagerly on CUDA")
    parser.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="read each decode step's tokens before launching the next (no overlap of host and device work)",
    )
    parser.add_argument(
        "--disable-fused-kernels",
        action="store_true",
        help="torch's elementwise ops instead of the fused Triton kernels (RMSNorm, rotary, SiLU) on CUDA",
    )
    parser.add_argument(
        "--attention-backend",
        choices=["triton", "torch_native"],
        default="triton",
        help="triton: the engine's Triton attention kernels (decode, packed prefill) on CUDA; torch_native: "
        "SDPA (what the CPU always runs)",
    )
    parser.add_argument(
        "--disable-radix-cache",
        action="store_true",
        help="no prefix cache: every prefill computes all its tokens (cached_tokens stays 0)",
    )
    parser.add_argument("--skip-server-warmup", action="store_true")
    parser.add_argument(
        "--start-paused",
        action="store_true",
        help="hold every generation request at the admission gate from the start, as a pause does, until "
        "/continue_generation (a restarted engine serves nothing before its weights are pushed)",
    )
    parser.add_argument("--num-threads", type=int, help="torch intra-op threads on CPU")
    parser.add_argument("--log-level", default="info")
    return parser.parse_args(argv)


def launch_command(argv: list[str]) -> str:
    """The arguments as `/server_info.launch_command` shows them (SGLang's form), the API key redacted."""
    shown: list[str] = []
    for argument in argv:
        if shown and shown[-1] == "--api-key":
            shown.append("<redacted>")
        elif argument.startswith("--api-key="):
            shown.append("--api-key=<redacted>")
        else:
            shown.append(argument)
    return " ".join(shown)


if __name__ == "__main__":
    parse_args(sys.argv[1:])
