"""A task from its own distribution (examples/task-package), found by entry point, run by the agent loop."""

from __future__ import annotations

import re

from agents_testing import ScriptedEngine, smollm2_tokenizer

from asyncrl_agents.loop import MultiTurnAgentLoop
from asyncrl_core import plugins
from asyncrl_core.protocols import Task
from asyncrl_core.types import SamplingParams


def calculator_user(context: str) -> str:
    """A model that sets up the calculation from the problem, calls the calculator, and answers its result."""
    results = re.findall(r"<result> (.*?) </result>", context.rsplit("A crate holds", 1)[-1])
    if results:
        return f"<answer> {results[-1]} </answer><|im_end|>"
    problem = re.search(r"A crate holds (\d+) boxes of (\d+) apples\. (\d+) apples are eaten", context)
    assert problem is not None
    a, b, c = problem.groups()
    return f"I multiply and subtract. <calc> {a} * {b} - {c} </calc>"


async def test_third_party_task_runs_through_the_agent_loop() -> None:
    assert "arith" in plugins.names("asyncrl.tasks")
    factory = plugins.load("asyncrl.tasks", "arith")
    assert callable(factory)
    task = factory(seed=0, max_turns=3)
    assert isinstance(task, Task)
    tokenizer = smollm2_tokenizer()
    engine = ScriptedEngine(tokenizer, calculator_user)
    loop = MultiTurnAgentLoop(
        task,
        engine,
        tokenizer,
        group_size=2,
        sampling=SamplingParams(max_new_tokens=48),
        max_prompt_len=256,
        max_response_len=256,
    )
    with task.serve() as extra_args:
        assert extra_args == {}
        samples = task.dataset("train")
        index = next(i for i, s in enumerate(samples) if s.messages[-1].content.startswith("A crate holds"))
        group = await loop.run_group(index)
    await loop.aclose()
    for trajectory in group.trajectories:
        assert trajectory.finish_reason == "answer"
        assert trajectory.reward == 1.0
        assert trajectory.num_turns == 2
        response = tokenizer.decode(trajectory.token_ids[trajectory.prompt_len :])
        assert f"</calc>\n<result> {samples[index].answers[0]} </result>\n" in response
        observation_mask = [m for m in trajectory.loss_mask if m == 0]
        assert observation_mask  # the calculator's result is not trained on
