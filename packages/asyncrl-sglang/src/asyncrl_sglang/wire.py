"""SGLang's native HTTP wire format as pydantic models: the one definition the built-in engine's routes and
the client both use (SGLang 0.5.23's field names, defaults and aliases; see `sglang-contract.md`).

Rules, each in one place:
- Request bodies are strict: no silent coercion (a bool is not an int, `"3"` is not 3), NaN and infinities
  are refused. Unknown top-level keys are ignored, as SGLang's request dataclasses ignore them; unknown
  `sampling_params` keys are refused, as SGLang's `SamplingParams` refuses them.
- A body that does not validate is SGLang's `ErrorResponse` (400), built by `schema_error_body`.
- Responses keep SGLang's optional keys optional: a server emits only the keys it sets
  (`model_dump(exclude_unset=True)`), and a client reads whichever of the accepted spellings came
  (`output_ids`/`token_ids`, `num_retractions`/`total_retractions`). Unknown response keys are ignored
  (servers add keys over time); the known ones are strict when read from JSON text.

Nothing here does I/O or imports torch.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, RootModel, ValidationError

PauseMode = Literal["abort", "retract", "in_place"]
"""How `/pause_generation` treats in-flight requests: `abort` returns them partial, `retract` requeues them
(tokens kept, KV recomputed on continue), `in_place` freezes them with their KV cache."""
MemoryTag = Literal["weights", "kv_cache", "cuda_graph"]
DEFAULT_GROUP_NAME = "weight_update_group"
"""The weight-update process group name SGLang uses when none is given."""
DEFAULT_MAX_NEW_TOKENS = 128
DUPLICATE_RID = "Duplicate request ID"
"""The start of the message that refuses a request id already in flight (HTTP 400, gRPC INVALID_ARGUMENT)."""

_REQUEST = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, frozen=True)
_SAMPLING = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, frozen=True)
_RESPONSE = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

ModelT = TypeVar("ModelT", bound=BaseModel)


class WireError(ValueError):
    """A body that does not have the shape of its model; `str()` is one line naming the offending fields."""


def describe(error: ValidationError) -> str:
    """One line naming every field that failed and why (`sampling_params.top_k: ...; rid: ...`)."""
    parts: list[str] = []
    for item in error.errors(include_url=False):
        where = ".".join(str(part) for part in item["loc"]) or "body"
        parts.append(f"{where}: {item['msg']}")
    return "; ".join(parts)


def parse_json(model: type[ModelT], raw: bytes | str) -> ModelT:
    """`model` from JSON text; `WireError` (one line) when it does not validate."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as error:
        raise WireError(describe(error)) from None


def parse_object(model: type[ModelT], value: object) -> ModelT:
    """`model` from an already decoded JSON value; `WireError` when it does not validate."""
    try:
        return model.model_validate(value)
    except ValidationError as error:
        raise WireError(describe(error)) from None


