"""The weight routes of the built-in engine: tensor, disk and distributed updates, the process group, the
version relabel and the update session. Every update decodes or receives its tensors first, then takes the
gate's writer side (unless a pause or a session already excludes generation), loads and relabels.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import torch
from aiohttp import web

from asyncrl_engine._http import json_model, read_model, semantic_error, update_failure
from asyncrl_engine.engine import Engine
from asyncrl_engine.gate import AdmissionGate
from asyncrl_engine.model_config import ModelLoadError
from asyncrl_engine.request import EngineBusyError
from asyncrl_sglang.process_group import join_weight_update_group
from asyncrl_sglang.tensor_codec import decode_tensors
from asyncrl_sglang.wire import (
    BeginWeightUpdateRequest,
    DestroyWeightsUpdateGroupRequest,
    EndWeightUpdateRequest,
    GetWeightsByNameRequest,
    InitWeightsUpdateGroupRequest,
    UpdateResult,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightVersionRequest,
    WeightUpdateOptions,
    WireError,
)

SAFETENSORS_FORMAT = "safetensors"
MAX_WEIGHT_VERSION_CHARS = 256
"""The longest weight version a route takes (`new_version`, `weight_version`): the version is echoed in every
later response's `meta_info`, so an unbounded one would grow them all. SGLang sets no bound."""
GROUP_TIMEOUT_S = 120.0
_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}

logger = logging.getLogger(__name__)


