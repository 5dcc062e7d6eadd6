"""HuggingFace <-> Megatron-Core weight mapping for Llama and Qwen2 decoders, with tensor-parallel sharding.

Conventions (HuggingFace name -> Megatron parameter, for layer `i`; `D` hidden size, `d` head dim,
`G` key/value heads, `Q = heads / G` query heads per group, `F` intermediate size, `P` TP size):

- `model.embed_tokens.weight` [V, D] -> `embedding.word_embeddings.weight`, vocab rows padded with zeros to
  a multiple of `P` and split in `P` contiguous row blocks. `lm_head.weight` -> `output_layer.weight`
  likewise, unless the embeddings are tied (then the output layer reuses the embedding and no `lm_head` is
  exported).
- `q_proj`, `k_proj`, `v_proj` (weights and Qwen2 biases) -> one fused `self_attention.linear_qkv`, laid out
  per key/value group: for each group `g`, its `Q` query heads, then its key head, then its value head, i.e.
  `[G, Q + 2, d, D]` flattened to `[G (Q + 2) d, D]`. Rank `r` holds groups `[r G/P, (r + 1) G/P)`.
- `o_proj` [D, heads d] -> `self_attention.linear_proj`, split along the input dimension (row parallel).
- `gate_proj`, `up_proj` [F, D] -> one `mlp.linear_fc1` [2F/P, D] per rank: that rank's block of gate rows,
  then its block of up rows. `down_proj` [D, F] -> `mlp.linear_fc2`, split along the input dimension.
- `input_layernorm`, `post_attention_layernorm` and `model.norm` are replicated. With the local layer spec
  they are `input_layernorm`, `pre_mlp_layernorm` and `decoder.final_layernorm`; with TransformerEngine's
  spec the first two are fused into `linear_qkv.layer_norm_weight` and `linear_fc1.layer_norm_weight`.

Export gathers the shards of each parameter over the tensor-parallel group, one parameter at a time, and
yields buckets lazily: all ranks of a tensor-parallel group must consume `export_hf_weights` in step, and no
rank ever holds more than one bucket of gathered weights besides its own shards.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from asyncrl_core.errors import AsyncRLError
from asyncrl_megatron.model import Architecture

NamedTensors = list[tuple[str, torch.Tensor]]
TensorReader = Callable[[str], torch.Tensor]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


class WeightMappingError(AsyncRLError, ValueError):
    """HuggingFace weights that do not fit the Megatron model (a missing tensor, a wrong shape)."""


# ---------------------------------------------------------------------------------------------- reading


class SafetensorsReader:
    """Reads tensors by HuggingFace name from a folder of safetensors files (sharded or not), lazily."""

    def __init__(self, path: str | Path) -> None:
        folder = Path(path)
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            self._files = {name: folder / file for name, file in weight_map.items()}
        else:
            single = folder / "model.safetensors"
            if not single.is_file():
                raise WeightMappingError(f"{folder} has neither model.safetensors nor its index")
            from safetensors import safe_open

            with safe_open(str(single), framework="pt") as handle:
                self._files = {name: single for name in handle.keys()}  # noqa: SIM118

    def names(self) -> set[str]:
        return set(self._files)

    def __call__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        file = self._files.get(name)
        if file is None:
            raise WeightMappingError(f"the checkpoint has no tensor {name!r}")
        with safe_open(str(file), framework="pt") as handle:
            return handle.get_tensor(name)


# ------------------------------------------------------------------------------------- HF -> Megatron


def _row_block(tensor: torch.Tensor, rank: int, size: int, dim: int = 0) -> torch.Tensor:
    return tensor.chunk(size, dim=dim)[rank]


def _pad_vocab(tensor: torch.Tensor, padded_rows: int) -> torch.Tensor:
    if tensor.shape[0] == padded_rows:
        return tensor
    padding = tensor.new_zeros((padded_rows - tensor.shape[0], *tensor.shape[1:]))
    return torch.cat([tensor, padding])


def fuse_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: Architecture, rank: int = 0, size: int = 1
) -> torch.Tensor:
    """Megatron's `linear_qkv` shard of rank `rank` from HF q/k/v weights (`[out, D]`) or biases (`[out]`)."""
    trailing = q.shape[1:]
    groups = arch.num_kv_heads
    q = q.reshape(groups, arch.heads_per_group, arch.head_dim, *trailing)
    k = k.reshape(groups, 1, arch.head_dim, *trailing)
    v = v.reshape(groups, 1, arch.head_dim, *trailing)
    fused = torch.cat([q, k, v], dim=1)  # [G, Q + 2, d, ...]
    return _row_block(fused, rank, size).reshape(-1, *trailing)


