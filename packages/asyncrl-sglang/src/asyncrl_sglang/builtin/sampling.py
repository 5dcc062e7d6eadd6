"""Sampling parameters (SGLang's `sampling_params`, validated) and batched sampling with exact logprobs.

Logprobs are those of the distribution the token is drawn from *before* top-k / top-p / min-p truncation:
`log_softmax(logits / temperature)`, and `log_softmax(logits)` for greedy requests (temperature < 1e-6).
This is SGLang's default (its sampler takes the log of the temperature-scaled probabilities; the raw
distribution needs its `RETURN_ORIGINAL_LOGPROB` switch). A trainer that recomputes logprobs divides its
logits by the same temperature.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

GREEDY_TEMPERATURE = 1e-6
DEFAULT_MAX_NEW_TOKENS = 128


class RequestError(ValueError):
    """A request the engine refuses. `schema`: a type error of the body (SGLang's ErrorResponse envelope)
    rather than a bad value (the `{"error": {...}}` envelope)."""

    def __init__(self, message: str, *, schema: bool = False) -> None:
        super().__init__(message)
        self.schema = schema


# Keys SGLang accepts whose default is all the built-in engine offers: a non-default value is refused.
_UNSUPPORTED_UNLESS_DEFAULT: dict[str, object] = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "stop_regex": None,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "custom_params": None,
    "logit_bias": None,
    "beam_width": None,
}
_ACCEPTED_AND_IGNORED = ("spaces_between_special_tokens",)
_KNOWN_KEYS = frozenset(
    {
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "min_new_tokens",
        "n",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "skip_special_tokens",
        "no_stop_trim",
        "stream_interval",
        "sampling_seed",
        *_UNSUPPORTED_UNLESS_DEFAULT,
        *_ACCEPTED_AND_IGNORED,
    }
)


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """Validated sampling parameters of one request."""

    max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS
    """None: until the context length."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1: the whole vocabulary."""
    min_p: float = 0.0
    min_new_tokens: int = 0
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    stream_interval: int = 1
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def logprob_temperature(self) -> float:
        """The temperature of the distribution logprobs are reported under (1 for temperature ~ 0)."""
        return 1.0 if self.temperature < GREEDY_TEMPERATURE else self.temperature

    @property
    def needs_truncation(self) -> bool:
        return self.top_k > 1 or self.top_p < 1.0 or self.min_p > 0.0

    @classmethod
    def from_json(cls, raw: object, vocab_size: int) -> SamplingOptions:
        """Validate a `sampling_params` object. Unknown keys and wrong types: schema errors; bad values:
        `RequestError` with the offending key."""
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise RequestError(f"sampling_params must be an object, got {type(raw).__name__}", schema=True)
        params: Mapping[str, object] = raw  # pyright: ignore[reportUnknownVariableType]
        unknown = sorted(set(params) - _KNOWN_KEYS)
        if unknown:
            raise RequestError(f"sampling_params: unknown field(s) {', '.join(unknown)}", schema=True)
        for key, default in _UNSUPPORTED_UNLESS_DEFAULT.items():
            if key in params and params[key] is not None and params[key] != default:
                raise RequestError(f"sampling_params.{key} is not supported by the built-in engine")
        max_new_tokens = (
            _get_int(params, "max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
            if params.get("max_new_tokens", 0) is not None
            else None
        )
        options = cls(
            max_new_tokens=max_new_tokens,
            temperature=_get_float(params, "temperature", 1.0),
            top_p=_get_float(params, "top_p", 1.0),
            top_k=_get_int(params, "top_k", -1),
            min_p=_get_float(params, "min_p", 0.0),
            min_new_tokens=_get_int(params, "min_new_tokens", 0),
            n=_get_int(params, "n", 1),
            stop=_get_stop(params),
            stop_token_ids=frozenset(_get_int_list(params, "stop_token_ids")),
            ignore_eos=_get_bool(params, "ignore_eos", False),
            skip_special_tokens=_get_bool(params, "skip_special_tokens", True),
            no_stop_trim=_get_bool(params, "no_stop_trim", False),
            stream_interval=_get_int(params, "stream_interval", 1),
            sampling_seed=_get_int(params, "sampling_seed", None),
        )
        options.check_values(vocab_size)
        return options

    def check_values(self, vocab_size: int) -> None:
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            raise RequestError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 1 and self.top_k != -1:
            raise RequestError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.min_new_tokens < 0 or (
            self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens
        ):
            raise RequestError(f"min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens}")
        if self.n < 1:
            raise RequestError(f"n must be >= 1, got {self.n}")
        if self.stream_interval < 1:
            raise RequestError(f"stream_interval must be >= 1, got {self.stream_interval}")
        bad = sorted(t for t in self.stop_token_ids if not 0 <= t < vocab_size)
        if bad:
            raise RequestError(f"stop_token_ids {bad} are outside the vocabulary (size {vocab_size})")
        if any(not s for s in self.stop):
            raise RequestError("stop strings must not be empty")


def _type_error(key: str, expected: str, value: object) -> RequestError:
    return RequestError(f"sampling_params.{key}: expected {expected}, got {value!r}", schema=True)


def _get_int(params: Mapping[str, object], key: str, default: int | None) -> Any:
    value = params.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error(key, "an integer", value)
    return value


def _get_float(params: Mapping[str, object], key: str, default: float) -> float:
    value = params.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _type_error(key, "a number", value)
    result = float(value)
    if result != result or result in (float("inf"), float("-inf")):
        raise _type_error(key, "a finite number", value)
    return result


def _get_bool(params: Mapping[str, object], key: str, default: bool) -> bool:
    value = params.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _type_error(key, "a boolean", value)
    return value


def _get_int_list(params: Mapping[str, object], key: str) -> list[int]:
    value = params.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):  # pyright: ignore[reportUnknownVariableType]
        raise _type_error(key, "a list of integers", value)
    return [int(v) for v in value]  # pyright: ignore[reportUnknownVariableType, reportUnknownArgumentType]


def _get_stop(params: Mapping[str, object]) -> tuple[str, ...]:
    value = params.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):  # pyright: ignore[reportUnknownVariableType]
        return tuple(str(v) for v in value)  # pyright: ignore[reportUnknownVariableType]
    raise _type_error("stop", "a string or a list of strings", value)


