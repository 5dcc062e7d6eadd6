"""The Megatron-Core actor: trains a GPT model built from a HuggingFace Llama/Qwen2 folder on buffered groups.

A step (`train_step`) makes `ppo_epochs` passes over the step's groups cut into mini-batches of
`ppo_mini_batch_size` groups, one optimizer update per mini-batch and pass (by default one update per step),
with the objective every actor shares (`asyncrl_core.algorithms`): each mini-batch is packed with
group-relative advantages, its rows are sorted by length and dealt to the data-parallel ranks, and each rank
runs its rows in micro-batches (`micro_batch_size` rows, or as many as fit in `max_tokens_per_micro_batch`
tokens), right-padded to a width rounded up to a multiple of 64 tokens, accumulating gradients in
Megatron's gradient buffers
(`DistributedDataParallel`), which average them over the data-parallel group once per update.
Tensor-parallel ranks of one data-parallel rank see the same rows. The loss weights are fixed for the whole
mini-batch, so any split of the rows gives the mini-batch gradient.

Logprobs and entropy. The model returns vocab-parallel logits `[n, t, V / TP]`. With TP = 1 the objective's
own `token_logprobs` and `token_entropy` are used, as in the torch actor; an entropy that is only logged
(`entropy_coef = 0`) comes from the logprobs' own pass (`token_logprobs_and_entropy`). With TP > 1 the
logprob of each target comes from Megatron's `vocab_parallel_cross_entropy`, and the entropy from a softmax
whose maximum and sums are all-reduced over the tensor-parallel group. Vocabulary rows added to make the
vocabulary divisible by TP get `-inf` logits, so they never take probability mass. Logits are divided by the
engines' sampling temperature first.

Old and proximal policies. The old logprobs are the engines' rollout logprobs. The decoupled correction's
proximal logprobs are the policy's before the step's first update, taken once by a forward pass without
gradient and kept for every update of the step; with a single update, they are that update's own logprobs,
detached.

Optimizer. On a GPU: Megatron's optimizer (`get_megatron_optimizer`: AdamW or plain SGD, float32 master
weights for bfloat16 parameters, the distributed optimizer if configured, gradient clipping). On a CPU,
Megatron's optimizer wrappers allocate CUDA tensors, so the same update is done with `torch.optim` on the
float32 parameters (or on float32 master copies of bfloat16 ones) and a tensor-parallel-aware gradient-norm
clip; see the package README.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from asyncrl_core import models
from asyncrl_core.actor.rng import rng_state, seed_all, set_rng_state
from asyncrl_core.actor.updates import UpdateLoop
from asyncrl_core.algorithms import (
    LossSettings,
    PackedBatch,
    RankPlan,
    policy_loss,
    rank_plan,
    token_entropy,
    token_logprobs,
    token_logprobs_and_entropy,
)
from asyncrl_core.errors import AsyncRLError
from asyncrl_core.protocols import NamedTensors, WeightExportRole
from asyncrl_core.shares import LENGTH_MULTIPLE
from asyncrl_core.types import BatchShare, Group
from asyncrl_megatron import checkpoint, parallel
from asyncrl_megatron.mapping import SafetensorsReader, export_hf_weights, load_hf_weights
from asyncrl_megatron.model import Architecture, build_gpt_model, megatron_warnings_ignored, padded_vocab_size

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.models.gpt import GPTModel

    from asyncrl_core.config import AlgorithmConfig, AsyncRLConfig, MegatronActorConfig

logger = logging.getLogger(__name__)

_HF_COPIED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


class MegatronActorError(AsyncRLError):
    """The Megatron actor cannot be built, train on a batch or read a checkpoint; nothing was changed."""


@dataclass(frozen=True, slots=True)
class MegatronActorSettings:
    """The actor's settings: the `actor` section of the configuration, as plain values."""

    model_path: str
    """A HuggingFace Llama/Qwen2 folder, or `smollm2-135m`."""
    temperature: float
    """The engines' sampling temperature: logprobs are taken under `softmax(logits / temperature)`
    (`actor.temperature`, derived from `rollout.sampling.temperature`)."""
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Parameter dtype; bfloat16 parameters get float32 master weights in the optimizer (Megatron's on a GPU,
    `torch.optim` over master copies on a CPU)."""
    micro_batch_size: int = 1
    """Rows per forward/backward pass (when `max_tokens_per_micro_batch` is None)."""
    max_tokens_per_micro_batch: int | None = None
    """Tokens per forward/backward pass, padding included: as many rows as fit, padded to a bucketed width
    (`asyncrl_core.algorithms.micro_batches`); None: `micro_batch_size` rows."""
    optimizer: Literal["adamw", "sgd"] = "adamw"
    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    """Must be 1: the actor is tensor and data parallel."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (GPUs, `tensor_parallel_size > 1`)."""
    use_distributed_optimizer: bool = True
    """Shard the optimizer state over the data-parallel group (GPUs)."""
    gradient_checkpointing: bool = False
    """Recompute each layer in the backward pass (Megatron's full, uniform recomputation)."""
    weight_export_bucket_mb: int = 512
    ppo_mini_batch_size: int | None = None
    """Groups per optimizer update; `None`: all the groups of a step."""
    ppo_epochs: int = 1
    """Passes over a step's mini-batches."""
    seed: int = 0
    """Seed of Python's, numpy's and torch's generators and of Megatron's model-parallel ones (`runner.seed`
    in a run)."""

    @classmethod
    def from_config(cls, actor: MegatronActorConfig, *, seed: int = 0) -> MegatronActorSettings:
        """The settings of the configuration's `actor` section (`backend: megatron`), which must be resolved
        (`actor.temperature` set, as a validated `AsyncRLConfig` derives it), with `seed` (`runner.seed`)."""
        if actor.temperature is None:
            raise MegatronActorError(
                "actor.temperature is unset: pass the `actor` section of a validated AsyncRLConfig (which "
                "derives it from rollout.sampling.temperature) or set it to the engines' temperature"
            )
        return cls(
            model_path=actor.model_path,
            temperature=actor.temperature,
            ppo_mini_batch_size=actor.ppo_mini_batch_size,
            ppo_epochs=actor.ppo_epochs,
            dtype=actor.dtype,
            micro_batch_size=actor.micro_batch_size,
            max_tokens_per_micro_batch=actor.max_tokens_per_micro_batch,
            optimizer=actor.optimizer,
            lr=actor.lr,
            weight_decay=actor.weight_decay,
            adam_beta1=actor.adam_beta1,
            adam_beta2=actor.adam_beta2,
            adam_eps=actor.adam_eps,
            grad_clip=actor.grad_clip,
            tensor_parallel_size=actor.tensor_parallel_size,
            pipeline_parallel_size=actor.pipeline_parallel_size,
            sequence_parallel=actor.sequence_parallel,
            use_distributed_optimizer=actor.use_distributed_optimizer,
            gradient_checkpointing=actor.gradient_checkpointing,
            weight_export_bucket_mb=actor.weight_export_bucket_mb,
            seed=seed,
        )


