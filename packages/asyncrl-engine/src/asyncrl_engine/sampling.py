"""Batched sampling with exact logprobs, under each request's `SamplingOptions` (`options.py`).

Logprobs are those of the distribution the token is drawn from *before* top-k / top-p / min-p truncation:
`log_softmax(logits / temperature)`, and `log_softmax(logits)` for greedy requests (temperature < 1e-6).
This is SGLang's default (its sampler takes the log of the temperature-scaled probabilities; the raw
distribution needs its `RETURN_ORIGINAL_LOGPROB` switch). A trainer that recomputes logprobs divides its
logits by the same temperature.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from asyncrl_engine.options import SamplingOptions


class SamplingState(Protocol):
    """What `sample_tokens` reads of a request."""

    options: SamplingOptions
    output_ids: list[int]
    top_logprobs_num: int
    generator: torch.Generator | None


SampledToken = tuple[int, float, list[tuple[float, int]]]
"""(token id, its logprob, the top `top_logprobs_num` (logprob, id) pairs)."""


@dataclass(frozen=True, slots=True)
class DeviceSample:
    """One step's draws, still where they were computed: `tokens` [B] (the ids, a next decode step's input)
    and `packed` [B, 2 + 2 * top_num] float64 (per row: the id, its logprob, the top logprobs, their ids)."""

    tokens: Tensor
    packed: Tensor
    top_num: int


def sample_tokens(
    requests: Sequence[SamplingState],
    logits: Tensor,
    generator: torch.Generator,
    eos_token_ids: frozenset[int],
) -> list[SampledToken]:
    """Draw one token per row of logits [B, vocab] (float32, modified in place) under each request's options
    and read the draws on the host (`sample_on_device`, then `unpack_samples`: one synchronisation)."""
    sample = sample_on_device(requests, logits, generator, eos_token_ids)
    return unpack_samples(requests, sample.packed, sample.top_num)


@dataclass(slots=True)
class SamplingPlan:
    """What one step's sampling needs of its rows, read in one pass over them (it runs every decode step)."""

    banned_rows: list[int]
    banned_ids: list[int]
    """(row, id) pairs that cannot be drawn: EOS and stop ids before a row's `min_new_tokens`."""
    temperatures: list[float]
    """Each row's `logprob_temperature`."""
    sampled_rows: list[int]
    """The rows that draw (the others take the argmax)."""
    top_num: int
    """The most top logprobs a row asks for."""
    truncating: bool
    """Whether a sampled row truncates (top-k, top-p, min-p)."""
    own_generators: bool
    """Whether a sampled row draws from its own generator (`sampling_seed`)."""

    @classmethod
    def of(
        cls,
        requests: Sequence[SamplingState],
        eos_token_ids: frozenset[int],
        num_outputs: Sequence[int] | None = None,
    ) -> SamplingPlan:
        """`num_outputs[b]`: see `sample_on_device`."""
        plan = cls([], [], [], [], 0, False, False)
        for row, request in enumerate(requests):
            options = request.options
            num_output = len(request.output_ids) if num_outputs is None else num_outputs[row]
            if num_output < options.min_new_tokens:
                banned = options.stop_token_ids | (frozenset() if options.ignore_eos else eos_token_ids)
                plan.banned_rows.extend([row] * len(banned))
                plan.banned_ids.extend(banned)
            plan.temperatures.append(options.logprob_temperature)
            if not options.greedy:
                plan.sampled_rows.append(row)
                plan.truncating = plan.truncating or options.needs_truncation
                plan.own_generators = plan.own_generators or request.generator is not None
            plan.top_num = max(plan.top_num, request.top_logprobs_num)
        return plan

    @property
    def dense(self) -> bool | None:
        """How `sample_dense` can draw this step: False when every row takes the argmax at temperature 1, True
        when every row draws (from the shared generator, untruncated); None when it cannot (bans, top
        logprobs, truncation, own generators, greedy rows beside sampled ones or under another temperature):
        `sample_on_device` then does."""
        if self.banned_rows or self.top_num or self.truncating or self.own_generators:
            return None
        if not self.sampled_rows:
            return None if any(t != 1.0 for t in self.temperatures) else False
        return True if len(self.sampled_rows) == len(self.temperatures) else None


