"""Helpers of the agent tests: a scripted engine that fixes the model's words, and a recording client.

`ScriptedEngine` is a real `GenerationClient`: it decodes the ids it is given, asks a `respond` function what
the model says next, tokenises that with the model's real tokenizer, and applies the engine's stopping rules
(stop strings checked on the decoded text after every token, stop token ids, `max_new_tokens`), returning
ids, logprobs and version spans as an engine does.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from asyncrl_core.protocols import GenerationClient
from asyncrl_core.types import NO_VERSION, Generation, SamplingParams, Trajectory, VersionSpan


@cache
def smollm2_tokenizer() -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from asyncrl_core.models import smollm2_135m
    from asyncrl_core.prompts import load_tokenizer

    return load_tokenizer(smollm2_135m())


def smollm2_path() -> Path:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from asyncrl_core.models import smollm2_135m

    return smollm2_135m()


@dataclass
class Call:
    input_ids: list[int]
    sampling: SamplingParams
    rid: str | None
    generation: Generation


@dataclass
class ScriptedEngine:
    """Returns `respond(context_text)` as the model's next words, cut where a real engine would stop."""

    tokenizer: Any
    respond: Callable[[str], str]
    version: int = 0
    switch_version_at: int | None = None
    """Output token index where the weights change to `version + 1` (a sync in the middle of a request)."""
    delay_s: float = 0.0
    calls: list[Call] = field(default_factory=list[Call])
    in_flight: int = 0
    max_in_flight: int = 0

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        rid: str | None = None,
        routing_key: str | None = None,
    ) -> Generation:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
            generation = self._generate(list(input_ids), sampling)
        finally:
            self.in_flight -= 1
        self.calls.append(Call(list(input_ids), sampling, rid, generation))
        return generation

    def _generate(self, input_ids: list[int], sampling: SamplingParams) -> Generation:
        context = self.tokenizer.decode(input_ids, skip_special_tokens=False)
        words = self.respond(context)
        candidate: list[int] = self.tokenizer.encode(words, add_special_tokens=False)
        output: list[int] = []
        finish: str = "length"
        matched: int | str | None = None
        stop_ids = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop_ids.add(self.tokenizer.eos_token_id)
        for token in candidate:
            if len(output) >= sampling.max_new_tokens:
                break
            output.append(token)
            if token in stop_ids:
                finish, matched = "stop", token
                break
            text = self.tokenizer.decode(output, skip_special_tokens=False)
            hit = next((stop for stop in sampling.stop if stop in text), None)
            if hit is not None:
                finish, matched = "stop", hit
                break
        else:
            if len(output) < sampling.max_new_tokens:
                finish = "stop"  # the script's words ran out: the model ended its message
        n = len(output)
        logprobs = [-0.1 - 0.01 * ((len(input_ids) + i) % 7) for i in range(n)]
        if self.switch_version_at is not None and 0 < self.switch_version_at < n:
            spans = (
                VersionSpan(self.version, 0, self.switch_version_at),
                VersionSpan(self.version + 1, self.switch_version_at, n),
            )
        else:
            spans = (VersionSpan(self.version, 0, n),)
        text = self.tokenizer.decode(output, skip_special_tokens=True)
        if isinstance(matched, str) and not sampling.no_stop_trim:
            text = text[: text.rfind(matched)]
        return Generation(
            output_ids=output,
            logprobs=logprobs,
            text=text,
            finish_reason=finish,  # type: ignore[arg-type]
            version_spans=spans,
            matched_stop=matched,
            prompt_tokens=len(input_ids),
        )


_QUESTION = re.compile(r"Question: (.*?)\n")
_INFORMATION = re.compile(r"<information>(.*?)</information>", re.DOTALL)


