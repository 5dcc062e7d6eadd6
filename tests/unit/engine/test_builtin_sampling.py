"""The built-in engine's batched sampler: tokens drawn from the (truncated) distribution, logprobs exact."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from asyncrl_engine.options import SamplingOptions
from asyncrl_engine.sampling import CDF_BLOCK, sample_tokens

DRAWS = 20_000


@dataclass
class _State:
    options: SamplingOptions
    output_ids: list[int] = field(default_factory=lambda: list[int]())
    top_logprobs_num: int = 0
    generator: torch.Generator | None = None


def _frequencies(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double() / len(tokens)


def test_draws_follow_the_distribution_and_its_truncations() -> None:
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    logits = probs.log().expand(DRAWS, -1).contiguous()
    generator = torch.Generator().manual_seed(0)
    # 5 standard deviations of a frequency at p = 0.5 over DRAWS draws.
    tolerance = 5 * (0.25 / DRAWS) ** 0.5

    full = sample_tokens([_State(SamplingOptions())] * DRAWS, logits.clone(), generator, frozenset())
    torch.testing.assert_close(
        _frequencies([t for t, _, _ in full], 6), probs.double(), atol=tolerance, rtol=0
    )
    # The reported logprob is the token's own under the untruncated distribution.
    for token, logprob, top in full[:50]:
        assert abs(logprob - probs[token].log().item()) < 1e-5
        assert top == []

    top_k = sample_tokens([_State(SamplingOptions(top_k=2))] * DRAWS, logits.clone(), generator, frozenset())
    expected = torch.tensor([0.4, 0.25, 0, 0, 0, 0], dtype=torch.float64) / 0.65
    torch.testing.assert_close(_frequencies([t for t, _, _ in top_k], 6), expected, atol=tolerance, rtol=0)
    # top_p 0.7: the mass before token 2 is 0.65 < 0.7, before token 3 0.8: tokens 0-2 stay.
    top_p = sample_tokens(
        [_State(SamplingOptions(top_p=0.7))] * DRAWS, logits.clone(), generator, frozenset()
    )
    expected = torch.tensor([0.4, 0.25, 0.15, 0, 0, 0], dtype=torch.float64) / 0.8
    torch.testing.assert_close(_frequencies([t for t, _, _ in top_p], 6), expected, atol=tolerance, rtol=0)


def test_mixed_batch_greedy_seeded_and_banned_rows() -> None:
    vocab = 50
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(1)) * 3
    greedy = _State(SamplingOptions(temperature=0.0), top_logprobs_num=3)
    seeded = _State(SamplingOptions(sampling_seed=5), generator=torch.Generator().manual_seed(5))
    banned_token = int(logits[2].argmax())
    banned = _State(
        SamplingOptions(temperature=0.0, min_new_tokens=1, stop_token_ids=frozenset({banned_token}))
    )
    shared = _State(SamplingOptions(temperature=0.5, min_p=0.2))
    result = sample_tokens([greedy, seeded, banned, shared], logits.clone(), torch.Generator(), frozenset())

    logprobs = torch.log_softmax(logits, dim=-1)
    assert result[0][0] == int(logits[0].argmax())
    values, ids = logprobs[0].topk(3)
    assert [i for _, i in result[0][2]] == ids.tolist()
    torch.testing.assert_close(torch.tensor([v for v, _ in result[0][2]]), values, atol=1e-6, rtol=0)
    assert result[1][2] == []
    assert result[2][2] == []
    # A banned token is never drawn before min_new_tokens; the row's argmax among the rest is.
    masked = logits[2].clone()
    masked[banned_token] = float("-inf")
    assert result[2][0] == int(masked.argmax())
    # min_p: only tokens with at least 0.2 times the top probability (at temperature 0.5) can be drawn.
    tempered = torch.softmax(logits[3] / 0.5, dim=-1)
    assert tempered[result[3][0]] >= 0.2 * tempered.max()
    # A seeded row draws the same token whatever batch it is in.
    alone = sample_tokens(
        [_State(SamplingOptions(sampling_seed=5), generator=torch.Generator().manual_seed(5))],
        logits[1:2].clone(),
        torch.Generator(),
        frozenset(),
    )
    assert alone[0][0] == result[1][0]


def test_draws_over_several_blocks_of_the_vocabulary() -> None:
    # Mass in every block of the two-level draw, the last one partial: 3 x 512 + 37 tokens.
    vocab = 3 * CDF_BLOCK + 37
    heavy = {5: 0.2, CDF_BLOCK - 1: 0.15, CDF_BLOCK: 0.15, 2 * CDF_BLOCK + 100: 0.2, vocab - 1: 0.2}
    probs = torch.full((vocab,), 0.1 / (vocab - len(heavy)))
    for token, p in heavy.items():
        probs[token] = p
    logits = probs.log().expand(DRAWS, -1).contiguous()
    drawn = sample_tokens(
        [_State(SamplingOptions())] * DRAWS, logits, torch.Generator().manual_seed(3), frozenset()
    )
    frequencies = _frequencies([t for t, _, _ in drawn], vocab)
    tolerance = 5 * (0.25 / DRAWS) ** 0.5
    for token, p in heavy.items():
        assert abs(frequencies[token].item() - p) < tolerance, token
    assert abs(frequencies.sum().item() - 1) < 1e-9
    light = [t for t in range(vocab) if t not in heavy]
    assert abs(frequencies[light].sum().item() - 0.1) < tolerance