def sample_on_device(
    requests: Sequence[SamplingState],
    logits: Tensor,
    generator: torch.Generator,
    eos_token_ids: frozenset[int],
    num_outputs: Sequence[int] | None = None,
    plan: SamplingPlan | None = None,
) -> DeviceSample:
    """Draw one token per row of logits [B, vocab] (float32, modified in place) under each request's options,
    without waiting for the device: every copy to it is non-blocking and nothing is read back.

    `num_outputs[b]`: the output tokens row b has when this token is drawn (default `len(output_ids)`; more
    when earlier draws are still on the device), which `min_new_tokens` compares with. `plan`: the rows'
    `SamplingPlan`, when the caller has read it.

    Sampling inverts the cumulative distribution: one uniform draw per row, the first token whose cumulative
    probability exceeds it (exact but for the float32 rounding of the cumulative sum, as `torch.multinomial`).
    One draw per row instead of one per vocabulary entry keeps the random-number generation out of the step's
    cost. The draw of a request with `sampling_seed` comes from its own generator, so its tokens do not
    depend on the batch it runs in. Greedy rows take the argmax.
    """
    device = logits.device
    if plan is None:
        plan = SamplingPlan.of(requests, eos_token_ids, num_outputs)
    if plan.banned_rows:
        index = _to_device([plan.banned_rows, plan.banned_ids], torch.long, device)
        logits[index[0], index[1]] = float("-inf")
    if any(t != 1.0 for t in plan.temperatures):
        logits.div_(_to_device(plan.temperatures, torch.float32, device).unsqueeze(1))
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = logprobs.argmax(dim=-1)
    sampled_rows = plan.sampled_rows
    if sampled_rows:
        every_row = len(sampled_rows) == len(requests)
        rows = None if every_row else _to_device(sampled_rows, torch.long, device)
        probs = (logprobs if rows is None else logprobs[rows]).exp()
        if plan.truncating:
            probs = _truncate(probs, [requests[row].options for row in sampled_rows])
        uniforms = _uniforms([requests[row] for row in sampled_rows], generator, device)
        drawn = _draw(probs, uniforms, tokens if rows is None else tokens[rows])
        if rows is None:
            tokens = drawn
        else:
            tokens[rows] = drawn
    return _pack(logprobs, tokens, plan.top_num)


def sample_dense(logits: Tensor, temperatures: Tensor | None, uniforms: Tensor | None) -> DeviceSample:
    """`sample_on_device` for a step whose `SamplingPlan.dense` is not None, from tensors alone (what a CUDA
    graph of the decode step captures): logits [B, vocab] (float32, modified in place) divided by
    `temperatures` [B] (None: all 1), then every row drawn with `uniforms` [B] (the shared generator's draws
    in row order, as `sample_on_device` takes them), or every row's argmax when `uniforms` is None."""
    if temperatures is not None:
        logits.div_(temperatures.unsqueeze(1))
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = logprobs.argmax(dim=-1)
    if uniforms is not None:
        tokens = _draw(logprobs.exp(), uniforms, tokens)
    return _pack(logprobs, tokens, 0)


def _draw(probs: Tensor, uniforms: Tensor, fallback: Tensor) -> Tensor:
    """Each row's token under `uniforms` (`_inverse_cdf`); a draw that rounding put on a token of probability
    0 (past the end, or one truncation removed) takes the row's `fallback` (its most likely token)."""
    drawn = _inverse_cdf(probs, uniforms)
    inside = drawn.clamp(max=probs.shape[1] - 1)
    valid = (drawn < probs.shape[1]) & (probs.gather(1, inside.unsqueeze(1)).squeeze(1) > 0)
    return torch.where(valid, inside, fallback)


def _pack(logprobs: Tensor, tokens: Tensor, top_num: int) -> DeviceSample:
    chosen = logprobs.gather(1, tokens.unsqueeze(1))
    columns = [tokens.unsqueeze(1).double(), chosen.double()]
    if top_num > 0:
        values, ids = logprobs.topk(top_num, dim=-1)
        columns += [values.double(), ids.double()]
    # float64 holds every token id and every float32 value exactly: one tensor, one copy to the host.
    return DeviceSample(tokens=tokens, packed=torch.cat(columns, dim=1), top_num=top_num)


def unpack_samples(requests: Sequence[SamplingState], packed: Tensor, top_num: int) -> list[SampledToken]:
    """The host's reading of a `DeviceSample.packed` (on the host), one `SampledToken` per request."""
    if packed.device.type != "cpu":
        packed = packed.cpu()
    ids = packed[:, 0].long().tolist()
    logprobs = packed[:, 1].tolist()
    if top_num == 0:
        return [(token, logprob, []) for token, logprob in zip(ids, logprobs, strict=True)]
    values = packed[:, 2 : 2 + top_num].tolist()
    top_ids = packed[:, 2 + top_num :].long().tolist()
    result: list[SampledToken] = []
    for request, token, logprob, row_values, row_ids in zip(
        requests, ids, logprobs, values, top_ids, strict=True
    ):
        count = request.top_logprobs_num
        result.append((token, logprob, list(zip(row_values[:count], row_ids[:count], strict=True))))
    return result


