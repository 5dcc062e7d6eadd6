"""The extension points between asyncrl's components, as `Protocol`s.

The rollout side (asyncrl_sglang), the agent side (asyncrl_agents) and the actors (asyncrl_core.actor,
asyncrl_megatron) meet only here and in `asyncrl_core.types`, so none of them imports another.
Heavy types appear under TYPE_CHECKING only: importing this module imports neither torch nor anything else
heavy.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from asyncrl_core.types import Generation, Group, SamplingParams

if TYPE_CHECKING:
    import torch

NamedTensors = list[tuple[str, "torch.Tensor"]]
"""One bucket of weights under HuggingFace parameter names."""


@runtime_checkable
class GenerationClient(Protocol):
    """Generates from token ids on the rollout engines (token in, token out: no re-tokenisation)."""

    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, *, rid: str | None = None
    ) -> Generation:
        """Sample a continuation of `input_ids`.

        Returns when the request finishes. A request paused by a weight sync continues after it (retract or
        in_place) or is held back until the sync is done (drain); `Generation.version_spans` records which
        weights produced which tokens. Raises `asyncrl_core.errors.GenerationError` for a request the
        engine refused (too long for the context, bad sampling values).
        """
        ...


@runtime_checkable
class Actor(Protocol):
    """A training backend: trains on groups, bumps its weight version, exports weights for the engines."""

    @property
    def version(self) -> int:
        """The weight version of the current parameters; 0 before the first step."""
        ...

    def train_step(self, groups: Sequence[Group]) -> dict[str, float]:
        """One optimiser step on `groups` (advantages are computed per group); returns `train/...` metrics.

        Increments `version` by one.
        """
        ...

    def export_weights(self, bucket_bytes: int) -> Iterator[NamedTensors]:
        """The current weights under HuggingFace names, in buckets of about `bucket_bytes` each.

        Buckets are produced lazily, so a large model never needs a second full copy in memory.
        """
        ...

    def save_checkpoint(self, path: str) -> None:
        """Write model, optimiser state and version under the folder `path`."""
        ...

    def load_checkpoint(self, path: str) -> None:
        """Restore what `save_checkpoint` wrote."""
        ...
