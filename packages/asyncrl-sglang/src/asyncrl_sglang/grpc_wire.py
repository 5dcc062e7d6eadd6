"""The gRPC wire format of generation, shared by the client (`asyncrl_sglang.grpc_client`) and the built-in
engine's service (`asyncrl_engine.grpc_service`).

The messages are SGLang's `SglangScheduler` service as published in `smg-grpc-proto` (never regenerated
here). What this module adds is the part both sides must agree on beyond the `.proto`:

- `sampling_message` / `sampling_fields`: proto3 has no presence for most sampling fields. As SGLang 0.5.23's
  servicer (`smg-grpc-servicer` 0.14.1, `_convert_sampling_params`) reads them, the zeros that can never be
  meant are unset: `top_p` 0 is 1.0, `top_k` 0 is -1 (every token), `repetition_penalty` 0 is 1.0, and `n` 0
  is 1 (its request manager samples once for n <= 1); every other zero is literal (`temperature` 0 is greedy,
  `min_p` 0 is off, `min_new_tokens` 0). The client still writes every value whose SGLang default is not zero
  (temperature, top_p, top_k, repetition_penalty, n, skip_special_tokens); the service reads the message into
  the same `sampling_params` object `/generate` takes, so one validation serves both transports.
- The trailing metadata of `Generate`. The service has no weight-version field; the built-in engine sends,
  after the last `GenerateComplete`, `asyncrl-weight-versions` (per completion index, the request's
  half-open spans over output positions, `[[{"version": "3", "start": 0, "end": 12}, ...], ...]`, the
  shape of `/generate`'s `meta_info.weight_versions`) and `asyncrl-num-retractions` (per index, an int).
  A server that does not send them is handled by the client (it derives spans from its own syncs).
- The API key travels in call metadata as `authorization: Bearer KEY`, as on HTTP.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TypeVar

from pydantic import StrictInt, TypeAdapter, ValidationError
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from asyncrl_core.errors import GenerationError
from asyncrl_core.types import FinishReason, SamplingParams
from asyncrl_sglang.wire import WeightVersionSpan, describe

T = TypeVar("T")

WEIGHT_VERSIONS_KEY = "asyncrl-weight-versions"
"""Trailing-metadata key of the per-token version spans (JSON, one list of spans per completion index)."""
NUM_RETRACTIONS_KEY = "asyncrl-num-retractions"
"""Trailing-metadata key of the retraction counts (JSON, one int per completion index)."""
AUTHORIZATION_KEY = "authorization"
"""Call-metadata key of the API key (`Bearer KEY`)."""
FINISH_REASONS: Mapping[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}
"""`GenerateComplete.finish_reason` values, each as asyncrl's `FinishReason`."""

Span = tuple[str, int, int]
"""(version label, start, end): a half-open range of output positions generated under one version."""

MetadataItems = Iterable[tuple[str, str | bytes]]


