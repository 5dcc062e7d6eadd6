"""Sampling parameters of one request (SGLang's `sampling_params`, validated), and the refusals of a request
for its values. Torch-free: the scheduler reads these options to decide when a request ends."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from asyncrl_sglang.wire import DEFAULT_MAX_NEW_TOKENS, SamplingParamsBody

GREEDY_TEMPERATURE = 1e-6


class RequestError(ValueError):
    """A request the engine refuses for its values (the `{"error": {...}}` envelope); shape errors are the
    wire model's (`asyncrl_sglang.wire`)."""


# `sampling_params` keys whose default is all the built-in engine offers: a non-default value is refused.
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


MAX_STOP_STRINGS = 256
"""The most stop strings one request may list (`sampling_params.stop`). SGLang sets no bound; every string is
compiled into the request's stop pattern and searched at each token, so the count is bounded here."""
MAX_STOP_STRING_CHARS = 1024
"""The longest stop string, in characters: the stop-string matcher keeps a window of the output this long."""

NEVER_MATCHES = r"(?!)"
"""A regular expression that matches no text (the stop pattern of options without stop strings)."""


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
    # Derived once (read for every row of every step):
    greedy: bool = field(init=False, repr=False, compare=False)
    """Whether the request takes the argmax (temperature ~ 0, or top-k 1)."""
    logprob_temperature: float = field(init=False, repr=False, compare=False)
    """The temperature of the distribution logprobs are reported under (1 for temperature ~ 0)."""
    needs_truncation: bool = field(init=False, repr=False, compare=False)
    longest_stop: int = field(init=False, repr=False, compare=False)
    """The length of the longest stop string (0: none)."""
    stop_pattern: re.Pattern[str] = field(init=False, repr=False, compare=False)
    """Finds the earliest stop string in a text (the first listed of those starting there): one search of
    the stop-string matcher's window per token, whatever the number of stop strings."""

    def __post_init__(self) -> None:
        derived = {
            "greedy": self.temperature < GREEDY_TEMPERATURE or self.top_k == 1,
            "logprob_temperature": 1.0 if self.temperature < GREEDY_TEMPERATURE else self.temperature,
            "needs_truncation": self.top_k > 1 or self.top_p < 1.0 or self.min_p > 0.0,
            "longest_stop": max(map(len, self.stop), default=0),
            "stop_pattern": re.compile("|".join(map(re.escape, self.stop)) if self.stop else NEVER_MATCHES),
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_wire(cls, params: SamplingParamsBody | None, vocab_size: int) -> SamplingOptions:
        """The options of a validated `sampling_params` (None: all defaults); a value the engine does not
        offer or that is out of range: `RequestError` naming the key."""
        if params is None:
            return cls()
        for key, default in _UNSUPPORTED_UNLESS_DEFAULT.items():
            value = getattr(params, key)
            if value is not None and value != default:
                raise RequestError(f"sampling_params.{key} is not supported by the built-in engine")
        stop = (params.stop,) if isinstance(params.stop, str) else tuple(params.stop or ())
        check_stop(stop)  # before the stop pattern is compiled
        options = cls(
            max_new_tokens=params.max_new_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            min_p=params.min_p,
            min_new_tokens=params.min_new_tokens,
            n=params.n,
            stop=stop,
            stop_token_ids=frozenset(params.stop_token_ids or ()),
            ignore_eos=params.ignore_eos,
            skip_special_tokens=params.skip_special_tokens,
            no_stop_trim=params.no_stop_trim,
            stream_interval=params.stream_interval if params.stream_interval is not None else 1,
            sampling_seed=params.sampling_seed,
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
        check_stop(self.stop)
        if self.sampling_seed is not None and not -(2**63) <= self.sampling_seed < 2**64:
            # torch.Generator.manual_seed takes a 64-bit value; a larger one would fail at admission.
            raise RequestError(f"sampling_seed must be a 64-bit integer, got {self.sampling_seed}")


def check_stop(stop: Sequence[str]) -> None:
    """`RequestError` naming `sampling_params.stop` for more than `MAX_STOP_STRINGS` strings, one longer than
    `MAX_STOP_STRING_CHARS`, or an empty one."""
    if len(stop) > MAX_STOP_STRINGS:
        raise RequestError(
            f"sampling_params.stop holds {len(stop)} strings, more than the {MAX_STOP_STRINGS} the built-in "
            "engine takes"
        )
    if any(not s for s in stop):
        raise RequestError("stop strings must not be empty")
    longest = max(map(len, stop), default=0)
    if longest > MAX_STOP_STRING_CHARS:
        raise RequestError(
            f"sampling_params.stop holds a string of {longest} characters, longer than the "
            f"{MAX_STOP_STRING_CHARS} the built-in engine takes"
        )


def check_fits(prompt: Sequence[int], options: SamplingOptions, context_length: int) -> None:
    """Refuse a request whose prompt plus `max_new_tokens` exceeds the context, with SGLang's message (both
    transports, HTTP and gRPC)."""
    if options.max_new_tokens is None:
        if len(prompt) >= context_length:
            raise RequestError(
                f"The input ({len(prompt)} tokens) is longer than the model's context length "
                f"({context_length} tokens)."
            )
        return
    total = len(prompt) + options.max_new_tokens
    if total > context_length:
        raise RequestError(
            f"Requested token count exceeds the model's maximum context length of {context_length} tokens. "
            f"You requested a total of {total} tokens: {len(prompt)} tokens from the input messages and "
            f"{options.max_new_tokens} tokens for the completion. Please reduce the number of tokens in "
            "the input messages or the completion to fit within the limit."
        )
