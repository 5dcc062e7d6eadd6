"""The PyTorch actor: trains a HuggingFace causal LM on buffered groups, data parallel over its devices.

A step (`train_step`) makes `actor.ppo_epochs` passes over the step's groups cut into mini-batches of
`actor.ppo_mini_batch_size` groups, one optimiser update per mini-batch and pass, and bumps the weight
version once; by default, one update per step. Within an update, the mini-batch's rows are sorted by length
and dealt to the data-parallel ranks (`asyncrl_core.shares`: the runner hands each rank its share), and each
rank runs its rows in micro-batches, accumulating gradients: with `actor.max_tokens_per_micro_batch`, as
many trajectories as fit in that many tokens, packed into one row (`asyncrl_core.algorithms.batch`'s packed
layout, attention kept within each trajectory by `asyncrl_core.actor.attention`); otherwise
`actor.micro_batch_size` trajectories, right-padded. The per-token loss weights are fixed for the whole
mini-batch, so the accumulated gradient equals the mini-batch gradient whatever the split and the layout.
DDP averages gradients over the ranks, so each rank scales its loss by the world size.

Precision. Parameters and optimiser state are float32 (the master weights). `actor.dtype: bfloat16` runs the
forward and backward passes under bfloat16 autocast where the device supports it (CUDA with bf16, a CPU
with native bf16); elsewhere it falls back to float32 and logs a warning. Dropout is switched off: the
policy being trained must be the distribution the engines sample from.

Old and proximal policies. The old logprobs of the PPO ratio are the engines' rollout logprobs, fixed for the
whole step. With `off_policy_correction: decoupled` the ratio is taken against the proximal logprobs instead:
the policy's own logprobs before the step's first update, computed once by a forward pass without gradient
before it and kept for every update of the step, so the clip acts from the second update on. With a single
update per step that forward pass is the update's own (the trust-region ratio is then 1 at every token, and
what remains is the truncated importance weight between the proximal and the behaviour policy).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from asyncrl_core import models
from asyncrl_core.actor.attention import (
    PACKED_ATTENTION,
    log_attention_backend,
    packed_attention_arguments,
    register_packed_attention,
)
from asyncrl_core.actor.distributed import (
    all_reduce_sum,
    barrier,
    init_process_group,
    ranks_disagree,
    settings_from_environment,
    world,
)
from asyncrl_core.actor.rng import load_rng, rng_file, save_rng, seed_all, set_rng_state
from asyncrl_core.actor.torch_checkpoint import (
    MODEL_FILE,
    OPTIMIZER_FILE,
    atomic_save,
    copy_tokenizer_files,
    optimizer_from_safetensors,
    optimizer_to_safetensors,
    read_version,
    write_state,
)
from asyncrl_core.actor.updates import UpdateLoop
from asyncrl_core.algorithms import (
    LossSettings,
    PackedBatch,
    RankPlan,
    policy_loss,
    rank_plan,
    token_entropy,
    token_logprobs,
)
from asyncrl_core.config.models import TorchActorConfig
from asyncrl_core.errors import ActorError
from asyncrl_core.protocols import NamedTensors, WeightExportRole
from asyncrl_core.shares import LENGTH_MULTIPLE
from asyncrl_core.types import BatchShare, Group

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from asyncrl_core.config import AlgorithmConfig, AsyncRLConfig

logger = logging.getLogger(__name__)


def bfloat16_supported(device: torch.device) -> bool:
    """Whether `device` computes in bfloat16 natively (a CPU without it would emulate, slowly)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())  # pyright: ignore[reportPrivateUsage]
        except (AttributeError, RuntimeError):
            return False
    return False


def default_device() -> torch.device:
    """The current CUDA device when there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def load_causal_lm(
    path: Path, device: torch.device, dtype: torch.dtype, *, attention: str | None = None
) -> PreTrainedModel:
    """The causal LM of the folder `path` on `device`, dropout off and no KV cache (a model to train), with
    transformers' attention implementation `attention` (its default when None)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    config = AutoConfig.from_pretrained(str(path))
    for key, value in config.to_dict().items():
        if "dropout" in key and isinstance(value, float):
            setattr(config, key, 0.0)
    config.use_cache = False
    chosen: dict[str, Any] = {} if attention is None else {"attn_implementation": attention}
    model = AutoModelForCausalLM.from_pretrained(str(path), config=config, dtype=dtype, **chosen)
    return model.to(device)  # pyright: ignore[reportArgumentType] (transformers annotates `to` oddly)