def authorization(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying `api_key` (nothing when there is no key)."""
    return ((AUTHORIZATION_KEY, f"Bearer {api_key}"),) if api_key else ()


def sampling_message(sampling: SamplingParams) -> pb.SamplingParams:
    """The proto `SamplingParams` of `sampling`, every non-zero SGLang default written out. `GenerationError`
    for a `top_p` or `top_k` of 0, which the server would read as unset (`sampling_fields`), not refuse."""
    for name, value in (("top_p", sampling.top_p), ("top_k", sampling.top_k)):
        if value == 0:
            raise GenerationError(
                f"{name} 0 cannot be sent over gRPC: SGLang's servicer reads a proto3 zero as unset "
                f"({'1.0' if name == 'top_p' else '-1, every token'}); "
                "top_p must be in (0, 1], top_k >= 1 or -1"
            )
    message = pb.SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        repetition_penalty=1.0,
        max_new_tokens=sampling.max_new_tokens,
        stop=list(sampling.stop),
        stop_token_ids=list(sampling.stop_token_ids),
        skip_special_tokens=True,
        spaces_between_special_tokens=True,
        n=1,
        ignore_eos=sampling.ignore_eos,
        no_stop_trim=sampling.no_stop_trim,
    )
    return message


def sampling_fields(message: pb.SamplingParams) -> dict[str, object]:
    """The `/generate` `sampling_params` object a proto `SamplingParams` means, as SGLang's servicer reads it:
    values literally, except the zeros no client can mean (`top_p`, `top_k`, `repetition_penalty`, `n`: unset,
    so their neutral value), and the optional fields, absent when not set (`max_new_tokens` absent: no limit
    but the context)."""
    fields: dict[str, object] = {
        "temperature": message.temperature,
        "top_p": message.top_p or 1.0,
        "top_k": message.top_k or -1,
        "min_p": message.min_p,
        "frequency_penalty": message.frequency_penalty,
        "presence_penalty": message.presence_penalty,
        "repetition_penalty": message.repetition_penalty or 1.0,
        "max_new_tokens": message.max_new_tokens if message.HasField("max_new_tokens") else None,
        "stop": list(message.stop) or None,
        "stop_token_ids": list(message.stop_token_ids) or None,
        "skip_special_tokens": message.skip_special_tokens,
        "spaces_between_special_tokens": message.spaces_between_special_tokens,
        "n": message.n or 1,
        "min_new_tokens": message.min_new_tokens,
        "ignore_eos": message.ignore_eos,
        "no_stop_trim": message.no_stop_trim,
    }
    if message.HasField("stream_interval"):
        fields["stream_interval"] = message.stream_interval
    constraint = message.WhichOneof("constraint")
    if constraint is not None:
        fields["ebnf" if constraint == "ebnf_grammar" else constraint] = getattr(message, constraint)
    if message.logit_bias:
        fields["logit_bias"] = dict(message.logit_bias)
    if message.HasField("custom_params"):
        fields["custom_params"] = {key: value for key, value in message.custom_params.items()}
    return fields


_SPANS = TypeAdapter(list[list[WeightVersionSpan]])
"""`asyncrl-weight-versions`: per completion index, `/generate`'s `meta_info.weight_versions`."""
_RETRACTIONS = TypeAdapter(list[StrictInt])
"""`asyncrl-num-retractions`: per completion index, an int."""


def encode_trailer(
    spans: Sequence[Sequence[Span]], num_retractions: Sequence[int]
) -> tuple[tuple[str, str], ...]:
    """The trailing metadata of one `Generate` call: spans and retractions per completion index."""
    versions = [
        [WeightVersionSpan(version=version, start=start, end=end) for version, start, end in index_spans]
        for index_spans in spans
    ]
    return (
        (WEIGHT_VERSIONS_KEY, _SPANS.dump_json(versions).decode()),
        (NUM_RETRACTIONS_KEY, _RETRACTIONS.dump_json(list(num_retractions)).decode()),
    )


class TrailerError(ValueError):
    """Trailing metadata under asyncrl's keys that does not have their shape."""


def decode_trailer(metadata: MetadataItems | None) -> tuple[list[list[Span]] | None, list[int] | None]:
    """Spans and retraction counts per completion index from trailing metadata; None for a key the server
    did not send. Raises `TrailerError` when a key is present but malformed."""
    values: Mapping[str, str | bytes] = dict(metadata or ())
    spans = _decode(_SPANS, values.get(WEIGHT_VERSIONS_KEY), WEIGHT_VERSIONS_KEY)
    retractions = _decode(_RETRACTIONS, values.get(NUM_RETRACTIONS_KEY), NUM_RETRACTIONS_KEY)
    if spans is None:
        return None, retractions
    return [[(s.version, s.start, s.end) for s in index_spans] for index_spans in spans], retractions


def _decode(adapter: TypeAdapter[T], raw: str | bytes | None, key: str) -> T | None:
    if raw is None:
        return None
    try:
        return adapter.validate_json(raw)
    except ValidationError as error:
        raise TrailerError(f"trailing metadata {key} is malformed: {describe(error)}") from None
