"""asyncrl-task-arith: arithmetic word problems with a calculator tool, as a third-party asyncrl task."""

from asyncrl_task_arith.task import ArithArguments, ArithTask, Calculator, evaluate

__all__ = ["ArithArguments", "ArithTask", "Calculator", "evaluate"]
