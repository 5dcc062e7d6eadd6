"""The agent loop's overhead per turn against the generation time of the same turn.

Runs searchr1-mini groups through `MultiTurnAgentLoop` against the built-in engine (SmolLM2-135M-Instruct on
the CPU, shown a worked demonstration so that it writes `<search>` calls) and the real retrieval server (BM25,
loopback HTTP), then reports per model turn: generation (the `/generate` round trip), parsing (decoding
the turn and parsing its tags), the tool round trip (per search call), and bookkeeping (appending ids, masks,
logprobs and versions, formatting and tokenising the observation, budget checks). A second run with a
scripted engine (the model's words fixed, no model) shows the loop's own cost when generation is free.

    uv run python benchmarks/system/agent_loop.py [--groups 1 --group-size 4 --max-new-tokens 32]

Prints a table and writes the figures as JSON (`--out`, default `benchmarks/results/agent_loop.json`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncrl_agents.loop import MultiTurnAgentLoop
from asyncrl_agents.tasks.searchr1 import SearchR1MiniTask
from asyncrl_core.metrics import (
    TRAJECTORY_BOOKKEEPING_S,
    TRAJECTORY_GENERATION_S,
    TRAJECTORY_NUM_MODEL_TOKENS,
    TRAJECTORY_NUM_TOOL_CALLS,
    TRAJECTORY_PARSE_S,
    TRAJECTORY_TOOL_S,
)
from asyncrl_core.types import Generation, Group, SamplingParams, VersionSpan

PHASES = (TRAJECTORY_GENERATION_S, TRAJECTORY_PARSE_S, TRAJECTORY_TOOL_S, TRAJECTORY_BOOKKEEPING_S)


def per_turn(groups: Sequence[Group], wall_s: float) -> dict[str, float]:
    """Totals over all trajectories, as means per model turn (tool time per tool call)."""
    trajectories = [t for g in groups for t in g.trajectories]
    turns = sum(t.num_turns for t in trajectories)
    calls = sum(t.metrics[TRAJECTORY_NUM_TOOL_CALLS] for t in trajectories)
    totals = {phase: sum(t.metrics[phase] for t in trajectories) for phase in PHASES}
    overhead = totals[TRAJECTORY_PARSE_S] + totals[TRAJECTORY_TOOL_S] + totals[TRAJECTORY_BOOKKEEPING_S]
    return {
        "num_trajectories": len(trajectories),
        "num_turns": turns,
        "num_tool_calls": calls,
        "num_model_tokens": sum(t.metrics[TRAJECTORY_NUM_MODEL_TOKENS] for t in trajectories),
        "mean_reward": sum(t.reward for t in trajectories) / max(1, len(trajectories)),
        "generation_ms_per_turn": 1e3 * totals[TRAJECTORY_GENERATION_S] / max(1, turns),
        "parse_ms_per_turn": 1e3 * totals[TRAJECTORY_PARSE_S] / max(1, turns),
        "bookkeeping_ms_per_turn": 1e3 * totals[TRAJECTORY_BOOKKEEPING_S] / max(1, turns),
        "tool_ms_per_call": 1e3 * totals[TRAJECTORY_TOOL_S] / max(1, calls),
        "tool_ms_per_turn": 1e3 * totals[TRAJECTORY_TOOL_S] / max(1, turns),
        "overhead_ms_per_turn": 1e3 * overhead / max(1, turns),
        "overhead_over_generation": overhead / totals[TRAJECTORY_GENERATION_S]
        if totals[TRAJECTORY_GENERATION_S]
        else float("nan"),
        "wall_s": wall_s,
    }


class FixedWordsEngine:
    """A `GenerationClient` whose "model" searches once, then answers: the loop's cost without a model."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._search = tokenizer.encode("<think> Search. </think>\n<search> founded company </search>")
        self._answer = [*tokenizer.encode("<answer> nobody </answer>"), tokenizer.eos_token_id]

    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, *, rid: str | None = None
    ) -> Generation:
        await asyncio.sleep(0)
        searched = "</information>" in self._tokenizer.decode(input_ids[-24:])
        ids = self._answer if searched else self._search
        ids = ids[: sampling.max_new_tokens]
        return Generation(ids, [-0.5] * len(ids), "", "stop", (VersionSpan(0, 0, len(ids)),))


