"""From the `/generate` wire format (`asyncrl_sglang.wire`) to asyncrl's types, and back.

The tolerance rules of the SGLang contract that are about meaning rather than shape live here:
- per-token version spans come from `meta_info.weight_versions` when the server sends them, else one span of
  `meta_info.weight_version` covers every token and the generation is marked `versions_verified=False`;
- retractions are `num_retractions` (or `total_retractions`, early-2026 servers), else 0;
- `prompt_tokens` is absent on abort responses built from the waiting queue: the prompt length is used;
- an abort whose finish reason carries a status (SGLang's `FINISH_ABORT` with `status_code`: 400 bad input,
  500 an internal error, 503 the engine cannot serve it) is the engine's answer of that status, not an
  output (`AbortStatusError`), wherever it comes: a 200 body or a stream's last event. Only an abort with no
  status (a user's `abort_request`, a pause in abort mode) is a partial output with finish reason `abort`.
(The alternative key spellings themselves are aliases of the wire model.)

Weight versions are ints in asyncrl (the actor's step count) and travel as their decimal string. A server
label that is not a decimal int (SGLang's launch default `"default"`) is version 0: the weights a server was
started with are the actor's initial weights.
"""

from __future__ import annotations

from collections.abc import Sequence

from asyncrl_core.errors import GenerationError
from asyncrl_core.types import Generation, SamplingParams, VersionSpan
from asyncrl_sglang.wire import (
    GenerateRequest,
    GenerateResponse,
    MetaInfo,
    SamplingParamsBody,
    WireError,
    parse_json,
)

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


def sampling_params_body(sampling: SamplingParams) -> SamplingParamsBody:
    """SGLang's `sampling_params` for `sampling`; keys left at the server default are not sent."""
    fields: dict[str, object] = {
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
    }
    if sampling.stop:
        fields["stop"] = list(sampling.stop)
    if sampling.stop_token_ids:
        fields["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.ignore_eos:
        fields["ignore_eos"] = True
    if sampling.no_stop_trim:
        fields["no_stop_trim"] = True
    return SamplingParamsBody.model_validate(fields)


def generate_body(input_ids: Sequence[int], sampling: SamplingParams, rid: str) -> dict[str, object]:
    """The `GenerateReqInput` JSON of one token-in, token-out request with output logprobs."""
    if not input_ids:
        raise GenerationError("cannot generate from an empty prompt: input_ids has no token")
    request = GenerateRequest(
        input_ids=[int(token_id) for token_id in input_ids],
        sampling_params=sampling_params_body(sampling),
        rid=rid,
        return_logprob=True,
        stream=False,
    )
    return request.model_dump(mode="json", exclude_unset=True)


def _logprobs(meta: MetaInfo, output_ids: Sequence[int]) -> list[float]:
    triples = meta.output_token_logprobs
    if triples is None:
        raise GenerationError(
            "malformed /generate response: meta_info.output_token_logprobs is missing although "
            "return_logprob was requested"
        )
    if len(triples) != len(output_ids):
        raise GenerationError(
            f"malformed /generate response: {len(triples)} output logprobs for {len(output_ids)} output ids"
        )
    logprobs: list[float] = []
    for position, ((logprob, logprob_token_id, _), token_id) in enumerate(
        zip(triples, output_ids, strict=True)
    ):
        if logprob_token_id != token_id:
            raise GenerationError(
                f"malformed /generate response: output_token_logprobs[{position}] is for token "
                f"{logprob_token_id}, output_ids has {token_id}"
            )
        if logprob is None:
            raise GenerationError(f"malformed /generate response: output logprob {position} is null")
        logprobs.append(logprob)
    return logprobs


def _spans(meta: MetaInfo, num_tokens: int) -> tuple[tuple[VersionSpan, ...], bool]:
    """Version spans over the output tokens, and whether the server reported them per token."""
    reported = meta.weight_versions
    if not reported:
        return (VersionSpan(parse_version(meta.weight_version), 0, num_tokens),), False
    spans = tuple(VersionSpan(parse_version(span.version), span.start, span.end) for span in reported)
    if not tiles(spans, num_tokens):
        raise GenerationError(
            f"malformed /generate response: weight_versions {list(spans)!r} do not tile the "
            f"{num_tokens} output tokens"
        )
    return spans, True


def tiles(spans: tuple[VersionSpan, ...], num_tokens: int) -> bool:
    """Whether `spans` cover output positions `0..num_tokens` in order, without gaps or overlaps."""
    expected = 0
    for span in spans:
        if span.start != expected or span.end < span.start:
            return False
        expected = span.end
    return expected == num_tokens


class AbortStatusError(GenerationError):
    """A finished `/generate` result that is no output: the engine aborted the request with an HTTP status
    (`status`, with its `message`). SGLang answers such an abort (`_handle_abort_finish_reason`) with the
    status itself (400 as a refused request, 500 and 503 as an HTTPException), except in a stream, whose last
    event is the abort, status included, under HTTP 200. A caller treats it exactly as an answer of
    `status`: the HTTP client resends a 503 and raises `GenerationError` for the others."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, message)
        self.status = status
        self.message = message

    def __str__(self) -> str:
        return f"the engine aborted the request with status {self.status}: {self.message}"


def parse_generation(response: bytes | str, num_prompt_tokens: int) -> Generation:
    """A `Generation` from the JSON text of a finished, single `/generate` result (a non-streamed body, or
    a stream's last event). `AbortStatusError` when it is an abort carrying a status."""
    try:
        body = parse_json(GenerateResponse, response)
    except WireError as error:
        raise GenerationError(f"malformed /generate response: {error}") from None
    meta = body.meta_info
    finish = meta.finish_reason
    if finish is None:
        raise GenerationError("malformed /generate response: a final response has finish_reason null")
    if finish.type == "abort" and finish.status_code is not None:
        raise AbortStatusError(finish.status_code, finish.message or "aborted")
    matched = finish.matched
    if isinstance(matched, list):
        # Several stop ids may be reported at once; the first is the one that ended the output.
        matched = matched[0] if matched else None
    spans, verified = _spans(meta, len(body.output_ids))
    return Generation(
        output_ids=body.output_ids,
        logprobs=_logprobs(meta, body.output_ids),
        text=body.text or "",
        finish_reason=finish.type,
        version_spans=spans,
        versions_verified=verified,
        matched_stop=matched,
        prompt_tokens=meta.prompt_tokens if meta.prompt_tokens is not None else num_prompt_tokens,
        num_retractions=meta.num_retractions or 0,
    )
