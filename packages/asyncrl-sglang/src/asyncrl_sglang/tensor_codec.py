"""Named tensors as the base64 text of a safetensors file: the payload of `/update_weights_from_tensor`
between asyncrl's client and the built-in engine, in both directions. Plain bytes, never a pickle: nothing is
unpickled from the network.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class TensorCodecError(ValueError):
    """A payload that is not base64 safetensors, or tensors that cannot be written as one."""


def encode_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """One payload holding `named_tensors`, moved to the CPU and made contiguous. Tensors sharing storage
    (tied embeddings) are copied, since a safetensors file cannot alias. A name given twice is an error."""
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    seen_storage: set[int] = set()
    for name, tensor in named_tensors:
        if name in tensors:
            raise TensorCodecError(f"the tensors name {name!r} twice")
        cpu = tensor.detach().to("cpu").contiguous()
        storage = cpu.untyped_storage().data_ptr()
        if storage in seen_storage:
            cpu = cpu.clone()
        seen_storage.add(storage)
        tensors[name] = cpu
    return base64.b64encode(save(tensors)).decode("ascii")


def decode_tensors(payload: str) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of one payload, in file order."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as error:
        raise TensorCodecError(f"a payload is not valid base64: {error}") from None
    try:
        return list(load(raw).items())
    except (SafetensorError, ValueError) as error:
        raise TensorCodecError(f"a payload is not a safetensors file: {error}") from None
