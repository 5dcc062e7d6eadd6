"""The actors' training step alone, before and after packed rows and token-budget micro-batches, in one run.

Two batches of multi-turn trajectories (model turns, then a tool's observation, which is not trained):

- `gpu`: the README's one-GPU workload, 32 groups of 8, rows of 291 to 847 tokens;
- `long_tail`: 32 groups of 8 whose lengths range tenfold (90 to 900 tokens), most of them short.

Each goes through every path below, on the same random Llama (SmolLM2-135M's shape on a GPU, bfloat16; a
small one on a CPU, float32), 1 warm-up step and `--steps` timed ones each:

- `torch_before`: the torch actor as it was: padded micro-batches of `--micro-batch-size` rows, each as wide
  as its longest row, transformers' stock `sdpa` attention with torch's default kernel choice (cuDNN first
  on Hopper);
- `torch_padded`: the same micro-batches at widths bucketed to 64 tokens on a GPU, through the actor's
  attention (no cuDNN);
- `torch_packed`: micro-batches of `--max-tokens` tokens, each packed into one row (variable-length flash
  attention on a GPU);
- `megatron_before` / `megatron_budget`: the Megatron actor at `--micro-batch-size` rows, each as wide as its
  longest, and at `--max-tokens` tokens padded to bucketed widths (when megatron-core imports);
- `bare_packed`: the limit: the same tokens, in the same packed micro-batches, through one forward and
  backward of the HuggingFace model (all logits, plain next-token cross-entropy) and nothing else.

Printed per path: trained tokens per second (real tokens, prompts included, over the median step), the
padding share (positions computed that hold no token), the first three steps' times against the median of the
later ones (a step that falls as shapes repeat means something plans per shape), and on a GPU the busy share
of its `train_step` calls: `nvidia-smi`'s `utilization.gpu` sampled every 200 ms (`gpu_busy.GpuSampler`, the
measure of `sync_vs_async.py --gpu-utilization`), averaged over the samples inside the timed calls. Then the
ratios, side by side: packed against before, packed against the bare limit.

With `--profile FILE`, each path but the before ones runs one more step under `torch.profiler`, and FILE
gets its kernels' time over the step's wall time (the device's own busy share, without sampling), the number
of kernels, and the operators that took the most device and host time.

    python benchmarks/system/train_step.py [--steps 5] [--max-tokens 16384] [--micro-batch-size 8] \\
        [--batches gpu,long_tail] [--skip-megatron] [--json out.json] [--profile profile.txt]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from actor import CPU_SHAPE, SMOLLM2_SHAPE, VOCAB_SIZE, write_random_llama
from asyncrl_core.types import NO_VERSION, Group, Trajectory
from gpu_busy import GpuSampler, window_mean


def multi_turn_groups(
    num_groups: int, group_size: int, lengths: Callable[[random.Random], int], seed: int
) -> list[Group]:
    """Groups of trajectories of the lengths `lengths` draws: a prompt of a third (at most 200 tokens),
    then model turns of 20-120 tokens, each but the last followed by an observation of 30-150 tokens."""
    rng = random.Random(seed)
    groups: list[Group] = []
    for group_index in range(num_groups):
        trajectories: list[Trajectory] = []
        for _ in range(group_size):
            total = lengths(rng)
            prompt_len = min(200, max(2, total // 3))
            mask: list[int] = []
            while len(mask) < total - prompt_len:
                mask += [1] * rng.randint(20, 120) + [0] * rng.randint(30, 150)
            mask = mask[: total - prompt_len]
            mask[-1] = 1  # the answer ends the trajectory
            trajectories.append(
                Trajectory(
                    token_ids=[rng.randrange(3, VOCAB_SIZE) for _ in range(total)],
                    prompt_len=prompt_len,
                    loss_mask=mask,
                    rollout_logprobs=[-10.8 + rng.uniform(-0.1, 0.1) if m else 0.0 for m in mask],
                    versions=[0 if m else NO_VERSION for m in mask],
                    reward=float(rng.random() < 0.5),
                )
            )
        groups.append(Group(group_id=group_index, prompt_index=group_index, trajectories=trajectories))
    return groups


BATCHES: dict[str, Callable[[random.Random], int]] = {
    "gpu": lambda rng: rng.randint(291, 847),
    # Log-uniform over a tenfold range: most rows short, a few long.
    "long_tail": lambda rng: int(90 * 10 ** rng.random()),
}


def padding_share(parts: list[list[Any]]) -> float:
    """Share of the computed positions of a plan's micro-batches that hold no token."""
    computed = sum(part.input_ids.numel() for mini in parts for part in mini)
    real = sum(part.num_tokens for mini in parts for part in mini)
    return 1.0 - real / computed