class MegatronActor(UpdateLoop):
    """The `asyncrl_core.protocols.Actor` on Megatron-Core, tensor and data parallel.

    Build one in every rank of the actor's world (with more than one rank, after a launcher that hosts the
    world's store set `RANK`/`WORLD_SIZE`/`MASTER_ADDR`/`MASTER_PORT`: `asyncrl_megatron.parallel`); every
    rank must get the same groups in `train_step` and consume `export_weights` in step. The temperature and
    the updates of a step come from the settings (`MegatronActorSettings.from_config(config.actor)`).
    """

    error_type = MegatronActorError

    def __init__(self, settings: MegatronActorSettings, loss: LossSettings) -> None:
        on_gpu = torch.cuda.is_available()
        if settings.pipeline_parallel_size != 1:
            raise MegatronActorError(
                "the Megatron actor is tensor and data parallel: set actor.pipeline_parallel_size to 1"
            )
        if settings.sequence_parallel and (settings.tensor_parallel_size == 1 or not on_gpu):
            raise MegatronActorError(
                "actor.sequence_parallel needs actor.tensor_parallel_size > 1 and GPUs (gloo cannot "
                "reduce-scatter)"
            )
        if settings.temperature <= 0.0:
            raise MegatronActorError(f"temperature must be > 0, got {settings.temperature}")
        mini_batch_size = settings.ppo_mini_batch_size
        if settings.ppo_epochs < 1 or (mini_batch_size is not None and mini_batch_size < 1):
            raise MegatronActorError(
                f"ppo_epochs ({settings.ppo_epochs}) and ppo_mini_batch_size ({mini_batch_size}) must be "
                "positive"
            )
        self.settings = settings
        self.loss_settings = loss
        self.temperature = settings.temperature
        self.update_metrics: tuple[dict[str, float], ...] = ()
        """The metrics of each optimizer update of the last `train_step`, in order."""
        self.model_path = models.resolve_model_path(settings.model_path, key="actor.model_path")
        self.arch = Architecture.from_pretrained(self.model_path)
        self.dtype = torch.bfloat16 if settings.dtype == "bfloat16" else torch.float32

        seed_all(settings.seed)  # Python's, numpy's and torch's; Megatron's own in `initialize`
        parallel.initialize(settings.tensor_parallel_size, seed=settings.seed)
        from megatron.core import parallel_state

        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.dp_group = parallel.process_group(parallel_state.get_data_parallel_group())
        self.tp_group = parallel.process_group(parallel_state.get_tensor_model_parallel_group())
        self.device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        self.length_multiple = LENGTH_MULTIPLE if on_gpu else 1
        """Micro-batch widths are rounded up to a multiple of this many tokens: buckets on a GPU, none on a
        CPU (`asyncrl_core.shares.LENGTH_MULTIPLE`)."""

        with megatron_warnings_ignored():
            self._build_all(loss, on_gpu)
        config = json.loads((self.model_path / "config.json").read_text())
        pad_id = config.get("pad_token_id")
        self.pad_id: int = pad_id if isinstance(pad_id, int) else 0
        self._version = 0

    def _build_all(self, loss: LossSettings, on_gpu: bool) -> None:
        reader = SafetensorsReader(self.model_path)
        self.module: GPTModel = self._build(reader)
        self.module.train()
        self.model: DistributedDataParallel = self._wrap(self.module)
        self.reference: GPTModel | None = None
        if loss.needs_reference:
            self.reference = self._build(reader)
            self.reference.eval()
            self.reference.requires_grad_(False)
        self._megatron_optimizer: Any = None
        self._torch_optimizer: torch.optim.Optimizer | None = None
        self._master_parameters: list[torch.nn.Parameter] | None = None
        if on_gpu:
            self._megatron_optimizer = self._build_megatron_optimizer()
        else:
            self._torch_optimizer = self._build_torch_optimizer()

    @classmethod
    def from_config(
        cls, actor: MegatronActorConfig, algorithm: AlgorithmConfig, *, seed: int = 0
    ) -> MegatronActor:
        """The actor for the configuration's `actor` (`backend: megatron`) and `algorithm` sections, its
        generators seeded with `seed` (`runner.seed`)."""
        return cls(MegatronActorSettings.from_config(actor, seed=seed), LossSettings.from_config(algorithm))

    @classmethod
    def from_run_config(cls, config: AsyncRLConfig, *, model_path: str, device: str) -> MegatronActor:
        """The actor plugin factory (`asyncrl.actors`): the run's actor on `model_path`. Megatron picks its
        device itself (the rank's GPU, else the CPU)."""
        del device
        if config.actor.backend != "megatron":
            raise MegatronActorError(f"the Megatron actor cannot run actor.backend {config.actor.backend!r}")
        return cls.from_config(
            config.actor.model_copy(update={"model_path": model_path}),  # pyright: ignore[reportArgumentType]
            config.algorithm,
            seed=config.runner.seed,
        )

    # --- the Actor protocol ---------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    @property
    def weight_export_role(self) -> WeightExportRole:
        """The first tensor-parallel group (data-parallel rank 0) gathers the weights, and its tensor-parallel
        rank 0 (global rank 0) sends them; the other data-parallel replicas take no part."""
        if self.dp_rank != 0:
            return "none"
        return "send" if self.tp_rank == 0 else "join"

    def train_step(self, batch: Sequence[Group] | BatchShare) -> dict[str, float]:
        """One training step: `ppo_epochs` passes over mini-batches of `ppo_mini_batch_size` groups, one
        optimizer update each; the version goes up by one.

        `batch` is this data-parallel rank's `BatchShare` (as the runner hands it over; the tensor-parallel
        ranks of one data-parallel rank get the same share), or the step's groups, which every rank is then
        given and cuts the same way (`asyncrl_core.algorithms.rank_plan`).

        Returns the step's `train/...` metrics, equal on every rank: `policy_loss`'s metrics and
        `train/grad_norm` (before clipping; 0 when clipping is off on a GPU, where Megatron does not compute
        it) as means over the updates (each update's own metrics are in `update_metrics`), `train/lr`,
        `train/num_updates`, and the step's `train/num_trajectories`, `train/num_tokens` and
        `train/num_loss_tokens`. Raises `BatchError` for malformed groups or another rank's share (nothing
        is changed) and `MegatronActorError` for a non-finite gradient: in the first update, the weights,
        the optimizer and the version are unchanged; in a later one, the updates before it are kept and the
        version goes up by one, as the error says.
        """
        with megatron_warnings_ignored():
            return self._train_step(batch)

    def _train_step(self, batch: Sequence[Group] | BatchShare) -> dict[str, float]:
        plan = self.plan(batch)
        # Every micro-batch is copied to the device before the first forward pass, so no host work or
        # host-to-device copy waits between the micro-batches' kernels.
        on_device = [[part.to(self.device) for part in parts] for parts in plan.micro_batches]
        return self._run_updates(
            dataclasses.replace(plan, micro_batches=on_device),
            num_epochs=self.settings.ppo_epochs,
            needs_proximal=self.loss_settings.needs_proximal,
            lr=self.settings.lr,
        )

    def _accumulate_gradients(
        self, parts: list[PackedBatch], proximal: list[torch.Tensor | None]
    ) -> dict[str, torch.Tensor]:
        """Forward and backward passes of one mini-batch's micro-batches into Megatron's gradient buffers,
        averaged over the data-parallel group; returns the summed metrics."""
        self.model.zero_grad_buffer()
        self._zero_grad()
        totals: dict[str, torch.Tensor] = {}
        for part, part_proximal in zip(parts, proximal, strict=True):
            loss, metrics = self._micro_batch_loss(part, part_proximal)
            # The buffers average gradients over data-parallel ranks; the weights already split the batch.
            (loss * self.dp_size).backward()
            for name, value in metrics.items():
                totals[name] = totals[name] + value if name in totals else value
        self.model.finish_grad_sync()
        return totals

    def export_weights(
        self, bucket_bytes: int, *, dtype: torch.dtype | None = None
    ) -> Iterator[NamedTensors]:
        """The weights under HuggingFace names (QKV and gate/up unfused, TP shards gathered, vocabulary
        padding removed), in buckets of at most `bucket_bytes` (or one tensor).

        `dtype` defaults to the parameters' dtype. Collective over the tensor-parallel group: every rank
        must consume the iterator in step. With TP = 1 tensors may be views of the live parameters: consume
        each bucket before the next `train_step`.
        """
        with megatron_warnings_ignored():
            yield from export_hf_weights(self.module, self.arch, bucket_bytes, dtype)

    def save_checkpoint(self, path: str) -> None:
        """Write the model, the optimizer state, the random generators and the version under `path`, plus
        a HuggingFace copy of the weights (`asyncrl_megatron.checkpoint` describes the folder).

        Collective over the whole world. The model and optimizer go through Megatron's distributed
        checkpointing, so `load_checkpoint` reads them at any tensor- and data-parallel sizes.
        """
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        with megatron_warnings_ignored():
            checkpoint.save_sharded(self._sharded_state(is_loading=False), folder / checkpoint.DIST_FOLDER)
        checkpoint.write_rng(folder, dist.get_rank(), rng_state(), _rng_tracker().get_states())
        self._save_hf_copy(folder / checkpoint.HF_FOLDER)
        if dist.get_rank() == 0:
            checkpoint.write_description(
                folder,
                {
                    "version": self._version,
                    "optimizer": self.settings.optimizer,
                    "world_size": dist.get_world_size(),
                    "tensor_parallel_size": self.tp_size,
                    "data_parallel_size": self.dp_size,
                    "model_path": self.settings.model_path,
                },
            )
        dist.barrier()

    def load_checkpoint(self, path: str) -> None:
        """Restore what `save_checkpoint` wrote, at these tensor- and data-parallel sizes whatever sizes it
        was saved at (Megatron reshards the model and the optimizer state).

        The random generators come back only when the layout is the one they were saved with (they mean
        nothing in another); otherwise they stay as seeded and a warning says so. Everything is read and
        checked before anything changes: a checkpoint of another format, optimizer or model raises
        `MegatronActorError` and leaves the actor as it was.
        """
        folder = Path(path)
        try:
            description = checkpoint.read_description(folder)
            if description.get("optimizer") != self.settings.optimizer:
                raise checkpoint.CheckpointError(
                    f"the checkpoint in {folder} has optimizer {description.get('optimizer')!r}, this actor "
                    f"{self.settings.optimizer!r}"
                )
            same_layout = (description.get("world_size"), description.get("tensor_parallel_size")) == (
                dist.get_world_size(),
                self.tp_size,
            )
            generators = checkpoint.read_rng(folder, dist.get_rank()) if same_layout else None
            with megatron_warnings_ignored():
                state = checkpoint.detached(self._sharded_state(is_loading=True))
                loaded = checkpoint.load_sharded(state, folder / checkpoint.DIST_FOLDER)
        except checkpoint.CheckpointError as error:
            raise MegatronActorError(str(error)) from error
        with megatron_warnings_ignored():
            self.module.load_state_dict(loaded["model"])
            if self._megatron_optimizer is not None:
                self._megatron_optimizer.load_state_dict(loaded["optimizer"])
            else:
                assert self._torch_optimizer is not None
                checkpoint.load_torch_optimizer_state(
                    self._torch_optimizer, self._master_parameters, loaded["optimizer"]
                )
        self._version = int(description["version"])
        if generators is not None:
            set_rng_state(generators[0])
            _rng_tracker().set_states(generators[1])
        else:
            logger.warning(
                "the checkpoint in %s was saved by %s ranks at tensor parallelism %s, this actor has %d at "
                "%d: the weights and optimizer state are resharded, the random generators stay as seeded",
                folder,
                description.get("world_size"),
                description.get("tensor_parallel_size"),
                dist.get_world_size(),
                self.tp_size,
            )
        dist.barrier()

    def _sharded_state(self, *, is_loading: bool) -> dict[str, Any]:
        """The model's and the optimizer's sharded state dict (`dist_checkpointing`'s description of which
        slice of each global tensor this rank holds)."""
        model = self.module.sharded_state_dict()
        if self._megatron_optimizer is not None:
            optimizer = self._megatron_optimizer.sharded_state_dict(
                model, is_loading=is_loading, metadata=checkpoint.DISTRIBUTED_OPTIMIZER_SHARDING
            )
        else:
            assert self._torch_optimizer is not None
            optimizer = checkpoint.torch_optimizer_state(
                self._torch_optimizer,
                model,
                [p for p in self.module.parameters() if p.requires_grad],
                self._master_parameters,
                is_loading=is_loading,
            )
        return {"model": model, "optimizer": optimizer}

    def _save_hf_copy(self, hf_folder: Path) -> None:
        """Rank 0 writes the exported weights and the model's config and tokenizer files to `hf_folder`
        (collective: every rank of the first tensor-parallel group gathers)."""
        weights: dict[str, torch.Tensor] = {}
        role = self.weight_export_role
        if role != "none":
            for bucket in self.export_weights(self.settings.weight_export_bucket_mb << 20):
                if role == "send":
                    weights.update((name, tensor.detach().cpu().contiguous()) for name, tensor in bucket)
        if role != "send":
            return
        from safetensors.torch import save_file

        hf_folder.mkdir(exist_ok=True)
        temporary = hf_folder / "model.safetensors.tmp"
        save_file(weights, str(temporary), metadata={"format": "pt"})
        os.replace(temporary, hf_folder / "model.safetensors")
        for name in _HF_COPIED_FILES:
            if (self.model_path / name).is_file():
                shutil.copyfile(self.model_path / name, hf_folder / name)

    # --- beyond the protocol --------------------------------------------------------------------------------

    @torch.no_grad()
    def forward_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits `[T, V]` (float32, full vocabulary on every rank) of one token sequence `[T]`."""
        ids = input_ids.to(self.device)[None]
        positions = torch.arange(ids.shape[1], device=self.device)[None]
        with megatron_warnings_ignored():
            logits = self.module(ids, positions, None)[0].float()
        if self.tp_size > 1:
            pieces = [torch.empty_like(logits) for _ in range(self.tp_size)]
            dist.all_gather(pieces, logits.contiguous(), group=self.tp_group)
            logits = torch.cat(pieces, dim=-1)
        return logits[:, : self.arch.vocab_size]

    # --- internals ------------------------------------------------------------------------------------------

    def _build(self, reader: SafetensorsReader) -> GPTModel:
        model = build_gpt_model(
            self.arch,
            tensor_parallel_size=self.settings.tensor_parallel_size,
            dtype=self.dtype,
            gradient_checkpointing=self.settings.gradient_checkpointing,
        )
        if self.settings.sequence_parallel:
            model.config.sequence_parallel = True
        load_hf_weights(model, reader, self.arch)
        return model

    def _wrap(self, module: GPTModel) -> DistributedDataParallel:
        with megatron_warnings_ignored():
            from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=self.settings.use_distributed_optimizer and self.device.type == "cuda",
        )
        return DistributedDataParallel(config=module.config, ddp_config=ddp_config, module=module)

    def _build_megatron_optimizer(self) -> Any:
        with megatron_warnings_ignored():
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        s = self.settings
        config = OptimizerConfig(
            optimizer="adam" if s.optimizer == "adamw" else "sgd",
            lr=s.lr,
            min_lr=s.lr,
            weight_decay=s.weight_decay,
            adam_beta1=s.adam_beta1,
            adam_beta2=s.adam_beta2,
            adam_eps=s.adam_eps,
            sgd_momentum=0.0,
            bf16=self.dtype == torch.bfloat16,
            params_dtype=self.dtype,
            use_distributed_optimizer=s.use_distributed_optimizer,
            clip_grad=s.grad_clip,
        )
        return get_megatron_optimizer(config, [self.model])

    def _build_torch_optimizer(self) -> torch.optim.Optimizer:
        """`torch.optim` over the float32 parameters, or over float32 master copies of bfloat16 ones (as
        Megatron's optimizer keeps them), copied back into the model after each step."""
        s = self.settings
        parameters: list[torch.nn.Parameter] = [p for p in self.module.parameters() if p.requires_grad]
        if self.dtype != torch.float32:
            self._master_parameters = [torch.nn.Parameter(p.detach().float()) for p in parameters]
            parameters = self._master_parameters
        if s.optimizer == "adamw":
            return torch.optim.AdamW(
                parameters,
                lr=s.lr,
                betas=(s.adam_beta1, s.adam_beta2),
                eps=s.adam_eps,
                weight_decay=s.weight_decay,
            )
        return torch.optim.SGD(parameters, lr=s.lr, weight_decay=s.weight_decay)

    def _optimizer(self) -> Any:
        return self._megatron_optimizer if self._megatron_optimizer is not None else self._torch_optimizer

    def _zero_grad(self) -> None:
        if self._megatron_optimizer is not None:
            self._megatron_optimizer.zero_grad()
        elif self._torch_optimizer is not None:
            self._torch_optimizer.zero_grad(set_to_none=True)

    def _apply_update(self) -> float | None:
        if not self._gradients_finite():
            self.model.zero_grad_buffer()
            self._zero_grad()
            return None
        if self._megatron_optimizer is not None:
            success, grad_norm, _ = self._megatron_optimizer.step()
            if not success:
                raise MegatronActorError(f"the optimizer skipped the step at version {self._version}")
            return float(grad_norm or 0.0)
        assert self._torch_optimizer is not None
        parameters = [p for p in self.module.parameters() if p.requires_grad]
        grad_norm = self._global_grad_norm(parameters)
        stepped = self._master_parameters or parameters
        for target, parameter in zip(stepped, parameters, strict=True):
            # Megatron's gradient buffers hold the (averaged) float32 gradient; torch.optim reads `.grad`.
            target.grad = parameter.main_grad  # pyright: ignore[reportAttributeAccessIssue]
        if self.settings.grad_clip > 0 and grad_norm > self.settings.grad_clip:
            scale = self.settings.grad_clip / (grad_norm + 1e-6)
            for target in stepped:
                assert target.grad is not None
                target.grad.mul_(scale)
        self._torch_optimizer.step()
        self._torch_optimizer.zero_grad(set_to_none=True)
        if self._master_parameters is not None:
            with torch.no_grad():
                for parameter, master in zip(parameters, self._master_parameters, strict=True):
                    parameter.copy_(master)
        return grad_norm

    def _sum_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        if self.dp_size > 1:
            dist.all_reduce(values, group=self.dp_group)
        return values

    def _gradients_finite(self) -> bool:
        """Whether every rank's gradient buffers are finite (checked before the optimizer touches weights).

        Every parameter's `main_grad` is a view into one of DDP's contiguous gradient buffers, so one
        reduction per buffer checks them all.
        """
        # Megatron's DDP shadows the `nn.Module.buffers` method with its list of gradient buffers.
        grad_buffers: list[Any] = [*self.model.buffers, *self.model.expert_parallel_buffers]  # pyright: ignore[reportGeneralTypeIssues]
        finite = [torch.isfinite(buffer.grad_data).all() for buffer in grad_buffers]
        bad = torch.zeros((), device=self.device) if not finite else ~torch.stack(finite).all()
        flag = bad.float().reshape(1)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item() == 0.0

    def _global_grad_norm(self, parameters: list[torch.nn.Parameter]) -> float:
        """L2 norm of the full model's gradient (DDP's averaged `main_grad`s): sharded parameters summed over
        TP ranks, replicated once."""
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        squares = torch.zeros((), dtype=torch.float64, device=self.device)
        for parameter in parameters:
            grad: torch.Tensor = parameter.main_grad  # pyright: ignore[reportAttributeAccessIssue]
            if param_is_not_tensor_parallel_duplicate(parameter):
                squares += grad.detach().double().square().sum()
        if self.tp_size > 1:
            dist.all_reduce(squares, group=self.tp_group)
        return float(squares.sqrt().item())

    def _logits(self, model: torch.nn.Module, part: PackedBatch) -> torch.Tensor:
        """Vocab-parallel logits `[n, t, V / TP]` divided by the temperature, padding rows at `-inf`."""
        # Right padding needs no attention mask: causal attention never lets a real token see a later pad.
        if part.packed:
            raise MegatronActorError("the Megatron actor trains on padded rows, not packed ones")
        logits: torch.Tensor = model(part.input_ids, part.position_ids, None)
        if self.temperature != 1.0:
            logits = logits / self.temperature
        padded = padded_vocab_size(self.arch.vocab_size, self.tp_size)
        if padded != self.arch.vocab_size:
            shard = padded // self.tp_size
            first_padding = self.arch.vocab_size - self.tp_rank * shard
            if first_padding < shard:
                column = torch.arange(shard, device=logits.device)
                logits = logits.masked_fill(column >= first_padding, float("-inf"))
        return logits

    def _logprobs(self, logits: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return token_logprobs(logits, target_ids)
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        # It works in place on float32 logits (a bfloat16 input is converted, hence copied, first), and the
        # entropy and reference paths still need them.
        source = logits.clone() if logits.dtype == torch.float32 else logits
        return -vocab_parallel_cross_entropy(source, target_ids)

    def _entropy(self, logits: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return token_entropy(logits)
        return _vocab_parallel_entropy(logits, self.tp_group)

    def plan(self, batch: Sequence[Group] | BatchShare) -> RankPlan:
        """This data-parallel rank's micro-batches of a step (`train_step`'s `batch`), on the CPU."""
        return rank_plan(
            batch,
            self.dp_rank,
            self.dp_size,
            self.pad_id,
            mini_batch_size=self.settings.ppo_mini_batch_size,
            micro_batch_size=self.settings.micro_batch_size,
            normalize_std=self.loss_settings.normalize_advantage_std,
            aggregation=self.loss_settings.loss_aggregation,
            max_tokens=self.settings.max_tokens_per_micro_batch,
            # The local layer spec's attention refuses packed sequences (see the package README).
            packed=False,
            length_multiple=self.length_multiple,
        )

    def _proximal_logprobs(self, part: PackedBatch) -> torch.Tensor:
        return self._logprobs(self._logits(self.module, part), part.target_ids)

    def _micro_batch_loss(
        self, part: PackedBatch, proximal: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logits = self._logits(self.model, part)
        if self.tp_size == 1 and self.loss_settings.entropy_coef == 0.0:
            # The logged entropy comes from the logprobs' own pass over the logits.
            logprobs, entropy = token_logprobs_and_entropy(logits, part.target_ids)
        else:
            logprobs = self._logprobs(logits, part.target_ids)
            if self.loss_settings.entropy_coef > 0.0:
                entropy = self._entropy(logits)
            else:
                with torch.no_grad():
                    entropy = self._entropy(logits.detach())
        ref_logprobs = None
        if self.reference is not None:
            with torch.no_grad():
                ref_logits = self._logits(self.reference, part)
                ref_logprobs = self._logprobs(ref_logits, part.target_ids)
            del ref_logits
        if self.loss_settings.needs_proximal and proximal is None:
            proximal = logprobs.detach()  # a single update: its own forward pass is the policy before it
        return policy_loss(
            logprobs,
            part.rollout_logprobs,
            part.advantages,
            part.loss_weights,
            self.loss_settings,
            proximal_logprobs=proximal,
            ref_logprobs=ref_logprobs,
            entropy=entropy,
        )


def _vocab_parallel_entropy(logits: torch.Tensor, group: Any) -> torch.Tensor:
    """Entropy `[...]` (float32) of the softmax over vocab-parallel logits `[..., V / TP]`.

    `H = log Z - sum(p z)` with `Z = sum(exp(z))`; the maximum, `Z` and `sum(exp(z) z)` are all-reduced
    over the tensor-parallel group. The sums go through Megatron's `reduce_from_tensor_model_parallel_region`
    (all-reduce forward, identity backward), so the result is differentiable when `logits` is.
    """
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    values = logits.float()
    maximum = values.detach().amax(dim=-1, keepdim=True)
    dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=group)
    shifted = values - maximum
    exp = shifted.exp()
    total = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1))
    weighted = reduce_from_tensor_model_parallel_region(
        (exp * torch.nan_to_num(shifted, neginf=0.0)).sum(dim=-1)
    )
    return total.log() - weighted / total


def _rng_tracker() -> Any:
    """Megatron's tensor-parallel generator tracker (set up by `parallel.initialize`)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    if tracker is None:
        raise MegatronActorError("Megatron's random-generator tracker is not set up")
    return tracker