def split_qkv(fused: torch.Tensor, arch: Architecture) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The HuggingFace q, k, v tensors of a full (all groups) Megatron `linear_qkv` weight or bias."""
    trailing = fused.shape[1:]
    grouped = fused.reshape(arch.num_kv_heads, arch.heads_per_group + 2, arch.head_dim, *trailing)
    q = grouped[:, : arch.heads_per_group].reshape(-1, *trailing)
    k = grouped[:, arch.heads_per_group].reshape(-1, *trailing)
    v = grouped[:, arch.heads_per_group + 1].reshape(-1, *trailing)
    return q, k, v


def megatron_shard(name: str, read: TensorReader, arch: Architecture, rank: int, size: int) -> torch.Tensor:
    """The value of Megatron parameter `name` on tensor-parallel rank `rank` of `size`, from HF tensors."""
    from asyncrl_megatron.model import padded_vocab_size

    padded = padded_vocab_size(arch.vocab_size, size)
    if name == "embedding.word_embeddings.weight":
        return _row_block(_pad_vocab(read("model.embed_tokens.weight"), padded), rank, size)
    if name == "output_layer.weight":
        return _row_block(_pad_vocab(read("lm_head.weight"), padded), rank, size)
    if name == "decoder.final_layernorm.weight":
        return read("model.norm.weight")
    match = _LAYER.match(name)
    if match is None:
        raise WeightMappingError(f"no HuggingFace source for Megatron parameter {name!r}")
    hf = f"model.layers.{match.group(1)}."
    local = match.group(2)
    if local in ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"):
        return read(hf + "input_layernorm.weight")
    if local in ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"):
        return read(hf + "post_attention_layernorm.weight")
    if local in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = local.rsplit(".", 1)[1]
        attn = hf + "self_attn."
        return fuse_qkv(
            read(f"{attn}q_proj.{kind}"), read(f"{attn}k_proj.{kind}"), read(f"{attn}v_proj.{kind}"),
            arch, rank, size,
        )  # fmt: skip
    if local == "self_attention.linear_proj.weight":
        return _row_block(read(hf + "self_attn.o_proj.weight"), rank, size, dim=1)
    if local == "mlp.linear_fc1.weight":
        gate = _row_block(read(hf + "mlp.gate_proj.weight"), rank, size)
        up = _row_block(read(hf + "mlp.up_proj.weight"), rank, size)
        return torch.cat([gate, up])
    if local == "mlp.linear_fc2.weight":
        return _row_block(read(hf + "mlp.down_proj.weight"), rank, size, dim=1)
    raise WeightMappingError(f"no HuggingFace source for Megatron parameter {name!r}")


def _tensor_parallel() -> tuple[int, int, dist.ProcessGroup | None]:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1, None
    group = parallel_state.get_tensor_model_parallel_group()
    assert isinstance(group, dist.ProcessGroup), "this rank is not in a tensor-parallel group"
    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
        group,
    )


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, read: TensorReader, arch: Architecture) -> None:
    """Copy HuggingFace weights (by name, through `read`) into this rank's shard of a Megatron GPT model.

    A parameter whose mapped shape differs raises `WeightMappingError` naming the parameter and both shapes;
    parameters are copied one at a time, so read the checkpoint's config with `Architecture` first.
    """
    rank, size, _ = _tensor_parallel()
    for name, parameter in model.named_parameters():
        value = megatron_shard(_strip_wrappers(name), read, arch, rank, size)
        if value.shape != parameter.shape:
            raise WeightMappingError(
                f"{name}: HuggingFace weights give shape {tuple(value.shape)}, the model has "
                f"{tuple(parameter.shape)} (tensor-parallel rank {rank} of {size})"
            )
        parameter.copy_(value)


def _strip_wrappers(name: str) -> str:
    # DistributedDataParallel and Float16Module wrap the model in `module.`; the mapping names the GPT model.
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


# ------------------------------------------------------------------------------------- Megatron -> HF


def _gather(shard: torch.Tensor, dim: int, size: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    if size == 1:
        return shard.detach()
    pieces = [torch.empty_like(shard) for _ in range(size)]
    dist.all_gather(pieces, shard.detach().contiguous(), group=group)
    return torch.cat(pieces, dim=dim)


def hf_tensors(name: str, shard: torch.Tensor, arch: Architecture) -> NamedTensors:
    """The HuggingFace tensors held by Megatron parameter `name`, gathered over the tensor-parallel group.

    Collective: every rank of the group must call it with the same `name`, in the same order.
    """
    _, size, group = _tensor_parallel()
    if name == "embedding.word_embeddings.weight":
        return [("model.embed_tokens.weight", _gather(shard, 0, size, group)[: arch.vocab_size])]
    if name == "output_layer.weight":
        return [("lm_head.weight", _gather(shard, 0, size, group)[: arch.vocab_size])]
    if name == "decoder.final_layernorm.weight":
        return [("model.norm.weight", shard.detach())]
    match = _LAYER.match(name)
    if match is None:
        raise WeightMappingError(f"no HuggingFace name for Megatron parameter {name!r}")
    hf = f"model.layers.{match.group(1)}."
    local = match.group(2)
    if local in ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"):
        return [(hf + "input_layernorm.weight", shard.detach())]
    if local in ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"):
        return [(hf + "post_attention_layernorm.weight", shard.detach())]
    if local in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = local.rsplit(".", 1)[1]
        q, k, v = split_qkv(_gather(shard, 0, size, group), arch)
        attn = hf + "self_attn."
        return [(f"{attn}q_proj.{kind}", q), (f"{attn}k_proj.{kind}", k), (f"{attn}v_proj.{kind}", v)]
    if local == "self_attention.linear_proj.weight":
        return [(hf + "self_attn.o_proj.weight", _gather(shard, 1, size, group))]
    if local == "mlp.linear_fc1.weight":
        # Each rank holds [gate block; up block]: regroup the gathered blocks into the full gate and up.
        full = _gather(shard, 0, size, group).reshape(size, 2, -1, shard.shape[1])
        gate = full[:, 0].reshape(-1, shard.shape[1])
        up = full[:, 1].reshape(-1, shard.shape[1])
        return [(hf + "mlp.gate_proj.weight", gate), (hf + "mlp.up_proj.weight", up)]
    if local == "mlp.linear_fc2.weight":
        return [(hf + "mlp.down_proj.weight", _gather(shard, 1, size, group))]
    raise WeightMappingError(f"no HuggingFace name for Megatron parameter {name!r}")


def export_hf_weights(
    model: torch.nn.Module, arch: Architecture, bucket_bytes: int, dtype: torch.dtype | None = None
) -> Iterator[NamedTensors]:
    """The model's weights under HuggingFace names, in buckets of at most about `bucket_bytes` each.

    A bucket closes before the tensor that would push it past `bucket_bytes` (a single larger tensor gets a
    bucket of its own). Tensors are in the model's dtype unless `dtype` is given; with tensor parallelism 1
    and no conversion they share memory with the parameters, so copy them before the next optimizer step.
    Collective over the tensor-parallel group (see the module docstring).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: NamedTensors = []
    filled = 0
    for name, parameter in model.named_parameters():
        for hf_name, tensor in hf_tensors(_strip_wrappers(name), parameter, arch):
            value = tensor if dtype is None else tensor.to(dtype)
            num_bytes = value.numel() * value.element_size()
            if bucket and filled + num_bytes > bucket_bytes:
                yield bucket
                bucket, filled = [], 0
            bucket.append((hf_name, value))
            filled += num_bytes
    if bucket:
        yield bucket