def _unique_named_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters and persistent buffers under their HuggingFace names, each storage once.

    A tied output layer shares the embedding's tensor, so `lm_head.weight` is left out: the embedding comes
    first in the state dict, and loaders of tied models (HuggingFace, the built-in engine) fill both.
    """
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        yield name, tensor


class TorchActor(UpdateLoop):
    """The `asyncrl_core.protocols.Actor` on PyTorch and HuggingFace `transformers`.

    Build one per data-parallel rank, after `asyncrl_core.actor.distributed.init_process_group` when there
    is more than one; every rank must then get its own share of the step, or the same groups, in
    `train_step`. Everything comes from the configuration's `actor` and `algorithm` sections:
    `actor.temperature` (the engines' sampling temperature, derived from `rollout.sampling.temperature`),
    and `actor.ppo_mini_batch_size` and `actor.ppo_epochs`, which set the optimiser updates of a step.
    """

    def __init__(
        self,
        actor: TorchActorConfig,
        algorithm: AlgorithmConfig,
        *,
        device: torch.device | str | None = None,
        seed: int = 0,
    ) -> None:
        if actor.tensor_parallel_size != 1 or actor.pipeline_parallel_size != 1:
            raise ActorError(
                "the torch actor is data parallel only: set actor.tensor_parallel_size and "
                "actor.pipeline_parallel_size to 1, or use actor.backend: megatron"
            )
        if actor.temperature is None:
            raise ActorError(
                "actor.temperature is unset: pass the `actor` section of a validated AsyncRLConfig (which "
                "derives it from rollout.sampling.temperature) or set it to the engines' temperature"
            )
        self.config = actor
        self.settings = LossSettings.from_config(algorithm)
        self.temperature: float = actor.temperature
        """The engines' sampling temperature: logprobs are taken under `softmax(logits / temperature)`."""
        self.update_metrics: tuple[dict[str, float], ...] = ()
        """The metrics of each optimiser update of the last `train_step`, in order."""
        self.device = torch.device(device) if device is not None else default_device()
        self.length_multiple = LENGTH_MULTIPLE if self.device.type == "cuda" else 1
        """Micro-batch widths and packed lengths are rounded up to a multiple of this many tokens: shape
        buckets on a GPU, none on a CPU (`asyncrl_core.shares.LENGTH_MULTIPLE`)."""
        self.rank, self.world_size = world()
        seed_all(seed)  # `runner.seed`: every generator of the run derives from it
        self.model_path = models.resolve_model_path(actor.model_path, key="actor.model_path")
        self.compute_dtype = torch.float32
        if actor.dtype == "bfloat16":
            if bfloat16_supported(self.device):
                self.compute_dtype = torch.bfloat16
            else:
                logger.warning("%s has no native bfloat16: the torch actor computes in float32", self.device)

        # Packed rows need attention that stays within each trajectory; padded ones take the same function.
        register_packed_attention()
        self.attention_backend = log_attention_backend(self.device, self.compute_dtype)
        """The kernel that packed rows' attention runs (`asyncrl_core.actor.attention`)."""
        self.module = load_causal_lm(self.model_path, self.device, torch.float32, attention=PACKED_ATTENTION)
        if actor.gradient_checkpointing:
            # transformers 5 renamed the method; the old name remains as a deprecated alias.
            enable = getattr(self.module, "activation_checkpointing_enable", None)
            if enable is None:
                enable = self.module.gradient_checkpointing_enable
            enable({"use_reentrant": False})
        self.module.train()
        self._logits_at = LossPositionLogits(self.module)
        self._model: torch.nn.Module = self._logits_at
        if self.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            # Buffers (rotary tables) are equal on every rank and never trained: not synchronised at each
            # forward pass. torch 2.15 renamed the option; the old name warns there.
            buffers: dict[str, Any] = (
                {"forward_sync_buffers": False}
                if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                else {"broadcast_buffers": False}
            )
            self._model = DistributedDataParallel(
                self._logits_at,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                gradient_as_bucket_view=True,
                **buffers,
            )
        self._reference_logits: LossPositionLogits | None = None
        if self.settings.needs_reference:
            # The same computation as the policy's forward pass, so that the KL is 0 until the policy moves:
            # float32 weights under the same autocast (bfloat16 weights would round the residual stream and
            # the norms differently), the same mode (train, dropout off), the same logits module.
            reference = load_causal_lm(
                self.model_path, self.device, torch.float32, attention=PACKED_ATTENTION
            )
            reference.train(self.module.training)
            reference.requires_grad_(False)
            self._reference_logits = LossPositionLogits(reference)

        parameters = [p for p in self.module.parameters() if p.requires_grad]
        if actor.optimizer == "adamw":
            self.optimizer: torch.optim.Optimizer = torch.optim.AdamW(
                parameters,
                lr=actor.lr,
                betas=(actor.adam_beta1, actor.adam_beta2),
                eps=actor.adam_eps,
                weight_decay=actor.weight_decay,
            )
        else:
            self.optimizer = torch.optim.SGD(parameters, lr=actor.lr, weight_decay=actor.weight_decay)
        pad_id = getattr(self.module.config, "pad_token_id", None)
        self.pad_id: int = pad_id if isinstance(pad_id, int) else 0
        self._version = 0

    @classmethod
    def from_run_config(cls, config: AsyncRLConfig, *, model_path: str, device: str) -> TorchActor:
        """The actor plugin factory (`asyncrl.actors`): the run's actor on `model_path` and `device`.

        A process the runner started as one of several data-parallel ranks (`WORLD_SIZE` > 1 in its
        environment) first joins their process group (gloo on a CPU, NCCL on GPUs), whose collectives may
        wait up to `actor.train_timeout_s` for a rank."""
        actor = config.actor
        if not isinstance(actor, TorchActorConfig):
            raise ActorError(f"the torch actor cannot run actor.backend {actor.backend!r}")
        settings = settings_from_environment(actor.train_timeout_s)
        if settings is not None and not torch.distributed.is_initialized():
            init_process_group(settings, "cuda" if torch.device(device).type == "cuda" else "cpu")
        return cls(
            actor.model_copy(update={"model_path": model_path}),
            config.algorithm,
            device=device,
            seed=config.runner.seed,
        )

    # --- the Actor protocol ---------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    @property
    def weight_export_role(self) -> WeightExportRole:
        """Rank 0 sends; every rank holds the whole model, so the others take no part."""
        return "send" if self.rank == 0 else "none"

    @property
    def reference(self) -> PreTrainedModel | None:
        """The frozen reference model of the KL term, loaded only when `algorithm.kl_coef > 0`."""
        return None if self._reference_logits is None else self._reference_logits.causal_lm

    def train_step(self, batch: Sequence[Group] | BatchShare) -> dict[str, float]:
        """One training step: `actor.ppo_epochs` passes over mini-batches of `actor.ppo_mini_batch_size`
        groups, one optimiser update each; the version goes up by one.

        `batch` is this rank's `BatchShare` (as the runner hands it over), or the step's groups, which every
        rank is then given and cuts the same way (`asyncrl_core.algorithms.rank_plan`).

        Returns the step's `train/...` metrics, equal on every rank: `policy_loss`'s metrics and
        `train/grad_norm` (before clipping) as means over the updates (each update's own metrics are in
        `update_metrics`), `train/lr`, `train/num_updates`, and the step's `train/num_trajectories`,
        `train/num_tokens` (prompt and response, all ranks) and `train/num_loss_tokens`. Raises `BatchError`
        for malformed groups or another rank's share (nothing is changed) and `ActorError` for a non-finite
        gradient: in the first update, the weights, the optimiser and the version are unchanged; in a later
        one, the updates before it are kept and the version goes up by one, as the error says.
        """
        return self._run_updates(
            self.plan(batch),
            num_epochs=self.config.ppo_epochs,
            needs_proximal=self.settings.needs_proximal,
            lr=float(self.optimizer.param_groups[0]["lr"]),
        )

    def plan(self, batch: Sequence[Group] | BatchShare) -> RankPlan:
        """This rank's micro-batches of a step (`train_step`'s `batch`): packed rows of at most
        `actor.max_tokens_per_micro_batch` tokens, or padded ones of `actor.micro_batch_size` rows."""
        return rank_plan(
            batch,
            self.rank,
            self.world_size,
            self.pad_id,
            mini_batch_size=self.config.ppo_mini_batch_size,
            micro_batch_size=self.config.micro_batch_size,
            normalize_std=self.settings.normalize_advantage_std,
            aggregation=self.settings.loss_aggregation,
            max_tokens=self.config.max_tokens_per_micro_batch,
            packed=True,
            length_multiple=self.length_multiple,
        )

    def export_weights(
        self, bucket_bytes: int, *, dtype: torch.dtype | None = None
    ) -> Iterator[NamedTensors]:
        """The weights under HuggingFace names, in buckets of at most `bucket_bytes` (or one tensor).

        `dtype` defaults to the compute dtype (bfloat16 when training in bfloat16, else float32). Tensors
        already in `dtype` are detached views of the live parameters, so consume each bucket before the next
        `train_step`; a cast makes a copy of one bucket at a time, never of the whole model. A tied
        `lm_head.weight` is not exported (see `_unique_named_tensors`).
        """
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        target = dtype or self.compute_dtype
        return self._buckets(bucket_bytes, target)

    def save_checkpoint(self, path: str) -> None:
        """Write a HuggingFace model folder plus optimiser state and version under `path` (rank 0 writes),
        and each rank's random generators.

        `model.safetensors` holds the float32 master weights (so the folder loads with `from_pretrained`
        and in the engines), `optimizer.safetensors` the optimiser state, `actor_state.json` the version
        and the number of data-parallel ranks, `rng_state_rank<k>.json` rank k's generators
        (`asyncrl_core.actor.rng`). Each file is written under a temporary name and renamed into place.
        Whole tensors, so any number of ranks loads them. With several ranks, every rank first checks that
        its weights and optimiser state equal rank 0's and raises `ActorError`, writing nothing, if not.
        """
        differing = ranks_disagree(self._state_tensors())
        if differing:
            raise ActorError(
                f"the data-parallel ranks hold different weights or optimiser state at version "
                f"{self._version} ({len(differing)} tensors, first {differing[:5]}): their updates diverged, "
                "so no rank's copy stands for the others; nothing was written"
            )
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        save_rng(folder, self.rank)
        if self.rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
            weights = {name: t.detach().cpu().contiguous() for name, t in _unique_named_tensors(self.module)}
            atomic_save(weights, folder / MODEL_FILE, {"format": "pt"})
            del weights
            tensors, metadata = optimizer_to_safetensors(self.optimizer, self.config.optimizer)
            atomic_save(tensors, folder / OPTIMIZER_FILE, metadata)
            self.module.config.save_pretrained(str(folder))
            copy_tokenizer_files(self.model_path, folder)
            write_state(
                folder,
                version=self._version,
                data_parallel_size=self.world_size,
                optimizer=self.config.optimizer,
                model_path=str(self.config.model_path),
            )
        barrier()

    def load_checkpoint(self, path: str) -> None:
        """Restore weights, optimiser state, version and this rank's random generators written by
        `save_checkpoint`.

        Everything is read and checked before anything is changed: a missing file, a tensor of another
        name or shape, or another optimiser raises `ActorError` and leaves the actor as it was.
        """
        folder = Path(path)
        try:
            generators = load_rng(folder, self.rank)
        except (OSError, ValueError) as error:
            raise ActorError(f"cannot read {rng_file(folder, self.rank)}: {error}") from error
        version = read_version(folder, self.config.optimizer)
        try:
            weights = load_file(str(folder / MODEL_FILE), device=str(self.device))
            optimizer_tensors = load_file(str(folder / OPTIMIZER_FILE))
        except (OSError, RuntimeError, ValueError, SafetensorError) as error:
            raise ActorError(f"cannot read the checkpoint in {folder}: {error}") from error
        targets = dict(_unique_named_tensors(self.module))
        problems = [f"missing {name}" for name in targets if name not in weights]
        problems += [f"unexpected {name}" for name in weights if name not in targets]
        problems += [
            f"{name} has shape {tuple(weights[name].shape)}, the model {tuple(tensor.shape)}"
            for name, tensor in targets.items()
            if name in weights and weights[name].shape != tensor.shape
        ]
        if problems:
            raise ActorError(f"the checkpoint in {folder} does not fit the model: " + "; ".join(problems))
        optimizer_state = optimizer_from_safetensors(optimizer_tensors, folder / OPTIMIZER_FILE)
        try:
            # Checks the parameter groups before it changes anything; the weights are copied after it.
            self.optimizer.load_state_dict(optimizer_state)
        except (KeyError, ValueError) as error:
            raise ActorError(f"the optimiser state in {folder} does not fit this actor: {error}") from error
        with torch.no_grad():
            for name, tensor in targets.items():
                tensor.copy_(weights[name])
        self._version = version
        if generators is not None:
            set_rng_state(generators)

    # --- beyond the protocol --------------------------------------------------------------------------------

    @torch.no_grad()
    def forward_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits `[T, V]` (float32) of one token sequence `[T]`, as the training forward computes them."""
        with self._autocast():
            output = self.module(input_ids=input_ids.to(self.device)[None], use_cache=False)
        return output.logits[0].float()

    # --- internals ------------------------------------------------------------------------------------------

    def _state_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Weights and optimiser state tensors, in the same order on every rank."""
        yield from _unique_named_tensors(self.module)
        for index, entry in sorted(self.optimizer.state_dict()["state"].items()):
            for key, value in sorted(entry.items()):
                if isinstance(value, torch.Tensor):
                    yield f"optimizer.state.{index}.{key}", value

    def _no_sync(self) -> contextlib.AbstractContextManager[None]:
        no_sync = getattr(self._model, "no_sync", None)
        return no_sync() if no_sync is not None else contextlib.nullcontext()

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)

    def _accumulate_gradients(
        self, parts: list[PackedBatch], proximal: list[torch.Tensor | None]
    ) -> dict[str, torch.Tensor]:
        """Forward and backward passes of one mini-batch's micro-batches; returns the summed metrics."""
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, torch.Tensor] = {}
        for index, part in enumerate(parts):
            last = index == len(parts) - 1
            sync = contextlib.nullcontext() if last or self.world_size == 1 else self._no_sync()
            with sync:
                loss, metrics = self._micro_batch_loss(part.to(self.device), proximal[index])
                (loss * self.world_size).backward()
            for name, value in metrics.items():
                totals[name] = totals[name] + value if name in totals else value
        return totals

    def _apply_update(self) -> float | None:
        parameters = [p for p in self.module.parameters() if p.grad is not None]
        max_norm = self.config.grad_clip if self.config.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
        # DDP averaged the gradient, so every rank has the same norm and takes the same branch.
        finite = bool(torch.isfinite(grad_norm))
        if finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm.item()) if finite else None

    def _sum_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(values)

    def _first_trained_column(self, part: PackedBatch) -> int:
        trained_columns = part.loss_mask.any(dim=0).nonzero()
        return int(trained_columns[0].item()) if trained_columns.numel() else part.input_ids.shape[1] - 1

    def _trained_logprobs(
        self, model: torch.nn.Module, part: PackedBatch, first: int, *, entropy_grad: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logprobs of the targets and entropies `[n, width - first]` at the trained positions (zero
        elsewhere), from logits of those positions only; the entropy has a gradient with `entropy_grad`."""
        mask = part.loss_mask[:, first:].bool()
        packed = (
            {}
            if part.sequence_offsets is None
            else packed_attention_arguments(part.sequence_offsets, part.max_sequence_len)
        )
        with self._autocast():
            logits = model(part.input_ids, part.position_ids, mask, first, **packed)
        targets = part.target_ids[:, first:][mask]
        logprobs = token_logprobs(logits, targets, self.temperature)
        if entropy_grad:
            entropy = token_entropy(logits, self.temperature)
        else:
            with torch.no_grad():
                entropy = token_entropy(logits.detach(), self.temperature)
        return _scatter(logprobs, mask), _scatter(entropy, mask)

    @torch.no_grad()
    def _proximal_logprobs(self, part: PackedBatch) -> torch.Tensor:
        """The current policy's logprobs of the part's targets, from its first trained column on."""
        part = part.to(self.device)
        first = self._first_trained_column(part)
        return self._trained_logprobs(self._logits_at, part, first)[0]

    def _micro_batch_loss(
        self, part: PackedBatch, proximal: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        first = self._first_trained_column(part)
        logprobs, entropy = self._trained_logprobs(
            self._model, part, first, entropy_grad=self.settings.entropy_coef > 0.0
        )
        ref_logprobs = None
        if self._reference_logits is not None:
            with torch.no_grad():
                ref_logprobs = self._trained_logprobs(self._reference_logits, part, first)[0]
        if self.settings.needs_proximal and proximal is None:
            proximal = logprobs.detach()  # a single update: its own forward pass is the policy before it
        return policy_loss(
            logprobs,
            part.rollout_logprobs[:, first:],
            part.advantages[:, first:],
            part.loss_weights[:, first:],
            self.settings,
            proximal_logprobs=proximal,
            ref_logprobs=ref_logprobs,
            entropy=entropy,
        )

    def _buckets(self, bucket_bytes: int, dtype: torch.dtype) -> Iterator[NamedTensors]:
        bucket: NamedTensors = []
        size = 0
        for name, parameter in _unique_named_tensors(self.module):
            tensor = parameter.detach()
            if tensor.is_floating_point() and tensor.dtype != dtype:
                tensor = tensor.to(dtype)
            num_bytes = tensor.numel() * tensor.element_size()
            if bucket and size + num_bytes > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, tensor.contiguous()))
            size += num_bytes
        if bucket:
            yield bucket


# Model families whose logits are exactly `output_embeddings(decoder(...).last_hidden_state)`: no scaling or
# soft-capping after the output layer, so it can be applied to the trained positions alone.
_PLAIN_OUTPUT_LAYER = frozenset({"llama", "mistral", "qwen2", "qwen3"})


class LossPositionLogits(torch.nn.Module):
    """A causal LM whose output layer runs only where a loss is taken.

    `forward(input_ids, position_ids, mask, first, **attention)` returns the logits `[K, V]` of the `K`
    positions that `mask` (`[n, width - first]`, boolean) selects among the columns from `first` on, in
    row-major order; `attention` (`packed_attention_arguments` of a packed row) reaches the attention. In
    agentic trajectories most positions after the first answer token are tool output, which is not trained,
    and for a small model with a large vocabulary the output layer is most of the compute (a 7.1M-parameter
    Llama with a 49k vocabulary trained on one batch in 0.75 s instead of 1.86 s). Families outside
    `_PLAIN_OUTPUT_LAYER` take the full forward from `first` on (`logits_to_keep` where the model accepts
    it) and select afterwards. A module, so that DDP wraps it and sees every parameter used in its forward
    pass.

    Right padding needs no attention mask: causal attention never lets a real token see a later pad; a
    packed row's trajectories are kept apart by its sequence offsets.
    """

    def __init__(self, causal_lm: PreTrainedModel) -> None:
        super().__init__()
        self.causal_lm = causal_lm
        self.plain = getattr(causal_lm.config, "model_type", None) in _PLAIN_OUTPUT_LAYER
        self.accepts_logits_to_keep = "logits_to_keep" in inspect.signature(causal_lm.forward).parameters

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor,
        first: int,
        **attention: torch.Tensor | int,
    ) -> torch.Tensor:
        output_layer = self.causal_lm.get_output_embeddings() if self.plain else None
        if output_layer is not None:
            decoder = self.causal_lm.get_decoder()
            output = decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False, **attention)
            return output_layer(output.last_hidden_state[:, first:][mask])
        num_last = input_ids.shape[1] - first
        keep = {"logits_to_keep": num_last} if self.accepts_logits_to_keep else {}
        logits = self.causal_lm(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, **keep, **attention
        ).logits
        return logits[:, -num_last:][mask]


def _scatter(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`values` of the `mask` positions (row-major) laid out as `mask`'s shape, zero elsewhere."""
    return torch.zeros(mask.shape, dtype=values.dtype, device=values.device).masked_scatter(mask, values)
