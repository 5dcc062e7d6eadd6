"""asyncrl's exception hierarchy: every error a user can cause is an `AsyncRLError` with a clear message."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class AsyncRLError(Exception):
    """Base class of every error asyncrl raises on purpose."""


@dataclass(frozen=True, slots=True)
class ConfigProblem:
    """One problem of a configuration: the dotted key it concerns and what to write instead."""

    key: str
    """Dotted key path, e.g. `rollout.sglang.launch` or `rollout.sglang.urls[0]`; empty for the whole file."""
    message: str

    def __str__(self) -> str:
        return f"{self.key}: {self.message}" if self.key else self.message


class ConfigError(AsyncRLError):
    """The configuration is invalid; the message names each offending key and the fix.

    `problems` lists every problem found, so a user fixes them all in one pass. A plain string is accepted
    too and becomes one problem without a key; so does a single `ConfigProblem`.
    """

    def __init__(self, problems: str | ConfigProblem | Sequence[ConfigProblem]) -> None:
        if isinstance(problems, str):
            problems = ConfigProblem("", problems)
        self.problems: tuple[ConfigProblem, ...] = (
            (problems,) if isinstance(problems, ConfigProblem) else tuple(problems)
        )
        if len(self.problems) == 1:
            text = str(self.problems[0])
        else:
            lines = "\n".join(f"  - {problem}" for problem in self.problems)
            text = f"{len(self.problems)} problems in the configuration:\n{lines}"
        super().__init__(text)


class PluginError(AsyncRLError):
    """A plugin (task, agent loop, actor or rollout backend) could not be found or loaded."""


class ActorError(AsyncRLError):
    """The actor cannot load its model, train on a batch, or read a checkpoint; nothing was changed."""


class GenerationError(AsyncRLError):
    """The rollout engine refused a request (bad input, prompt too long: a 400) or failed it on its own (an
    internal error that the request reproduced alone: a 500); retrying will not help."""


class PromptTooLongError(AsyncRLError, ValueError):
    """A prompt, chat template applied, is longer than `data.max_prompt_len` or leaves no room to generate;
    the caller skips it (the dataloader filters such prompts)."""


class EngineUnavailableError(AsyncRLError):
    """The rollout engine could not be reached within the retries and timeouts allowed."""


class EngineControlError(AsyncRLError):
    """A rollout engine refused or failed a control call (pause, flush, weight update, launch); the message
    names the engine and the engine's reason."""


class GroupBufferError(AsyncRLError):
    """The group buffer refused an operation; the buffer is exactly as it was before the call.

    Each subclass carries typed fields besides its message, and pickles with them (Ray ships exceptions
    between processes).
    """

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_buffer_error, (type(self), str(self), dict(vars(self))))


def _rebuild_buffer_error(
    cls: type[GroupBufferError], message: str, fields: dict[str, object]
) -> GroupBufferError:
    return cls(message, **fields)


class InvalidArgumentError(GroupBufferError, ValueError):
    """A limit or argument is out of range: a limit below 1, a batch of 0 groups, a negative index."""

    def __init__(self, message: str, *, argument: str) -> None:
        super().__init__(message)
        self.argument = argument
        """The argument's name, or the configuration key that set the limit."""


class InvalidGroupError(GroupBufferError):
    """The group id was never admitted, the group is no longer in flight (for `abandon`), or its completion
    names another prompt than the one it was admitted for."""

    def __init__(self, message: str, *, group_id: int) -> None:
        super().__init__(message)
        self.group_id = group_id


class VersionError(GroupBufferError):
    """A weight version is negative, or the versions of a group or of the actor go backwards."""

    def __init__(self, message: str, *, group_id: int | None) -> None:
        super().__init__(message)
        self.group_id = group_id
        """The group whose versions are wrong, or None when the actor's version is."""


class DropLimitExceededError(GroupBufferError):
    """More stale groups would be dropped in one step than `rollout_buffer.max_dropped_groups_per_step`."""

    def __init__(
        self, message: str, *, dropped_this_step: int, would_drop: int, max_dropped_groups_per_step: int
    ) -> None:
        super().__init__(message)
        self.dropped_this_step = dropped_this_step
        """Groups already dropped in the running step."""
        self.would_drop = would_drop
        """Stale groups the refused hand-off would have dropped."""
        self.max_dropped_groups_per_step = max_dropped_groups_per_step


class CorruptStateError(GroupBufferError):
    """Snapshot bytes that are truncated, damaged, of another format, or describe an impossible state."""


class MetricsError(AsyncRLError, ValueError):
    """A run folder without `metrics.jsonl`, a line of it that is not a metrics record (the message names the
    file and line), or a metric asked for that no run logged."""
