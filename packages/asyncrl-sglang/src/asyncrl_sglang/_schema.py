"""The `/generate` wire format: the request body the client sends and the response it reads back.

Everything here is pure data handling (no I/O), so the tolerance rules of the SGLang contract live in one
place:
- output ids are `output_ids`, or `token_ids` on servers older than about 0.4.4;
- per-token version spans come from `meta_info.weight_versions` when the server sends them, else one span of
  `meta_info.weight_version` covers every token and the generation is marked `versions_verified=False`;
- retractions come from `num_retractions`, else `total_retractions` (early-2026 servers), else 0;
- `prompt_tokens` is absent on abort responses built from the waiting queue: the prompt length is used.

Weight versions are ints in asyncrl (the actor's step count) and travel as their decimal string. A server
label that is not a decimal int (SGLang's launch default `"default"`) is version 0: the weights a server was
started with are the actor's initial weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

from asyncrl_core.errors import GenerationError
from asyncrl_core.types import FinishReason, Generation, SamplingParams, VersionSpan

JsonObject = dict[str, object]

INITIAL_VERSION = 0
"""The asyncrl version of a server label that is not a decimal int (`"default"`, SGLang's launch default)."""


def version_label(version: int) -> str:
    """The string a server stores for asyncrl weight version `version`."""
    return str(version)


def parse_version(label: object) -> int:
    """asyncrl's int version of a server's weight-version label; non-numeric labels are `INITIAL_VERSION`."""
    if isinstance(label, bool):
        return INITIAL_VERSION
    if isinstance(label, int):
        return label
    if isinstance(label, str):
        text = label.strip()
        if text.lstrip("-").isdecimal():
            return int(text)
    return INITIAL_VERSION


def sampling_params_body(sampling: SamplingParams) -> JsonObject:
    """SGLang's `sampling_params` object for `sampling`; keys left at the server default are omitted."""
    body: JsonObject = {
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
    }
    if sampling.stop:
        body["stop"] = list(sampling.stop)
    if sampling.stop_token_ids:
        body["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.ignore_eos:
        body["ignore_eos"] = True
    if sampling.no_stop_trim:
        body["no_stop_trim"] = True
    return body


def generate_body(input_ids: Sequence[int], sampling: SamplingParams, rid: str) -> JsonObject:
    """The `GenerateReqInput` body of one token-in, token-out request with output logprobs."""
    if not input_ids:
        raise GenerationError("cannot generate from an empty prompt: input_ids has no token")
    return {
        "input_ids": [int(token_id) for token_id in input_ids],
        "sampling_params": sampling_params_body(sampling),
        "rid": rid,
        "return_logprob": True,
        "stream": False,
    }


def _object(value: object, what: str) -> Mapping[str, object]:
    if not isinstance(value, dict):
        raise GenerationError(
            f"malformed /generate response: {what} is {type(value).__name__}, not an object"
        )
    return cast(Mapping[str, object], value)


def _int_list(value: object, what: str) -> list[int]:
    if not isinstance(value, list):
        raise GenerationError(f"malformed /generate response: {what} is not a list")
    items = cast(list[object], value)
    if not all(isinstance(item, int) and not isinstance(item, bool) for item in items):
        raise GenerationError(f"malformed /generate response: {what} holds a value that is not an int")
    return cast(list[int], items)


def _finish(meta: Mapping[str, object]) -> tuple[FinishReason, int | str | None]:
    finish = meta.get("finish_reason")
    if finish is None:
        raise GenerationError("malformed /generate response: a final response has finish_reason null")
    finish_object = _object(finish, "meta_info.finish_reason")
    kind = finish_object.get("type")
    if kind not in ("stop", "length", "abort"):
        raise GenerationError(f"malformed /generate response: unknown finish_reason type {kind!r}")
    matched = finish_object.get("matched")
    if isinstance(matched, list):
        # Several stop ids may be reported at once; the first is the one that ended the output.
        matched_ids = cast(list[object], matched)
        matched = matched_ids[0] if matched_ids else None
    if not isinstance(matched, (int, str)) or isinstance(matched, bool):
        matched = None
    return kind, matched


def _logprobs(meta: Mapping[str, object], output_ids: Sequence[int]) -> list[float]:
    triples = meta.get("output_token_logprobs")
    if not isinstance(triples, list):
        raise GenerationError(
            "malformed /generate response: meta_info.output_token_logprobs is missing although "
            "return_logprob was requested"
        )
    triples = cast(list[object], triples)
    if len(triples) != len(output_ids):
        raise GenerationError(
            f"malformed /generate response: {len(triples)} output logprobs for {len(output_ids)} output ids"
        )
    logprobs: list[float] = []
    for position, (triple, token_id) in enumerate(zip(triples, output_ids, strict=True)):
        if not isinstance(triple, list) or len(cast(list[object], triple)) < 2:
            raise GenerationError(
                f"malformed /generate response: output_token_logprobs[{position}] is not a triple"
            )
        logprob, logprob_token_id = cast(list[object], triple)[:2]
        if logprob_token_id != token_id:
            raise GenerationError(
                f"malformed /generate response: output_token_logprobs[{position}] is for token "
                f"{logprob_token_id}, output_ids has {token_id}"
            )
        if not isinstance(logprob, (int, float)) or isinstance(logprob, bool):
            raise GenerationError(f"malformed /generate response: output logprob {position} is {logprob!r}")
        logprobs.append(float(logprob))
    return logprobs


def _spans(meta: Mapping[str, object], num_tokens: int) -> tuple[tuple[VersionSpan, ...], bool]:
    """Version spans over the output tokens, and whether the server reported them per token."""
    reported = meta.get("weight_versions")
    if not isinstance(reported, list) or not reported:
        return (VersionSpan(parse_version(meta.get("weight_version")), 0, num_tokens),), False
    spans: list[VersionSpan] = []
    for index, item in enumerate(cast(list[object], reported)):
        span = _object(item, f"meta_info.weight_versions[{index}]")
        start, end = span.get("start"), span.get("end")
        if not isinstance(start, int) or not isinstance(end, int):
            raise GenerationError(f"malformed /generate response: weight_versions[{index}] lacks start/end")
        spans.append(VersionSpan(parse_version(span.get("version")), start, end))
    expected_start = 0
    for span in spans:
        if span.start != expected_start or span.end < span.start:
            raise GenerationError(
                f"malformed /generate response: weight_versions {reported!r} do not tile the "
                f"{num_tokens} output tokens"
            )
        expected_start = span.end
    if expected_start != num_tokens:
        raise GenerationError(
            f"malformed /generate response: weight_versions end at {expected_start}, "
            f"but there are {num_tokens} output tokens"
        )
    return tuple(spans), True


def _num_retractions(meta: Mapping[str, object]) -> int:
    for key in ("num_retractions", "total_retractions"):
        value = meta.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return 0


def parse_generation(response: object, num_prompt_tokens: int) -> Generation:
    """A `Generation` from the JSON body of a finished, non-streamed, single `/generate` response."""
    body = _object(response, "the response body")
    raw_ids = body.get("output_ids", body.get("token_ids"))
    if raw_ids is None:
        raise GenerationError("malformed /generate response: neither output_ids nor token_ids is present")
    output_ids = _int_list(raw_ids, "output_ids")
    meta = _object(body.get("meta_info"), "meta_info")
    finish_reason, matched = _finish(meta)
    spans, verified = _spans(meta, len(output_ids))
    text = body.get("text")
    prompt_tokens = meta.get("prompt_tokens")
    return Generation(
        output_ids=output_ids,
        logprobs=_logprobs(meta, output_ids),
        text=text if isinstance(text, str) else "",
        finish_reason=finish_reason,
        version_spans=spans,
        versions_verified=verified,
        matched_stop=matched,
        prompt_tokens=prompt_tokens if isinstance(prompt_tokens, int) else num_prompt_tokens,
        num_retractions=_num_retractions(meta),
    )


def error_message(body: object, fallback: str) -> str:
    """The human message of an SGLang error body, whichever envelope it uses (`error.message`, `message`,
    `detail`), else `fallback` (the raw text)."""
    if isinstance(body, dict):
        fields = cast(Mapping[str, object], body)
        error = fields.get("error")
        if isinstance(error, dict):
            message = cast(Mapping[str, object], error).get("message")
            if isinstance(message, str):
                return message
        for key in ("message", "detail"):
            value = fields.get(key)
            if isinstance(value, str):
                return value
    return fallback
