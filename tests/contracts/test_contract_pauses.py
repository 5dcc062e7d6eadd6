"""Weight syncs that land in the middle of a request, in each pause mode, checked token by token, with the
request sent over each generation transport (HTTP `/generate`, gRPC `Generate`).

The engine runs greedy decoding of a long request; the sync swaps weights A (version v) for weights B
(version v+1) while it runs. An independent reference (transformers' LlamaForCausalLM with the same weights)
says what each mode must produce after the boundary `k` that the version spans report:
- retract: the greedy continuation of `prompt + output[:k]` under B, recomputed from scratch;
- in_place: the KV of `prompt + output[:k-1]` comes from A (the engine had computed it before the pause),
  every later position, and every logit from token `k` on, from B;
- drain: the request finishes under A; requests sent during the sync wait and run under B.

A and B differ from the checkpoint in every tensor but the (large) embedding, so each bucket stays small.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from asyncrl_core.protocols import NamedTensors
from asyncrl_core.types import SamplingParams, VersionSpan
from asyncrl_sglang.client import SGLangClient
from asyncrl_sglang.pool import EnginePool
from asyncrl_sglang.weight_sync import SyncMode, TensorTransport, sync_weights

pytestmark = pytest.mark.integration

PROMPT = [1, 504, 3237, 314, 260, 1345, 28, 4186]
NUM_TOKENS = 160
GREEDY = SamplingParams(max_new_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
BUCKET_BYTES = 64 * 1024
KEPT = "model.embed_tokens.weight"


class Reference:
    """Greedy decoding with transformers, for weights the engine is given by name."""

    def __init__(self, model_path: Path) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import LlamaForCausalLM

        self.old = LlamaForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
        self.new = LlamaForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
        self.base = {name: tensor.detach().clone() for name, tensor in self.old.named_parameters()}

    def weights(self, seed: int) -> dict[str, torch.Tensor]:
        """The checkpoint with every tensor but the embedding moved by noise of about its own scale."""
        generator = torch.Generator().manual_seed(seed)
        changed: dict[str, torch.Tensor] = {}
        for name, tensor in self.base.items():
            if name == KEPT:
                continue
            noise = torch.randn(tensor.shape, generator=generator) * max(float(tensor.std()), 0.02)
            changed[name] = tensor + noise
        return changed

    @torch.no_grad()
    def _step(self, model: torch.nn.Module, ids: list[int], cache: object | None) -> tuple[int, object]:
        out = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
        return int(out.logits[0, -1].argmax()), out.cache

    def _continue(self, model: torch.nn.Module, token: int, cache: object, count: int) -> list[int]:
        tokens: list[int] = []
        while len(tokens) < count:
            tokens.append(token)
            token, cache = self._step(model, [token], cache)
        return tokens

    def load(self, old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> None:
        for model, weights in ((self.old, old), (self.new, new)):
            parameters = dict(model.named_parameters())
            for name, tensor in weights.items():
                parameters[name].data.copy_(tensor)

    def greedy(self, model: torch.nn.Module, ids: list[int], count: int) -> list[int]:
        token, cache = self._step(model, ids, None)
        return self._continue(model, token, cache, count)

    def in_place(self, prompt: list[int], prefix: list[int], count: int) -> list[int]:
        """Tokens after `prefix` when the old weights computed the KV of `prompt + prefix[:-1]`."""
        _, cache = self._step(self.old, prompt + prefix[:-1], None)
        token, cache = self._step(self.new, prefix[-1:], cache)
        return self._continue(self.new, token, cache, count)


@pytest.fixture(scope="module")
def reference(tiny_llama_path: Path) -> Reference:
    return Reference(tiny_llama_path)


def buckets(weights: dict[str, torch.Tensor]) -> Iterator[NamedTensors]:
    """`weights` in buckets of about `BUCKET_BYTES`, like `Actor.export_weights` yields them."""
    bucket: NamedTensors = []
    size = 0
    for name in sorted(weights):
        tensor = weights[name]
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= BUCKET_BYTES:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


async def generated_tokens(client: SGLangClient) -> float:
    return (await client.metrics()).values["sglang:generation_tokens_total"]


async def wait_for_tokens(client: SGLangClient, start: float, count: int) -> None:
    """Wait until the engine has generated `count` tokens since its counter read `start`."""
    async with asyncio.timeout(120):
        while True:
            if await generated_tokens(client) - start >= count:
                return
            await asyncio.sleep(0.005)


async def sync_mid_request(
    connect: Callable[[], SGLangClient], reference: Reference, mode: SyncMode, old_seed: int, new_seed: int
) -> tuple[list[int], int, int]:
    """Run one long greedy request across a sync from A to B; returns its ids, the boundary `k`, and v.

    On a loaded machine the engine may finish the request between the wait for its first tokens and the
    pause (the sync then finds nothing left to pause): that run shows nothing and is repeated, a few times
    at most."""
    for _ in range(MAX_ATTEMPTS - 1):
        try:
            return await _sync_mid_request_once(connect, reference, mode, old_seed, new_seed)
        except _FinishedBeforeThePause:
            continue
    return await _sync_mid_request_once(connect, reference, mode, old_seed, new_seed, last_attempt=True)


MAX_ATTEMPTS = 3


class _FinishedBeforeThePause(Exception):
    pass


async def _sync_mid_request_once(
    connect: Callable[[], SGLangClient],
    reference: Reference,
    mode: SyncMode,
    old_seed: int,
    new_seed: int,
    *,
    last_attempt: bool = False,
) -> tuple[list[int], int, int]:
    old, new = reference.weights(old_seed), reference.weights(new_seed)
    reference.load(old, new)
    async with EnginePool([connect()]) as pool:
        client = pool.clients[0]
        version = await client.weight_version() + 1
        first = await sync_weights(pool, buckets(old), version, mode=mode, transport=TensorTransport())
        assert first.num_paused_requests == 0
        assert first.num_buckets > 1
        start = await generated_tokens(client)
        task = asyncio.create_task(pool.generate(PROMPT, GREEDY))
        await wait_for_tokens(client, start, 8)
        result = await sync_weights(pool, buckets(new), version + 1, mode=mode, transport=TensorTransport())
        if result.num_paused_requests == 0 and not last_attempt:
            await task
            raise _FinishedBeforeThePause
        assert result.num_paused_requests == 1
        assert result.metrics()["time/sync_weights"] == result.time_s
        generation = await task
        assert await client.weight_version() == version + 1
    assert generation.finish_reason == "length"
    assert generation.versions_verified
    spans = generation.version_spans
    if mode == "drain":
        assert spans == (VersionSpan(version, 0, NUM_TOKENS),)
        return generation.output_ids, NUM_TOKENS, version
    if spans == (VersionSpan(version, 0, NUM_TOKENS),) and not last_attempt:
        raise _FinishedBeforeThePause
    boundary = spans[0].end
    assert spans == (VersionSpan(version, 0, boundary), VersionSpan(version + 1, boundary, NUM_TOKENS))
    assert 8 <= boundary < NUM_TOKENS
    if mode == "retract":
        assert generation.num_retractions >= 1
    else:
        assert generation.num_retractions == 0
    return generation.output_ids, boundary, version


async def test_retract_continues_from_the_kept_tokens_under_the_new_weights(
    connect: Callable[[], SGLangClient], reference: Reference
) -> None:
    output, boundary, _ = await sync_mid_request(connect, reference, "retract", 1, 2)
    assert output[:boundary] == reference.greedy(reference.old, PROMPT, boundary)
    recomputed = reference.greedy(reference.new, PROMPT + output[:boundary], NUM_TOKENS - boundary)
    assert output[boundary:] == recomputed
    # The test has teeth: keeping the old KV would have produced other tokens.
    assert recomputed != reference.in_place(PROMPT, output[:boundary], NUM_TOKENS - boundary)


async def test_in_place_continues_with_the_old_kv_cache(
    connect: Callable[[], SGLangClient], reference: Reference
) -> None:
    output, boundary, _ = await sync_mid_request(connect, reference, "in_place", 3, 4)
    assert output[:boundary] == reference.greedy(reference.old, PROMPT, boundary)
    kept_kv = reference.in_place(PROMPT, output[:boundary], NUM_TOKENS - boundary)
    assert output[boundary:] == kept_kv
    assert kept_kv != reference.greedy(reference.new, PROMPT + output[:boundary], NUM_TOKENS - boundary)


async def test_drain_finishes_in_flight_requests_under_the_old_weights(
    connect: Callable[[], SGLangClient], reference: Reference
) -> None:
    output, _, _ = await sync_mid_request(connect, reference, "drain", 5, 6)
    assert output == reference.greedy(reference.old, PROMPT, NUM_TOKENS)


async def test_drain_holds_new_requests_until_the_sync_is_done(
    connect: Callable[[], SGLangClient], reference: Reference
) -> None:
    old, new = reference.weights(7), reference.weights(8)
    reference.load(old, new)
    async with EnginePool([connect()]) as pool:
        client = pool.clients[0]
        version = await client.weight_version() + 1
        await sync_weights(pool, buckets(old), version, mode="drain", transport=TensorTransport())
        start = await generated_tokens(client)
        running = asyncio.create_task(pool.generate(PROMPT, GREEDY))
        await wait_for_tokens(client, start, 8)
        syncing = asyncio.create_task(
            sync_weights(pool, buckets(new), version + 1, mode="drain", transport=TensorTransport())
        )
        await asyncio.sleep(0)  # the sync closes admission before its first await
        assert not pool.admission_open
        held = asyncio.create_task(
            pool.generate(PROMPT, SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True))
        )
        result = await syncing
        assert result.num_paused_requests == 1
        first, second = await running, await held
    assert first.version_spans == (VersionSpan(version, 0, NUM_TOKENS),)
    assert second.version_spans == (VersionSpan(version + 1, 0, 20),)
    assert second.output_ids == reference.greedy(reference.new, PROMPT, 20)
