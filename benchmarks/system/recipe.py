"""Does the CPU recipe learn, and how long do its steps take? The main job's parts, without Ray.

Warm-starts the configured model on the task's demonstrations (`asyncrl_core.actor.warm_start`), starts
the built-in engine (`asyncrl_sglang.launcher`) and the task's retrieval server on the rollout core, and
trains `TorchActor` on the actor core, with the weights synced into the engine after every step
(`sync_weights`, `TensorTransport`, `rollout.pause_mode`). Groups come from `MultiTurnAgentLoop` against an
`EnginePool`, as in a run. `--mode async` keeps generating while the actor trains (at most
`rollout_buffer.max_buffered_groups` groups in flight or waiting, the oldest trained first);
`--mode sync` generates a whole batch, then trains.

    uv run python benchmarks/system/recipe.py [CONFIG] [key=value ...] [--mode async] [--cores 0,1]

Prints per step the reward, the staleness, the time spent training, syncing and waiting for data, and the
rollout's groups per second; at the end the means of the first and last quarter of steps. Writes the
figures as JSON (`--out`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from asyncrl_agents.loop import MultiTurnAgentLoop
from asyncrl_core import plugins
from asyncrl_core.config import AsyncRLConfig, load_config
from asyncrl_core.errors import PromptTooLongError
from asyncrl_core.metrics import TRAIN_LOSS, TRAJECTORY_NUM_MODEL_TOKENS
from asyncrl_core.protocols import Task
from asyncrl_core.types import Group, SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config", nargs="?", help="YAML file (default: the embedded searchr1-mini)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    parser.add_argument("--mode", choices=["async", "sync"], default="async")
    parser.add_argument("--cores", default="0,1", help="actor core, rollout core")
    parser.add_argument("--work-dir", default="runs/recipe", help="warm start, engine logs")
    parser.add_argument("--out", help="JSON file for the figures")
    args = parser.parse_args(argv)
    if args.config and "=" in args.config:
        args.overrides.insert(0, args.config)
        args.config = None
    return args


def make_task(name: str, args: dict[str, Any]) -> Task:
    factory = cast("Callable[..., Task]", plugins.load("asyncrl.tasks", name))
    return factory(**args)


def earliest_version(group: Group) -> int:
    """The earliest weight version that sampled a token of `group` (its finish version if none did)."""
    versions = group.version_range()
    return versions[0] if versions is not None else group.finish_version


def quarter_means(values: list[float]) -> tuple[float, float]:
    quarter = max(1, len(values) // 4)
    return statistics.fmean(values[:quarter]), statistics.fmean(values[-quarter:])


async def rl_loop(
    config: AsyncRLConfig, model: Path, work_dir: Path, actor_core: int, rollout_core: int, mode: str
) -> dict[str, Any]:
    import torch

    from asyncrl_core.actor import TorchActor
    from asyncrl_sglang.launcher import builtin_command, free_port, start_engines
    from asyncrl_sglang.weight_sync import TensorTransport, sync_weights

    task_name = config.agentloop.task_name
    assert task_name is not None
    task_args = dict(config.agentloop.task_args)
    rollout = config.rollout
    batch_size = config.data.rollout_batch_size
    max_buffered = config.rollout_buffer.max_buffered_groups or 2 * batch_size
    if mode == "sync":
        max_buffered = batch_size  # generate one batch, then train on it

    # Everything started from here on the rollout core inherits it: the retrieval server and the engine.
    os.sched_setaffinity(0, {rollout_core})
    serving = make_task(task_name, task_args)
    with serving.serve() as served:
        command = builtin_command(
            model_path=str(model),
            host="127.0.0.1",
            port=free_port(),
            max_running_requests=rollout.max_running_requests,
            context_length=rollout.context_length,
            extra_args={"num_threads": 1, "seed": config.runner.seed},
        )
        with start_engines([command], log_dir=work_dir / "engines", health_timeout_s=300) as engines:
            os.sched_setaffinity(0, {actor_core})
            torch.set_num_threads(1)
            actor_config = config.actor.model_copy(update={"model_path": str(model)})
            actor = TorchActor(
                actor_config,  # pyright: ignore[reportArgumentType]
                config.algorithm,
                device="cpu",
            )
            task = make_task(task_name, {**task_args, **served})
            pool = engines.pool()
            sampling = rollout.sampling
            loop = MultiTurnAgentLoop(
                task,
                pool,
                model,
                group_size=config.algorithm.group_size,
                sampling=SamplingParams(
                    max_new_tokens=sampling.max_new_tokens or config.data.max_response_len,
                    temperature=sampling.temperature,
                    top_p=sampling.top_p,
                    top_k=sampling.top_k,
                ),
                max_prompt_len=config.data.max_prompt_len,
                max_response_len=config.data.max_response_len,
                context_len=rollout.context_length,
                max_turns=config.agentloop.max_turns,
                max_concurrent_groups=max_buffered,
            )
            prompts = list(range(len(loop.dataset(config.data.split))))
            rng = random.Random(config.runner.seed)
            order: list[int] = []

            def next_prompt() -> int:
                if not order:
                    order.extend(prompts)
                    rng.shuffle(order)
                return order.pop()

            finished: list[tuple[int, Group]] = []  # (admission order, group)
            ready = asyncio.Condition()
            running: set[asyncio.Task[None]] = set()
            admitted = 0
            generating = asyncio.Event()
            generating.set()

            async def one_group(ticket: int) -> None:
                while True:
                    try:
                        group = await loop.run_group(next_prompt(), split=config.data.split)
                        break
                    except PromptTooLongError:
                        continue
                async with ready:
                    finished.append((ticket, group))
                    ready.notify_all()

            def admit() -> None:
                nonlocal admitted
                while len(running) + len(finished) < max_buffered and generating.is_set():
                    job = asyncio.create_task(one_group(admitted))
                    admitted += 1
                    running.add(job)
                    job.add_done_callback(running.discard)
                    job.add_done_callback(lambda _: admit_soon())

            def admit_soon() -> None:
                asyncio.get_running_loop().call_soon(admit)

            steps: list[dict[str, Any]] = []
            generated_groups = 0
            rollout_started = time.perf_counter()
            admit()
            for step in range(config.runner.num_steps):
                step_started = time.perf_counter()
                if mode == "sync" and step > 0:
                    generating.set()
                    admit()
                async with ready:
                    await asyncio.wait_for(ready.wait_for(lambda: len(finished) >= batch_size), 1800)
                    finished.sort(key=lambda item: (earliest_version(item[1]), item[0]))
                    batch = [group for _, group in finished[:batch_size]]
                    del finished[:batch_size]
                if mode == "sync":
                    generating.clear()
                else:
                    admit()
                wait_s = time.perf_counter() - step_started
                generated_groups += len(batch)
                staleness = [actor.version - earliest_version(group) for group in batch]
                trained = time.perf_counter()
                metrics = await asyncio.to_thread(actor.train_step, batch)
                train_s = time.perf_counter() - trained
                synced = time.perf_counter()
                result = await sync_weights(
                    pool,
                    actor.export_weights(actor.config.weight_export_bucket_mb << 20),
                    actor.version,
                    mode=rollout.pause_mode,
                    transport=TensorTransport(),
                )
                sync_s = time.perf_counter() - synced
                trajectories = [t for g in batch for t in g.trajectories]
                record = {
                    "step": step + 1,
                    "reward": statistics.fmean(t.reward for t in trajectories),
                    "turns": statistics.fmean(t.num_turns for t in trajectories),
                    "model_tokens": statistics.fmean(
                        t.metrics[TRAJECTORY_NUM_MODEL_TOKENS] for t in trajectories
                    ),
                    "response_len": statistics.fmean(t.response_len for t in trajectories),
                    "answered": statistics.fmean(t.finish_reason == "answer" for t in trajectories),
                    "staleness_max": max(staleness),
                    "wait_s": wait_s,
                    "train_s": train_s,
                    "sync_s": sync_s,
                    "sync_paused": result.num_paused_requests,
                    "step_s": time.perf_counter() - step_started,
                    "loss": metrics.get(TRAIN_LOSS, float("nan")),
                    "groups_per_s": generated_groups / (time.perf_counter() - rollout_started),
                }
                steps.append(record)
                print(
                    f"step {record['step']:3d}  reward {record['reward']:.3f}  answered "
                    f"{record['answered']:.2f}  turns {record['turns']:.2f}  "
                    f"tokens {record['model_tokens']:5.1f}"
                    f"  stale {record['staleness_max']}  wait {wait_s:5.1f}s  train {train_s:5.1f}s  "
                    f"sync {sync_s:4.1f}s  step {record['step_s']:5.1f}s",
                    flush=True,
                )
            generating.clear()
            for job in list(running):
                job.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            await loop.aclose()
            await pool.aclose()
    return {"steps": steps}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = load_config(args.config, args.overrides)
    actor_core, rollout_core = (int(core) for core in args.cores.split(","))
    work_dir = Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)

    import torch

    from asyncrl_core.actor import warm_start

    task_name = config.agentloop.task_name
    assert task_name is not None
    os.sched_setaffinity(0, {actor_core, rollout_core})
    torch.set_num_threads(2)
    started = time.perf_counter()
    task = make_task(task_name, dict(config.agentloop.task_args))
    model = warm_start(config, task)
    warm_start_s = time.perf_counter() - started
    print(f"warm start: {warm_start_s:.1f} s -> {model}", flush=True)

    rl_started = time.perf_counter()
    result = asyncio.run(rl_loop(config, model, work_dir, actor_core, rollout_core, args.mode))
    rl_s = time.perf_counter() - rl_started
    rewards = [step["reward"] for step in result["steps"]]
    first, last = quarter_means(rewards)
    summary = {
        "mode": args.mode,
        "overrides": args.overrides,
        "warm_start_s": warm_start_s,
        "rl_s": rl_s,
        "total_s": warm_start_s + rl_s,
        "reward_first_quarter": first,
        "reward_last_quarter": last,
        "median_train_s": statistics.median(step["train_s"] for step in result["steps"]),
        "median_sync_s": statistics.median(step["sync_s"] for step in result["steps"]),
        "median_wait_s": statistics.median(step["wait_s"] for step in result["steps"]),
        "median_step_s": statistics.median(step["step_s"] for step in result["steps"]),
        "groups_per_s": result["steps"][-1]["groups_per_s"],
    }
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps({**summary, **result}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