def measure(
    name: str,
    step: Callable[[], object],
    num_tokens: int,
    steps: int,
    sampler: GpuSampler | None,
) -> dict[str, Any]:
    """Times 1 + `steps` calls of `step` (device work included); the first is the warm-up."""
    cuda = torch.cuda.is_available()
    durations: list[float] = []
    windows: list[tuple[float, float]] = []
    for _ in range(1 + steps):
        if cuda:
            torch.cuda.synchronize()
        start, wall = time.perf_counter(), time.time()
        step()
        if cuda:
            torch.cuda.synchronize()
        durations.append(time.perf_counter() - start)
        windows.append((wall, time.time()))
    timed = durations[1:]
    median = statistics.median(timed)
    busy = None
    if sampler is not None:
        busy = window_mean(sampler.samples, windows[1:], {torch.cuda.current_device()})
    later = durations[3:] or timed
    result = {
        "seconds": durations,
        "median_s": median,
        "tokens_per_s": num_tokens / median,
        "gpu_busy": busy,
        "first_three_over_later": [d / statistics.median(later) for d in durations[:3]],
    }
    busy_text = "-" if busy is None else f"{busy:.0%}"
    firsts = " ".join(f"{d:.2f}" for d in durations[:3])
    print(f"  {name:<16} {median:>8.3f} s {num_tokens / median:>10.0f} tok/s  busy {busy_text:>4}  "
          f"first steps {firsts} s (later median {statistics.median(later):.2f} s)", flush=True)  # fmt: skip
    return result