async def run_groups(loop: MultiTurnAgentLoop, num_groups: int) -> tuple[list[Group], float]:
    started = time.perf_counter()
    groups = await asyncio.gather(*(loop.run_group(index) for index in range(num_groups)))
    return list(groups), time.perf_counter() - started


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from asyncrl_core.models import smollm2_135m
    from asyncrl_sglang.client import SGLangClient
    from asyncrl_sglang.launcher import builtin_command, free_port, start_engines

    model = smollm2_135m()
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.7)
    settings = {
        "group_size": args.group_size,
        "sampling": sampling,
        "max_prompt_len": 1024,
        "max_response_len": 512,
        "context_len": 2048,
        "max_turns": args.max_turns,
        "num_demonstrations": args.demonstrations,
    }
    results: dict[str, Any] = {}
    engine = builtin_command(
        model_path=str(model),
        host="127.0.0.1",
        port=free_port(),
        max_running_requests=32,
        context_length=2048,
        extra_args={"num_threads": args.threads},
    )
    with SearchR1MiniTask().serve() as task_args, tempfile.TemporaryDirectory() as log_dir:
        with start_engines([engine], log_dir=Path(log_dir)) as launched:
            task = SearchR1MiniTask(**task_args)
            async with SGLangClient(launched.urls[0]) as client:
                loop = MultiTurnAgentLoop(task, client, model, **settings)  # type: ignore[arg-type]
                # Warm up the engine, the tokenizer and the HTTP connections with one short request.
                await client.generate([1, 2, 3], SamplingParams(max_new_tokens=2))
                log("engine warm; measuring")
                groups, wall_s = await run_groups(loop, args.groups)
                log(f"engine run done in {wall_s:.1f} s")
                results["builtin_engine"] = per_turn(groups, wall_s)
                await loop.aclose()
        task = SearchR1MiniTask(**task_args)
        loop = MultiTurnAgentLoop(task, FixedWordsEngine(loop.tokenizer), loop.tokenizer, **settings)  # type: ignore[arg-type]
        await run_groups(loop, 1)
        groups, wall_s = await run_groups(loop, args.groups)
        results["fixed_words"] = per_turn(groups, wall_s)
        await loop.aclose()
    return results


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def print_table(results: dict[str, Any]) -> None:
    rows = [
        ("generation (ms/turn)", "generation_ms_per_turn"),
        ("parse (ms/turn)", "parse_ms_per_turn"),
        ("bookkeeping (ms/turn)", "bookkeeping_ms_per_turn"),
        ("tool round trip (ms/call)", "tool_ms_per_call"),
        ("loop overhead (ms/turn)", "overhead_ms_per_turn"),
        ("overhead / generation", "overhead_over_generation"),
        ("turns", "num_turns"),
        ("tool calls", "num_tool_calls"),
        ("model tokens", "num_model_tokens"),
        ("mean reward", "mean_reward"),
    ]
    names = list(results)
    print(f"{'per model turn':<28}" + "".join(f"{name:>18}" for name in names))
    for label, key in rows:
        cells = "".join(f"{results[name][key]:>18.3f}" for name in names)
        print(f"{label:<28}{cells}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--groups", type=int, default=1, help="groups measured at once")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32, help="most tokens of one model turn")
    parser.add_argument(
        "--demonstrations", type=int, default=1, help="worked examples shown before the question"
    )
    parser.add_argument("--threads", type=int, default=1, help="CPU threads of the built-in engine")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/agent_loop.json"))
    args = parser.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the engine and the retrieval server are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    results = asyncio.run(main_async(args))
    print_table(results)
    report = {
        "benchmark": "agent_loop",
        "command": " ".join(["python", *sys.argv]),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        },
        "settings": {key: value for key, value in vars(args).items() if key != "out"},
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