def mini_reader(context: str) -> str:
    """A model that answers searchr1-mini questions by reading what the retriever returned, hop by hop.

    It only knows what the observations in `context` say, so a correct answer proves that the retriever's
    passages reached the next turn.
    """
    questions = _QUESTION.findall(context)
    assert questions, "no question in the prompt"
    question = questions[-1]  # demonstrations come first
    information = _INFORMATION.findall(context.rsplit(question, 1)[-1])
    latest = information[-1] if information else ""

    def search(query: str) -> str:
        return f"<think> I need to look up {query}. </think>\n<search> {query} </search>"

    def answer(text: str) -> str:
        return f"<think> Found it. </think>\n<answer> {text} </answer><|im_end|>"

    if match := re.fullmatch(r"In which city was the founder of (.+) born\?", question):
        if len(information) == 0:
            return search(match.group(1))
        if len(information) == 1:
            founder = re.search(r"founded in \d+ by (.+?)\.", latest)
            return search(founder.group(1)) if founder else answer("unknown")
        born = re.search(r"was born in (\w+)\.", latest)
        return answer(born.group(1) if born else "unknown")
    if match := re.fullmatch(r"In which city was (.+) born\?", question):
        if not information:
            return search(match.group(1))
        born = re.search(
            rf"{re.escape(match.group(1))} \(born \d+\) is an? \w+ who was born in (\w+)\.", latest
        )
        return answer(born.group(1) if born else "unknown")
    if match := re.fullmatch(r"Who founded (.+)\?", question):
        if not information:
            return search(match.group(1))
        founder = re.search(
            rf"{re.escape(match.group(1))} is an? \w+ company founded in \d+ by (.+?)\.", latest
        )
        return answer(founder.group(1) if founder else "unknown")
    return answer("unknown")


@dataclass
class RecordingClient:
    """Passes every call to `client` and records it with its answer."""

    client: GenerationClient
    calls: list[Call] = field(default_factory=list[Call])

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        rid: str | None = None,
        routing_key: str | None = None,
    ) -> Generation:
        generation = await self.client.generate(input_ids, sampling, rid=rid, routing_key=routing_key)
        self.calls.append(Call(list(input_ids), sampling, rid, generation))
        return generation


def check_alignment(trajectory: Trajectory, recorded: Sequence[Call], prompt: Sequence[int]) -> None:
    """The trajectory is the prompt, then each generation's ids verbatim, then each observation's ids."""
    assert trajectory.token_ids[: trajectory.prompt_len] == list(prompt)
    n = trajectory.response_len
    assert len(trajectory.loss_mask) == len(trajectory.rollout_logprobs) == len(trajectory.versions) == n
    # The calls that produced this trajectory: each one's input is a prefix of it. Trajectories of a group
    # share their prompt, so among calls with the same input, the one whose output continues this one is it.
    calls: dict[int, Call] = {}
    for call in recorded:
        length = len(call.input_ids)
        ids = call.generation.output_ids
        if (
            length >= len(prompt)
            and call.input_ids == trajectory.token_ids[:length]
            and trajectory.token_ids[length : length + len(ids)] == ids
        ):
            calls[length] = call
    assert len(calls) == trajectory.num_turns
    position = trajectory.prompt_len
    model_tokens = 0
    for length, call in sorted(calls.items()):
        assert length >= position, "a turn must be generated from the whole sequence so far"
        position = length
        ids = call.generation.output_ids
        offset = position - trajectory.prompt_len
        assert trajectory.token_ids[position : position + len(ids)] == ids
        assert trajectory.loss_mask[offset : offset + len(ids)] == [1] * len(ids)
        assert trajectory.rollout_logprobs[offset : offset + len(ids)] == call.generation.logprobs
        assert trajectory.versions[offset : offset + len(ids)] == call.generation.token_versions()
        model_tokens += len(ids)
        position += len(ids)
    assert sum(trajectory.loss_mask) == model_tokens
    for mask, logprob, version in zip(
        trajectory.loss_mask, trajectory.rollout_logprobs, trajectory.versions, strict=True
    ):
        if mask == 0:
            assert logprob == 0.0
            assert version == NO_VERSION
        else:
            assert version != NO_VERSION
