"""A retriever that goes down for a while and comes back, under the real agent loop: while it is down every
search becomes an error observation, counted in the step's tool metrics, logged as a warning and told once
to `on_tool_health` (naming the retriever); once it is back on its port, searches succeed again without any
restart of the loop, and that is told too."""

from __future__ import annotations

import logging
import os
import signal

import pytest
from agents_testing import ScriptedEngine, mini_reader, smollm2_tokenizer

from asyncrl_agents.loop import MultiTurnAgentLoop
from asyncrl_agents.retrieval import RetrievalServer
from asyncrl_agents.tasks.searchr1 import SearchR1MiniTask
from asyncrl_core import metrics
from asyncrl_core.runner.workers import group_metrics
from asyncrl_core.types import SamplingParams, ToolHealth

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


async def test_a_retriever_outage_shows_in_the_step_metrics_until_it_is_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    corpus = SearchR1MiniTask().corpus_file()
    server = RetrievalServer(corpus)
    url = server.start()
    task = SearchR1MiniTask(retriever_url=f"{url}/retrieve", search_timeout_s=5.0)
    told: list[ToolHealth] = []
    loop = MultiTurnAgentLoop(
        task,
        ScriptedEngine(smollm2_tokenizer(), mini_reader),
        smollm2_tokenizer(),
        group_size=2,
        sampling=SamplingParams(max_new_tokens=64),
        max_prompt_len=512,
        max_response_len=1024,
        on_tool_health=told.append,
    )

    async def step() -> dict[str, float]:
        return group_metrics([await loop.run_group(0)])

    try:
        with caplog.at_level(logging.WARNING, logger="asyncrl_agents.loop"):
            before = await step()
            assert before[metrics.TOOL_CALLS] > 0
            assert before[metrics.TOOL_ERRORS] == 0.0

            os.killpg(server.pid, signal.SIGKILL)  # the retriever dies
            server.stop()  # reaps it
            during = await step()
            assert during[metrics.TOOL_ERRORS] == during[metrics.TOOL_CALLS] > 0
            assert during[metrics.TOOL_ERROR_RATE] == 1.0
            assert "tool call search(" in caplog.text
            assert "failed (1 in a row)" in caplog.text
            (down,) = told  # once, however many calls failed
            assert down.tool == "search"
            assert down.failing
            assert f"retrieval server {url}/retrieve did not answer" in down.message

            server = RetrievalServer(corpus, port=int(url.rsplit(":", 1)[1]))
            assert server.start() == url  # back on its port
            after = await step()
            assert after[metrics.TOOL_CALLS] > 0
            assert after[metrics.TOOL_ERRORS] == 0.0
            assert "tool search answers again" in caplog.text
            back = told[1]
            assert (back.tool, back.failing) == ("search", False)
            assert len(told) == 2
            assert back.at >= down.at
    finally:
        server.stop()
        await loop.aclose()
