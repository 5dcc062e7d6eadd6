"""The run's timeouts: one configuration key per kind of wait, and one error that names it.

| key | what it bounds |
|---|---|
| `runner.startup_timeout_s` | the start of the workers: engines, actor ranks, agent loops, buffer |
| `rollout.request_timeout_s` | one generation request (and the wait for the next batch of data) |
| `rollout.drain_timeout_s` | the requests in flight finishing: a `drain` weight sync, the end of the run |
| `actor.train_timeout_s` | one training step of every rank; the weight push that follows, as long again |
| `runner.eval_timeout_s` | one evaluation, once the driver waits for it |
| `checkpoint.timeout_s` | saving or loading one checkpoint |

A call to a worker that answers at once (the buffer's statistics, reopening the agent loops) has no key of
its own: it is bounded by `CONTROL_TIMEOUT_S`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, get_args

from asyncrl_core.runner.workers import RunnerError

if TYPE_CHECKING:
    from asyncrl_core.config import AsyncRLConfig

TimeoutKey = Literal[
    "runner.startup_timeout_s",
    "rollout.request_timeout_s",
    "rollout.drain_timeout_s",
    "actor.train_timeout_s",
    "runner.eval_timeout_s",
    "checkpoint.timeout_s",
]
TIMEOUT_KEYS: tuple[TimeoutKey, ...] = get_args(TimeoutKey)
CONTROL_TIMEOUT_S = 300.0
"""Seconds a call that a healthy worker answers at once may take (a worker stuck, or a machine so loaded
that nothing answers)."""


def timeout_of(config: AsyncRLConfig, key: TimeoutKey) -> float:
    """The seconds `key` gives in `config`."""
    section, _, name = key.partition(".")
    return float(getattr(getattr(config, section), name))


def timed_out(what: str, seconds: float, key: TimeoutKey | None) -> RunnerError:
    """The error of a wait on `what` that ran past `seconds`: it names the key that bounds the wait."""
    if key is None:
        return RunnerError(
            f"{what} did not answer within {seconds:.0f} s (a call a healthy worker answers at once: "
            "the worker is stuck or the machine overloaded)"
        )
    return RunnerError(f"{what} did not finish within {seconds:.0f} s; raise `{key}` if it needs longer")