def profile_step(name: str, step: Callable[[], object], path: Path) -> dict[str, float]:
    """One call of `step` under `torch.profiler`; appends its summary and top operators to `path` and
    returns the kernels' summed time over the wall time (`device_busy`) and the number of kernels."""
    from torch.profiler import DeviceType, ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as profiler:
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        wall_s = time.perf_counter() - start
    events = profiler.key_averages()
    kernels = [event for event in events if event.device_type == DeviceType.CUDA]
    device_s = sum(event.self_device_time_total for event in kernels) / 1e6
    num_kernels = sum(event.count for event in kernels)
    summary = {"wall_s": wall_s, "device_s": device_s, "device_busy": device_s / wall_s,
               "num_kernels": float(num_kernels)}  # fmt: skip
    with path.open("a", encoding="utf-8") as out:
        out.write(f"\n=== {name}: {wall_s:.3f} s wall (profiled), kernels {device_s:.3f} s "
                  f"({device_s / wall_s:.0%}), {num_kernels} kernels\n")  # fmt: skip
        if cuda:
            out.write(events.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70))
        out.write(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
    print(f"    profiled {name}: kernels {device_s:.3f} s of {wall_s:.3f} s ({device_s / wall_s:.0%}), "
          f"{num_kernels} kernels", flush=True)  # fmt: skip
    return summary


def bare_packed_step(
    model: Any, parts: list[Any], device: torch.device, dtype: torch.dtype
) -> Callable[[], None]:
    """The limit: each packed micro-batch through the model's forward and backward with all logits and a
    plain next-token cross-entropy, no actor around it."""
    from asyncrl_core.actor.attention import packed_attention_arguments

    on_device = [part.to(device) for part in parts]

    def step() -> None:
        model.zero_grad(set_to_none=True)
        for part in on_device:
            assert part.sequence_offsets is not None
            arguments = packed_attention_arguments(part.sequence_offsets, part.max_sequence_len)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                logits = model(input_ids=part.input_ids, position_ids=part.position_ids, **arguments).logits
            loss = torch.nn.functional.cross_entropy(
                logits.float().flatten(0, 1), part.target_ids.flatten(), reduction="sum"
            ) / max(part.num_tokens, 1)
            loss.backward()

    return step


def main() -> int:
    on_gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=5 if on_gpu else 2)
    parser.add_argument("--groups", type=int, default=32 if on_gpu else 4)
    parser.add_argument("--group-size", type=int, default=8 if on_gpu else 4)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16384 if on_gpu else 4096)
    parser.add_argument("--batches", default="gpu,long_tail")
    parser.add_argument("--skip-megatron", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--profile", type=Path, help="append a profile of one more step of each path here")
    args = parser.parse_args()

    from asyncrl_core.actor import TorchActor
    from asyncrl_core.config import AlgorithmConfig, TorchActorConfig

    dtype_name: Literal["bfloat16", "float32"] = "bfloat16" if on_gpu else "float32"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    shape = SMOLLM2_SHAPE if on_gpu else CPU_SHAPE
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    card = torch.cuda.get_device_name() if on_gpu else f"CPU ({os.cpu_count()} cores)"
    print(f"device: {card}; torch {torch.__version__}; model {shape}, vocab {VOCAB_SIZE}; {dtype_name}")
    print(f"micro-batches: {args.micro_batch_size} rows (before, padded) or {args.max_tokens} tokens; "
          f"1 warm-up + {args.steps} timed steps per path")  # fmt: skip
    sampler = GpuSampler() if on_gpu else None
    if sampler is not None:
        sampler.start()
    results: dict[str, Any] = {"device": card, "dtype": dtype_name, "shape": shape, "batches": {}}
    algorithm = AlgorithmConfig.model_validate({"group_size": args.group_size, "kl_coef": 0.0})
    common = {"dtype": dtype_name, "lr": 1e-6, "temperature": 1.0, "optimizer": "adamw"}
    try:
        with tempfile.TemporaryDirectory(prefix="asyncrl-train-step-") as scratch:
            model_dir = write_random_llama(Path(scratch) / "model", shape)
            common["model_path"] = str(model_dir)

            def torch_actor(**fields: object) -> TorchActor:
                return TorchActor(TorchActorConfig.model_validate(common | fields), algorithm, device=device)

            for batch_name in args.batches.split(","):
                groups = multi_turn_groups(args.groups, args.group_size, BATCHES[batch_name], seed=1)
                lengths = [len(t.token_ids) for g in groups for t in g.trajectories]
                num_tokens = sum(lengths)
                print(f"\n{batch_name}: {len(lengths)} rows of {min(lengths)}-{max(lengths)} tokens, "
                      f"{num_tokens} tokens")  # fmt: skip
                runs = torch_runs(torch_actor, groups, num_tokens, args, sampler, dtype)
                if not args.skip_megatron:
                    runs |= megatron_runs(model_dir, groups, num_tokens, args, dtype_name, sampler)

                print("  ratios (tokens/s):")
                ratios: dict[str, float] = {}
                for numerator, denominator in (
                    ("torch_packed", "torch_before"),
                    ("torch_packed", "torch_padded"),
                    ("torch_packed", "bare_packed"),
                    ("megatron_budget", "megatron_before"),
                ):
                    if numerator in runs and denominator in runs:
                        ratio = runs[numerator]["tokens_per_s"] / runs[denominator]["tokens_per_s"]
                        ratios[f"{numerator}/{denominator}"] = ratio
                        print(f"    {numerator} / {denominator}: {ratio:.2f}")
                for name, run in runs.items():
                    print(f"  {name}: padding share {run['padding_share']:.1%}")
                results["batches"][batch_name] = {
                    "rows": len(lengths), "min_len": min(lengths), "max_len": max(lengths),
                    "num_tokens": num_tokens, "runs": runs, "ratios": ratios,
                }  # fmt: skip
                if args.json:  # after each batch, so that a run cut short keeps what it measured
                    args.json.write_text(json.dumps(results, indent=2) + "\n")
    finally:
        if sampler is not None:
            sampler.stop()
    return 0


def actor_run(actor: Any, groups: list[Group], num_tokens: int, steps: int, sampler: GpuSampler | None,
              name: str, profile: Path | None) -> dict[str, Any]:  # fmt: skip
    """`measure` of an actor's `train_step` on `groups`, with the padding share of its micro-batches."""
    plan = actor.plan(groups)
    run = measure(name, lambda: actor.train_step(groups), num_tokens, steps, sampler)
    run["padding_share"] = padding_share(plan.micro_batches)
    run["micro_batches"] = len(plan.micro_batches[0])
    if profile is not None:
        run["profile"] = profile_step(name, lambda: actor.train_step(groups), profile)
    return run


def torch_runs(
    torch_actor: Callable[..., Any],
    groups: list[Group],
    num_tokens: int,
    args: argparse.Namespace,
    sampler: GpuSampler | None,
    dtype: torch.dtype,
) -> dict[str, Any]:
    """`torch_before`, `torch_padded`, `torch_packed` and `bare_packed` (the module docstring)."""
    runs: dict[str, Any] = {}
    # Before: padded to the longest row (no buckets), transformers' stock attention.
    before = torch_actor(micro_batch_size=args.micro_batch_size)
    before.length_multiple = 1
    before.module.set_attn_implementation("sdpa")
    runs["torch_before"] = actor_run(before, groups, num_tokens, args.steps, sampler, "torch_before", None)
    del before
    padded = torch_actor(micro_batch_size=args.micro_batch_size)
    runs["torch_padded"] = actor_run(
        padded, groups, num_tokens, args.steps, sampler, "torch_padded", args.profile
    )
    del padded
    packed = torch_actor(max_tokens_per_micro_batch=args.max_tokens)
    runs["torch_packed"] = actor_run(
        packed, groups, num_tokens, args.steps, sampler, "torch_packed", args.profile
    )
    runs["torch_packed"]["attention"] = packed.attention_backend
    plan = packed.plan(groups)
    bare = bare_packed_step(packed.module, plan.micro_batches[0], packed.device, dtype)
    runs["bare_packed"] = measure("bare_packed", bare, num_tokens, args.steps, sampler)
    if args.profile is not None:
        runs["bare_packed"]["profile"] = profile_step("bare_packed", bare, args.profile)
    runs["bare_packed"]["padding_share"] = runs["torch_packed"]["padding_share"]
    del packed, bare
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return runs


def megatron_runs(
    model_dir: Path,
    groups: list[Group],
    num_tokens: int,
    args: argparse.Namespace,
    dtype_name: Literal["bfloat16", "float32"],
    sampler: GpuSampler | None,
) -> dict[str, Any]:
    """`megatron_before` and `megatron_budget`, or nothing when megatron-core does not import."""
    try:
        from asyncrl_core.algorithms import LossSettings
        from asyncrl_megatron.actor import MegatronActor, MegatronActorSettings
    except ImportError as error:
        print(f"  megatron-core not importable ({error}): the Megatron actor is not measured")
        return {}
    runs: dict[str, Any] = {}

    def actor(**changes: object) -> MegatronActor:
        settings = MegatronActorSettings(
            model_path=str(model_dir),
            temperature=1.0,
            dtype=dtype_name,
            lr=1e-6,
            **changes,  # type: ignore[arg-type]
        )
        return MegatronActor(settings, LossSettings())

    before = actor(micro_batch_size=args.micro_batch_size)
    before.length_multiple = 1
    runs["megatron_before"] = actor_run(
        before, groups, num_tokens, args.steps, sampler, "megatron_before", None
    )
    del before
    budget = actor(max_tokens_per_micro_batch=args.max_tokens)
    runs["megatron_budget"] = actor_run(
        budget, groups, num_tokens, args.steps, sampler, "megatron_budget", args.profile
    )
    return runs


if __name__ == "__main__":
    sys.exit(main())
