"""What every route of the built-in server shares: the JSON body as a wire model, SGLang's error envelopes."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel

from asyncrl_sglang.wire import ErrorBody, ErrorDetail, UpdateResult, WireError, parse_json, schema_error_body

Json = dict[str, Any]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ModelT = TypeVar("ModelT", bound=BaseModel)
PARSE_OFF_LOOP_BYTES = 1 << 20
"""A body larger than this is parsed in a worker thread, so that the event loop keeps answering meanwhile."""


def error_response(message: str, status: int = 400, kind: str = "Bad Request") -> web.Response:
    """SGLang's `ErrorResponse` envelope (schema failures, HTTPExceptions)."""
    return web.json_response(schema_error_body(message, status, kind), status=status)


def semantic_error(message: str, status: int = 400) -> web.Response:
    """A request refused for its values: `{"error": {"message": ...}}`."""
    return json_model(ErrorBody(error=ErrorDetail(message=message)), status=status)


def update_failure(message: str) -> web.Response:
    return json_model(UpdateResult(success=False, message=message), status=400)


def not_found() -> web.Response:
    return web.json_response({"detail": "Not Found"}, status=404)


def json_model(model: BaseModel, status: int = 200) -> web.Response:
    """A response body from a wire model, with only the keys that were set."""
    return web.Response(
        text=model.model_dump_json(exclude_unset=True), status=status, content_type="application/json"
    )


MAX_REQUEST_BODY_BYTES = web.AppKey("max_request_body_bytes", int)
"""The application's bound on a request body (the server's `--max-request-body-bytes`); unset: none."""


async def read_model(
    request: web.Request, model: type[ModelT], *, required: bool, bounded: bool = True
) -> ModelT:
    """The body as `model`. An absent body is `{}` unless `required`. Invalid, or larger than the
    application's `MAX_REQUEST_BODY_BYTES` (unless not `bounded`): `WireError`, which the server's middleware
    answers with SGLang's `ErrorResponse` (400)."""
    limit = request.app.get(MAX_REQUEST_BODY_BYTES) if bounded else None
    raw = await request.read() if limit is None else await read_bounded(request, limit)
    if not raw.strip():
        if required:
            raise WireError("A JSON request body is required.")
        raw = b"{}"
    if len(raw) > PARSE_OFF_LOOP_BYTES:
        return await asyncio.to_thread(parse_json, model, raw)
    return parse_json(model, raw)


async def read_bounded(request: web.Request, limit: int) -> bytes:
    """The body, refused (`WireError`) as soon as it is known to exceed `limit` bytes: from its
    Content-Length before anything is read, else once the chunks read so far exceed it."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise WireError(_too_large(f"{declared} bytes", limit))
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise WireError(_too_large(f"more than {limit} bytes", limit))
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: str, limit: int) -> str:
    return (
        f"The request body has {size}, more than the {limit} bytes the server takes "
        "(its --max-request-body-bytes)"
    )