def _to_device(values: Sequence[object], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A host list as a tensor on `device`, copied without waiting for the device's queued work (a
    blocking copy to a CUDA device would wait for it, and so for the step launched before)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _uniforms(requests: Sequence[SamplingState], generator: torch.Generator, device: torch.device) -> Tensor:
    """One uniform draw in [0, 1) per request: from its own generator where it has one, else from the shared
    `generator` (in row order)."""
    shared = sum(1 for r in requests if r.generator is None)
    if shared == len(requests):
        return torch.rand(shared, generator=generator, device=device)
    drawn = torch.rand(shared, generator=generator, device=device) if shared else None
    parts: list[Tensor] = []
    next_shared = 0
    for request in requests:
        if request.generator is None:
            assert drawn is not None
            parts.append(drawn[next_shared : next_shared + 1])
            next_shared += 1
        else:
            parts.append(torch.rand(1, generator=request.generator, device=device))
    return torch.cat(parts)


CDF_BLOCK = 512
"""Tokens per block of the two-level inverse CDF: a block is picked from the blocks' sums, then a token from
the block's own cumulative sum."""


def _inverse_cdf(probs: Tensor, uniforms: Tensor) -> Tensor:
    """Per row of probs [B, vocab] (unnormalised, non-negative), the first token whose cumulative probability
    exceeds `uniforms[b]` times the row's total: a draw from the row's distribution; [B] token ids (the
    vocabulary size where rounding put the draw past a block's end).

    In two levels, so that no sequential scan runs over the whole vocabulary (`cumsum` over 49k entries was a
    sixth of a CPU decode step): the blocks' sums (a vectorised reduction) and their cumulative sum pick a
    block, then the cumulative sum of that block's `CDF_BLOCK` entries picks the token."""
    vocab = probs.shape[1]
    device = probs.device
    full = vocab // CDF_BLOCK * CDF_BLOCK
    parts: list[Tensor] = []
    if full:
        parts.append(probs[:, :full].unfold(1, CDF_BLOCK, CDF_BLOCK).sum(dim=-1))
    if full < vocab:
        parts.append(probs[:, full:].sum(dim=-1, keepdim=True))
    block_cdf = torch.cat(parts, dim=1).cumsum(dim=-1)  # [B, blocks]
    targets = uniforms.to(block_cdf.dtype).unsqueeze(1) * block_cdf[:, -1:]
    block = torch.searchsorted(block_cdf, targets, right=True).clamp(max=block_cdf.shape[1] - 1)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    columns = block * CDF_BLOCK + torch.arange(CDF_BLOCK, device=device)  # [B, CDF_BLOCK]
    inside = columns < vocab
    within = probs.gather(1, columns.clamp(max=vocab - 1)).masked_fill(~inside, 0.0).cumsum(dim=-1)
    offset = torch.searchsorted(within, targets - before, right=True)
    # Rounding between the block's sum and its own cumulative sum can put the draw past the block: invalid.
    token = torch.where(offset < CDF_BLOCK, block * CDF_BLOCK + offset, vocab)
    return token.squeeze(1)


def _truncate(probs: Tensor, options: Sequence[SamplingOptions]) -> Tensor:
    """Zero the probabilities outside each row's top-k, top-p nucleus and min-p floor; probs [B, vocab]."""
    device = probs.device
    vocab = probs.shape[1]
    # One copy: top_k is exact in float64 (a vocabulary is far below 2**53).
    params = torch.tensor(
        [
            [o.top_k if o.top_k > 0 else vocab for o in options],
            [o.top_p for o in options],
            [o.min_p for o in options],
        ],
        dtype=torch.float64,
    ).to(device, non_blocking=True)
    top_k, top_p, min_p = params[0], params[1].to(probs.dtype), params[2].to(probs.dtype)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[1], device=device).unsqueeze(0)
    # A token is dropped when the mass strictly before it already reaches top_p (the first always stays).
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = (ranks >= top_k.unsqueeze(1)) | (mass_before >= top_p.unsqueeze(1))
    drop |= sorted_probs < (min_p * sorted_probs[:, :1].squeeze(1)).unsqueeze(1)
    drop[:, 0] = False
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)
