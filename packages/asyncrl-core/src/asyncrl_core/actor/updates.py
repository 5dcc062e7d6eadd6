"""The optimiser updates of one training step, written once for every actor.

A step makes `ppo_epochs` passes over its mini-batches (`RankPlan.micro_batches`), one optimiser update per
mini-batch and pass, and bumps the weight version once. The decoupled correction's proximal logprobs are the
policy's before the step's first update, taken once by a forward pass without gradient and kept for every
update of the step, so that the clip acts from the second update on; a single update takes them from its own
forward pass instead (the actor's loss does, given `None`).

A non-finite gradient is never applied. In the step's first update nothing has changed yet: the step is
skipped, weights, optimiser and version as they were. In a later update, the updates before it stand, so the
version goes up by one for them. Either way the actor raises its error type, saying which.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from asyncrl_core.algorithms import PackedBatch, RankPlan
from asyncrl_core.errors import ActorError, AsyncRLError
from asyncrl_core.metrics import (
    TRAIN_GRAD_NORM,
    TRAIN_LR,
    TRAIN_NUM_LOSS_TOKENS,
    TRAIN_NUM_TOKENS,
    TRAIN_NUM_TRAJECTORIES,
    TRAIN_NUM_UPDATES,
)


class UpdateLoop(ABC):
    """An actor's training step after its rows are planned: the updates, the proximal policy, the
    non-finite-gradient rule, the version and the step's metrics. The actor supplies one mini-batch's
    gradient, the optimiser step, the proximal logprobs and the sum over its data-parallel ranks."""

    error_type: ClassVar[type[AsyncRLError]] = ActorError
    """What a non-finite gradient raises."""
    _version: int
    update_metrics: tuple[dict[str, float], ...]
    """Each update's own metrics of the last step (summed over the data-parallel ranks), in order."""

    @abstractmethod
    def _accumulate_gradients(
        self, parts: list[PackedBatch], proximal: list[torch.Tensor | None]
    ) -> dict[str, torch.Tensor]:
        """Forward and backward passes of one mini-batch's micro-batches (this rank's), the gradient left
        for `_apply_update`; returns the metrics summed over the micro-batches."""

    @abstractmethod
    def _apply_update(self) -> float | None:
        """Apply the accumulated gradient and return its global norm before clipping; or, when the gradient
        is not finite on any rank, discard it, leave the weights and the optimiser alone and return None."""

    @abstractmethod
    def _proximal_logprobs(self, part: PackedBatch) -> torch.Tensor:
        """The current policy's logprobs of the part's targets (called without gradient)."""

    @abstractmethod
    def _sum_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """`values` summed over the data-parallel ranks."""

    def _run_updates(
        self, plan: RankPlan, *, num_epochs: int, needs_proximal: bool, lr: float
    ) -> dict[str, float]:
        """`num_epochs` passes over the plan's mini-batches, one update each; the version goes up by one.

        Returns the step's `train/...` metrics, equal on every rank: the loss's metrics and `train/grad_norm`
        as means over the updates (each update's own in `update_metrics`), `train/lr` (`lr`),
        `train/num_updates`, and the plan's `train/num_trajectories`, `train/num_tokens` and
        `train/num_loss_tokens`. Raises `error_type` for a non-finite gradient (see the module).
        """
        plans = plan.micro_batches
        num_updates = num_epochs * len(plans)
        proximal: list[list[torch.Tensor | None]] = [[None] * len(parts) for parts in plans]
        if needs_proximal and num_updates > 1:
            with torch.no_grad():
                proximal = [[self._proximal_logprobs(part) for part in parts] for parts in plans]

        names: list[str] = []
        per_update: list[torch.Tensor] = []
        grad_norms: list[float] = []
        for update in range(num_updates):
            index = update % len(plans)
            totals = self._accumulate_gradients(plans[index], proximal[index])
            grad_norm = self._apply_update()
            if grad_norm is None:
                if update == 0:
                    raise self.error_type(
                        f"non-finite gradient at version {self._version}: the step was skipped and the "
                        "weights are unchanged"
                    )
                self._version += 1
                raise self.error_type(
                    f"non-finite gradient in update {update + 1} of the step: the {update} updates before it "
                    f"were applied and the version is now {self._version}"
                )
            names = sorted(totals)
            per_update.append(torch.stack([totals[name].float() for name in names]))
            grad_norms.append(grad_norm)
        self._version += 1

        reduced = self._sum_over_ranks(torch.stack(per_update)).tolist()
        self.update_metrics = tuple(
            dict(zip(names, values, strict=True)) | {TRAIN_GRAD_NORM: grad_norm}
            for values, grad_norm in zip(reduced, grad_norms, strict=True)
        )
        result = {
            name: sum(metrics[name] for metrics in self.update_metrics) / num_updates
            for name in self.update_metrics[0]
        }
        result[TRAIN_LR] = lr
        result[TRAIN_NUM_UPDATES] = float(num_updates)
        result[TRAIN_NUM_TRAJECTORIES] = float(plan.num_rows)
        result[TRAIN_NUM_TOKENS] = float(plan.num_tokens)
        result[TRAIN_NUM_LOSS_TOKENS] = float(plan.num_loss_tokens)
        return result