class SamplingState(Protocol):
    """What `sample_tokens` reads of a request."""

    options: SamplingOptions
    output_ids: list[int]
    top_logprobs_num: int
    generator: torch.Generator | None


SampledToken = tuple[int, float, list[tuple[float, int]]]
"""(token id, its logprob, the top `top_logprobs_num` (logprob, id) pairs)."""


def sample_tokens(
    requests: Sequence[SamplingState],
    logits: Tensor,
    generator: torch.Generator,
    eos_token_ids: frozenset[int],
) -> list[SampledToken]:
    """Draw one token per row of logits [B, vocab] (float32) under each request's options.

    Sampling uses the exponential-race form (argmax of p / E, E ~ Exp(1)), which draws from p exactly; the
    noise of a request with `sampling_seed` comes from its own generator, so its tokens do not depend on the
    batch it runs in. Greedy rows take the argmax.
    """
    vocab = logits.shape[1]
    device = logits.device
    # min_new_tokens: EOS and stop ids cannot be drawn before the minimum.
    for row, request in enumerate(requests):
        options = request.options
        if len(request.output_ids) < options.min_new_tokens:
            banned = list(options.stop_token_ids | (frozenset() if options.ignore_eos else eos_token_ids))
            if banned:
                logits[row, banned] = float("-inf")
    temperatures = torch.tensor(
        [r.options.logprob_temperature for r in requests], device=device, dtype=torch.float32
    )
    logprobs = torch.log_softmax(logits / temperatures.unsqueeze(1), dim=-1)
    tokens = logprobs.argmax(dim=-1)
    sampled_rows = [row for row, r in enumerate(requests) if not r.options.greedy]
    if sampled_rows:
        rows = torch.tensor(sampled_rows, device=device)
        probs = logprobs[rows].exp()
        truncating = [requests[row].options for row in sampled_rows]
        if any(o.needs_truncation for o in truncating):
            probs = _truncate(probs, truncating)
        noise = torch.empty_like(probs)
        shared = [i for i, row in enumerate(sampled_rows) if requests[row].generator is None]
        if shared:
            noise[shared] = torch.empty((len(shared), vocab), device=device).exponential_(generator=generator)
        for i, row in enumerate(sampled_rows):
            own = requests[row].generator
            if own is not None:
                noise[i].exponential_(generator=own)
        tokens[rows] = (probs / noise).argmax(dim=-1)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    top_num = max(r.top_logprobs_num for r in requests)
    top_values: list[list[float]] = []
    top_ids: list[list[int]] = []
    if top_num > 0:
        values, ids = logprobs.topk(top_num, dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    result: list[SampledToken] = []
    for row, (token, logprob) in enumerate(zip(tokens.tolist(), chosen.tolist(), strict=True)):
        count = requests[row].top_logprobs_num
        top = list(zip(top_values[row][:count], top_ids[row][:count], strict=True)) if count > 0 else []
        result.append((int(token), float(logprob), top))
    return result


def _truncate(probs: Tensor, options: Sequence[SamplingOptions]) -> Tensor:
    """Zero the probabilities outside each row's top-k, top-p nucleus and min-p floor; probs [B, vocab]."""
    device = probs.device
    top_k = torch.tensor([o.top_k if o.top_k > 0 else probs.shape[1] for o in options], device=device)
    top_p = torch.tensor([o.top_p for o in options], device=device, dtype=probs.dtype)
    min_p = torch.tensor([o.min_p for o in options], device=device, dtype=probs.dtype)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[1], device=device).unsqueeze(0)
    # A token is dropped when the mass strictly before it already reaches top_p (the first always stays).
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = (ranks >= top_k.unsqueeze(1)) | (mass_before >= top_p.unsqueeze(1))
    drop |= sorted_probs < (min_p * sorted_probs[:, :1].squeeze(1)).unsqueeze(1)
    drop[:, 0] = False
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)
