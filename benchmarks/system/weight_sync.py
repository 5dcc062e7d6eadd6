"""Weight-sync time of the Megatron actor at tensor parallel size 1 and 2 on the CPU, side by side in one run.

One built-in engine serves a random Llama (SmolLM2's tokenizer and vocabulary, `--hidden` wide, `--layers`
deep). Each round builds, in turn, a world of one process (TP = 1) and a world of two gloo ranks (TP = 2,
`asyncrl_megatron.parallel.spawn`); every rank builds the runner's `ActorWorker` with the Megatron actor and
syncs its weights into the engine, after `--warmup` untimed syncs, `--syncs` times with each transport:
`tensor` (safetensors in the request body) and `distributed` (a gloo broadcast group the sender forms with the
engine at its first sync). Both ranks of TP = 2 take part in every sync (the export gathers each tensor's
shards); rank 0 sends. Recorded per sync, on the sender: `time/sync_weights` (the engine paused, the export
with its gathers, the push, the engine continued) and the wall time of `ActorWorker.sync_weights` (with the
connection to the engine). Each world closes its transport at its end (`close_weight_transport`), so the
next world forms a group of its own with the same engine.

Prints the medians per TP and transport and the ratio TP = 2 over TP = 1; `--json` writes every sample.

    uv run python benchmarks/system/weight_sync.py [--hidden 256 --layers 4 --syncs 5 --rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TRANSPORTS = ("tensor", "distributed")


def run_config(model_dir: str, url: str, tensor_parallel_size: int, transport: str) -> Any:
    from asyncrl_core.config import load_config

    pairs = {
        "runner.run_dir": tempfile.mkdtemp(prefix="weight-sync-run-"),
        "cluster.component_placement": "{actor: 0}",
        "actor.backend": "megatron",
        "actor.tensor_parallel_size": tensor_parallel_size,
        "actor.model_path": model_dir,
        "actor.dtype": "float32",
        "agentloop.task_name": "arith",
        "rollout.sglang.launch": "external",
        "rollout.sglang.urls": f"[{url}]",
        "rollout.sglang.weight_transport": transport,
    }
    return load_config(None, [f"{key}={value}" for key, value in pairs.items()])


def world(model_dir: str, url: str, warmup: int, syncs: int) -> dict[str, Any]:
    """One rank of a spawned world: the syncs of each transport, timed on the sender."""
    from asyncrl_core import metrics
    from asyncrl_core.runner.workers import ActorWorker, EngineEndpoint, RankSettings
    from asyncrl_megatron import parallel

    world_size = int(os.environ["WORLD_SIZE"])
    rank = RankSettings(int(os.environ["RANK"]), world_size, int(os.environ["MASTER_PORT"]))
    endpoints = [EngineEndpoint(url)]
    samples: dict[str, dict[str, list[float]]] = {}
    try:
        worker = ActorWorker(
            run_config(model_dir, url, world_size, TRANSPORTS[0]), model_path=model_dir, devices=(), rank=rank
        )
        role = worker.actor.weight_export_role
        for transport in TRANSPORTS:
            # The transport is built from the worker's configuration at its first sync after a close.
            worker.config = run_config(model_dir, url, world_size, transport)
            sync_s: list[float] = []
            wall_s: list[float] = []
            for index in range(warmup + syncs):
                started = time.perf_counter()
                result = worker.sync_weights(endpoints, "retract")
                elapsed = time.perf_counter() - started
                if index >= warmup and role == "send":
                    sync_s.append(result[metrics.TIME_SYNC_WEIGHTS])
                    wall_s.append(elapsed)
            worker.close_weight_transport(endpoints)
            samples[transport] = {"sync_s": sync_s, "wall_s": wall_s}
        num_bytes = sum(
            tensor.numel() * tensor.element_size()
            for bucket in worker.actor.export_weights(64 << 20)
            for _, tensor in bucket
        )
        return {"role": role, "samples": samples, "bytes": num_bytes}
    finally:
        parallel.destroy()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--hidden", type=int, default=256, help="hidden size of the random Llama")
    parser.add_argument("--layers", type=int, default=4, help="layers of the random Llama")
    parser.add_argument("--warmup", type=int, default=1, help="untimed syncs per transport and world")
    parser.add_argument("--syncs", type=int, default=5, help="timed syncs per transport and world")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of TP = 1 then TP = 2")
    parser.add_argument("--json", type=Path, help="write every sample here")
    args = parser.parse_args()

    from asyncrl_core.models import tiny_llama
    from asyncrl_megatron.parallel import spawn
    from asyncrl_sglang.launcher import builtin_command, free_port, start_engines

    sizes = (1, 2)
    samples = {(tp, transport): {"sync_s": [], "wall_s": []} for tp in sizes for transport in TRANSPORTS}
    num_bytes = 0
    with tempfile.TemporaryDirectory(prefix="weight-sync-") as folder:
        model_dir = tiny_llama(
            Path(folder) / "model",
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=3 * args.hidden,
        )
        command = builtin_command(
            model_path=str(model_dir),
            host="127.0.0.1",
            port=free_port(),
            max_running_requests=2,
            extra_args={"num_threads": 1},
        )
        with start_engines([command], log_dir=Path(folder)) as launched:
            engine_url = launched.urls[0]
            for round_index in range(args.rounds):
                for tp in sizes:
                    started = time.perf_counter()
                    ranks = spawn(
                        world, tp, (str(model_dir), engine_url, args.warmup, args.syncs), timeout_s=1800
                    )
                    (sender,) = [rank for rank in ranks if rank["role"] == "send"]
                    num_bytes = sender["bytes"]
                    for transport in TRANSPORTS:
                        for key, values in sender["samples"][transport].items():
                            samples[(tp, transport)][key] += values
                    print(
                        f"round {round_index + 1}, TP = {tp}: {time.perf_counter() - started:.0f} s",
                        file=sys.stderr,
                    )

    print(
        f"random Llama hidden {args.hidden}, {args.layers} layers: {num_bytes / 2**20:.1f} MiB of float32 "
        f"weights; {args.rounds} rounds x {args.syncs} syncs per TP and transport (medians, seconds)"
    )
    print("| transport | TP = 1 sync | TP = 2 sync | TP 2 / TP 1 | TP = 1 wall | TP = 2 wall | TP 2 / TP 1 |")
    print("|---|---|---|---|---|---|---|")
    for transport in TRANSPORTS:
        one, two = samples[(1, transport)], samples[(2, transport)]
        row = [transport]
        for key in ("sync_s", "wall_s"):
            first, second = statistics.median(one[key]), statistics.median(two[key])
            row += [f"{first:.3f}", f"{second:.3f}", f"{second / first:.2f}x"]
        print("| " + " | ".join(row) + " |")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "machine": platform.platform(),
                    "cpus": os.cpu_count(),
                    "hidden": args.hidden,
                    "layers": args.layers,
                    "bytes": num_bytes,
                    "samples": {f"tp{tp}/{transport}": value for (tp, transport), value in samples.items()},
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