class WeightRoutes:
    """Weight updates of one engine; `gate` is shared with generation and the pause routes."""

    def __init__(self, engine: Engine, gate: AdmissionGate) -> None:
        self.engine = engine
        self.gate = gate
        self._group_name: str | None = None
        self._group: Any = None
        self._group_device = torch.device("cpu")

    async def _engine(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self.engine.call_async(fn))

    async def _apply_update(
        self, body: WeightUpdateOptions, tensors_fn: Callable[[], Awaitable[list[tuple[str, torch.Tensor]]]]
    ) -> UpdateResult:
        """The common path of weight updates: locking, abort, validation, load, version, flush.

        `tensors_fn` produces the tensors (decoding or receiving); it runs before anything changes.
        """
        flush, version = body.flush_cache, body.weight_version
        try:
            tensors = await tensors_fn()
        except (ValueError, ModelLoadError, RuntimeError) as error:
            return UpdateResult(success=False, message=f"Failed to update weights: {error}")
        # After the tensors: a distributed update receives every broadcast whatever its fields.
        refusal = version_refusal("weight_version", version)
        if refusal is not None:
            return UpdateResult(
                success=False, message=f"Failed to update weights: {refusal}. Nothing was loaded."
            )
        if body.abort_all_requests:
            await self._engine(self.engine.abort_all)
        async with self.gate.update():

            def load() -> None:
                if flush and not self.engine.is_idle():
                    raise EngineBusyError(
                        f"flush_cache=true needs an idle engine, but {self.engine.num_running} running and "
                        f"{self.engine.num_waiting} waiting requests are held by the pause; send "
                        "flush_cache=false with retract and in_place pauses. Nothing was loaded."
                    )
                self.engine.load_weights(tensors, version)
                if flush:
                    self.engine.flush_cache()

            try:
                await self._engine(load)
            except (ModelLoadError, EngineBusyError) as error:
                return UpdateResult(success=False, message=f"Failed to update weights: {error}")
        message = f"Succeeded to update model weights ({len(tensors)} tensors)."
        if version is not None:
            message += f" Weight version updated to {version}."
        return UpdateResult(success=True, message=message)

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        body = await read_model(request, UpdateWeightsFromTensorRequest, required=True, bounded=False)
        if body.load_format != SAFETENSORS_FORMAT:
            return update_failure(
                f"load_format {body.load_format!r} is not accepted: the built-in engine takes only "
                f'"{SAFETENSORS_FORMAT}" (each payload the base64 of a safetensors file; never a pickle)'
            )
        payloads = body.serialized_named_tensors

        async def decode() -> list[tuple[str, torch.Tensor]]:
            if len(payloads) != 1:
                raise ValueError(f"expected one payload (tensor parallel size 1), got {len(payloads)}")
            return await asyncio.to_thread(decode_tensors, payloads[0])

        return _result(await self._apply_update(body, decode))

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await read_model(request, UpdateWeightsFromDiskRequest, required=True)

        async def read() -> list[tuple[str, torch.Tensor]]:
            return await asyncio.to_thread(_read_safetensors_folder, body.model_path)

        result = await self._apply_update(body, read)
        return _result(result.model_copy(update={"num_paused_requests": 0}))

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        body = await read_model(request, InitWeightsUpdateGroupRequest, required=True)
        address, port, rank_offset = body.master_address, body.master_port, body.rank_offset
        world_size, group_name, backend = body.world_size, body.group_name, body.backend
        if self._group_name is not None:
            return update_failure(
                f"a weight update group ({self._group_name!r}) already exists; destroy it first"
            )
        if backend == "nccl" and self.engine.model.device.type != "cuda":
            return update_failure("backend nccl needs a CUDA engine; a CPU engine joins with backend gloo")
        if not 0 < rank_offset < world_size:
            return update_failure(f"rank_offset {rank_offset} must be in [1, world_size={world_size})")

        def join() -> Any:
            return join_weight_update_group(
                master_address=address,
                master_port=port,
                world_size=world_size,
                rank=rank_offset,
                group_name=group_name,
                backend=backend,
                timeout_s=GROUP_TIMEOUT_S,
            )

        try:
            group = await asyncio.to_thread(join)
        except Exception as error:
            return update_failure(f"Failed to init the weight update group: {error}")
        logger.info(
            "joined the weight update group %r at %s:%d as rank %d of %d (%s)",
            group_name,
            address,
            port,
            rank_offset,
            world_size,
            backend,
        )
        self._group = group
        self._group_name = group_name
        self._group_device = self.engine.model.device if backend == "nccl" else torch.device("cpu")
        return _result(UpdateResult(success=True, message="Succeeded to initialize custom process group."))

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        body = await read_model(request, UpdateWeightsFromDistributedRequest, required=True)
        names, dtypes, shapes, group_name = body.names, body.dtypes, body.shapes, body.group_name
        if not (len(names) == len(dtypes) == len(shapes)):
            raise WireError(
                f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})"
            )
        if body.load_format is not None:
            return update_failure("load_format: only null (one broadcast per tensor) is accepted")
        if self._group_name is None or group_name != self._group_name:
            return update_failure(
                f"no weight update group named {group_name!r}; call /init_weights_update_group"
            )
        specs: list[tuple[str, torch.dtype, list[int]]] = []
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            torch_dtype = _TORCH_DTYPES.get(dtype.removeprefix("torch."))
            if torch_dtype is None:
                raise WireError(f"dtypes: {dtype!r} of {name!r} is not one of {', '.join(_TORCH_DTYPES)}")
            specs.append((name, torch_dtype, shape))
        device = self._group_device
        group = self._group

        async def receive() -> list[tuple[str, torch.Tensor]]:
            def run() -> list[tuple[str, torch.Tensor]]:
                import torch.distributed as dist

                options = dist.BroadcastOptions()
                options.rootRank = 0
                received: list[tuple[str, torch.Tensor]] = []
                for name, dtype, shape in specs:
                    tensor = torch.empty(shape, dtype=dtype, device=device)
                    group.broadcast([tensor], options).wait(timedelta(seconds=GROUP_TIMEOUT_S))
                    received.append((name, tensor))
                return received

            # Receive everything first even if a name is wrong, so the trainer's broadcasts never hang.
            return await asyncio.to_thread(run)

        return _result(await self._apply_update(body, receive))

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        group_name = (await read_model(request, DestroyWeightsUpdateGroupRequest, required=False)).group_name
        if self._group_name is None or group_name != self._group_name:
            return update_failure(f"no weight update group named {group_name!r}")

        group = self._group

        def leave() -> None:
            import torch.distributed as dist

            dist.destroy_process_group(group)

        self._group_name = None
        self._group = None
        await asyncio.to_thread(leave)
        return _result(UpdateResult(success=True, message="Succeeded to destroy custom process group."))

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await read_model(request, UpdateWeightVersionRequest, required=True)
        version = body.new_version
        refusal = version_refusal("new_version", version)
        if refusal is not None:
            return update_failure(refusal)
        if body.abort_all_requests:
            await self._engine(self.engine.abort_all)
        await self._engine(lambda: self.engine.set_weight_version(version))
        return _result(
            UpdateResult(success=True, message=f"Weight version updated to {version}", new_version=version)
        )

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        """SGLang's verification route: the parameter's first `truncate_size` rows (or values) as float32
        lists, read between scheduler steps so an update is never seen half-applied."""
        body = await read_model(request, GetWeightsByNameRequest, required=True)
        name, truncate_size = body.name, body.truncate_size

        def read() -> list[Any] | None:
            view = self.engine.model.named.get(name)
            return None if view is None else view[:truncate_size].to(torch.float32).cpu().tolist()

        values = await self._engine(read)
        if values is None:
            return semantic_error(f"Get parameter by name failed: the model has no parameter {name!r}")
        return web.json_response(values)

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        """Open an update session: outside a pause it holds the writer side until `/end_weight_update`, so
        the buckets of one update are never sampled from half-applied."""
        selector = (await read_model(request, BeginWeightUpdateRequest, required=False)).selector
        if selector == "draft":
            return update_failure(f"selector {selector!r}: the built-in engine has no draft model")
        if not await self.gate.open_session():
            return _result(UpdateResult(success=True, message="A weight update session is already open."))
        return _result(UpdateResult(success=True, message="Weight update session opened."))

    async def end_weight_update(self, request: web.Request) -> web.Response:
        await read_model(request, EndWeightUpdateRequest, required=False)
        if not await self.gate.close_session():
            return _result(UpdateResult(success=True, message="No weight update session was open."))
        return _result(UpdateResult(success=True, message="Weight update session closed."))


def _result(result: UpdateResult) -> web.Response:
    return json_model(result, status=200 if result.success else 400)


def _read_safetensors_folder(path: str) -> list[tuple[str, torch.Tensor]]:
    from pathlib import Path

    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors file in {path}")
    tensors: list[tuple[str, torch.Tensor]] = []
    for file in files:
        tensors.extend(load_file(str(file)).items())
    return tensors


def version_refusal(field: str, version: str | None) -> str | None:
    """Why a weight version given in `field` is refused (longer than `MAX_WEIGHT_VERSION_CHARS`), or None."""
    if version is not None and len(version) > MAX_WEIGHT_VERSION_CHARS:
        return (
            f"{field} has {len(version)} characters, more than the {MAX_WEIGHT_VERSION_CHARS} the built-in "
            "engine takes"
        )
    return None
