"""The arith task on its own: the calculator, parsing, reward, and its registration as an asyncrl task."""

from __future__ import annotations

import asyncio
import importlib.metadata
from fractions import Fraction

import pytest

from asyncrl_core.protocols import Task
from asyncrl_core.types import FinalAnswer, InvalidTurn, ToolCall, ToolResult
from asyncrl_task_arith import ArithTask, Calculator, evaluate


def test_calculator_evaluates_arithmetic_only() -> None:
    assert evaluate("12 * (3 + 4)") == 84
    assert evaluate("-1.5 + 1/4") == Fraction(-5, 4)
    assert asyncio.run(Calculator()("7 / 2")) == "3.5"
    for bad in ("__import__('os')", "2 ** 100000", "1 / 0", "a + 1", "", "[1]"):
        with pytest.raises(ValueError, match=r"not an arithmetic|only numbers|division by zero"):
            evaluate(bad)


def test_turns_are_parsed() -> None:
    task = ArithTask()
    assert task.parse_turn("Let me compute <calc> 3*4 </calc>") == ToolCall("calc", "3*4")
    assert task.parse_turn("<answer> 12 </answer>") == FinalAnswer("12")
    assert isinstance(task.parse_turn("<calc> 3*4"), InvalidTurn)
    assert task.observation(ToolCall("calc", "3*4"), ToolResult("12")) == "\n<result> 12 </result>\n"


def test_reward_compares_numbers() -> None:
    task = ArithTask()
    sample = task.dataset("train")[0]
    value = sample.answers[0]
    assert task.reward(sample, FinalAnswer(value)) == 1.0
    assert task.reward(sample, FinalAnswer(f"{value}.0")) == 1.0
    assert task.reward(sample, FinalAnswer("not a number")) == 0.0
    assert task.reward(sample, None) == 0.0


def test_dataset_is_fixed_by_the_seed() -> None:
    assert ArithTask(seed=1).dataset("test") == ArithTask(seed=1).dataset("test")
    assert len(ArithTask().dataset("train")) == 2000
    with pytest.raises(KeyError, match="train, test"):
        ArithTask().dataset("dev")


def test_registered_as_an_asyncrl_task() -> None:
    (entry_point,) = [e for e in importlib.metadata.entry_points(group="asyncrl.tasks") if e.name == "arith"]
    assert entry_point.load() is ArithTask
    assert isinstance(ArithTask(), Task)