# ================================================================================================ requests
class SamplingParamsBody(BaseModel):
    """`sampling_params` (SGLang's `SamplingParams` constructor arguments)."""

    model_config = _SAMPLING

    max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS
    """Absent: 128; explicit null: until the context length; 0: prefill only."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    custom_params: dict[str, Any] | None = None
    stream_interval: int | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None
    beam_width: int | None = None


InputIds = list[int] | list[list[int]]


class GenerateRequest(BaseModel):
    """`GenerateReqInput`: the fields a text client uses, plus those the built-in engine must refuse by name
    (typed loosely: their presence is what matters)."""

    model_config = _REQUEST

    text: str | list[str] | None = None
    input_ids: InputIds | None = None
    sampling_params: SamplingParamsBody | list[SamplingParamsBody] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    return_prompt_token_ids: bool = False
    return_hidden_states: bool | str | list[bool] = False
    # Accepted by SGLang, refused by the built-in engine when set (see `unsupported_inputs`).
    input_embeds: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    lora_path: Any = None
    session_params: Any = None
    custom_logit_processor: Any = None
    token_ids_logprob: Any = None

    def unsupported_inputs(self) -> list[str]:
        """The multimodal, LoRA, session and custom-processor fields that carry a value."""
        names = (
            "input_embeds",
            "image_data",
            "video_data",
            "audio_data",
            "lora_path",
            "session_params",
            "custom_logit_processor",
            "token_ids_logprob",
        )
        return [name for name in names if getattr(self, name) not in (None, False, [], {})]


class AbortRequest(BaseModel):
    model_config = _REQUEST
    rid: str = ""
    abort_all: bool = False


class PauseRequest(BaseModel):
    model_config = _REQUEST
    mode: PauseMode = "abort"


class ContinueRequest(BaseModel):
    model_config = _REQUEST
    torch_empty_cache: bool = True


class MemoryRequest(BaseModel):
    """`/release_memory_occupation` and `/resume_memory_occupation`; `tags` None means all."""

    model_config = _REQUEST
    tags: list[MemoryTag] | None = None


class WeightUpdateOptions(BaseModel):
    model_config = _REQUEST
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    torch_empty_cache: bool = False


class UpdateWeightsFromTensorRequest(WeightUpdateOptions):
    serialized_named_tensors: list[str]
    load_format: str | None = None
    disable_draft_model: bool | None = None


class UpdateWeightsFromDiskRequest(WeightUpdateOptions):
    model_path: str
    load_format: str | None = None


class InitWeightsUpdateGroupRequest(BaseModel):
    model_config = _REQUEST
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP_NAME
    backend: str = "nccl"


class UpdateWeightsFromDistributedRequest(WeightUpdateOptions):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = DEFAULT_GROUP_NAME
    load_format: str | None = None


class DestroyWeightsUpdateGroupRequest(BaseModel):
    model_config = _REQUEST
    group_name: str = DEFAULT_GROUP_NAME


class UpdateWeightVersionRequest(BaseModel):
    model_config = _REQUEST
    new_version: str
    abort_all_requests: bool = True


class BeginWeightUpdateRequest(BaseModel):
    model_config = _REQUEST
    selector: Literal["target", "draft", "all"] = "all"


class EndWeightUpdateRequest(BaseModel):
    model_config = _REQUEST


class GetWeightsByNameRequest(BaseModel):
    """`/get_weights_by_name` (a debugging and verification route): one parameter by its HuggingFace name,
    answered as a JSON list of its first `truncate_size` entries along the first dimension, in float32."""

    model_config = _REQUEST
    name: str
    truncate_size: int = Field(default=100, ge=1)


WeightsReply = list[float] | list[list[float]]
"""The body of `/get_weights_by_name`: a 1-D parameter's values, or a matrix's rows."""


class WeightsReplyModel(RootModel[WeightsReply]):
    """`WeightsReply` as a model, to read the JSON body strictly."""

    model_config = ConfigDict(strict=True)


# =============================================================================================== responses
LogprobTriple = tuple[float | None, int, str | None]
"""`[logprob, token id, token text or null]`."""


class FinishReason(BaseModel):
    model_config = _RESPONSE
    type: Literal["stop", "length", "abort"]
    matched: int | str | list[int] | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None
    err_type: str | None = None


class WeightVersionSpan(BaseModel):
    """Output tokens `[start, end)` were sampled under weight version `version`."""

    model_config = _RESPONSE
    version: str
    start: int
    end: int


class MetaInfo(BaseModel):
    """`meta_info` of a `/generate` response; keys SGLang leaves out in some cases are optional."""

    model_config = _RESPONSE
    id: str
    finish_reason: FinishReason | None
    prompt_tokens: int | None = None
    """Absent on abort responses of requests that never left the waiting queue."""
    completion_tokens: int | None = None
    reasoning_tokens: int | None = None
    cached_tokens: int | None = None
    weight_version: str | None = None
    weight_versions: list[WeightVersionSpan] | None = None
    num_retractions: int | None = Field(
        default=None, validation_alias=AliasChoices("num_retractions", "total_retractions")
    )
    e2e_latency: float | None = None
    response_sent_to_client_ts: float | None = None
    input_token_logprobs: list[LogprobTriple] | None = None
    output_token_logprobs: list[LogprobTriple] | None = None
    output_token_logprobs_length: int | None = None
    input_top_logprobs: list[list[LogprobTriple] | None] | None = None
    output_top_logprobs: list[list[LogprobTriple] | None] | None = None


class GenerateResponse(BaseModel):
    """One `/generate` result (a batch or `n > 1` answers a JSON list of these). Server-sent events add
    `index` when the request was a list."""

    model_config = _RESPONSE
    text: str | None = None
    """Absent when the server runs without a tokenizer."""
    output_ids: list[int] = Field(validation_alias=AliasChoices("output_ids", "token_ids"))
    prompt_token_ids: list[int] | None = None
    meta_info: MetaInfo
    index: int | None = None


class ErrorDetail(BaseModel):
    model_config = _RESPONSE
    message: str
    type: str | None = None
    code: int | None = None
    retryable: bool | None = None


class ErrorBody(BaseModel):
    """`{"error": {"message": ...}}`: a request the engine refused (bad values, too long, duplicate rid)."""

    model_config = _RESPONSE
    error: ErrorDetail


class ErrorResponse(BaseModel):
    """SGLang's `ErrorResponse`: a body that failed validation (400) or an HTTPException (its status)."""

    model_config = _RESPONSE
    object: Literal["error"] = "error"
    message: str
    type: str
    param: str | None = None
    code: int


