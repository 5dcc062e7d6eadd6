"""The arith task: word problems, a `<calc>` calculator and `<answer>`, scored by numeric equality.

It implements `asyncrl_core.protocols.Task` structurally (no base class): the agent loop only needs the
methods and attributes the protocol lists.
"""

from __future__ import annotations

import ast
import contextlib
import math
import operator
import random
import re
from collections.abc import Callable, Generator, Mapping, Sequence
from fractions import Fraction
from typing import Annotated, ClassVar

from pydantic import Field

from asyncrl_core.config import TaskArguments
from asyncrl_core.protocols import Tool
from asyncrl_core.types import (
    ChatMessage,
    Demonstration,
    FinalAnswer,
    InvalidTurn,
    TaskSample,
    ToolCall,
    ToolResult,
    TurnAction,
)

SYSTEM_PROMPT = (
    "Solve the problem. You may use a calculator: write <calc> expression </calc> and the result comes back "
    "between <result> and </result>. Give the final number as <answer> number </answer>."
)

_BINARY: dict[type[ast.operator], Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
_MAX_DIGITS = 30


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression (+ - * / and parentheses on decimal numbers).

    Raises ValueError naming what is not allowed; nothing but arithmetic is ever evaluated.
    """
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from error

    def walk(node: ast.expr) -> Fraction:
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, int | float)
            and not isinstance(node.value, bool)
        ):
            return Fraction(str(node.value))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            value = walk(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("division by zero")
            value = _BINARY[type(node.op)](left, right)
            if len(str(value.numerator)) > _MAX_DIGITS or len(str(value.denominator)) > _MAX_DIGITS:
                raise ValueError("number too large")
            return value
        raise ValueError(f"only numbers, + - * / and parentheses are allowed, not {ast.unparse(node)!r}")

    return walk(tree.body)


def format_number(value: Fraction) -> str:
    """An integer as digits, anything else as a decimal rounded to 6 places."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6f}".rstrip("0").rstrip(".")


class Calculator:
    """The `calc` tool."""

    name = "calc"

    async def __call__(self, arguments: str) -> str:
        return format_number(evaluate(arguments))


_TEMPLATES = (
    (
        "A crate holds {a} boxes of {b} apples. {c} apples are eaten. How many apples are left?",
        "{a} * {b} - {c}",
    ),
    ("{a} workers each lay {b} bricks a day for {c} days. How many bricks do they lay?", "{a} * {b} * {c}"),
    (
        "A tank holds {a} litres and {b} litres are added {c} times. How many litres are in it?",
        "{a} + {b} * {c}",
    ),
    (
        "{a} sweets are shared among {b} children, then each gets {c} more. How many has each?",
        "{a} / {b} + {c}",
    ),
)
_TAG = re.compile(r"<(calc|answer)>(.*?)</\1>", re.DOTALL)


class ArithArguments(TaskArguments):
    """Arguments of `arith` (`agentloop.task_args`), checked before a run starts."""

    seed: Annotated[int, Field(ge=0)] = 0
    """Seed of the generated problems."""
    max_turns: Annotated[int, Field(ge=1)] = 3
    """Most model turns: calculator calls plus the answer."""
    num_train: Annotated[int, Field(ge=1)] = 2000
    """Problems in the `train` split."""
    num_test: Annotated[int, Field(ge=1)] = 200
    """Problems in the `test` split."""


class ArithTask:
    """Arithmetic word problems; `seed` fixes the problems, `max_turns` bounds calculator calls + answer."""

    name = "arith"
    arguments_model: ClassVar[type[TaskArguments]] = ArithArguments
    stop = ("</calc>", "</answer>")

    def __init__(self, seed: int = 0, max_turns: int = 3, num_train: int = 2000, num_test: int = 200) -> None:
        self.max_turns = max_turns
        rng = random.Random(seed)
        problems: list[TaskSample] = []
        for index in range(num_train + num_test):
            template, formula = rng.choice(_TEMPLATES)
            b, c = rng.randint(2, 12), rng.randint(2, 30)
            a = b * rng.randint(2, 40) if "/" in formula else rng.randint(2, 60)
            numbers = {"a": a, "b": b, "c": c}
            value = evaluate(formula.format(**numbers))
            messages = (ChatMessage("system", SYSTEM_PROMPT), ChatMessage("user", template.format(**numbers)))
            problems.append(TaskSample(f"arith-{index}", messages, (format_number(value),)))
        self._splits = {"train": problems[:num_train], "test": problems[num_train:]}
        self._calculator = Calculator()

    def dataset(self, split: str) -> Sequence[TaskSample]:
        if split not in self._splits:
            raise KeyError(f"no split {split!r} in arith (splits: {', '.join(self._splits)})")
        return self._splits[split]

    def tools(self) -> Mapping[str, Tool]:
        return {"calc": self._calculator}

    def parse_turn(self, text: str) -> TurnAction:
        match = _TAG.search(text)
        if match is None:
            return InvalidTurn("no <calc> or <answer>")
        tag, content = match.group(1), match.group(2).strip()
        if not content:
            return InvalidTurn(f"empty <{tag}>")
        return FinalAnswer(content) if tag == "answer" else ToolCall("calc", content)

    def observation(self, action: ToolCall | InvalidTurn, result: ToolResult | None) -> str:
        if isinstance(action, InvalidTurn) or result is None:
            return "\nUse <calc> expression </calc> or <answer> number </answer>.\n"
        text = result.text if result.error is None else f"error: {result.error}"
        return f"\n<result> {text} </result>\n"

    def reward(self, sample: TaskSample, answer: FinalAnswer | None) -> float:
        if answer is None:
            return 0.0
        try:
            given = evaluate(answer.text.replace(",", ""))
        except ValueError:
            return 0.0
        expected = Fraction(sample.answers[0])
        return 1.0 if math.isclose(float(given), float(expected), rel_tol=1e-6, abs_tol=1e-9) else 0.0

    def demonstrations(self) -> Sequence[Demonstration]:
        sample = self._splits["train"][0]
        answer = sample.answers[0]
        return (Demonstration(sample.messages, f"<answer> {answer} </answer>"),)

    @contextlib.contextmanager
    def serve(self) -> Generator[Mapping[str, str]]:
        yield {}  # the calculator runs in-process: nothing to start

    async def aclose(self) -> None:
        return None
