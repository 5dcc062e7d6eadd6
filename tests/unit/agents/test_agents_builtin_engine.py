"""The agent loop against the real built-in engine through the real SGLang-protocol client."""

from __future__ import annotations

import asyncio
import math
import os
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import pytest
from agents_testing import RecordingClient, check_alignment, smollm2_tokenizer

from asyncrl_agents.loop import MultiTurnAgentLoop
from asyncrl_agents.tasks.searchr1 import INVALID_TURN_OBSERVATION, SearchR1MiniTask
from asyncrl_core.types import NO_VERSION, Generation, SamplingParams

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_multi_turn_group_on_the_builtin_engine(tmp_path: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from engine_process import serve_builtin

    from asyncrl_core.models import tiny_llama
    from asyncrl_sglang.client import SGLangClient

    model = tiny_llama(tmp_path / "tiny-llama")
    context_len = 1024
    mini = SearchR1MiniTask()
    with mini.serve() as task_args, serve_builtin(model, context_length=context_len) as server:
        task = SearchR1MiniTask(**task_args)
        async with SGLangClient(server.url) as client:
            recorder = RecordingClient(client)
            loop = MultiTurnAgentLoop(
                task,
                recorder,
                model,
                group_size=3,
                sampling=SamplingParams(max_new_tokens=24, temperature=1.0),
                max_prompt_len=512,
                max_response_len=200,
                context_len=context_len,
                max_turns=3,
            )
            group = await loop.run_group(5)
            await loop.aclose()

    tokenizer = smollm2_tokenizer()
    prompt = loop.prompt_ids(task.dataset("train")[5])
    assert len(group.trajectories) == 3
    for trajectory in group.trajectories:
        # A random model writes no tags: turns are invalid (corrected, then continued) until a limit or EOS.
        assert trajectory.finish_reason in {"max_turns", "context", "stop"}
        assert 1 <= trajectory.num_turns <= 3
        assert trajectory.response_len <= 200
        check_alignment(trajectory, recorder.calls, prompt)
        model_logprobs = [
            lp for lp, m in zip(trajectory.rollout_logprobs, trajectory.loss_mask, strict=True) if m
        ]
        assert all(math.isfinite(lp) and lp <= 0.0 for lp in model_logprobs)
        assert NO_VERSION not in [
            v for v, m in zip(trajectory.versions, trajectory.loss_mask, strict=True) if m
        ]
        if trajectory.num_turns > 1:
            response = tokenizer.decode(trajectory.token_ids[trajectory.prompt_len :])
            assert INVALID_TURN_OBSERVATION in response or "<information>" in response
    # Every request continued the sequence exactly: no re-tokenisation between turns.
    assert len(recorder.calls) == sum(t.num_turns for t in group.trajectories)
    assert all(call.sampling.no_stop_trim for call in recorder.calls)


async def test_every_turn_of_a_trajectory_goes_to_one_engine_of_a_pool(tmp_path: Path) -> None:
    # Two engines behind a pool: without the trajectory's id as routing key, a later turn goes to whichever
    # engine has fewer requests outstanding and misses the prefix cache holding the turns before.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from engine_process import serve_builtin

    from asyncrl_core.models import tiny_llama
    from asyncrl_sglang.client import SGLangClient
    from asyncrl_sglang.pool import EnginePool

    class LoggingClient(SGLangClient):
        """The client of one engine, noting the rid of every request sent to it."""

        def __init__(self, base_url: str) -> None:
            super().__init__(base_url)
            self.rids: list[str] = []

        async def generate(
            self,
            input_ids: Sequence[int],
            sampling: SamplingParams,
            *,
            rid: str | None = None,
            routing_key: str | None = None,
        ) -> Generation:
            assert rid is not None
            self.rids.append(rid)
            return await super().generate(input_ids, sampling, rid=rid, routing_key=routing_key)

    model = tiny_llama(tmp_path / "tiny-llama")
    mini = SearchR1MiniTask()
    with (
        mini.serve() as task_args,
        serve_builtin(model, context_length=1024) as first,
        serve_builtin(model, context_length=1024) as second,
    ):
        task = SearchR1MiniTask(**task_args)
        engines = [LoggingClient(first.url), LoggingClient(second.url)]
        async with EnginePool(engines) as pool:
            loop = MultiTurnAgentLoop(
                task,
                pool,
                model,
                group_size=4,
                # No stop on an end-of-message token: the trajectories run several turns.
                sampling=SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True),
                max_prompt_len=512,
                max_response_len=200,
                context_len=1024,
                max_turns=3,
            )
            groups = await asyncio.gather(loop.run_group(1), loop.run_group(2))
            await loop.aclose()

    # A turn's rid is its trajectory's id with the turn number appended.
    engines_of: dict[str, set[int]] = defaultdict(set)
    for index, engine in enumerate(engines):
        for rid in engine.rids:
            engines_of[rid.rsplit("-", 1)[0]].add(index)
    num_turns = sum(t.num_turns for group in groups for t in group.trajectories)
    assert sum(len(engine.rids) for engine in engines) == num_turns > 8
    assert len(engines_of) == 8
    assert all(len(indices) == 1 for indices in engines_of.values()), dict(engines_of)
    # The first turns were spread over both engines (least loaded), and stayed there.
    assert {index for indices in engines_of.values() for index in indices} == {0, 1}