class UpdateResult(BaseModel):
    """The answer of weight-update style routes."""

    model_config = _RESPONSE
    success: bool
    message: str
    num_paused_requests: int | None = None
    new_version: str | None = None


class GenerationControlResult(BaseModel):
    """The answer of `/pause_generation` and `/continue_generation`."""

    model_config = _RESPONSE
    message: str
    status: str


class LoadsQuery(BaseModel):
    """The query of `/v1/loads`. Query values are text, so numbers are read from their decimal form."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    dp_rank: int | None = None
    """Only this data-parallel rank (a rank the server does not have: no loads)."""
    include: str | None = None
    """Comma-separated sections: `core`, `memory`, `spec`, `lora`, `disagg`, `queues`, `all` (absent: all)."""
    format: str | None = None
    """`prometheus` for Prometheus text; anything else is JSON, as in SGLang."""


class RankLoad(BaseModel):
    """One data-parallel rank's entry of `/v1/loads`: the keys asyncrl reads (the others are ignored)."""

    model_config = _RESPONSE
    dp_rank: int = 0
    total_prefill_busy_us: float | None = None
    """Microseconds the rank's scheduler has spent in prefill since it started (absent from older servers)."""


class LoadsReply(BaseModel):
    """`/v1/loads` in JSON: one entry per data-parallel rank."""

    model_config = _RESPONSE
    loads: list[RankLoad]


class ModelInfo(BaseModel):
    """`/model_info` (SGLang 0.5.23 writes every one of these keys)."""

    model_config = _RESPONSE
    model_path: str
    served_model_name: str | None = None
    tokenizer_path: str | None = None
    is_generation: bool
    preferred_sampling_params: dict[str, Any] | None = None
    weight_version: str | None = None
    load_format: str | None = None
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    disaggregation_mode: str | None = None
    has_image_understanding: bool | None = None
    has_audio_understanding: bool | None = None
    model_type: str | None = None
    architectures: list[str] | None = None


class WeightVersionReply(BaseModel):
    """`/get_weight_version` on servers older than early 2026."""

    model_config = _RESPONSE
    weight_version: str


class AnyErrorEnvelope(BaseModel):
    """Whichever error envelope a server answered: `error.message`, `message` or `detail`."""

    model_config = _RESPONSE
    error: ErrorDetail | None = None
    message: str | None = None
    detail: str | None = None

    def text(self) -> str | None:
        if self.error is not None:
            return self.error.message
        return self.message if self.message is not None else self.detail


def schema_error_body(message: str, status: int = 400, kind: str = "Bad Request") -> dict[str, object]:
    """The JSON of SGLang's `ErrorResponse`."""
    return ErrorResponse(message=message, type=kind, code=status).model_dump()


def error_message(body: bytes | str, fallback: str) -> str:
    """The human message of the JSON text of an SGLang error body, whichever envelope it uses
    (`error.message`, `message`, `detail`), else `fallback`."""
    try:
        envelope = AnyErrorEnvelope.model_validate_json(body)
    except ValidationError:
        return fallback
    text = envelope.text()
    return text if text is not None else fallback
